"""The real run's emulated link with each node's NIC shared by its ranks (issue 30): the shared
record (NicState) and bookings at explicit start times against hand-computed ends, on fake
clocks. Link: 1 Gbit/s and 1 ms; a message of 1.25 MB holds it for 1 ms + 10 ms."""

from __future__ import annotations

import math
import os
import stat
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import cloudburst.comm.transport as transport_module
from cloudburst import runtime
from cloudburst.comm import costs, link
from cloudburst.comm import nic as nic_module
from cloudburst.comm.collectives import all_reduce_sum
from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import EmulatedWork, LinkEmulator, Topology
from cloudburst.comm.nic import NicState, PendingEnd, nic_dir, resolve_end
from cloudburst.comm.stats import CommStats
from cloudburst.config import RunConfig
from tests.support import FakeTime, close, link_ranks

SPEC = LinkSpec(1.0, 1.0)
MB = 1_250_000  # 1 ms + 10 ms on the link
G02 = ("g", (0, 2))  # a group of ranks 0 (node 0) and 2 (node 1)
TOPO, CFG = Topology.contiguous(4, 2), RunConfig(workers=4, nodes=2, inter_node_link="1,1")


def ranks(record, world: int = 4, nodes: int = 2) -> list[LinkEmulator]:
    """``world`` ranks on ``nodes`` nodes (contiguous blocks), sharing one record."""
    return link_ranks(SPEC, Topology.contiguous(world, nodes), record(nodes))


def wait_clock(monkeypatch, now: float, step: float | None = None) -> FakeTime:
    """Replace the clock and sleep that PendingEnd.wait (and the record's lock) use."""
    fake = FakeTime(now, step)
    monkeypatch.setattr(nic_module, "_lock_clock", fake.monotonic)
    monkeypatch.setattr(nic_module, "_lock_sleep", fake.sleep)
    return fake


# ---------------------------------------------------------------------------- the record
def test_the_record_lives_in_dev_shm_when_present_else_in_the_temp_dir(monkeypatch):
    monkeypatch.setattr(nic_module.tempfile, "gettempdir", lambda: "/the/temp/dir")
    monkeypatch.setattr(nic_module.os.path, "isdir", lambda p: p == "/dev/shm")
    assert nic_dir() == "/dev/shm"
    monkeypatch.setattr(nic_module.os.path, "isdir", lambda p: False)
    assert nic_dir() == "/the/temp/dir"


def test_a_record_of_one_node_is_made_private_to_its_owner_with_a_30_s_lock(tmp_path, record):
    old = os.umask(0)  # the mode as asked for, not as the umask trims it
    try:
        nic = record(1)  # one node is a valid record
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "nic").st_mode) == 0o600
    assert nic.lock_timeout_s == 30.0 and nic.num_nodes == 1
    with nic.locked():
        assert nic.free(0) == (0.0, 0.0)
    with pytest.raises(ValueError, match=r"num_nodes: 0 must be >= 1"):
        NicState(str(tmp_path / "none"), 0)  # no nodes: refused, naming the count


def test_the_record_is_created_once_checked_unlinked_and_closed(tmp_path):
    """A second NicState attaches (sees the first's bookings); a record of another size or
    without the magic is refused; unlink and close are idempotent."""
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
    NicState(path, 2).close()
    with open(path, "r+b") as f:
        f.write(b"NOTANIC!")  # the magic overwritten; the size still fits 2 nodes
    with pytest.raises(OSError, match=r"nic is not a NIC record of 2 nodes"):
        NicState(path, 2)


def test_an_op_is_unbooked_open_or_closed(record):
    nic = record(2)
    key = b"k" * 16
    with nic.locked():
        assert nic.op(key) is None and nic.op_end(key) is None  # unbooked
        nic.set_op(key, 3.0, math.nan, 1)  # one member in, others to come
        arrival, end, members = nic.op(key)
        assert (arrival, members) == (3.0, 1) and math.isnan(end)
        assert nic.op_end(key) is None
        nic.set_op(key, 4.0, 9.5, 2)  # rewritten in its own slot: the last member is in
        assert nic.op(key) == (4.0, 9.5, 2) and nic.op_end(key) == 9.5
        assert nic.op_end(b"x" * 16) is None
        # While the table has room a new op takes an empty slot: closed ops in at <= 0.0 stay.
        nic.set_op(b"a" * 16, 0.0, 1.0, 2)
        nic.set_op(b"b" * 16, -1.0, 2.0, 2)
        assert nic.op(b"a" * 16) == (0.0, 1.0, 2) and nic.op(b"b" * 16) == (-1.0, 2.0, 2)
        assert nic.op(key) == (4.0, 9.5, 2)


@pytest.mark.parametrize("slots", [4, nic_module.NIC_OPS])
def test_a_full_table_forgets_the_first_of_the_earliest_closed_ops(record, monkeypatch, slots):
    """A new op in a full table replaces the closed op whose last member came in earliest,
    the first of those on a tie (an open op, however early, is kept)."""
    monkeypatch.setattr(nic_module, "NIC_OPS", slots)
    nic = record(2)
    keys = [i.to_bytes(16, "big") for i in range(1, slots + 2)]
    closed = [1.0, 0.5, 0.5] + [3.0] * (slots - 4)  # the last members' arrivals
    with nic.locked():
        nic.set_op(keys[0], 0.0, math.nan, 1)  # open, and the earliest
        for key, at in zip(keys[1:slots], closed, strict=True):
            nic.set_op(key, at, at + 1, 2)
        nic.set_op(keys[slots], 5.0, 6.0, 2)
        assert nic.op(keys[2]) is None  # the first of the closed ops in at 0.5 went
        assert nic.op(keys[0])[::2] == (0.0, 1)
        assert [nic.op_end(k) for k in (keys[1], keys[3], keys[-1])] == [2.0, 1.5, 6.0]


def test_a_table_full_of_open_ops_refuses_a_new_one(record, monkeypatch):
    monkeypatch.setattr(nic_module, "NIC_OPS", 4)
    nic = record(2)
    with nic.locked():
        for i in range(4):
            nic.set_op(bytes([i + 1]) * 16, 1.0, math.nan, 1)
        with pytest.raises(RuntimeError, match=r"has 4 open ops"):
            nic.set_op(b"z" * 16, 2.0, 3.0, 2)


def test_the_shared_clock_is_machine_wide():
    # time.perf_counter is CLOCK_MONOTONIC on Linux: the same clock in every process.
    assert nic_module.shared_clock_ok()


# ---------------------------------------------------------------------------- collectives
def test_a_member_s_bookings_on_a_group_are_numbered_0_1_2(record, monkeypatch):
    r = ranks(record)
    pendings = [r[0].book_collective(0.5, G02, start=10.0) for _ in range(3)]
    assert [p.name for p in pendings] == ["g (0, 2) #0", "g (0, 2) #1", "g (0, 2) #2"]
    pendings_clock = wait_clock(monkeypatch, 0.0, step=1.0)
    with pytest.raises(TimeoutError, match=r"collective g \(0, 2\) #1 still had members"):
        pendings[1].wait(timeout_s=0.5)
    # Rank 2's bookings pair with rank 0's in order: each op starts once both are in and the
    # NICs are free, and lasts 0.5 s.
    assert r[2].book_collective(0.5, G02, start=10.2) == close(10.7)
    assert r[2].book_collective(0.5, G02, start=10.4) == close(11.2)  # #1: after #0
    assert [p.peek() for p in pendings[:2]] == [close(10.7), close(11.2)]
    assert pendings[2].peek() is None
    polls = len(pendings_clock.sleeps)
    assert pendings[0].wait() == close(10.7) and len(pendings_clock.sleeps) == polls  # known
    # Both nodes' NICs are held, both ways, until the end; the members are charged, no other.
    assert r[0].nic.free(0) == r[0].nic.free(1) == (close(11.2), close(11.2))
    assert [e.emulated_s for e in r] == [1.5, 0.0, 1.0, 0.0]


def test_a_process_group_is_named_by_its_own_members(record, monkeypatch):
    world = SimpleNamespace(group_name="0", ranks=(0, 1, 2, 3))
    across = SimpleNamespace(group_name="7", ranks=(1, 3))
    fake_dist = SimpleNamespace(
        group=SimpleNamespace(WORLD=world), get_process_group_ranks=lambda pg: list(pg.ranks)
    )
    monkeypatch.setattr(transport_module, "dist", fake_dist)
    r = ranks(record)
    pending = r[1].book_collective(0.5, across, start=10.0)
    assert isinstance(pending, PendingEnd) and pending.name == "7 (1, 3) #0"
    assert r[3].book_collective(0.5, across, start=10.25) == close(10.75)  # 2 members: done
    assert pending.peek() == close(10.75)


def test_two_collectives_of_different_groups_on_one_node_serialise(record):
    # DASO on 2 nodes (0, 1 | 2, 3): its global groups (0, 2) and (1, 3) both cross the NICs.
    r = ranks(record)
    across1 = ("across1", (1, 3))
    # An op starts when its last member is in: the first ones get a pending end.
    first0 = r[0].book_collective(0.5, G02, start=10.0)
    first1 = r[1].book_collective(0.5, across1, start=10.0)
    assert isinstance(first0, PendingEnd) and first0.peek() is None
    assert r[2].book_collective(0.5, G02, start=10.2) == close(10.7)
    # Its last member is in at 10.3, but node 0's and node 1's NICs are busy until 10.7.
    assert r[3].book_collective(0.5, across1, start=10.3) == close(11.2)
    assert resolve_end(first0) == close(10.7) and resolve_end(first1) == close(11.2)
    # The next op of group 0 (the second on it) queues behind both.
    second = r[2].book_collective(0.5, G02, start=10.6)
    assert r[0].book_collective(0.5, G02, start=10.7) == close(11.7)
    assert resolve_end(second) == close(11.7)
    assert r[0].nic.free(0) == r[0].nic.free(1) == (close(11.7), close(11.7))
    # Each rank is charged its ops' cost (the queueing shows in the time it waits).
    assert [e.emulated_s for e in r] == [close(1.0), close(0.5), close(1.0), close(0.5)]


def test_a_collective_with_two_members_on_one_node_is_booked_once(record):
    r = ranks(record)
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
    # 3 nodes (0, 1 | 2, 3 | 4, 5): ranks 0 and 2 (nodes 0, 1) and ranks 5 and 4 (node 2 alone:
    # no NIC) do not hold each other up; ranks 1 and 4 (nodes 0 and 2) wait for node 0.
    r = ranks(record, 6, 3)
    r[0].book_collective(0.5, ("a", (0, 2)), start=10.0)
    assert r[2].book_collective(0.5, ("a", (0, 2)), start=10.0) == close(10.5)
    r[1].book_collective(0.5, ("b", (1, 4)), start=10.0)
    assert r[4].book_collective(0.5, ("b", (1, 4)), start=10.0) == close(11.0)
    assert r[0].nic.free(1) == (close(10.5), close(10.5))
    assert r[0].nic.free(2) == (close(11.0), close(11.0))


def test_all_reduce_sum_books_the_collective_of_its_group(record, monkeypatch):
    """The call site: all_reduce_sum books (group name, ranks, index) on the shared NIC."""
    r = ranks(record)
    monkeypatch.setattr(link, "time", SimpleNamespace(perf_counter=lambda: 10.0))
    done = SimpleNamespace(wait=lambda: None, is_completed=lambda: True)
    comm = SimpleNamespace(
        group_size=lambda group: 2,
        all_reduce=lambda tensor, group, async_op=False: done,
        now=lambda: 0.0,
    )
    tensor = torch.zeros(1_000_000)  # 4 MB over 2 ranks: 2 ms + 4 MB / 125 MB/s = 0.034 s
    ends = []
    for rank, group in ((0, G02), (1, ("b", (1, 3))), (2, G02), (3, ("b", (1, 3)))):
        pending = all_reduce_sum(
            tensor, group, CommStats(), link=r[rank], spans_nodes=True, async_op=True, comm=comm
        )
        ends.append(pending.works[-1].deadline)
    assert isinstance(ends[0], PendingEnd) and ends[2] == close(10.034)
    assert [resolve_end(e) for e in ends] == [close(10.034), close(10.068)] * 2


# ---------------------------------------------------------------------------- messages
def test_a_rank_s_own_link_and_charge_follow_its_shared_collectives_and_messages(record):
    r = ranks(record)
    r[0].book_collective(0.5, G02, start=10.0)
    assert r[2].book_collective(0.5, G02, start=10.0) == close(10.5)
    # Rank 2 books 0.1 s of its own link at 10.0: after the collective's end.
    assert r[2].reserve(0.1, start=10.0) == close(10.6)
    # Messages and collectives share the NIC: rank 1's message waits for node 0's egress.
    assert r[1].book_send(MB, 3, start=10.0) == close(10.511)
    # Each shared message adds its cost to the rank's charge.
    assert r[0].book_send(MB, 2, start=11.0) == close(11.011)
    assert r[0].book_send(MB, 3, start=11.0) == close(11.022)  # queued at node 0's egress
    assert r[0].emulated_s == close(0.5 + 2 * 0.011)
    # A message within node 0 (rank 0 to rank 1) after a message across: rank 0's own link.
    assert r[0].book_send(MB, 2, start=20.0) == close(20.011)
    assert r[0].book_send(MB, 1, start=20.0) == close(20.022)


def test_two_messages_from_one_node_queue_on_its_egress(record):
    r = ranks(record, 6, 3)
    assert r[0].book_send(MB, 2, start=10.0) == close(10.011)  # node 0 -> node 1
    # Rank 1 (node 0) to node 2 at the same time: behind rank 0's message on the egress.
    assert r[1].book_send(MB, 4, start=10.0) == close(10.022)
    assert r[0].nic.free(0)[0] == close(10.022)
    assert [e.emulated_s for e in r[:2]] == [close(0.011), close(0.011)]


def test_two_nodes_sending_to_one_node_queue_at_its_ingress(record):
    # Incast: nodes 0 and 1 send to rank 4 (node 2) at 10.0; the second leaves its egress at once,
    # its bytes wait for node 2's ingress: max(10.0 + 0.011, 10.011 + 0.010) = 10.021.
    r = ranks(record, 6, 3)
    assert r[0].book_send(MB, 4, start=10.0) == close(10.011)
    assert r[2].book_send(MB, 4, start=10.0) == close(10.021)
    assert r[0].nic.free(1)[0] == close(10.011)  # node 1's egress: its message alone
    assert r[0].nic.free(2)[1] == close(10.021)
    transfer = costs.nic_transfer(10.0, 10.011, MB, 0.001, 125e6, 125e6)
    assert transfer == (close(10.011), close(10.021))


def test_a_shared_message_without_a_start_leaves_now(record, monkeypatch):
    fake = FakeTime(30.0)
    monkeypatch.setattr(link, "time", fake)
    r = ranks(record)
    assert r[0].book_send(MB, 2) == close(30.011)
    assert r[0].nic.free(0)[0] == close(30.011) and r[0].nic.free(1)[1] == close(30.011)


# ---------------------------------------------------------------------------- waiting
def test_waiting_polls_every_0_2_ms_until_the_last_member_books(record, monkeypatch):
    r = ranks(record)
    pending = r[0].book_collective(0.5, G02, start=10.0)
    fake = wait_clock(monkeypatch, 100.0)

    def third_poll(count: int) -> None:
        assert count <= 3, "still polling after the last member booked"
        if count == 3:
            r[2].book_collective(0.5, G02, start=10.25)

    fake.on_sleep = third_poll
    assert pending.wait(timeout_s=5.0) == close(10.75)
    assert fake.sleeps == [0.0002] * 3


@pytest.mark.parametrize(
    "timeout, now, step, message, sleeps, end",
    [
        # Each poll moves the clock 0.25 s (exact in binary): the deadline 101.0 is reached at
        # the fifth look, which still waits; the sixth, at 101.25, gives up.
        (1.0, 100.0, 0.25, "#0 still had members to come 1 s after it ran", 5, 101.25),
        (None, 0.0, 10.0, "60 s after it ran", 7, 70.0),  # looked at 0, 10, ..., 60 and 70
    ],
)
def test_waiting_gives_up_only_past_its_timeout_60_s_by_default(
    record, monkeypatch, timeout, now, step, message, sleeps, end
):
    """A wait for a collective's members polls until its timeout (60 s if none is given) has
    passed, sleeping 0.2 ms each time, then raises."""
    pending = ranks(record)[0].book_collective(0.5, G02, start=10.0)
    fake = wait_clock(monkeypatch, now, step=step)
    with pytest.raises(TimeoutError, match=message):
        pending.wait() if timeout is None else pending.wait(timeout_s=timeout)
    assert fake.sleeps == [0.0002] * sleeps and fake.now == end


def test_emulated_work_is_complete_once_its_pending_end_is_known_and_past(record, monkeypatch):
    fake = FakeTime(10.0)
    monkeypatch.setattr(link, "time", fake)
    r = ranks(record)
    work = EmulatedWork(None, r[0].book_collective(0.5, G02, start=10.0))
    assert not work.is_completed()  # the end is not known yet
    r[2].book_collective(0.5, G02, start=10.2)  # ends at 10.7
    fake.advance(0.6)
    assert not work.is_completed()  # 10.6 < 10.7
    fake.advance(0.1)
    assert work.is_completed()


# ---------------------------------------------------------------------------- no sharing
def test_without_a_shared_record_each_rank_keeps_todays_link():
    for alone in (LinkEmulator(SPEC), LinkEmulator(SPEC, topology=TOPO, rank=0)):
        assert not alone.shared
        # Its own queue, whatever the group: today's reserve().
        assert alone.book_collective(0.5, G02, start=10.0) == close(10.5)
        assert alone.book_collective(0.5, ("across1", (1, 3)), start=10.0) == close(11.0)
        assert alone.book_send(MB, 2, start=10.0) == close(11.011)
        assert alone.book_send(MB, 3, start=12.0) == close(12.011)
        assert alone.emulated_s == close(1.022)
    assert not LinkEmulator(None, topology=TOPO, rank=0).active


@pytest.mark.parametrize("given", [{"topology": Topology((0, 1))}, {"rank": 0}, {}])
def test_a_shared_nic_is_refused_without_both_the_topology_and_the_rank(record, given):
    with pytest.raises(ValueError, match="^a shared NIC needs the topology and this rank$"):
        LinkEmulator(SPEC, nic=record(2), **given)


# ---------------------------------------------------------------------------- the runtime
class _Unreachable:
    """A job store that cannot be reached."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        raise RuntimeError("store unreachable")


def test_the_ranks_of_a_job_open_one_record_named_through_the_store(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "nic_dir", lambda: str(tmp_path))
    store = dist.HashStore()
    fields = [runtime._real_rank(CFG, r, store, None, "gloo", TOPO, share_nic=True) for r in (0, 2)]
    a, b = (f["link"] for f in fields)
    assert a.shared and b.shared and a.nic.path == b.nic.path
    assert a.nic.path.startswith(str(tmp_path / "cloudburst-nic-"))
    pending = a.book_collective(0.5, G02, start=1.0)
    assert b.book_collective(0.5, G02, start=1.2) == 1.7  # the same op, once
    assert resolve_end(pending) == 1.7
    # Another job (another store) gets a record of its own.
    other = runtime._real_rank(CFG, 0, dist.HashStore(), None, "gloo", TOPO, share_nic=True)["link"]
    assert other.nic.path != a.nic.path
    # One node, no link, or a rank outside the job's start (rejoined): nothing shared.
    assert runtime.shared_nic(RunConfig(workers=4), store, Topology.contiguous(4, 1)) is None
    no_link = runtime._real_rank(RunConfig(workers=4, nodes=2), 0, store, None, "gloo", TOPO, True)
    assert not no_link["link"].active and not no_link["link"].shared
    assert not runtime._real_rank(CFG, 0, store, None, "gloo", TOPO)["link"].shared
    for emu in (a, b, other):
        emu.release_name()
        emu.nic.close()
    assert list(tmp_path.iterdir()) == []


def test_a_rank_that_cannot_open_the_record_keeps_its_own_link_with_one_warning(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(runtime, "nic_dir", lambda: str(tmp_path / "missing"))
    for store in (dist.HashStore(), _Unreachable()):
        caplog.clear()
        emu = runtime._real_rank(CFG, 0, store, None, "gloo", TOPO, share_nic=True)["link"]
        assert emu.active and not emu.shared
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "each rank keeps its own" in warnings[0].getMessage()
        assert emu.book_collective(0.5, G02, start=1.0) == 1.5
        assert emu.book_collective(0.5, ("h", (1, 3)), start=1.0) == 2.0  # today's queue
