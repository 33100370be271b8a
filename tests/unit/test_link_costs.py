"""The emulated link's shared NIC record and its bookings, against values worked out by hand
(the pure cost functions: tests/unit/test_sim_physics.py). Every clock the code reads is a
fake that moves only when the test moves it or something sleeps. Link: 1 Gbit/s and 1 ms, so a
message of 1.25 MB holds a link for 1 ms + 10 ms.
"""

from __future__ import annotations

import math
import os
import stat
from types import SimpleNamespace

import pytest

import cloudburst.comm.transport as transport_module
from cloudburst.comm import link
from cloudburst.comm import nic as nic_module
from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import EmulatedWork, Topology
from cloudburst.comm.nic import NicState, PendingEnd, nic_dir
from tests.support import FakeTime, close, link_ranks

pytestmark = pytest.mark.unit

SPEC = LinkSpec(1.0, 1.0)
MB = 1_250_000  # 1 ms + 10 ms on the link


def wait_clock(monkeypatch, now: float, step: float | None = None) -> FakeTime:
    """Replace the clock and sleep that PendingEnd.wait (and the record's lock) use."""
    fake = FakeTime(now, step)
    monkeypatch.setattr(nic_module, "_lock_clock", fake.monotonic)
    monkeypatch.setattr(nic_module, "_lock_sleep", fake.sleep)
    return fake


# ---------------------------------------------------------------------------- where it lives
def test_the_record_lives_in_dev_shm_when_present_else_in_the_temp_dir(monkeypatch):
    monkeypatch.setattr(nic_module.tempfile, "gettempdir", lambda: "/the/temp/dir")
    monkeypatch.setattr(nic_module.os.path, "isdir", lambda p: p == "/dev/shm")
    assert nic_dir() == "/dev/shm"
    monkeypatch.setattr(nic_module.os.path, "isdir", lambda p: False)
    assert nic_dir() == "/the/temp/dir"


# ---------------------------------------------------------------------------- the record
def test_a_record_of_one_node_is_made_private_to_its_owner_with_a_30_s_lock(tmp_path):
    path = str(tmp_path / "nic")
    old = os.umask(0)  # the mode as asked for, not as the umask trims it
    try:
        nic = NicState(path, 1)  # one node is a valid record
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert nic.lock_timeout_s == 30.0 and nic.num_nodes == 1
        with nic.locked():
            assert nic.free(0) == (0.0, 0.0)
    finally:
        nic.close()
    with pytest.raises(ValueError, match=r"num_nodes: 0 must be >= 1"):
        NicState(str(tmp_path / "none"), 0)  # no nodes: refused, naming the count


def test_a_file_of_the_right_size_but_not_a_record_is_refused(tmp_path):
    path = str(tmp_path / "nic")
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
        # A new op takes an empty slot: a closed op whose last member came in at 0.0 (or
        # earlier) is still kept while the table has room.
        nic.set_op(b"a" * 16, 0.0, 1.0, 2)
        nic.set_op(b"b" * 16, -1.0, 2.0, 2)
        assert nic.op(b"a" * 16) == (0.0, 1.0, 2) and nic.op(b"b" * 16) == (-1.0, 2.0, 2)
        assert nic.op(key) == (4.0, 9.5, 2)


def test_a_full_table_forgets_the_first_of_the_earliest_closed_ops(record, monkeypatch):
    monkeypatch.setattr(nic_module, "NIC_OPS", 4)  # a table of 4 slots
    nic = record(2)
    keys = [bytes([i + 1]) * 16 for i in range(5)]
    with nic.locked():
        for key in keys[:4]:
            nic.set_op(key, 1.0, 2.0, 2)  # all closed, all last joined at 1.0
        nic.set_op(keys[4], 1.5, 2.5, 2)
        # Ties on the arrival: the first slot goes.
        assert nic.op(keys[0]) is None
        assert [nic.op_end(k) for k in keys[1:]] == [2.0, 2.0, 2.0, 2.5]


def test_a_table_full_of_open_ops_refuses_a_new_one(record, monkeypatch):
    monkeypatch.setattr(nic_module, "NIC_OPS", 4)
    nic = record(2)
    with nic.locked():
        for i in range(4):
            nic.set_op(bytes([i + 1]) * 16, 1.0, math.nan, 1)
        with pytest.raises(RuntimeError, match=r"has 4 open ops"):
            nic.set_op(b"z" * 16, 2.0, 3.0, 2)


# ---------------------------------------------------------------------------- collectives
def test_a_member_s_bookings_on_a_group_are_numbered_0_1_2(record, monkeypatch):
    topo = Topology.contiguous(4, 2)
    r = link_ranks(SPEC, topo, record(2))
    group = ("g", (0, 2))
    pendings = [r[0].book_collective(0.5, group, start=10.0) for _ in range(3)]
    assert [p.name for p in pendings] == ["g (0, 2) #0", "g (0, 2) #1", "g (0, 2) #2"]
    pendings_clock = wait_clock(monkeypatch, 0.0, step=1.0)
    with pytest.raises(TimeoutError, match=r"collective g \(0, 2\) #1 still had members"):
        pendings[1].wait(timeout_s=0.5)
    # Rank 2's bookings pair with rank 0's in order: each op starts once both are in and the
    # NICs are free, and lasts 0.5 s.
    assert r[2].book_collective(0.5, group, start=10.2) == close(10.7)
    assert r[2].book_collective(0.5, group, start=10.4) == close(11.2)  # #1: after #0
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
    r = link_ranks(SPEC, Topology.contiguous(4, 2), record(2))
    pending = r[1].book_collective(0.5, across, start=10.0)
    assert isinstance(pending, PendingEnd) and pending.name == "7 (1, 3) #0"
    assert r[3].book_collective(0.5, across, start=10.25) == close(10.75)  # 2 members: done
    assert pending.peek() == close(10.75)


def test_a_rank_s_own_link_and_charge_follow_its_shared_collectives_and_messages(record):
    r = link_ranks(SPEC, Topology.contiguous(4, 2), record(2))
    r[0].book_collective(0.5, ("g", (0, 2)), start=10.0)
    assert r[2].book_collective(0.5, ("g", (0, 2)), start=10.0) == close(10.5)
    # Rank 2 books 0.1 s of its own link at 10.0: after the collective's end.
    assert r[2].reserve(0.1, start=10.0) == close(10.6)
    # Each shared message adds its cost to the rank's charge.
    assert r[0].book_send(MB, 2, start=11.0) == close(11.011)
    assert r[0].book_send(MB, 3, start=11.0) == close(11.022)  # queued at node 0's egress
    assert r[0].emulated_s == close(0.5 + 2 * 0.011)
    # A message within node 0 (rank 0 to rank 1) after a message across: rank 0's own link.
    assert r[0].book_send(MB, 2, start=20.0) == close(20.011)
    assert r[0].book_send(MB, 1, start=20.0) == close(20.022)


def test_a_shared_message_without_a_start_leaves_now(record, monkeypatch):
    fake = FakeTime(30.0)
    monkeypatch.setattr(link, "time", fake)
    r = link_ranks(SPEC, Topology.contiguous(4, 2), record(2))
    assert r[0].book_send(MB, 2) == close(30.011)
    assert r[0].nic.free(0)[0] == close(30.011) and r[0].nic.free(1)[1] == close(30.011)


# ---------------------------------------------------------------------------- waiting
def test_waiting_polls_every_0_2_ms_until_the_last_member_books(record, monkeypatch):
    r = link_ranks(SPEC, Topology.contiguous(4, 2), record(2))
    group = ("g", (0, 2))
    pending = r[0].book_collective(0.5, group, start=10.0)
    fake = wait_clock(monkeypatch, 100.0)

    def third_poll(count: int) -> None:
        assert count <= 3, "still polling after the last member booked"
        if count == 3:
            r[2].book_collective(0.5, group, start=10.25)

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
    r = link_ranks(SPEC, Topology.contiguous(4, 2), record(2))
    pending = r[0].book_collective(0.5, ("g", (0, 2)), start=10.0)
    fake = wait_clock(monkeypatch, now, step=step)
    with pytest.raises(TimeoutError, match=message):
        pending.wait() if timeout is None else pending.wait(timeout_s=timeout)
    assert fake.sleeps == [0.0002] * sleeps and fake.now == end


def test_emulated_work_is_complete_once_its_pending_end_is_known_and_past(record, monkeypatch):
    fake = FakeTime(10.0)
    monkeypatch.setattr(link, "time", fake)
    r = link_ranks(SPEC, Topology.contiguous(4, 2), record(2))
    group = ("g", (0, 2))
    work = EmulatedWork(None, r[0].book_collective(0.5, group, start=10.0))
    assert not work.is_completed()  # the end is not known yet
    r[2].book_collective(0.5, group, start=10.2)  # ends at 10.7
    fake.advance(0.6)
    assert not work.is_completed()  # 10.6 < 10.7
    fake.advance(0.1)
    assert work.is_completed()
