"""The pieces of a shard's restart and failover that need no processes: the announcements in
the job store, the count of lost pushes, the watchdog leaving a failed-over shard alone, the
standby's placement, and the config's refusals."""

import threading

import pytest
import torch
import torch.distributed as dist

from cloudburst.comm.liveness import (
    FAILOVER_KEY,
    RejoinBoard,
    Watchdog,
    acked_version,
    announce_shard,
    await_shard,
    report_acked,
    shard_restarted,
)
from cloudburst.config import ConfigError, RunConfig
from cloudburst.runtime.groups import standby_of
from cloudburst.strategies.asgd.shard import make_shard
from tests.helpers import wait_until

pytestmark = pytest.mark.unit


def test_a_restarted_shard_announces_the_version_it_restored():
    store = dist.HashStore()
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


def test_a_restarted_shard_skips_the_rejoin_announcements_made_before_it():
    store = dist.HashStore()
    RejoinBoard(store, 5, secret=b"s" * 32).announce(3, 1)
    board = RejoinBoard(store, 5, secret=b"s" * 32)
    board.skip()
    assert board.poll() == []
    RejoinBoard(store, 5, secret=b"s" * 32).announce(2, 1)
    assert board.poll() == [(2, 1)]


def test_the_watchdog_leaves_a_failed_over_shard_alone():
    store = dist.HashStore()
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


def test_a_standby_copy_applying_the_forwarded_pushes_equals_the_shard():
    cfg = RunConfig(strategy="asgd", workers=2, servers=2, shard_standby=True, server_rule="sgd",
                    server_momentum=0.9)  # fmt: skip
    theta = torch.randn(50)
    primary, copy = make_shard(cfg, theta), make_shard(cfg, theta)
    gen = torch.Generator().manual_seed(0)
    for base in (0, 0, 1, 3, 2):
        delta = torch.randn(50, generator=gen)
        primary.apply_push(delta, base, 16)
        copy.apply_push(delta, base, 16)  # what the standby does with each forward
    assert torch.equal(primary.theta, copy.theta)
    assert primary.stats() == copy.stats()


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
