"""The emulated inter-node link (``--inter-node-link GBIT_PER_S[,LATENCY_MS]``) on a fake clock:
each delay against numbers worked out by hand (1 Gbit/s = 125,000,000 bytes/s)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import cloudburst.comm.transport as transport_module
from cloudburst.cli import main
from cloudburst.comm import allreduce, link
from cloudburst.comm.allreduce import AllreduceHookState, counting_allreduce_hook
from cloudburst.comm.collectives import all_reduce_sum
from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import EmulatedWork, LinkEmulator, Topology
from cloudburst.comm.messages import HEADER_BYTES, Header, Kind
from cloudburst.comm.p2p import PeerTransport
from cloudburst.comm.stats import CommStats
from cloudburst.config import ConfigError, RunConfig
from tests.support import FakeTime, close

T0 = 1000.0  # the fake clock starts here, not at 0: the link must use "now", not assume 0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime(T0)
    for module in (link, transport_module, allreduce):
        monkeypatch.setattr(module, "time", fake)
    return fake


# ---------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "text, gbit_per_s, latency_ms, bytes_per_s, latency_s",
    [
        ("1", 1.0, 0.0, 125_000_000, 0.0),
        ("1,0.5", 1.0, 0.5, 125_000_000, 0.0005),
        ("10,0", 10.0, 0.0, 1_250_000_000, 0.0),
        (" 2.5 , 3 ", 2.5, 3.0, 312_500_000, 0.003),
        ("1e-3,100", 0.001, 100.0, 125_000, 0.1),
    ],
)
def test_link_spec_parses_speed_and_latency(text, gbit_per_s, latency_ms, bytes_per_s, latency_s):
    spec = LinkSpec.parse(text)
    assert spec == LinkSpec(gbit_per_s, latency_ms)
    assert spec.bytes_per_s == pytest.approx(bytes_per_s, rel=1e-15)
    assert spec.latency_s == pytest.approx(latency_s, rel=1e-15)
    assert RunConfig(inter_node_link=text).cluster.inter_node_link == text


BAD_SPECS = [
    (t, "is not GBIT_PER_S[,LATENCY_MS]") for t in ("", "fast", "1,2,3", "1,", ",1", "1;1")
]
BAD_SPECS += [
    (t, "speed must be a positive number of Gbit/s") for t in ("0", "-1,1", "nan", "inf,1")
]
BAD_SPECS += [(t, "latency must be >= 0 ms") for t in ("1,-0.5", "1,nan", "1,inf")]


@pytest.mark.parametrize("text, fragment", BAD_SPECS)
def test_bad_link_specs_are_one_line_config_errors_naming_the_field(text, fragment, capsys):
    with pytest.raises(ValueError) as parsed:
        LinkSpec.parse(text)
    assert fragment in str(parsed.value) and repr(text) in str(parsed.value)
    with pytest.raises(ConfigError) as err:
        RunConfig(inter_node_link=text)
    message = str(err.value)
    assert message.startswith("inter_node_link: ") and "\n" not in message, message
    assert repr(text) in message and fragment in message, message
    # The CLI: exit code 2, one line on stderr, nothing launched (``=`` so "-1,1" is a value).
    assert main(["train", f"--inter-node-link={text}", "--out", "/nonexistent/x"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("cloudburst: invalid config: ")
    assert "inter_node_link" in err_lines[0] and fragment in err_lines[0]


def test_the_flag_and_the_toml_key_reach_the_config_and_nodes_the_topology(
    tmp_path, monkeypatch: pytest.MonkeyPatch, parse
):
    from cloudburst.runtime.placement import resolve_topology

    for var in ("LOCAL_WORLD_SIZE", "CLOUDBURST_LOCAL_JOB"):
        monkeypatch.delenv(var, raising=False)
    toml = tmp_path / "run.toml"
    toml.write_text('inter-node-link = "1,1"\nnodes = 2\nworkers = 4\n')
    from_file = parse("--config", str(toml))
    overridden = parse("--config", str(toml), "--inter-node-link", "10,0.2")
    assert LinkSpec.parse(from_file.cluster.inter_node_link) == LinkSpec(1.0, 1.0)
    assert LinkSpec.parse(overridden.cluster.inter_node_link) == LinkSpec(10.0, 0.2)
    assert resolve_topology(overridden, 4).node_of == (0, 0, 1, 1)


def test_topology_places_contiguous_blocks_on_nodes():
    topo = Topology.contiguous(5, 2)
    assert topo.node_of == (0, 0, 0, 1, 1) and topo.num_nodes == 2
    assert topo.ranks_on(1) == [3, 4]
    assert topo.crosses(2, 3) and not topo.crosses(0, 2)
    assert topo.spans_nodes([2, 3]) and not topo.spans_nodes([3, 4])
    # One node, or one rank per node, but never more nodes than ranks or none.
    assert Topology.contiguous(4, 1).node_of == (0, 0, 0, 0)
    assert Topology.contiguous(3, 3).node_of == (0, 1, 2)
    for ranks, nodes in ((2, 3), (3, 0), (3, 4)):
        with pytest.raises(ValueError, match=f"cannot place {ranks} ranks on {nodes} nodes"):
            Topology.contiguous(ranks, nodes)


# ---------------------------------------------------------------------------- cost model
def test_one_message_costs_one_latency_plus_its_bytes_over_the_bandwidth():
    emu = LinkEmulator(LinkSpec(1.0, 0.5))  # 125e6 bytes/s, 0.5 ms
    assert emu.p2p_s(1_250_000) == close(0.0005 + 0.01)
    assert emu.active and emu.p2p_s(0) == close(0.0005)
    assert LinkEmulator(LinkSpec(8.0)).p2p_s(3_000_000) == close(0.003)  # 1e9 bytes/s, no latency


def ring_allreduce_by_steps(nbytes: int, n: int, spec: LinkSpec) -> float:
    """A ring all-reduce step by step: reduce-scatter then all-gather, n - 1 steps each; in
    every step each rank sends one of the n chunks to its neighbour, all ranks at once, so a
    step takes one latency plus one chunk's bytes through one link."""
    chunk = nbytes / n
    elapsed = 0.0
    for _phase in ("reduce-scatter", "all-gather"):
        for _step in range(n - 1):
            elapsed += spec.latency_ms / 1e3 + chunk / (spec.gbit_per_s * 1e9 / 8)
    return elapsed


def test_ring_allreduce_cost():
    # 4 MB over 4 ranks: 2·3 latencies + 2·3/4 of the bytes = 0.006 + 1.5 · 0.032 s
    assert LinkEmulator(LinkSpec(1.0, 1.0)).allreduce_s(4_000_000, 4) == close(0.054)
    for n in (2, 3, 5, 8):
        for nbytes in (0, 4_000, 10_000_000):
            for spec in (LinkSpec(1.0, 1.0), LinkSpec(25.0, 0.05)):
                expected = ring_allreduce_by_steps(nbytes, n, spec)
                assert LinkEmulator(spec).allreduce_s(nbytes, n) == pytest.approx(expected)
    # a broadcast: ceil(log2 n) rounds of latency and the bytes once
    emu = LinkEmulator(LinkSpec(1.0, 0.5))
    for n, rounds in ((5, 3), (4, 2), (2, 1)):
        assert emu.broadcast_s(1_000_000, n) == close(rounds * 0.0005 + 0.008)
    # nothing crosses a link in a group of one, or without a link
    assert emu.allreduce_s(10**9, 1) == 0.0 and emu.broadcast_s(10**9, 1) == 0.0
    off = LinkEmulator(None)
    assert not off.active
    assert (off.p2p_s(10**9), off.allreduce_s(10**9, 8), off.broadcast_s(10**9, 8)) == (0, 0, 0)


# ---------------------------------------------------------------------------- the wire
def test_transfers_from_one_rank_queue_on_its_link(clock):
    assert LinkEmulator.wait_until(T0) == 0.0 and clock.sleeps == []  # a deadline now: no sleep
    emu = LinkEmulator(LinkSpec(1.0, 0.5))
    cost = emu.p2p_s(1_250_000)  # 0.0105 s
    assert emu.reserve(cost) == close(T0 + 0.0105)
    clock.advance(0.001)  # the second starts while the first is still on the wire: it queues
    assert emu.reserve(cost) == close(T0 + 0.021)
    clock.advance(1.0)  # the link has been idle since T0 + 0.021: the third starts now
    third = emu.reserve(cost)
    assert third == close(T0 + 1.001 + 0.0105)
    assert emu.reserve(0.5, start=T0 + 5.0) == close(T0 + 5.5)  # an explicit start
    assert emu.emulated_s == close(3 * 0.0105 + 0.5)
    assert clock.sleeps == []  # booking never sleeps; waiting does
    assert LinkEmulator.wait_until(third) == close(0.0105)
    assert clock.sleeps == [close(0.0105)] and clock.now == close(third)
    assert LinkEmulator.wait_until(T0) == 0.0 and len(clock.sleeps) == 1  # already past
    assert LinkEmulator(LinkSpec(1.0, 0.0)).reserve(2.0, start=0.25) == 2.25  # fresh: free


def _work(done: bool, waited: list | None = None) -> SimpleNamespace:
    """A collective's work handle, complete or not, that records each wait in ``waited``."""
    return SimpleNamespace(wait=lambda: waited.append(1), is_completed=lambda: done)


def test_an_emulated_work_waits_for_its_collective_then_for_the_link_and_completes_so(clock):
    waited: list = []
    assert EmulatedWork(_work(False, waited), deadline=T0 + 2.0).wait() is True
    assert waited and clock.sleeps == [2.0]
    assert EmulatedWork(None, deadline=T0 + 3.0).wait() is True  # no collective: the link only
    assert clock.sleeps == [2.0, 1.0]
    # Complete when its collective and the link are.
    now = clock.now
    assert not EmulatedWork(_work(False), deadline=now - 1.0).is_completed()
    assert not EmulatedWork(_work(True), deadline=now + 1.0).is_completed()
    assert EmulatedWork(_work(True), deadline=now - 1.0).is_completed()
    assert EmulatedWork(None, deadline=now - 1.0).is_completed()


def _transport(emu: LinkEmulator | None, sent: list, clock: FakeTime) -> PeerTransport:
    """Rank 0 of 4 ranks on 2 nodes (ranks 0, 1 | 2, 3); gloo replaced by a recorder of
    (destination, elements, fake time the message left)."""
    topo = Topology.contiguous(4, 2)
    transport = PeerTransport(
        group=None, stats=CommStats(), link=emu, crosses=lambda peer: topo.crosses(0, peer)
    )

    def record(tensor, dst, tag):
        sent.append((dst, tensor.numel(), clock.now))
        return SimpleNamespace(wait=lambda: None)

    transport._send = record
    transport._isend = record
    return transport


def test_messages_to_another_node_leave_once_the_link_has_carried_them(clock):
    sent: list = []
    transport = _transport(LinkEmulator(LinkSpec(1.0, 1.0)), sent, clock)
    numel = (1_250_000 - HEADER_BYTES) // 4  # header + payload: 1.25 MB = 10 ms at 1 Gbit/s
    push = Header(Kind.PUSH, numel=numel)
    payload = torch.zeros(numel)
    transport.send(1, push, payload)  # same node: leaves at once
    transport.send(2, push, payload)  # other node: 1 ms + 10 ms
    transport.send(3, push, payload)  # queued behind it: another 11 ms
    transport.send(3, Header(Kind.FETCH))  # a bare header: 1 ms + 64 bytes
    header_only = 0.001 + HEADER_BYTES / 125_000_000
    assert sent == [
        (1, 8, T0),
        (1, numel, T0),
        (2, 8, close(T0 + 0.011)),
        (2, numel, close(T0 + 0.011)),
        (3, 8, close(T0 + 0.022)),
        (3, numel, close(T0 + 0.022)),
        (3, 8, close(T0 + 0.022 + header_only)),
    ]
    stats = transport.stats
    assert stats.intra_node_bytes == 1_250_000
    assert stats.inter_node_bytes == 2 * 1_250_000 + HEADER_BYTES
    assert stats.sent_bytes == 3 * 1_250_000 + HEADER_BYTES
    assert stats.wait_s == close(0.022 + header_only) == stats.emulated_link_s  # held back so long
    # An overlapped payload (isend) waits for the link as well: 4 MB, 1 ms + 32 ms.
    transport.isend_payload(2, torch.zeros(1_000_000), reply=False)
    assert sent[-1] == (2, 1_000_000, close(T0 + 0.022 + header_only + 0.033))


def test_without_a_link_crossing_traffic_is_counted_but_never_delayed(clock):
    sent: list = []
    transport = _transport(None, sent, clock)
    transport.send(2, Header(Kind.PUSH, numel=100), torch.zeros(100))
    assert [t for *_, t in sent] == [T0, T0] and clock.sleeps == []
    assert transport.stats.inter_node_bytes == HEADER_BYTES + 400
    assert transport.stats.emulated_link_s == 0.0
    inactive = _transport(LinkEmulator(None), sent, clock)
    inactive.send(3, Header(Kind.FETCH))
    assert clock.sleeps == [] and inactive.stats.inter_node_bytes == HEADER_BYTES


def test_allreduce_across_nodes_completes_when_the_link_allows(clock, monkeypatch):
    reduced: list[int] = []  # the elements of each all-reduce gloo is asked for, of 4 ranks
    done = SimpleNamespace(wait=lambda: None, is_completed=lambda: True)
    fake = SimpleNamespace(ReduceOp=SimpleNamespace(SUM="sum"), get_world_size=lambda g=None: 4,
                           all_reduce=lambda t, op=None, group=None, async_op=False:
                           reduced.append(t.numel()) or (done if async_op else None))  # fmt: skip
    monkeypatch.setattr(transport_module, "dist", fake)
    emu = LinkEmulator(LinkSpec(1.0, 1.0))
    stats = CommStats()
    tensor = torch.zeros(1_000_000)  # 4 MB over 4 ranks: 0.054 s on the link
    pending = all_reduce_sum(tensor, None, stats, link=emu, spans_nodes=True, async_op=True)
    assert clock.sleeps == []  # non-blocking: training goes on
    last = pending.works[-1]
    assert isinstance(last, EmulatedWork) and last.deadline == close(T0 + 0.054)
    clock.advance(0.020)  # 20 ms of compute overlap with the transfer
    assert not last.is_completed()
    pending.wait()
    assert clock.sleeps == [close(0.034)] and last.is_completed()  # only the rest is waited
    assert stats.wait_s == close(0.034) and stats.emulated_link_s == close(0.054)
    assert stats.inter_node_bytes == 6_000_000 and stats.intra_node_bytes == 0  # 2·3/4 · 4 MB

    # Two back to back share the link: the second ends 2 · 0.054 s after they started.
    clock.sleeps.clear()
    start = clock.now
    a = all_reduce_sum(tensor, None, stats, link=emu, spans_nodes=True, async_op=True)
    b = all_reduce_sum(tensor, None, stats, link=emu, spans_nodes=True, async_op=True)
    a.wait()
    b.wait()
    assert clock.sleeps == [close(0.054), close(0.054)] and clock.now == close(start + 0.108)

    # Chunks are separate all-reduces, but the link is charged once for the whole tensor.
    reduced.clear()
    clock.sleeps.clear()
    all_reduce_sum(tensor, None, stats, link=emu, spans_nodes=True, chunk_elements=300_000)
    assert reduced == [300_000, 300_000, 300_000, 100_000]
    assert clock.sleeps == [close(0.054)]

    # Inside one node nothing is delayed, blocking or not.
    clock.sleeps.clear()
    all_reduce_sum(tensor, None, stats, link=emu, spans_nodes=False)
    all_reduce_sum(tensor, None, stats, link=emu, spans_nodes=False, async_op=True).wait()
    assert clock.sleeps == [] and stats.intra_node_bytes == 2 * 6_000_000


def test_ddp_buckets_across_nodes_queue_on_the_link(clock, monkeypatch):
    futures: list[torch.futures.Future] = []

    def all_reduce(tensor, group=None, async_op=False):
        fut = torch.futures.Future()
        futures.append(fut)
        return SimpleNamespace(get_future=lambda: fut)

    fake = SimpleNamespace(get_world_size=lambda group=None: 4, all_reduce=all_reduce)
    monkeypatch.setattr(allreduce, "dist", fake)
    stats = CommStats()
    state = AllreduceHookState(None, stats, spans_nodes=True, link=LinkEmulator(LinkSpec(1, 1)))
    big, small = torch.full((1_000_000,), 8.0), torch.full((250_000,), 8.0)  # 4 MB, 1 MB
    done = [
        counting_allreduce_hook(state, SimpleNamespace(buffer=lambda t=t: t)) for t in (big, small)
    ]
    assert clock.sleeps == [] and big[0] == 2.0  # both launched at T0, divided by the world size
    for fut, t in zip(futures, (big, small), strict=True):
        fut.set_result([t])  # gloo finishes both at once; the link has not
    # 4 MB: 0.054 s; 1 MB: 0.006 + 1.5 · 0.008 = 0.018 s, after the first: T0 + 0.072
    assert clock.sleeps == [close(0.054), close(0.018)] and clock.now == close(T0 + 0.072)
    assert done[1].wait() is small and stats.emulated_link_s == close(0.072)
    assert stats.inter_node_bytes == 6_000_000 + 1_500_000
