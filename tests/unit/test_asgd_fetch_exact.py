"""The asgd worker's read-only fetch of θ (``fetch_global_params``, what the evaluator and the
final checkpoint read) when a shard's connection breaks; and what a round hands the transport:
Δ computed chunk by chunk as it leaves on a CPU replica (the GPU staging path is
tests/gpu's: a CUDA replica through pinned buffers).

A job of three shards and one worker runs over :mod:`tests.fakes`; the shards' θ, versions and
sample counts are set by hand, so every value the fetch returns is known without running the
code under test. A broken connection to shard 1 is a transport that raises on it; the shard's
restart is its announcement in a real (in-memory) ``HashStore`` and a fresh fake link to the
same server loop, which holds the θ it "restored".
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cloudburst.comm.messages import Header
from cloudburst.config import RunConfig
from cloudburst.liveness import acked_version, announce_shard
from tests import reference as ref
from tests.fakes import WorkerSide, ps_job

BOUNDS = [(0, 3), (3, 6), (6, 9)]  # a 2 → 3 linear layer (9 values) over three shards
BROKEN = 1
LOGGER = "cloudburst.strategies.asgd.worker"


class _CutLink(WorkerSide):
    """The worker's first transport, whose connection to shard ``BROKEN`` breaks once ``cut``
    is set: ``"send"`` breaks the request, ``"recv"`` the reply (the shard died holding the
    request). ``stale`` marks the connection from before the shard's restart: using it again
    at all is an error of the worker, not a failure of the shard."""

    cut: str | None = None
    stale = False

    def _check_link(self, k: int) -> None:
        if k == BROKEN and self.stale:
            raise AssertionError("the connection to shard 1 from before its restart was used")

    def send(self, k: int, header: Header, payload=None, final: bool = False) -> None:
        self._check_link(k)
        if k == BROKEN and self.cut == "send":
            raise RuntimeError("Connection reset by peer\n(gloo detail)")
        super().send(k, header, payload, final)

    def recv_reply(self, k: int, out: torch.Tensor | None = None) -> Header:
        self._check_link(k)
        if k == BROKEN and self.cut is not None:
            self.net.requests[k].clear()  # the shard died before it answered
            raise RuntimeError("Connection closed by peer\n(gloo detail)")
        return super().recv_reply(k, out)


def _values(start: float) -> torch.Tensor:
    return torch.arange(9, dtype=torch.float32) * 0.25 + start


def _job():
    """One started worker over three shards (shard k at version 3 + 2k, 8·(k + 1) samples) whose
    replica then made local progress; the worker's cut link, the job, and the store."""
    cfg = RunConfig(
        strategy="asgd",
        workers=1,
        servers=3,
        dataset="synthetic",
        train_size=512,
        n_sync=4,
        max_restarts=1,
    )
    model = nn.Linear(2, 3)
    ref.set_flat(model, _values(1.0))
    job = ps_job(cfg, [model])
    worker = job.workers[0]
    link = _CutLink(worker.transport.net, worker.transport.rank, worker.stats)
    worker.transport = link
    store = dist.HashStore()
    worker.ctx.store = store
    worker.ctx.shard_link = lambda k, incarnation, rank, stats: WorkerSide(link.net, rank, stats)
    for k, loop in enumerate(job.loops):
        loop.shard.version, loop.shard.samples = 3 + 2 * k, 8 * (k + 1)
    worker.start()  # fetches θ = _values(1.0) at versions 3, 5, 7
    ref.set_flat(model, _values(50.0))  # one local step (of four before a round): not pushed
    worker.after_step(8)
    return worker, model, link, job, store


def _set_shards(job, theta: torch.Tensor, versions, samples) -> None:
    for (a, b), loop, v, s in zip(BOUNDS, job.loops, versions, samples, strict=True):
        loop.shard.theta.copy_(theta[a:b])
        loop.shard.version, loop.shard.samples = v, s


@pytest.mark.parametrize("cut", ["send", "recv"])
def test_a_fetch_that_loses_a_shard_takes_its_restarted_theta_and_reads_the_others(cut, caplog):
    """The other shards' θ and shard 0's sample count are read as they are; the lost shard's
    slice is the θ_k its restart serves, which the replica and its reference take too (the
    unpushed progress on that slice is gone); its version becomes the restored one, the version
    it last acknowledged is reported to the shard, and the reconnection is counted and logged
    with the transport's error."""
    worker, model, link, job, store = _job()
    served = _values(200.0)
    _set_shards(job, served, versions=[9, 11, 13], samples=[64, 72, 80])
    restored = _values(-30.0)
    job.loops[BROKEN].shard.theta.copy_(restored[3:6])
    job.loops[BROKEN].shard.version = 4
    announce_shard(store, shard=BROKEN, incarnation=1, version=4)
    link.cut = cut
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        theta, samples = worker.fetch_global_params()

    expected = torch.cat([served[0:3], restored[3:6], served[6:9]])
    assert torch.equal(theta, expected) and samples == 64 and worker.global_samples == 64
    local, fetched_before = _values(50.0), _values(1.0)
    assert torch.equal(ref.flat(model), torch.cat([local[0:3], restored[3:6], local[6:9]]))
    reference = torch.cat([fetched_before[0:3], restored[3:6], fetched_before[6:9]])
    assert torch.equal(worker.reference, reference)
    assert worker.versions == [3, 4, 7]  # a read-only fetch moves only the restarted shard's
    assert worker.shard_reconnects == 1
    assert acked_version(store, BROKEN, 1, worker.ctx.rank) == 5
    assert worker.step_info()["shard_reconnected"] == [
        {"shard": 1, "restart": 1, "version": 4, "acked": 5}
    ]
    assert all(not q for q in link.net.requests)  # every request answered
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    error = "Connection reset by peer" if cut == "send" else "Connection closed by peer"
    assert messages[0] == f"lost the connection to shard 1: {error}"
    assert len(messages) == 2 and messages[1].startswith("shard 1 restarted (restart 1)")


@pytest.mark.parametrize("cut", ["send", "recv"])
def test_after_a_restart_the_fetch_talks_to_the_shard_over_its_new_link(cut):
    """Once shard 1 was restarted, later fetches reach it over the link made for its restart
    (the old connection is never used again) and read every shard's current θ, with no further
    reconnection."""
    worker, model, link, job, store = _job()
    announce_shard(store, shard=BROKEN, incarnation=1, version=5)
    link.cut = cut
    worker.fetch_global_params()
    link.stale = True
    served = _values(-7.0)
    _set_shards(job, served, versions=[20, 21, 22], samples=[96, 104, 112])
    theta, samples = worker.fetch_global_params()
    assert torch.equal(theta, served) and samples == 96
    assert worker.shard_reconnects == 1 and worker.versions == [3, 5, 7]
    local = _values(50.0)
    assert torch.equal(ref.flat(model), torch.cat([local[0:3], _values(1.0)[3:6], local[6:9]]))


def test_a_fetch_with_every_shard_reachable_reads_each_shard_into_its_slice():
    """No shard lost: the fetched θ is the shards' θ joined in shard order, the sample count
    is shard 0's, and the replica, its reference and its versions are left alone."""
    worker, model, link, job, store = _job()
    served = _values(9.0)
    _set_shards(job, served, versions=[4, 6, 8], samples=[24, 32, 40])
    theta, samples = worker.fetch_global_params()
    assert torch.equal(theta, served) and samples == 24
    assert torch.equal(ref.flat(model), _values(50.0))
    assert torch.equal(worker.reference, _values(1.0)) and worker.versions == [3, 5, 7]
    assert worker.shard_reconnects == 0


# ------------------------------------------------------------------- Δ computed as it leaves
class _ChunkedLink(WorkerSide):
    """A worker transport that sends each payload in two chunks, as the real one sends fp32
    in chunks: it overwrites the payload it was handed, then has ``prepare`` fill each chunk
    just before "sending" it, and keeps what was sent."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sent: list[torch.Tensor] = []

    def isend_payload(self, k: int, payload: torch.Tensor, reply: bool, prepare=None):
        assert prepare is not None, "Δ was computed before the send, not as it leaves"
        payload.fill_(float("nan"))
        half = payload.numel() // 2
        prepare(0, half)
        prepare(half, payload.numel())
        self.sent.append(payload.clone())
        return super().isend_payload(k, payload, reply)


def test_a_cpu_replica_computes_each_shards_delta_chunk_by_chunk_as_it_is_sent():
    """A CPU fp32 replica under the add rule (overlapped push-and-fetch) hands the transport a
    ``prepare`` that computes each chunk of each shard's Δ just before the chunk leaves (the
    subtraction overlaps the wire); the shards receive Δ = θ_local − θ_fetched exactly."""
    cfg = RunConfig(
        strategy="asgd", workers=1, servers=3, dataset="synthetic", train_size=512, n_sync=1
    )
    model = nn.Linear(2, 3)
    ref.set_flat(model, _values(1.0))
    job = ps_job(cfg, [model])
    worker = job.workers[0]
    link = _ChunkedLink(worker.transport.net, worker.transport.rank, worker.stats)
    worker.transport = link
    worker.start()
    local = _values(1.0) + torch.tensor([3.0, -1.0, 0.5, 2.0, 4.0, -2.5, 1.5, 0.25, -0.75])
    ref.set_flat(model, local)
    worker.after_step(8)
    delta = local - _values(1.0)
    assert [t.tolist() for t in link.sent] == [delta[a:b].tolist() for a, b in BOUNDS]
    assert torch.equal(torch.cat([loop.shard.theta for loop in job.loops]), local)
    assert torch.equal(ref.flat(model), local)
