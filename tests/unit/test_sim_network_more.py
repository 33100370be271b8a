"""The virtual cluster's all-gather, all-to-all, DDP all-reduce, tags and measurements against
virtual times worked out by hand (8 ranks on 2 nodes; payload bytes scaled by SCALE, int64
control data not); and what the counted collectives (comm/collectives.py) ask and count."""

from __future__ import annotations

import re

import pytest
import torch

from cloudburst.comm.collectives import all_reduce_sum, all_to_all_s, broadcast, world_sum
from cloudburst.comm.costs import DDP_BUCKET_BYTES
from cloudburst.comm.stats import CommStats
from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.sim.run import run_ranks
from tests.support import RecordingLink, close, on_comm_threads, prior_stats

LAT, BW = 0.002, 1e9  # --inter-node-link 8,2
LAT_IN, BW_IN = 0.0005, 2e9  # --intra-node-link 16,0.5
SCALE = 3  # modelled_params per actual parameter
WORLD = 8


def _run(tmp_path, script, *args, scale: int = SCALE, intra: str | None = "16,0.5"):
    cfg = RunConfig(strategy="sync", workers=WORLD, nodes=2, dataset="synthetic",
                    inter_node_link="8,2", out=str(tmp_path))  # fmt: skip
    sim = SimulationConfig(step_time_s=0.01, intra_node_link=intra, modelled_params=scale)
    return run_ranks(cfg, script, *args, sim=sim, actual_params=1)


# ---------------------------------------------------------------------------- all-gather
def _gather(ctx, members, dtype):
    """Member k (position) calls an all-gather of [10k, 10k + 1, 10k + 2] at (k + 1) ms."""
    comm = ctx.comm
    group = comm.new_group("gather", members, 60.0)
    if ctx.rank not in members:
        return None
    pos = members.index(ctx.rank)
    piece = torch.tensor([10 * pos + k for k in range(3)]).to(dtype)
    out = torch.full((3 * len(members),), -1).to(dtype)
    comm.sleep(0.001 * (pos + 1))
    comm.all_gather(out, piece, group)
    return comm.now(), out.tolist()


@pytest.mark.parametrize(
    "members, dtype", [([2, 1], torch.float32), ([2, 1], torch.int64), ([5], torch.float32)],
    ids=["float32", "int64", "one-member"],
)  # fmt: skip
def test_an_all_gather_costs_a_ring_on_half_the_scaled_pieces(tmp_path, members, dtype):
    """Every member receives the pieces in member order and leaves at the last call + 2
    latencies + one piece's bytes (scaled by 3, whatever its dtype) / bandwidth (a ring of 2
    over n/2 pieces); a group of one gets its own piece at no cost."""
    element = 4 if dtype == torch.float32 else 8
    n = len(members)
    end = 0.001 * n + (2 * LAT_IN + 3 * element * SCALE / BW_IN if n > 1 else 0.0)
    runs = _run(tmp_path, _gather, members, dtype)
    want = [10 * pos + k for pos in range(n) for k in range(3)]
    assert all(runs[rank] == (close(end), want) for rank in members)


# ---------------------------------------------------------------------------- all-to-all
# Member s's input is cut into pieces of S[s][i] elements, piece i going to member i; member i's
# output is the pieces (0, i), (1, i), ... in member order. The all-to-all starts when its last
# member calls it and its links are free, and costs (n − 1) latencies + the busiest member's
# (scaled) bytes to the others / bandwidth, on the link the group spans (collectives.all_to_all_s).
STAGGER = 0.001  # member k calls the all-to-all at (k + 1) ms


def _splits(n: int) -> list[list[int]]:
    """S[s][i]: uneven pieces, some empty from n = 3 (S[2][0] = 0)."""
    return [[(7 * s + 3 * i + 1) % 5 for i in range(n)] for s in range(n)]


def _exchange(ctx, members, dtype, splits, as_tensor=False):
    """The members call one all-to-all, staggered, member k's input 20k, 20k + 1, ...; each
    returns (its time, its output)."""
    comm = ctx.comm
    group = comm.new_group("a2a", members, 60.0)
    if ctx.rank not in members:
        return None
    pos = members.index(ctx.rank)
    sends, receives = splits[pos], [row[pos] for row in splits]
    x = torch.tensor([20 * pos + k for k in range(sum(sends))]).to(dtype)
    out = torch.full((sum(receives),), -1).to(dtype)
    comm.sleep(STAGGER * (pos + 1))
    if as_tensor:  # split sizes counted in a narrow integer tensor, not Python ints
        sends = torch.tensor(sends, dtype=torch.int16)
        receives = torch.tensor(receives, dtype=torch.int16)
    comm.all_to_all(out, x, receives, sends, group)
    return comm.now(), out.tolist()


def _expected_output(i: int, splits: list[list[int]]) -> list[int]:
    """Member i's output by hand: piece (s, i) of every member s, in member order."""
    pieces = [range(sum(row[:i]), sum(row[: i + 1])) for row in splits]
    return [20 * s + k for s, piece in enumerate(pieces) for k in piece]


def _expected_end(n: int, splits, element: int, payload: bool, spans: bool) -> float:
    if n < 2:  # a group of one: nothing on the wire, no rounds
        return STAGGER
    lat, bw = (LAT, BW) if spans else (LAT_IN, BW_IN)
    sent = max(sum(row) - row[s] for s, row in enumerate(splits))
    return STAGGER * n + (n - 1) * lat + sent * element * (SCALE if payload else 1) / bw


GROUPS = {
    "one": [3],  # a group of one: its input copied to its output at no cost
    "2-node0": [1, 2],
    "2-across": [0, 7],
    "3-node1": [4, 6, 5],  # members in a non-rank order: positions are what count
    "3-across": [2, 3, 4],
    "4-node0": [0, 1, 2, 3],
    "4-across": [1, 3, 4, 6],
    # Member 0 holds the most data but keeps most of it; member 1 sends the most away: the
    # cost counts member 1's 5 floats sent away, not member 0's input of 9.
    "busiest": [0, 1, 2],
}
SPLITS = {"busiest": [[8, 1, 0], [2, 1, 3], [1, 0, 1]]}
DTYPES = {torch.float32: (4, True), torch.uint8: (1, True), torch.int64: (8, False)}
CASES = [(name, torch.float32, False) for name in GROUPS] + [
    (name, dtype, False) for name in ("2-node0", "3-across") for dtype in (torch.uint8, torch.int64)
]
# Split sizes may come as the elements of an int16 tensor (counts a caller computed with torch).
CASES += [("4-across", torch.float32, True)]


@pytest.mark.parametrize(
    "name, dtype, as_tensor", CASES, ids=[f"{n}-{str(d)[6:]}{'-int16' * t}" for n, d, t in CASES]
)
def test_all_to_all_delivers_every_piece_and_costs_the_busiest_members_bytes(
    tmp_path, name, dtype, as_tensor
):
    """Each member receives exactly its pieces, in member order, and leaves at the last arrival +
    (n − 1) latencies + the busiest sender's (scaled) bytes / bandwidth on the link spanned."""
    members = GROUPS[name]
    n, (element, payload) = len(members), DTYPES[dtype]
    splits = SPLITS.get(name, _splits(n))
    spans = len({m * 2 // WORLD for m in members}) > 1
    end = _expected_end(n, splits, element, payload, spans)
    runs = _run(tmp_path, _exchange, members, dtype, splits, as_tensor)
    for pos, rank in enumerate(members):
        assert runs[rank] == (close(end), _expected_output(pos, splits)), (name, rank)
    assert all(runs[r] is None for r in range(WORLD) if r not in members)


def _a2a_then_messages(ctx, posted):
    """Ranks 0 and 7 run an all-to-all across the nodes; at ``posted`` rank 3 (node 0) sends
    1e6 bytes (3e6 on the wire) to rank 5 (node 1) and to rank 2 (node 0)."""
    comm, rank = ctx.comm, ctx.rank
    result = _exchange(ctx, [0, 7], torch.float32, _splits(2))
    if rank == 3:
        comm.sleep(posted)
        for w in [comm.isend(torch.zeros(250_000), dst, tag=1) for dst in (5, 2)]:
            w.wait()
    if rank in (5, 2):
        comm.recv(torch.empty(250_000), 3, tag=1)
        return comm.now()
    return result


def test_the_all_to_all_holds_the_nics_of_the_nodes_it_spans(tmp_path):
    """A message from node 0 to node 1 posted while an all-to-all across them runs waits for its
    end (both NICs held); a message within node 0 (the intra-node link, not held) goes at once."""
    a2a_end = _expected_end(2, _splits(2), 4, True, True)
    posted = 3 * STAGGER  # after the all-to-all began (2 ms), before it ends
    runs = _run(tmp_path, _a2a_then_messages, posted)
    assert runs[0][0] == close(a2a_end) and runs[7][0] == close(a2a_end)
    assert runs[5] == close(a2a_end + LAT + 3e6 / BW)  # queued behind the all-to-all
    assert runs[2] == close(posted + LAT_IN + 3e6 / BW_IN)  # not held: leaves at once


SPLITS_MSG = "all-to-all: a member's input splits do not fit its tensor"
PEER_MSG = "all-to-all: what a member sends is not what its peer expects"


def _bad(ctx, inputs, sends, receives):
    """Members 0 and 1 call an all-to-all with the given inputs and splits."""
    comm = ctx.comm
    group = comm.new_group("pair", [0, 1], 60.0)
    if ctx.rank > 1:
        return
    x = torch.arange(float(inputs[ctx.rank]))
    out = torch.zeros(sum(receives[ctx.rank]))
    comm.sleep(STAGGER * (ctx.rank + 1))
    comm.all_to_all(out, x, receives[ctx.rank], sends[ctx.rank], group)


@pytest.mark.parametrize(
    "inputs, sends, receives, message",
    [
        # Member 1's splits add up to 3, its tensor holds 4 (its peer expects what it sends).
        ([3, 4], [[1, 2], [2, 1]], [[1, 2], [2, 1]], SPLITS_MSG),
        # Three splits each in a group of two (adding up to each tensor's size).
        ([3, 4], [[1, 1, 1], [2, 1, 1]], [[1, 2], [1, 1]], SPLITS_MSG),
        # Member 0 sends 2 to member 1, which expects 1 (each member's splits fit).
        ([3, 3], [[1, 2], [1, 2]], [[1, 1], [1, 2]], PEER_MSG),
    ],
    ids=["splits-short-of-tensor", "one-split-too-many", "peer-expects-other"],
)
def test_inconsistent_splits_fail_the_all_to_all_with_what_is_wrong(
    tmp_path, inputs, sends, receives, message
):
    """A member whose splits do not cut its tensor exactly, or whose pieces are not the sizes
    its peers expect, fails the all-to-all with a message that says which."""
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        _run(tmp_path, _bad, inputs, sends, receives)


# ---------------------------------------------------------------------------- messages
def _measurement(ctx) -> dict[str, float]:
    """Rank 0 (node 0) asks rank 4 (node 1) inside ``measuring()``; rank 4 replies, then sends
    rank 1 (node 0) a message of its own (1e6 bytes)."""
    comm, rank, t = ctx.comm, ctx.rank, {}
    if rank == 0:
        with comm.measuring():
            comm.send(torch.ones(10), 4, tag=3)
            reply = torch.zeros(10)
            comm.recv(reply, 4, tag=4)
            t["inside"], t["reply"] = comm.now(), reply[0].item()
        t["after"] = comm.now()
    elif rank == 4:
        request = torch.zeros(10)
        comm.recv(request, 0, tag=3)
        t["got_request"] = comm.now()
        comm.send(request * 5, 0, tag=4)  # the reply to a measurement: free
        t["replied"] = comm.now()
        comm.send(torch.zeros(250_000), 1, tag=4)  # to another rank: charged
        t["sent_other"] = comm.now()
    elif rank == 1:
        comm.recv(torch.zeros(250_000), 4, tag=4)
        t["got_other"] = comm.now()
    comm.barrier()
    t["messages"] = comm.net.messages  # what summary.json's "simulator" reports
    return t


def test_a_measurement_and_its_reply_are_free_and_other_traffic_is_not(tmp_path):
    """A measurement's request and its reply are free (the asker's clock is back where it was);
    the replier's next message to another rank is charged. Every message is counted once."""
    runs = _run(tmp_path, _measurement, scale=1)
    one = LAT + 1e6 / BW
    assert runs[0] == {"inside": 0.0, "reply": 5.0, "after": 0.0, "messages": 3}
    assert runs[4] == {
        "got_request": 0.0, "replied": 0.0, "sent_other": close(one), "messages": 3
    }  # fmt: skip
    assert runs[1] == {"got_other": close(one), "messages": 3}


def _tags(ctx) -> list[float]:
    """Rank 0 sends rank 1 (same node, a free link: all arrive at t = 0) tag 6, then tag 5
    twice; rank 1 receives tag 5, tag 5, tag 6."""
    comm = ctx.comm
    if ctx.rank == 0:
        for value, tag in ((6.0, 6), (1.0, 5), (2.0, 5)):
            comm.send(torch.full((3,), value), 1, tag=tag)
    if ctx.rank != 1:
        return []
    got = []
    for tag in (5, 5, 6):
        buf = torch.zeros(3)
        comm.recv(buf, 0, tag=tag)
        got.append(buf[0].item())
    return got + [comm.now()]


def test_a_receive_takes_its_tags_messages_in_the_order_they_were_sent(tmp_path):
    """A receive matches the tag (a message of another tag in the same group waits), and of
    messages arriving at the same time takes the one sent first."""
    assert _run(tmp_path, _tags, intra=None)[1] == [1.0, 2.0, 6.0, 0.0]


def _other_tag_first(ctx, send_other: bool) -> int:
    """Rank 1 waits for rank 0's tag-5 message, sent at 2 ms; with ``send_other`` rank 0 sends
    it a tag-6 message (never received) at 1 ms. The scheduler's task switches."""
    comm = ctx.comm
    if ctx.rank == 0:
        comm.sleep(0.001)
        if send_other:
            comm.send(torch.zeros(3), 1, tag=6)
        comm.sleep(0.001)
        comm.send(torch.ones(3), 1, tag=5)
    elif ctx.rank == 1:
        comm.recv(torch.zeros(3), 0, tag=5)
    comm.barrier()
    return comm.sched.switches


def test_a_message_for_another_tag_wakes_no_waiting_receiver(tmp_path):
    """A waiting receiver is woken only by a message it matches: an unmatched one sent to it
    adds no task switches."""
    assert _run(tmp_path, _other_tag_first, True) == _run(tmp_path, _other_tag_first, False)


# ---------------------------------------------------------------------------- DDP all-reduce
def _ddp(ctx, calls, numel, busy_bytes):
    """Ranks 1 and 2 (node 0) call DDP's all-reduce of ``numel`` float32 (rank + 1)s: rank r at
    ``calls[r] = (time, step)`` with its step's compute time. With ``busy_bytes``, rank 1 first
    sends that many int64 bytes to rank 3 (not waited for), holding its intra-node link."""
    comm, net = ctx.comm, ctx.comm.net
    group = comm.new_group("ddp", [1, 2], 60.0)
    if busy_bytes and ctx.rank == 1:
        comm.isend(torch.zeros(busy_bytes // 8, dtype=torch.int64), 3, tag=1)
    if busy_bytes and ctx.rank == 3:
        comm.recv(torch.zeros(busy_bytes // 8, dtype=torch.int64), 1, tag=1)
    if ctx.rank not in calls:
        return None
    at, step = calls[ctx.rank]
    comm.sleep(at)
    flat = torch.ones(numel) * (ctx.rank + 1)
    op = net.collective("all_reduce", group, ctx.rank, flat, step_s=step)
    net.wait_collective(op, "DDP all-reduce")
    return comm.now(), flat.tolist()


def test_ddp_overlaps_the_all_reduce_with_the_step_of_the_member_that_called_last(tmp_path):
    """Rank 1 calls last (at 1 ms, a step of 1.5 ms begun at −0.5 ms): the all-reduce overlaps
    its backward. 2 full buckets of B bytes, each a ring of 2 on the intra-node link, c = 2
    latencies + B / bandwidth, ready 1 ms and 1.5 ms after the step's start (forward step/3):
    bucket 1 (c > 0.5 ms) ends at 1 + 2c. Both leave at −0.5 + 1 + 2c ms, holding 2 + 3."""
    c = 2 * LAT_IN + DDP_BUCKET_BYTES / BW_IN
    end = -0.0005 + 0.001 + 2 * c
    calls = {1: (0.001, 0.0015), 2: (0.0005, 0.0003)}
    runs = _run(tmp_path, _ddp, calls, 1, 0, scale=2 * DDP_BUCKET_BYTES // 4)
    assert runs[1] == (close(end), [5.0]) and runs[2] == (close(end), [5.0])


def test_ddp_waits_for_a_member_link_still_busy_after_the_last_call(tmp_path):
    """Rank 1's intra-node link is busy until 0.5 ms + 4e6 / 2e9 = 2.5 ms (unscaled control
    data): an all-reduce of nothing called by 1 ms ends when the link is free, not at 1 ms."""
    calls = {1: (0.001, 0.002), 2: (0.0005, 0.004)}
    runs = _run(tmp_path, _ddp, calls, 0, 4_000_000)
    assert runs[1] == (close(0.0025), []) and runs[2] == (close(0.0025), [])


# ------------------------------------------------------------- all_reduce_sum, broadcast, world_sum
# On W threads (tests.support.ThreadComm, its clock read at 10.0, 10.5, ...): what the counted
# collectives give every rank, add to the counters and ask of an emulated link.
GROUP = object()  # an opaque group handle: passed through, never looked inside


@pytest.mark.parametrize(
    "size, spans, active, emulated",
    [(4, False, True, False), (1, True, True, False), (2, True, False, False),
     (2, True, True, True)],
    ids=["within-a-node", "one-rank-across-nodes", "inactive-link", "across-nodes"],
)  # fmt: skip
def test_all_reduce_sum_charges_the_link_only_for_two_or_more_ranks_across_nodes(
    size, spans, active, emulated
):
    """Rank 0's [1, 2, 3, 4] summed with the others' hundreds over GROUP, counted as a ring on
    the links spanned (intra-node by default); only a group of 2+ across nodes on an active link
    asks the link, books its cost on the group, adds it to emulated_link_s, waits for the work."""

    def rank_fn(rank, comm):
        mine = torch.tensor([1.0, 2.0, 3.0, 4.0]) if rank == 0 else torch.full((4,), 100.0)
        link, stats = RecordingLink(active, allreduce_cost_s=0.25), CommStats()
        kw = {"spans_nodes": True} if spans else {}  # within a node by default
        pending = all_reduce_sum(mine, GROUP, stats, link=link, comm=comm, **kw)
        return pending, mine, list(comm.calls), comm, link, stats

    runs = on_comm_threads(size, rank_fn, handle=GROUP, start=10.0, tick=0.5)
    pending, t, calls, comm, link, stats = runs[0]
    assert t.tolist() == [1.0 + 100 * (size - 1) + k for k in range(4)]
    assert calls == [("all_reduce", torch.float32, 4, emulated)] + [("wait",)] * emulated
    assert (link.asked, link.booked) == (([(16, size)], [(0.25, GROUP)]) if emulated else ([], []))
    moved = 2 * (size - 1) / size * 16
    assert (stats.inter_node_bytes, stats.intra_node_bytes) == ((moved, 0) if spans else (0, moved))
    assert (stats.wait_s, stats.emulated_link_s) == (0.5, 0.25 if emulated else 0.0)
    pending.wait()  # nothing left to wait for: two more readings of the same clock
    assert stats.wait_s == 1.0 and comm.clock == 12.0


def test_a_broadcast_is_counted_as_sent_within_the_group_by_its_source_and_received_by_the_rest():
    """Every rank ends with the source's tensor; the source counts its bytes as sent (within
    the group's node), the others as received; each adds the call's clock seconds to wait_s."""
    source = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64)

    def rank_fn(rank, comm):
        stats = prior_stats()
        t = source.clone() if rank == 2 else torch.full((3,), 7.0, dtype=torch.float64)
        return broadcast(t, 2, GROUP, stats, rank=rank, comm=comm), t, comm.calls, stats

    moved = 3 * 8
    runs = on_comm_threads(4, rank_fn, handle=GROUP, start=10.0, tick=0.5)
    for rank, (returned, t, calls, stats) in enumerate(runs):
        assert returned is None and torch.equal(t, source)
        assert calls == [("broadcast", torch.float64, 3, 2)]
        sends = moved if rank == 2 else 0
        assert (stats.sent_bytes, stats.intra_node_bytes) == (1000 + sends, 4000 + sends)
        assert stats.received_bytes == 2000 + moved - sends and stats.inter_node_bytes == 3000
        assert stats.wait_s == 1.0 + 0.5  # clock read at 10.0 before, 10.5 after
        assert stats.emulated_link_s == 0.25


@pytest.mark.parametrize(
    "spans, cost", [(False, 0.0625), (True, None), (True, 0.0625)],
    ids=["within-a-node", "across-nodes-no-link", "across-nodes"],
)  # fmt: skip
def test_a_world_sum_adds_in_float64_over_the_world_group_counted_as_a_ring(spans, cost):
    """The float64 sum as Python floats (0.1 + 0.2 is not the float32 sum) over the world group
    (None), counted as a ring of 2 × 8 bytes over 4 ranks, intra-node unless ``spans_nodes``: then
    an active link's cost is added to emulated_link_s, booked once, waited for; else not asked."""
    values = [[0.1, 3.0], [0.2, 1.0], [0.0, 0.0], [0.0, 0.0]]

    def rank_fn(rank, comm):
        stats, link = prior_stats(), cost and RecordingLink(allreduce_cost_s=cost)
        kw = {"spans_nodes": True} if spans else {}  # within a node by default
        out = world_sum(values[rank], stats, link=link, comm=comm, **kw)
        return out, comm.calls, stats, link

    out, calls, stats, link = on_comm_threads(4, rank_fn, handle=None, start=2.0, tick=0.75)[0]
    emulated = bool(spans and cost)
    assert out == [0.1 + 0.2, 4.0] and all(type(v) is float for v in out)
    assert calls == [("all_reduce", torch.float64, 2, emulated)] + [("wait",)] * emulated
    assert stats.sent_bytes == 1000 + 24 and stats.received_bytes == 2000 + 24
    inter, intra = (24, 0) if spans else (0, 24)
    assert (stats.inter_node_bytes, stats.intra_node_bytes) == (3000 + inter, 4000 + intra)
    assert stats.wait_s == 1.0 + 0.75
    assert stats.emulated_link_s == 0.25 + (cost if emulated else 0.0)
    if link:
        assert (link.asked, link.booked) == (([(16, 4)], [(cost, None)]) if emulated else ([], []))


def test_an_all_to_all_costs_a_latency_a_peer_plus_its_bytes_and_nothing_alone_or_on_a_free_link():
    """all_to_all_s: (n − 1) latencies + bytes / bandwidth; exactly 0 for a group of one or a
    link without a spec."""
    link = RecordingLink()
    assert all_to_all_s(link, 512, 3) == 2 * 0.125 + 0.5
    assert all_to_all_s(link, 512, 1) == 0.0
    assert all_to_all_s(link, 512, 0) == 0.0
    free = RecordingLink()
    free.spec = None
    assert all_to_all_s(free, 512, 4) == 0.0
