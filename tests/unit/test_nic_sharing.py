"""The real run's emulated link with each node's NIC shared by its ranks (issue 30): bookings
in one :class:`NicState` (shared by the ranks of a test, as by those of a machine) at explicit
start times, against hand-computed ends. Link: 1 Gbit/s and 1 ms; a message of 1.25 MB holds a
link for 1 ms + 10 ms.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cloudburst.comm import costs, link
from cloudburst.comm import nic as nic_module
from cloudburst.comm.collectives import all_reduce_sum
from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import LinkEmulator, Topology
from cloudburst.comm.nic import NicState, PendingEnd, resolve_end
from cloudburst.comm.stats import CommStats
from tests.support import close, link_ranks

pytestmark = pytest.mark.unit

SPEC = LinkSpec(1.0, 1.0)
MB = 1_250_000  # 1 ms + 10 ms on the link


# ---------------------------------------------------------------------------- collectives
def test_two_collectives_of_different_groups_on_one_node_serialise(record):
    # DASO on 4 ranks, 2 nodes (0, 1 | 2, 3): its global groups (0, 2) and (1, 3) both
    # cross the nodes' NICs.
    topo = Topology.contiguous(4, 2)
    r = link_ranks(SPEC, topo, record(2))
    across0, across1 = ("across0", (0, 2)), ("across1", (1, 3))
    # An op starts when its last member is in: the first ones get a pending end.
    first0 = r[0].book_collective(0.5, across0, start=10.0)
    first1 = r[1].book_collective(0.5, across1, start=10.0)
    assert isinstance(first0, PendingEnd) and first0.peek() is None
    assert r[2].book_collective(0.5, across0, start=10.2) == close(10.7)
    # Its last member is in at 10.3, but node 0's and node 1's NICs are busy until 10.7.
    assert r[3].book_collective(0.5, across1, start=10.3) == close(11.2)
    assert resolve_end(first0) == close(10.7) and resolve_end(first1) == close(11.2)
    # The next op of group 0 (the second on it) queues behind both.
    second = r[2].book_collective(0.5, across0, start=10.6)
    assert r[0].book_collective(0.5, across0, start=10.7) == close(11.7)
    assert resolve_end(second) == close(11.7)
    assert r[0].nic.free(0) == r[0].nic.free(1) == (close(11.7), close(11.7))
    # Each rank is charged its ops' cost (the queueing shows in the time it waits).
    assert [e.emulated_s for e in r] == [close(1.0), close(0.5), close(1.0), close(0.5)]


def test_a_collective_with_two_members_on_one_node_is_booked_once(record):
    topo = Topology.contiguous(4, 2)
    r = link_ranks(SPEC, topo, record(2))
    world = ("0", (0, 1, 2, 3))
    early = [
        r[i].book_collective(0.5, world, start=t) for i, t in ((0, 10.0), (1, 10.1), (3, 10.2))
    ]
    assert r[2].book_collective(0.5, world, start=10.4) == close(10.9)  # the last one in
    assert [resolve_end(e) for e in early] == [close(10.9)] * 3
    # Booked once: the NICs are free at 10.9, not 10.4 + 4 · 0.5.
    assert r[0].nic.free(0) == r[0].nic.free(1) == (close(10.9), close(10.9))
    pending = r[1].book_collective(0.25, ("across1", (1, 3)), start=10.2)
    assert r[3].book_collective(0.25, ("across1", (1, 3)), start=10.3) == close(11.15)
    assert resolve_end(pending) == close(11.15)


def test_a_collective_holds_only_its_own_nodes_nics(record):
    # 6 ranks on 3 nodes (0, 1 | 2, 3 | 4, 5): ranks 0 and 2 (nodes 0, 1) and ranks 5 and 4
    # (node 2 alone: no NIC) do not hold each other up; ranks 1 and 4 (nodes 0 and 2) wait
    # for node 0.
    topo = Topology.contiguous(6, 3)
    r = link_ranks(SPEC, topo, record(3))
    r[0].book_collective(0.5, ("a", (0, 2)), start=10.0)
    assert r[2].book_collective(0.5, ("a", (0, 2)), start=10.0) == close(10.5)
    r[1].book_collective(0.5, ("b", (1, 4)), start=10.0)
    assert r[4].book_collective(0.5, ("b", (1, 4)), start=10.0) == close(11.0)
    assert r[0].nic.free(1) == (close(10.5), close(10.5))
    assert r[0].nic.free(2) == (close(11.0), close(11.0))


# ---------------------------------------------------------------------------- messages
def test_two_messages_from_one_node_queue_on_its_egress(record):
    topo = Topology.contiguous(6, 3)
    r = link_ranks(SPEC, topo, record(3))
    assert r[0].book_send(MB, 2, start=10.0) == close(10.011)  # node 0 -> node 1
    # Rank 1 (node 0) to node 2 at the same time: behind rank 0's message on the egress.
    assert r[1].book_send(MB, 4, start=10.0) == close(10.022)
    assert r[0].nic.free(0)[0] == close(10.022)
    assert [e.emulated_s for e in r[:2]] == [close(0.011), close(0.011)]


def test_two_nodes_sending_to_one_node_queue_at_its_ingress(record):
    # Incast: nodes 0 and 1 both send to rank 4 (node 2) at 10.0. The first arrives at 10.011;
    # the second leaves its own egress at once, but its bytes wait for node 2's ingress:
    # max(10.0 + 0.011, 10.011 + 0.010) = 10.021 (costs.nic_transfer).
    topo = Topology.contiguous(6, 3)
    r = link_ranks(SPEC, topo, record(3))
    assert r[0].book_send(MB, 4, start=10.0) == close(10.011)
    assert r[2].book_send(MB, 4, start=10.0) == close(10.021)
    assert r[0].nic.free(1)[0] == close(10.011)  # node 1's egress: its message alone
    assert r[0].nic.free(2)[1] == close(10.021)
    assert costs.nic_transfer(10.0, 10.011, MB, 0.001, 125e6, 125e6) == (
        close(10.011),
        close(10.021),
    )


def test_messages_and_collectives_share_the_nic(record):
    topo = Topology.contiguous(4, 2)
    r = link_ranks(SPEC, topo, record(2))
    r[1].book_collective(0.5, ("across1", (1, 3)), start=10.0)
    assert r[3].book_collective(0.5, ("across1", (1, 3)), start=10.0) == close(10.5)
    assert r[0].book_send(MB, 2, start=10.0) == close(10.511)  # node 0's egress is busy


# ---------------------------------------------------------------------------- no sharing
def test_without_a_shared_record_each_rank_keeps_todays_link():
    topo = Topology.contiguous(4, 2)
    for alone in (LinkEmulator(SPEC), LinkEmulator(SPEC, topology=topo, rank=0)):
        assert not alone.shared
        # Its own queue, whatever the group: today's reserve().
        assert alone.book_collective(0.5, ("across0", (0, 2)), start=10.0) == close(10.5)
        assert alone.book_collective(0.5, ("across1", (1, 3)), start=10.0) == close(11.0)
        assert alone.book_send(MB, 2, start=10.0) == close(11.011)
        assert alone.book_send(MB, 3, start=12.0) == close(12.011)
        assert alone.emulated_s == close(1.022)
    assert not LinkEmulator(None, topology=topo, rank=0).active


@pytest.mark.parametrize("given", [{"topology": Topology((0, 1))}, {"rank": 0}, {}])
def test_a_shared_nic_is_refused_without_both_the_topology_and_the_rank(record, given):
    with pytest.raises(ValueError, match="^a shared NIC needs the topology and this rank$"):
        LinkEmulator(SPEC, nic=record(2), **given)


def test_all_reduce_sum_books_the_collective_of_its_group(record, monkeypatch):
    """The call site: all_reduce_sum books (group name, ranks, index) on the shared NIC."""
    from types import SimpleNamespace

    topo = Topology.contiguous(4, 2)
    r = link_ranks(SPEC, topo, record(2))
    monkeypatch.setattr(link, "time", SimpleNamespace(perf_counter=lambda: 10.0))

    class Comm:
        def group_size(self, group):
            return 2

        def all_reduce(self, tensor, group, async_op=False):
            return SimpleNamespace(wait=lambda: None, is_completed=lambda: True)

        def now(self):
            return 0.0

    tensor = torch.zeros(1_000_000)  # 4 MB over 2 ranks: 2 ms + 4 MB / 125 MB/s = 0.034 s
    ends = []
    a, b = ("a", (0, 2)), ("b", (1, 3))
    for rank, group in ((0, a), (1, b), (2, a), (3, b)):
        pending = all_reduce_sum(
            tensor, group, CommStats(), link=r[rank], spans_nodes=True, async_op=True,
            comm=Comm(),
        )  # fmt: skip
        ends.append(pending.works[-1].deadline)
    assert isinstance(ends[0], PendingEnd) and ends[2] == close(10.034)
    assert [resolve_end(e) for e in ends] == [close(10.034), close(10.068)] * 2


# ---------------------------------------------------------------------------- the record
def test_the_record_is_created_once_checked_unlinked_and_closed(tmp_path):
    path = str(tmp_path / "nic")
    first = NicState(path, 2)
    second = NicState(path, 2)  # attaches: the first one's bookings are visible
    with first.locked():
        first.set_free(1, 3.0, 4.0)
    with second.locked():
        assert second.free(1) == (3.0, 4.0) and second.free(0) == (0.0, 0.0)
    with pytest.raises(OSError, match="not a record of 3 nodes"):
        NicState(path, 3)
    first.unlink()
    first.unlink()  # idempotent: every rank may call it
    with second.locked():
        assert second.free(1) == (3.0, 4.0)  # still open after its name went
    fd, mapping = first._fd, first._map
    first.close()
    assert first._fd is None and mapping.closed
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor is closed
    first.close()  # a second close does nothing
    assert first._fd is None
    second.close()
    assert list(tmp_path.iterdir()) == []


def test_a_full_table_forgets_the_oldest_booking(record):
    nic = record(2)
    with nic.locked():
        for i in range(nic_module.NIC_OPS + 1):
            key = i.to_bytes(16, "big") if i else b"\xff" * 16
            nic.set_op(key, float(i), float(i) + 1, 0)  # closed: its last member in at i
        assert nic.op_end(b"\xff" * 16) is None  # booked first (at 0.0): forgotten
        assert nic.op_end((1).to_bytes(16, "big")) == 2.0
        assert nic.op_end(nic_module.NIC_OPS.to_bytes(16, "big")) == nic_module.NIC_OPS + 1.0


def test_the_shared_clock_is_machine_wide():
    # time.perf_counter is CLOCK_MONOTONIC on Linux: the same clock in every process.
    assert nic_module.shared_clock_ok()


# ---------------------------------------------------------------------------- the runtime
class _Unreachable:
    """A job store that cannot be reached."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        raise RuntimeError("store unreachable")


def test_the_ranks_of_a_job_open_one_record_named_through_the_store(tmp_path, monkeypatch):
    from cloudburst import runtime
    from cloudburst.config import RunConfig

    monkeypatch.setattr(runtime, "nic_dir", lambda: str(tmp_path))
    cfg = RunConfig(workers=4, nodes=2, inter_node_link="1,1")
    store, topo = dist.HashStore(), Topology.contiguous(4, 2)
    fields = [runtime._real_rank(cfg, r, store, None, "gloo", topo, share_nic=True) for r in (0, 2)]
    a, b = (f["link"] for f in fields)
    assert a.shared and b.shared and a.nic.path == b.nic.path
    assert a.nic.path.startswith(str(tmp_path / "cloudburst-nic-"))
    pending = a.book_collective(0.5, ("g", (0, 2)), start=1.0)
    assert b.book_collective(0.5, ("g", (0, 2)), start=1.2) == 1.7  # the same op, once
    assert resolve_end(pending) == 1.7
    # Another job (another store) gets a record of its own.
    other = runtime._real_rank(cfg, 0, dist.HashStore(), None, "gloo", topo, share_nic=True)["link"]
    assert other.nic.path != a.nic.path
    # One node, no link, or a rank outside the job's start (rejoined): nothing shared.
    assert runtime.shared_nic(RunConfig(workers=4), store, Topology.contiguous(4, 1)) is None
    no_link = runtime._real_rank(RunConfig(workers=4, nodes=2), 0, store, None, "gloo", topo, True)
    assert not no_link["link"].active and not no_link["link"].shared
    assert not runtime._real_rank(cfg, 0, store, None, "gloo", topo)["link"].shared
    for emu in (a, b, other):
        emu.release_name()
        emu.nic.close()
    assert list(tmp_path.iterdir()) == []


def test_a_rank_that_cannot_open_the_record_keeps_its_own_link_with_one_warning(
    tmp_path, monkeypatch, caplog
):
    from cloudburst import runtime
    from cloudburst.config import RunConfig

    monkeypatch.setattr(runtime, "nic_dir", lambda: str(tmp_path / "missing"))
    cfg = RunConfig(workers=4, nodes=2, inter_node_link="1,1")
    topo = Topology.contiguous(4, 2)
    for store in (dist.HashStore(), _Unreachable()):
        caplog.clear()
        emu = runtime._real_rank(cfg, 0, store, None, "gloo", topo, share_nic=True)["link"]
        assert emu.active and not emu.shared
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "each rank keeps its own" in warnings[0].getMessage()
        assert emu.book_collective(0.5, ("g", (0, 2)), start=1.0) == 1.5
        assert emu.book_collective(0.5, ("h", (1, 3)), start=1.0) == 2.0  # today's queue
