"""The asgd worker against real server shards over a fake, in-process comm layer (no processes).

``FakeNet`` (tests/support.py) stands in for gloo point-to-point: the worker's requests are
queued per shard and the shard's :class:`ServerLoop` handles them when the worker waits for an
answer, so the worker's push/fetch schedule, the overlapped replies and the rejection path run
exactly as in a job.

The asgd and easgd workers' accounting (samples, steps, staleness, dropped and rejected pushes,
the θ they publish) runs over the fake network of :mod:`tests.fakes` instead, W workers
stepped in a scripted order, every header through its wire encoding and every payload on the
stream (request or reply) gloo would carry it on.
"""

from __future__ import annotations

import logging
import math
import queue
import threading

import pytest
import torch
from torch import nn

from cloudburst.comm.flat import flatten_params
from cloudburst.comm.messages import Header, Kind
from cloudburst.config import RunConfig
from cloudburst.data import BatchStream, synthetic
from cloudburst.models import build_model
from cloudburst.strategies.asgd.serve import Standby
from tests import reference as ref
from tests.fakes import WorkerSide, flush, ps_job
from tests.support import BATCH, asgd_cfg, survivor_cfg, train_asgd_worker


def reference(steps: int) -> nn.Module:
    data = synthetic(512, 10)
    model = build_model("mlp", 40, 10, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stream = BatchStream(data.x_train, data.y_train, 32, seed=1)
    for _ in range(steps):
        x, y = next(stream)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_one_worker_equals_sgd_for_every_schedule_and_rule():
    expected = flatten_params(reference(24))
    for kw in [
        dict(servers=1, n_sync=1),
        dict(servers=3, n_sync=4),  # overlapped replies on 3 shards
        dict(servers=2, n_fetch=2, n_push=3),  # fetches keep unpushed progress
        dict(servers=2, n_fetch=3, n_push=2),
        dict(servers=2, n_sync=4, server_rule="sgd", server_lr=1.0),  # replies after apply
    ]:
        model, _, loops = train_asgd_worker(asgd_cfg(**kw), 24)
        theta = torch.cat([loop.shard.theta for loop in loops])
        # step 24 is a push and a fetch for every schedule here: shards and replica agree
        torch.testing.assert_close(theta, expected, rtol=1e-5, atol=1e-6, msg=str(kw))
        torch.testing.assert_close(
            flatten_params(model), expected, rtol=1e-5, atol=1e-6, msg=str(kw)
        )


def test_rejected_push_is_discarded_and_training_goes_on():
    # Push every step, fetch every 5: a NaN in the replica at step 7 is pushed at step 7, the
    # shard rejects it, and the worker starts again from the servers' θ.
    model, strategy, loops = train_asgd_worker(
        asgd_cfg(servers=2, n_push=1, n_fetch=5), 12, poison_at=7
    )
    assert strategy.pushes_rejected == 1
    assert sum(loop.shard.rejected_nonfinite for loop in loops) == 1  # shard 0 holds the NaN
    assert torch.isfinite(flatten_params(model)).all()
    assert all(torch.isfinite(loop.shard.theta).all() for loop in loops)
    assert loops[0].shard.version == 11 and loops[1].shard.version == 12


def test_after_every_push_the_worker_holds_the_servers_theta_whatever_its_staleness():
    # Between the worker's steps each shard takes 3 empty pushes from elsewhere (Δ = 0: θ
    # stays, the version moves on), so every push of the worker arrives 3 versions stale.
    # The worker rebuilds θ + λ·s·Δ from an overlapped reply itself: with the same s as the
    # shard's, under delay-adaptive (τ_C = W = 4: s = 1 at τ = 3) as under scale (s = 1/3).
    for compensation in ("delay-adaptive", "scale"):
        cfg = RunConfig(strategy="asgd", workers=4, dataset="synthetic", train_size=512,
                        servers=2, n_sync=1, server_lr=0.5,
                        staleness_compensation=compensation)  # fmt: skip

        def each(model, loops, compensation=compensation):
            servers = torch.cat([loop.shard.theta for loop in loops])
            assert torch.equal(flatten_params(model), servers), compensation
            for loop in loops:
                for _ in range(3):
                    loop.shard.apply_push(torch.zeros_like(loop.shard.theta), loop.shard.version)

        _, _, loops = train_asgd_worker(cfg, 6, each=each)
        # the worker's pushes after its first were 3 versions stale (the empty ones: 0)
        assert [loop.shard.staleness_hist for loop in loops] == [{0: 19, 3: 5}] * 2


class _Pair:
    """A primary's link to its standby and the standby's to it, as two in-process queues."""

    def __init__(self):
        self.forwards, self.acks = queue.Queue(), queue.Queue()

    def send(self, peer, header, payload=None):  # the primary forwards
        self.forwards.put((header, None if payload is None else payload.clone()))

    def recv_reply(self, peer, out=None):
        if out is None:  # the primary waits for the standby's answer
            return self.acks.get(timeout=30)
        header, payload = self.forwards.get(timeout=30)  # the standby receives a forward
        if payload is not None:
            out.copy_(payload)
        return header


class _StandbySide:
    def __init__(self, pair: _Pair):
        self.pair = pair

    def recv_reply(self, peer, out):
        return self.pair.recv_reply(peer, out)

    def send(self, peer, header, payload=None):
        self.pair.acks.put(header)


def test_a_standby_copy_holds_its_shards_theta_after_every_forwarded_push():
    # Shard 1's server forwards each applied push to its standby on server 0 before it
    # replies; the copy starts from shard 1's slice of θ0 and ends on shard 1's θ, bit for bit.
    pair, standby = _Pair(), []

    def setup(loops):
        loops[1].standby_link = pair
        standby.append(Standby(loops[0], 1, _StandbySide(pair)))
        assert torch.equal(standby[0].replica.theta, loops[1].shard.theta)
        standby.append(threading.Thread(target=standby[0]._run, daemon=True))
        standby[1].start()

    _, _, loops = train_asgd_worker(
        asgd_cfg(servers=2, n_sync=2, shard_standby=True), 8, setup=setup
    )
    standby, thread = standby
    pair.send(1, Header(Kind.REPLY, shard=1, aux=int(Kind.DONE)))  # the primary is done
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert loops[1].shard.version == 4
    assert torch.equal(standby.replica.theta, loops[1].shard.theta)
    assert standby.replica.stats() == loops[1].shard.stats()


class _WireWorkerSide(WorkerSide):
    """A worker's end of :mod:`tests.fakes` as the wire treats it: every header goes through
    its wire encoding, and a payload travels on the stream its ``reply`` flag names (gloo
    matches tags): a request's payload sent as a reply, or a reply awaited as a request, never
    arrives."""

    def send(self, k: int, header: Header, payload=None, final: bool = False) -> None:
        super().send(k, Header.from_tensor(header.to_tensor()), payload, final)

    def isend_payload(self, k: int, payload: torch.Tensor, reply: bool, prepare=None):
        if prepare is not None:
            prepare(0, payload.numel())
        if reply:
            raise AssertionError("a request's payload sent on the reply stream never arrives")
        return super().isend_payload(k, payload, reply, prepare)

    def irecv_payload(self, k: int, out: torch.Tensor, reply: bool):
        if not reply:
            raise AssertionError("a reply awaited on the request stream never arrives")
        return super().irecv_payload(k, out, reply)


def _ps(strategy: str, workers: int, **kw):
    """A started parameter-server job over the fake network, and its replicas."""
    cfg = survivor_cfg(strategy, workers, **kw)
    replicas = ref.Replicas(workers, ref.sgd())
    job = ps_job(cfg, replicas.models)
    for w in job.workers:
        w.transport = _WireWorkerSide(w.transport.net, w.transport.rank, w.stats)
        w.start()
    return job, replicas


def _steps(job, replicas: ref.Replicas, worker: int, steps: int = 1) -> None:
    """``steps`` local steps of one worker, each followed by its strategy's ``after_step``."""
    strategy = job.workers[worker]
    for _ in range(steps):
        replicas.step(worker, strategy.local_steps + 1)
        strategy.after_step(BATCH)


def test_asgd_counts_the_samples_of_every_step_and_publishes_the_fetched_theta():
    job, replicas = _ps("asgd", 1, servers=1, n_sync=2)
    worker, shard = job.workers[0], job.loops[0].shard
    _steps(job, replicas, 0)
    assert worker.global_params() is None  # no round this step
    _steps(job, replicas, 0)  # push and fetch
    assert shard.samples == 2 * BATCH and worker.global_samples == 2 * BATCH
    theta, samples = worker.global_params()
    assert samples == 2 * BATCH and torch.equal(theta, job.server_theta)
    _steps(job, replicas, 0, 3)
    assert shard.samples == 4 * BATCH and worker.local_steps == 5
    flush(worker)
    assert shard.samples == 5 * BATCH
    assert worker.state_dict()["local_steps"] == 5


@pytest.mark.parametrize("servers", [1, 2])
def test_asgd_reads_the_servers_theta_between_rounds_and_leaves_the_replica_alone(servers):
    job, replicas = _ps("asgd", 2, servers=servers, n_sync=2)
    w0, w1 = job.workers
    _steps(job, replicas, 1)  # w1: one step, no round
    _steps(job, replicas, 0, 2)  # w0 pushes two steps' samples
    replica, base = ref.flat(replicas.models[1]), w1.reference.clone()
    versions = list(w1.versions)
    theta, samples = w1.fetch_global_params()
    assert torch.equal(theta, job.server_theta) and samples == 2 * BATCH
    assert torch.equal(ref.flat(replicas.models[1]), replica)
    assert torch.equal(w1.reference, base) and w1.versions == versions
    fresh, samples = w0.fetch_global_params()  # w0 fetched this step: nothing to ask
    assert torch.equal(fresh, job.server_theta) and samples == 2 * BATCH


def test_asgd_worker_rebuilds_a_scaled_stale_push_as_the_server_applies_it():
    job, replicas = _ps("asgd", 2, servers=1, n_sync=1, staleness_scaling=True, server_lr=1.0)
    _steps(job, replicas, 0, 2)  # w0 pushes at versions 0 and 1
    _steps(job, replicas, 1)  # w1 pushes against version 0 at version 2: α = 1/2
    w1 = job.workers[1]
    assert w1.last_staleness == 2
    assert torch.equal(w1.reference, job.server_theta)
    assert torch.equal(ref.flat(replicas.models[1]), job.server_theta)


def test_asgd_sums_the_staleness_of_its_pushes():
    job, replicas = _ps("asgd", 2, servers=1, n_sync=1)
    for worker in (0, 1, 0, 1):  # staleness: w0 0, w1 1, w0 1, w1 1
        _steps(job, replicas, worker)
    report = [w.report() for w in job.workers]
    counts = [(r["staleness_sum_versions"], r["staleness_max_versions"]) for r in report]
    assert [(*c, r["pushes"]) for c, r in zip(counts, report, strict=True)] == [
        (1, 1, 2),
        (2, 1, 2),
    ]


def test_asgd_counts_each_dropped_push():
    job, replicas = _ps("asgd", 2, servers=1, n_sync=1, max_staleness=0)
    for worker in (0, 1, 0, 1):  # both of w1's pushes are one version stale
        _steps(job, replicas, worker)
    w1 = job.workers[1]
    assert (w1.pushes, w1.pushes_dropped, w1.report()["pushes_dropped_stale"]) == (2, 2, 2)
    assert job.workers[0].pushes_dropped == 0


def test_asgd_restarts_from_the_servers_theta_after_each_rejected_push(caplog):
    job, replicas = _ps("asgd", 1, servers=1, n_push=1, n_fetch=4)
    worker, model = job.workers[0], replicas.models[0]
    with caplog.at_level(logging.WARNING, logger="cloudburst.strategies.asgd.worker"):
        for step in (1, 2):
            replicas.step(0, step)
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan
            worker.after_step(BATCH)
            assert torch.equal(ref.flat(model), job.server_theta)
    assert worker.pushes_rejected == 2
    messages = [
        r.getMessage() for r in caplog.records if r.name == "cloudburst.strategies.asgd.worker"
    ]
    assert messages == ["the servers rejected this worker's push; re-fetching θ"] * 2


def test_easgd_counts_samples_and_steps_and_publishes_nothing_between_fetches():
    job, replicas = _ps("easgd", 1, servers=1, easgd_tau=2)
    worker, shard = job.workers[0], job.loops[0].shard
    _steps(job, replicas, 0)
    assert worker.global_params() is None
    _steps(job, replicas, 0, 3)
    assert shard.samples == 4 * BATCH and worker.global_samples == 4 * BATCH
    assert (worker.local_steps, worker.pushes) == (4, 2)


def test_easgd_leaves_a_dropped_replica_alone_and_resets_a_rejected_one_to_the_centre():
    job, replicas = _ps("easgd", 2, servers=1, easgd_tau=1, max_staleness=0)
    w1, model = job.workers[1], replicas.models[1]
    _steps(job, replicas, 0)  # the centre moves to version 1
    replicas.step(1, 1)
    before, centre = ref.flat(model), job.server_theta.clone()
    w1.after_step(BATCH)  # against version 0: dropped
    assert w1.pushes_dropped == 1
    assert torch.equal(ref.flat(model), before) and torch.equal(job.server_theta, centre)
    replicas.step(1, 2)
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    w1.after_step(BATCH)  # against version 1, not finite: rejected
    assert w1.pushes_rejected == 1
    assert torch.equal(ref.flat(model), job.server_theta) and torch.equal(job.server_theta, centre)
