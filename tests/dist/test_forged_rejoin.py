"""Rejoin groups on real gloo groups (threads of one process): the point-to-point transport
on one names global ranks, and the issue-44 attack (a process without the job secret announces
a rejoin for a live worker and builds the group) reads and changes nothing: the real worker
keeps its route and its restart. The shard is a real RequestServing behind a real Context; only
its world group is a queue."""

import datetime
import logging
import queue
import threading
import time

import pytest
import torch
import torch.distributed as dist

from cloudburst.comm import auth
from cloudburst.comm.liveness import RejoinBoard
from cloudburst.comm.messages import Header, Kind
from cloudburst.comm.p2p import PeerTransport
from cloudburst.config import RunConfig
from cloudburst.runtime.context import Context
from cloudburst.runtime.rejoin import rejoin_group, rejoin_members
from cloudburst.strategies.asgd.serving import RequestServing
from tests.support import (wait_until, RecordingMetrics)

pytestmark = pytest.mark.dist

SECRET, FORGED = b"k" * 32, b"f" * 32
WORKER = 2  # the worker the forger claims to be (ranks: server 0, workers 1 and 2)


class WorldQueue:
    """The world group's transport: the requests the test puts, in order."""

    def __init__(self) -> None:
        self.requests: queue.Queue = queue.Queue()

    def recv_request_any(self, src=None):
        return self.requests.get(timeout=60)

    def send(self, dst, header, payload=None) -> None:
        pass


@pytest.fixture
def job_secret():
    auth.install(SECRET)  # the server's (and the genuine worker's) secret
    yield
    auth.install(None)


class Shard:
    """A real shard's request serving (server 0 of 1, workers 1 and 2), run on a thread, with
    its world group faked by a queue; records every request it serves."""

    def __init__(self, store) -> None:
        cfg = RunConfig(strategy="asgd", servers=1, workers=2, max_restarts=1, comm_timeout_s=5)
        ctx = Context(cfg=cfg, rank=0, world_size=3, num_servers=1, num_workers=2,
                      workers_group=None, store=store, t0=time.time())  # fmt: skip
        self.world = WorldQueue()
        self.handled: list[tuple[str, int, Kind]] = []  # (group, sender, kind) of each request
        self.metrics = RecordingMetrics()
        self.serving = RequestServing(
            ctx, self.metrics, None, self.world, 0, handle=self._handle,
            on_lost=lambda ranks: None, on_admit=lambda rank: None,
            on_reconnect=lambda rank, acked: None, version=lambda: 0,
        )  # fmt: skip
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _handle(self, transport, src: int, header: Header) -> None:
        self.handled.append(("world" if transport is self.world else "rejoin", src, header.kind))
        if header.kind == Kind.DONE:
            self.serving.finished.add(src)

    def _run(self) -> None:
        try:
            self.serving.run()
        except BaseException as e:  # noqa: BLE001 - asserted by the tests
            self.errors.append(e)

    def request(self, rank: int, kind: Kind) -> None:
        """Worker ``rank`` sends a request on the world group."""
        self.world.requests.put((rank, Header(kind, shard=0)))

    def join(self) -> None:
        self.thread.join(timeout=30)
        self.request(1, Kind.PING)  # lets the world group's thread end
        assert not self.thread.is_alive() and self.errors == []


def test_a_forged_rejoin_reads_and_changes_nothing_and_the_worker_keeps_its_route(
    job_secret, caplog
):
    caplog.set_level(logging.WARNING)
    store = dist.HashStore()
    shard = Shard(store)
    serving, world, handled = shard.serving, shard.world, shard.handled
    shard.request(WORKER, Kind.PUSH)  # the real worker 2 trains

    # 1. The attack: an unsigned-by-the-secret announcement, then the group.
    RejoinBoard(store, 2, secret=FORGED).announce(WORKER, 1)
    with pytest.raises(RuntimeError, match="timeout"):  # no server builds that group with it
        rejoin_group(store, WORKER, 1, 1, 1, timeout_s=2, secret=FORGED)
    assert "refused rejoin announcement 1: rank 2, restart 1: not signed" in caplog.text
    assert serving.peer(WORKER) is world and serving.rejoins == 0

    # 2. A forger that races a genuine announcement (of worker 1's restart, say) for the
    # worker's place in its group: the group's job-secret check refuses it before anything
    # else moves on the group, and worker 1 keeps its route.
    RejoinBoard(store, 2, secret=SECRET).announce(1, 1)
    with pytest.raises(auth.PeerRefused, match=r"group rank\(s\) \[0\] did not prove"):
        rejoin_group(store, 1, 1, 1, 1, timeout_s=5, secret=FORGED)
    wait_until(lambda: serving.rejoins_refused == 1, timeout_s=30, what="the server's refusal")
    assert "refused the rejoin of worker rank 1 (restart 1)" in caplog.text
    assert serving.peer(1) is world and serving.peer(WORKER) is world  # their routes
    assert not serving.lost and not serving.finished
    # Nothing was served to or taken from either forgery: the world's requests only, and
    # both real workers train on there.
    for rank in (1, WORKER):
        shard.request(rank, Kind.PUSH)
    wait_until(lambda: len(handled) == 3, timeout_s=30, what="the workers' pushes")
    assert handled == [("world", rank, Kind.PUSH) for rank in (WORKER, 1, WORKER)]

    # 3. Worker 2's restart 1, which the forgery claimed, is still its own: admitted, served.
    RejoinBoard(store, 2, secret=SECRET).announce(WORKER, 1)
    group = rejoin_group(store, WORKER, 1, 1, 1, timeout_s=5, secret=SECRET)
    wait_until(lambda: serving.rejoins == 1, timeout_s=30, what="the genuine rejoin")
    assert serving.peer(WORKER) is not world and serving.peer(1) is world
    assert [f for e, f in shard.metrics.records if e == "rejoin"][0]["incarnation"] == 1
    worker = PeerTransport(group, members=rejoin_members(1, WORKER))
    worker.send(0, Header(Kind.DONE, shard=0))
    shard.request(1, Kind.DONE)
    shard.join()
    assert ("rejoin", WORKER, Kind.DONE) in handled and ("world", 1, Kind.DONE) in handled


def test_an_overwritten_rejoin_counter_costs_the_rejoins_not_the_shard(job_secret, caplog):
    store = dist.HashStore()
    store.set(RejoinBoard.COUNT, "not a number")  # as anyone who reaches the store can
    shard = Shard(store)
    for rank in (1, WORKER):
        shard.request(rank, Kind.PUSH)
        shard.request(rank, Kind.DONE)
    shard.join()  # served to the end
    assert [kind for _, _, kind in shard.handled] == [Kind.PUSH, Kind.DONE] * 2
    assert "the rejoin board cannot be read" in caplog.text


def _members(size: int, prefix: str, secrets: list[bytes | None], timeout_s: float) -> list:
    """A gloo group of ``size`` threads built through one store and authenticated; each member's
    group, or the exception it raised (a member given None as its secret sends nothing)."""
    store, outcomes = dist.HashStore(), [None] * size

    def member(r: int) -> None:
        group = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store), r, size, datetime.timedelta(seconds=timeout_s)
        )
        try:
            if secrets[r] is not None:
                auth.authenticate_group(group, prefix, secrets[r])
            outcomes[r] = group
        except RuntimeError as e:
            outcomes[r] = e

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    return outcomes


def test_a_group_admits_only_members_that_prove_the_secret():
    admitted = _members(3, "startup/world", [SECRET] * 3, 10)
    assert all(isinstance(o, dist.ProcessGroupGloo) for o in admitted)
    outcomes = _members(3, "startup/world", [SECRET, FORGED, SECRET], 10)
    assert all(isinstance(o, auth.PeerRefused) for o in outcomes)
    assert all("group rank(s) [1] did not prove" in str(o) for o in outcomes[::2])
    # A member that joins the group and stays silent is refused once the timeout passes.
    silent = _members(2, "standby/0/", [SECRET, None], 1)
    assert isinstance(silent[0], auth.PeerRefused)
    assert "did not complete the job-secret check" in str(silent[0])


def test_the_transport_on_a_rejoin_group_names_global_ranks():
    """Peers on a gloo group outside torch.distributed's registry keep their global ranks."""
    server_rank, worker_rank = 0, 5  # the worker is rank 1 of the group
    groups = _members(2, "rejoin/5/1/", [None, None], 20)
    server = PeerTransport(groups[0], members=[server_rank, worker_rank])
    worker = PeerTransport(groups[1], members=[server_rank, worker_rank])
    got = {}

    def serve():
        src, header = server.recv_request_any()
        got["src"], got["header"] = src, header
        got["payload"] = server.recv_payload(src, header.numel).tolist()
        server.send(src, Header(Kind.REPLY, shard=0, numel=3), torch.tensor([7.0, 8.0, 9.0]))

    t = threading.Thread(target=serve)
    t.start()
    worker.send(server_rank, Header(Kind.PUSH, shard=0, numel=2), torch.tensor([1.0, 2.0]))
    out = torch.empty(3)
    reply = worker.recv_reply(server_rank, out)
    t.join(timeout=20)
    assert got["src"] == worker_rank and got["header"].kind == Kind.PUSH
    assert got["payload"] == [1.0, 2.0]
    assert reply.kind == Kind.REPLY and out.tolist() == [7.0, 8.0, 9.0]
    assert worker.stats.sent_bytes == server.stats.received_bytes
    with pytest.raises(ValueError, match="not a member"):
        worker.send(3, Header(Kind.FETCH))
