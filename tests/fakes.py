"""An in-process fake of the point-to-point comm layer: parameter-server jobs with no processes.

:class:`FakeNetwork` stands in for gloo between the workers of a parameter-server strategy
(``asgd``, ``easgd``) and the real :class:`~cloudburst.strategies.asgd.server.ServerLoop` of
each shard. A worker's requests are queued per shard; a shard handles its queue (with the
loop's own request handling: validation, the shard rule, the reply) when a worker waits for one
of its answers. Everything runs in the calling thread, so the order in which the test calls the
workers' ``after_step`` *is* the order in which the shards see their pushes: a scripted
interleaving, with no timing in it.

:func:`ps_job` builds such a job from a config: W strategy objects (the class named by
``cfg.strategy``) wrapped around their replicas, and S server loops. What the fake does not do:
the DONE/PING handshake of ``finish`` (a worker would wait for the others in the one thread);
call :func:`flush` to push what a worker has left, as ``finish`` does first.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from cloudburst.comm.flat import flatten_params
from cloudburst.comm.messages import Header
from cloudburst.comm.stats import CommStats
from cloudburst.comm.transport import REAL
from cloudburst.config import RunConfig
from cloudburst.runtime.context import ReplicaView
from cloudburst.strategies import STRATEGY_CLASSES
from cloudburst.strategies.asgd import AsgdStrategy
from cloudburst.strategies.asgd.server import ServerLoop


class _Done:
    """A finished (or lazily finishing) work handle: ``wait`` runs ``fn`` once."""

    def __init__(self, fn: Callable[[], None] | None = None):
        self.fn = fn

    def wait(self) -> None:
        if self.fn is not None:
            fn, self.fn = self.fn, None
            fn()


class FakeNetwork:
    """Ordered channels between worker ranks and shards, and the loops that serve the shards."""

    def __init__(self) -> None:
        self.loops: list[ServerLoop] = []
        self.requests: list[collections.deque] = []  # per shard: (src, header), in arrival order
        # per (worker rank, shard): payloads worker → shard, headers and payloads shard → worker
        self.payloads: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque
        )
        self.replies: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque
        )
        self.reply_payloads: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque
        )

    def add_shard(self, loop: ServerLoop) -> None:
        self.requests.append(collections.deque())
        self.loops.append(loop)

    def pump(self, k: int) -> None:
        """Shard ``k`` handles every request queued for it, one at a time, as its loop does."""
        loop = self.loops[k]
        while self.requests[k]:
            src, header = self.requests[k].popleft()
            loop._serve_one(loop.transport, src, header)


class ServerSide:
    """Shard ``k``'s end of the fake (the interface of :class:`cloudburst.comm.p2p.PeerTransport`
    that :class:`ServerLoop` uses)."""

    def __init__(self, net: FakeNetwork, k: int):
        self.net, self.k, self.stats = net, k, CommStats()

    def recv_payload(
        self, src: int, numel: int, final: bool = False, out=None, on_chunk=None
    ) -> torch.Tensor:
        data = self.net.payloads[src, self.k].popleft()
        assert data.numel() == numel, f"payload of {data.numel()} elements, {numel} expected"
        return out.copy_(data) if out is not None else data

    def isend_payload(self, dst: int, payload: torch.Tensor, reply: bool, prepare=None) -> _Done:
        if prepare is not None:
            prepare(0, payload.numel())
        self.net.reply_payloads[dst, self.k].append(payload.clone())  # θ as it is now
        return _Done()

    def wait_all(self, works) -> None:
        for w in works:
            w.wait()

    def send(self, dst: int, header: Header, payload=None, final: bool = False) -> None:
        self.net.replies[dst, self.k].append(header)
        if payload is not None:
            self.net.reply_payloads[dst, self.k].append(payload.clone())


class WorkerSide:
    """Worker ``rank``'s end of the fake (what :class:`AsgdStrategy` uses)."""

    def __init__(self, net: FakeNetwork, rank: int, stats: CommStats | None = None):
        self.net, self.rank = net, rank
        self.stats = stats if stats is not None else CommStats()

    def send(self, k: int, header: Header, payload=None, final: bool = False) -> None:
        self.net.requests[k].append((self.rank, header))
        if payload is not None:
            self.net.payloads[self.rank, k].append(payload.clone())

    def isend_payload(self, k: int, payload: torch.Tensor, reply: bool, prepare=None) -> _Done:
        if prepare is not None:
            prepare(0, payload.numel())
        self.net.payloads[self.rank, k].append(payload.clone())
        return _Done()

    def irecv_payload(self, k: int, out: torch.Tensor, reply: bool) -> _Done:
        def arrive() -> None:
            self.net.pump(k)
            out.copy_(self.net.reply_payloads[self.rank, k].popleft())

        return _Done(arrive)

    def wait_all(self, works) -> None:
        for w in works:
            w.wait()

    def recv_reply(self, k: int, out: torch.Tensor | None = None) -> Header:
        self.net.pump(k)
        header = self.net.replies[self.rank, k].popleft()
        if header.numel:
            out.copy_(self.net.reply_payloads[self.rank, k].popleft())
        return header


class FakeStore:
    """The job store's counters (``add``), in a dict."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}

    def add(self, key: str, value: int) -> int:
        self.counters[key] = self.counters.get(key, 0) + value
        return self.counters[key]


class NoHeartbeat:
    """A worker's heartbeat that starts no thread (nobody checks liveness in the fake)."""

    def stop(self) -> None:
        pass


class NoLiveness:
    """Nobody is ever declared dead."""

    def dead(self, ranks) -> set[int]:
        return set()

    def revive(self, rank: int) -> None:
        pass


class RecordingMetrics:
    """Keeps the server's metrics records: (event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def log(self, event: str, **fields: Any) -> None:
        self.records.append((event, fields))


class FakeNamespace(ReplicaView, SimpleNamespace):
    """A context stand-in of the fields a test gives, with Context's replica view."""


@dataclass
class FakeContext(ReplicaView):
    """What a strategy or a server loop reads from :class:`cloudburst.runtime.context.Context`."""

    cfg: RunConfig
    rank: int
    net: FakeNetwork
    store: FakeStore
    heartbeat: NoHeartbeat = field(default_factory=NoHeartbeat)
    device: torch.device = torch.device("cpu")
    topology: None = None
    link: None = None
    rejoined: bool = False
    comm: Any = REAL

    @property
    def num_servers(self) -> int:
        return self.cfg.servers

    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    @property
    def is_server(self) -> bool:
        return self.rank < self.num_servers

    @property
    def server_index(self) -> int:
        return self.rank

    @property
    def worker_index(self) -> int:
        return self.rank - self.num_servers

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.num_servers, self.world_size))

    def elapsed_s(self) -> float:
        return 0.0

    def transport(self, stats: CommStats | None = None, group=None, members=None):
        if self.is_server:
            return ServerSide(self.net, self.rank)
        return WorkerSide(self.net, self.rank, stats)


@dataclass
class PsJob:
    workers: list[AsgdStrategy]
    loops: list[ServerLoop]
    metrics: list[RecordingMetrics]

    @property
    def server_theta(self) -> torch.Tensor:
        """The whole θ held by the shards, joined."""
        return torch.cat([loop.shard.theta for loop in self.loops])


def ps_job(cfg: RunConfig, models: list[nn.Module], theta: torch.Tensor | None = None) -> PsJob:
    """A parameter-server job of ``cfg.servers`` shards (starting from ``theta``, by default
    the first model's θ) and one worker per model (the strategy ``cfg.strategy`` names, already
    wrapped around its model, not started): the first ``len(models)`` of ``cfg.workers``."""
    if len(models) > cfg.workers:
        raise ValueError(f"{len(models)} models for {cfg.workers} workers")
    net, store = FakeNetwork(), FakeStore()
    theta = flatten_params(models[0]) if theta is None else theta
    loops, metrics = [], []
    for k in range(cfg.servers):
        recorder = RecordingMetrics()
        loop = ServerLoop(FakeContext(cfg, k, net, store), theta, recorder, NoLiveness())
        net.add_shard(loop)
        loops.append(loop)
        metrics.append(recorder)
    workers = []
    for i, model in enumerate(models):
        strategy = STRATEGY_CLASSES[cfg.strategy](FakeContext(cfg, cfg.servers + i, net, store))
        strategy.wrap(model, None)
        workers.append(strategy)
    return PsJob(workers, loops, metrics)


def flush(strategy: AsgdStrategy) -> None:
    """What ``finish`` does before its DONE handshake: push the steps not pushed yet."""
    strategy._flush()


def run_on_threads(size: int, barrier: threading.Barrier, make_comm, fn) -> list:
    """``fn(rank, make_comm(rank))`` on ``size`` threads that meet at ``barrier`` (aborted when
    one fails, so the others stop waiting); their results, or the first error raised."""
    results: list = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, make_comm(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def prior_stats() -> CommStats:
    """Counters holding earlier totals (all distinct), so an overwrite or a subtraction shows."""
    return CommStats(
        sent_bytes=1000, received_bytes=2000, wait_s=1.0, inter_node_bytes=3000,
        intra_node_bytes=4000, emulated_link_s=0.25,
    )  # fmt: skip


class _LinkSpec:
    latency_s = 0.125
    bytes_per_s = 1024.0


class RecordingLink:
    """An emulated link (``active`` or not) of latency 1/8 s and 1024 bytes/s that charges
    ``allreduce_cost_s`` for any all-reduce; records each cost asked (bytes, group size) and
    each booking (seconds, group); its bookings end at perf_counter 0 (long past: waiting for
    them never sleeps)."""

    spec = _LinkSpec()

    def __init__(self, active: bool = True, allreduce_cost_s: float = 0.0625):
        self.active, self.allreduce_cost_s = active, allreduce_cost_s
        self.asked: list[tuple] = []
        self.booked: list[tuple] = []

    def allreduce_s(self, nbytes: int, group_size: int) -> float:
        self.asked.append((nbytes, group_size))
        return self.allreduce_cost_s

    def book_collective(self, seconds: float, group: Any, start: float | None = None) -> float:
        self.booked.append((seconds, group))
        return 0.0
