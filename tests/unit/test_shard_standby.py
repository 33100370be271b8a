"""A shard's restart and failover without processes: the job store's announcements (a shard's
restart, a worker's signed rejoin), the count of lost pushes, the watchdog leaving a failed-over
shard alone, the standby's placement, and the config's refusals."""

import json
import logging
import threading

import pytest
import torch.distributed as dist

from cloudburst.comm.auth import sign
from cloudburst.comm.liveness import (
    FAILOVER_KEY,
    RejoinBoard,
    RejoinRefused,
    Watchdog,
    acked_version,
    announce_shard,
    await_shard,
    report_acked,
    shard_restarted,
)
from cloudburst.config import ConfigError, RunConfig
from cloudburst.runtime.groups import standby_of
from tests.support import wait_until


@pytest.fixture
def store():
    return dist.HashStore()


def test_a_restarted_shard_announces_the_version_it_restored(store):
    assert not shard_restarted(store)
    report_acked(store, shard=1, incarnation=1, rank=2, version=27)
    assert acked_version(store, 1, 1, 2) == 27
    assert acked_version(store, 1, 1, 3) is None  # that worker has not reconnected
    got = []
    waiter = threading.Thread(target=lambda: got.append(await_shard(store, 1, 1, timeout_s=5)))
    waiter.start()
    announce_shard(store, shard=1, incarnation=1, version=20)
    waiter.join(timeout=5)
    assert got == [20] and shard_restarted(store)
    with pytest.raises(RuntimeError):  # no second restart was announced
        await_shard(store, 1, 2, timeout_s=0.2)


def test_pushes_lost_is_the_highest_acknowledged_version_minus_the_restored_one():
    from cloudburst.strategies.asgd.server import ServerLoop

    class Loop:  # the two fields the count reads
        pushes_lost = ServerLoop.pushes_lost

    loop = Loop()
    loop.restored_version, loop.acked_before_restart = None, 0
    assert loop.pushes_lost == 0  # never restarted
    loop.restored_version, loop.acked_before_restart = 20, 27
    assert loop.pushes_lost == 7
    loop.acked_before_restart = 20
    assert loop.pushes_lost == 0  # a standby's copy: every acknowledged push kept


def test_the_watchdog_leaves_a_failed_over_shard_alone(store):
    lost = []
    store.set(FAILOVER_KEY.format(shard=1), "0")  # its standby took shard 1 over
    # Ranks 1 and 2 are both silent; the watchdog reports one rank, the lowest it finds dead:
    # rank 2 means it left the failed-over shard alone (and still finds a silent rank).
    watched = {1: "server shard 1 (rank 1)", 2: "worker"}
    dog = Watchdog(store, watched, 0.2, lambda r, role: lost.append(r)).start()
    try:
        wait_until(lambda: lost, timeout_s=30, what="the watchdog to report a silent rank")
    finally:
        dog.stop()
    assert lost == [2]


def test_each_shard_has_its_standby_on_the_next_server():
    assert [standby_of(k, 3) for k in range(3)] == [1, 2, 0]
    assert [standby_of(k, 2) for k in range(2)] == [1, 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(strategy="asgd", servers=1), "servers is 1; use --servers 2 or more"),
        (dict(strategy="easgd", servers=2), "only asgd's shards keep a standby, not easgd's"),
    ],
)
def test_the_standby_is_refused_where_it_cannot_live(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(workers=2, shard_standby=True, **kwargs)


# ------------------------------------------------------------------ the rejoin announcements
# Their order, refusal after the servers finish, and the job secret's signature they must carry.
SECRET = b"s" * 32


def _board(store, secret: bytes | None = SECRET, run: str = "run1") -> RejoinBoard:
    return RejoinBoard(store, timeout_s=5, secret=secret, run=run)


def test_servers_read_announcements_in_order_and_refuse_late_ones(store):
    worker = _board(store)
    servers = [_board(store) for _ in range(2)]
    assert servers[0].poll() == []
    worker.announce(3, 1)
    worker.announce(2, 1)
    assert servers[0].poll() == [(3, 1), (2, 1)]
    assert servers[0].poll() == []  # each announcement is read once
    assert servers[1].poll() == [(3, 1), (2, 1)]  # by every server, in the same order
    worker.announce(3, 2)
    # closing hands over what came before the close
    assert servers[0].close() == [(3, 2)]
    assert servers[1].close() == [(3, 2)]  # the other server admits it too
    with pytest.raises(RejoinRefused, match="rank 2 was restarted after"):
        worker.announce(2, 2)
    # a late announcement is refused on both sides
    assert servers[0].poll() == [] and servers[1].close() == []


def test_a_restarted_shard_skips_the_rejoin_announcements_made_before_it(store):
    _board(store).announce(3, 1)
    board = _board(store)
    board.skip()
    assert board.poll() == []
    _board(store).announce(2, 1)
    assert board.poll() == [(2, 1)]


def _forge(store, record: dict) -> int:
    """Write ``record`` as the next announcement, as anyone who reaches the store can."""
    number = store.add(RejoinBoard.COUNT, 1)
    store.set(f"rejoin/{number}", json.dumps(record))
    return number


def test_announcements_not_signed_with_this_jobs_secret_are_refused_and_logged(store, caplog):
    server = _board(store)
    plain = {"rank": 3, "incarnation": 1, "late": False}
    _forge(store, plain)  # unsigned, as before the secret (the attack)
    _forge(store, {**plain, "mac": sign(b"x" * 32, "rejoin", "run1", 2, 3, 1, False)})  # guessed
    _board(store, run="run0").announce(3, 1)  # signed for another run under the same secret
    genuine_number = store.add(RejoinBoard.COUNT, 0) + 1
    _board(store).announce(2, 1)
    genuine = json.loads(store.get(f"rejoin/{genuine_number}"))
    _forge(store, genuine)  # a genuine announcement copied to another number: replayed
    _forge(store, {**genuine, "incarnation": 2})  # its restart changed
    _forge(store, {**genuine, "rank": 3})  # its rank changed
    with caplog.at_level(logging.WARNING, logger="cloudburst.comm.liveness"):
        assert server.poll() == [(2, 1)]  # the genuine one only
    assert server.refused == 6
    refusals = [r.getMessage() for r in caplog.records if "refused rejoin" in r.getMessage()]
    assert len(refusals) == RejoinBoard.LOG_FIRST  # the first five, one line each
    assert "rank 3, restart 1: not signed with the job secret" in refusals[0]


def test_a_late_announcement_flipped_to_on_time_is_refused(store):
    server = _board(store)
    server.close()
    with pytest.raises(RejoinRefused, match="after the parameter servers had finished"):
        _board(store).announce(2, 1)
    record = json.loads(store.get("rejoin/1"))
    assert record["late"] is True
    store.set("rejoin/1", json.dumps({**record, "late": False}))
    assert _board(store).poll() == []


def test_without_a_secret_no_announcement_is_made_or_admitted(store):
    with pytest.raises(RejoinRefused, match="CLOUDBURST_JOB_SECRET_FILE"):
        _board(store, secret=None).announce(2, 1)
    assert store.add(RejoinBoard.COUNT, 0) == 0  # nothing was written
    _board(store).announce(2, 1)  # signed, but this server has no secret to check it with
    unkeyed = _board(store, secret=None)
    assert unkeyed.poll() == [] and unkeyed.refused == 1
