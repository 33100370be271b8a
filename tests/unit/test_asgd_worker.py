"""The asgd and easgd workers against real shards over :mod:`tests.support`'s fake comm:
schedules, replies, rejections, the accounting of workers stepped in a scripted order, a fetch
across a shard's restart, and Δ computed chunk by chunk as it leaves a CPU replica."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import cloudburst.strategies.asgd.worker as asgd
from cloudburst.comm.flat import flatten_params
from cloudburst.comm.liveness import acked_version, announce_shard
from cloudburst.comm.messages import Header, Kind, Status
from cloudburst.data import BatchStream, synthetic
from cloudburst.models import build_model
from cloudburst.strategies.asgd.serve import Standby
from tests import reference as ref
from tests.support import (
    BATCH,
    StandbyForwards,
    WorkerSide,
    asgd_cfg,
    flush,
    make_asgd_worker,
    ps_job,
    survivor_cfg,
    train_asgd_worker,
)

LOGGER = "cloudburst.strategies.asgd.worker"


def test_one_worker_equals_sgd_for_every_schedule_and_rule():
    data, model = synthetic(512, 10), build_model("mlp", 40, 10, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stream = BatchStream(data.x_train, data.y_train, 32, seed=1)
    for _ in range(24):  # plain SGD, as train_asgd_worker steps the worker
        ref.train_step(model, opt, *next(stream))
    expected = flatten_params(model)
    for kw in [
        dict(servers=1, n_sync=1),
        dict(servers=3, n_sync=4),  # overlapped replies on 3 shards
        dict(servers=2, n_fetch=2, n_push=3),  # fetches keep unpushed progress
        dict(servers=2, n_fetch=3, n_push=2),
        dict(servers=2, n_sync=4, server_rule="sgd", server_lr=1.0),  # replies after apply
    ]:
        model, _, loops = train_asgd_worker(asgd_cfg(**kw), 24)
        # step 24 is a push and a fetch for every schedule here: shards and replica agree
        for theta in (torch.cat([loop.shard.theta for loop in loops]), flatten_params(model)):
            torch.testing.assert_close(theta, expected, rtol=1e-5, atol=1e-6, msg=str(kw))


def test_chunked_add_matches_the_shards_bit_for_bit(monkeypatch):
    """The overlapped θ + αΔ written in chunks of 7 (none aligned to a shard; λ = 0.5)."""
    monkeypatch.setattr(asgd, "ADD_CHUNK_NUMEL", 7)
    model, strategy, loops = train_asgd_worker(asgd_cfg(servers=3, n_sync=3, server_lr=0.5), 12)
    theta = torch.cat([loop.shard.theta for loop in loops])
    assert strategy.pushes == 4 * 3 and strategy.pushes_rejected == 0
    assert all(loop.shard.version == 4 for loop in loops)
    assert torch.equal(flatten_params(model), theta)
    assert torch.equal(strategy.reference, theta)


@pytest.mark.parametrize("compensation", ["delay-adaptive", "scale"])
def test_after_every_push_the_worker_holds_the_servers_theta_whatever_its_staleness(compensation):
    """The worker rebuilds θ + λ·s·Δ with the shard's s: delay-adaptive, τ_C = 4 (s = 1 at
    τ = 3), and scale (s = 1/3)."""
    cfg = survivor_cfg("asgd", 4, servers=2, n_sync=1, server_lr=0.5,
                       staleness_compensation=compensation)  # fmt: skip

    def each(model, loops):
        # Δ = 0 pushes from elsewhere: θ stays, and the worker's next push arrives 3 versions stale
        assert torch.equal(flatten_params(model), torch.cat([loop.shard.theta for loop in loops]))
        for loop in loops:
            for _ in range(3):
                loop.shard.apply_push(torch.zeros_like(loop.shard.theta), loop.shard.version)

    _, strategy, loops = train_asgd_worker(cfg, 6, each=each)
    assert [loop.shard.staleness_hist for loop in loops] == [{0: 19, 3: 5}] * 2
    assert strategy.last_staleness == 3
    assert torch.equal(strategy.reference, torch.cat([loop.shard.theta for loop in loops]))


def test_a_standby_copy_holds_its_shards_theta_after_every_forwarded_push():
    """Shard 1 forwards each applied push to its standby on server 0: the copy (rule state
    included) ends on shard 1's θ and stats, bit for bit."""
    forwards = StandbyForwards(1)
    cfg = asgd_cfg(servers=2, n_sync=2, shard_standby=True, server_rule="sgd", server_momentum=0.9)
    _, _, loops = train_asgd_worker(
        cfg, 8, setup=lambda loops: setattr(loops[1], "standby_link", forwards)
    )
    standby = Standby(loops[0], 1, forwards.replay())
    standby._run()
    assert loops[1].shard.version == 4
    assert torch.equal(standby.replica.theta, loops[1].shard.theta)
    assert standby.replica.stats() == loops[1].shard.stats()


# ------------------------------------------------------ when a shard replies, relative to its add
REPLIES = {
    "push": dict(n_push=1, n_fetch=2),
    "push_fetch": dict(n_sync=1, server_lr=0.5),  # overlapped: the worker has θ from before
    "sgd": dict(n_sync=1, server_rule="sgd", server_lr=1.0),  # the reply carries θ after
}


@pytest.mark.parametrize("kind", list(REPLIES))
def test_a_reply_leaves_before_the_add_unless_it_carries_theta(kind):
    """A PUSH's or overlapped PUSH_FETCH's ack (the version after the push) leaves before θ
    moves; an optimizer rule's reply carries θ after the apply, so the apply comes first."""
    model = build_model("mlp", 40, 10, seed=0)
    strategy, loops = make_asgd_worker(asgd_cfg(servers=1, **REPLIES[kind]), model)
    strategy.start()
    shard, side = loops[0].shard, loops[0].transport
    before = shard.theta.clone()
    seen = []  # at each reply: its header, θ and the shard's version then
    send = side.send

    def recording_send(dst, header, payload=None, final=False):
        seen.append((header, shard.theta.clone(), shard.version))
        send(dst, header, payload, final)

    side.send = recording_send
    ref.set_flat(model, ref.flat(model) + 0.25)
    strategy._round(push=True, fetch=kind != "push")
    ((header, theta_then, version_then),) = seen
    assert header.kind == Kind.REPLY and header.status == Status.OK and header.version == 1
    assert not torch.equal(shard.theta, before)
    if kind == "sgd":
        assert header.numel == shard.theta.numel() and torch.equal(theta_then, shard.theta)
    else:
        assert header.numel == 0 and torch.equal(theta_then, before)
    if kind == "push_fetch":
        assert version_then == shard.version == 1  # the push was counted before the ack left
        delta = (before + 0.25) - before  # what the worker pushed (its replica started at θ)
        assert torch.equal(shard.theta, before.clone().add_(delta, alpha=0.5))
    if kind != "push":
        assert torch.equal(flatten_params(strategy.model), shard.theta)


class _WireWorkerSide(WorkerSide):
    """Headers through their encoding, payloads on the stream ``reply`` names (gloo's tags)."""

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


def test_asgd_sums_the_staleness_of_its_pushes_and_counts_each_dropped_one():
    job, replicas = _ps("asgd", 2, servers=1, n_sync=1)
    for worker in (0, 1, 0, 1):  # staleness: w0 0, w1 1, w0 1, w1 1
        _steps(job, replicas, worker)
    keys = ("staleness_sum_versions", "staleness_max_versions", "pushes")
    assert [tuple(w.report()[k] for k in keys) for w in job.workers] == [(1, 1, 2), (2, 1, 2)]
    job, replicas = _ps("asgd", 2, servers=1, n_sync=1, max_staleness=0)
    for worker in (0, 1, 0, 1):  # both of w1's pushes are one version stale: dropped
        _steps(job, replicas, worker)
    w1 = job.workers[1]
    assert (w1.pushes, w1.pushes_dropped, w1.report()["pushes_dropped_stale"]) == (2, 2, 2)
    assert job.workers[0].pushes_dropped == 0


def test_asgd_restarts_from_the_servers_theta_after_each_rejected_push_and_trains_on(caplog):
    """Only the shard holding the NaN rejects; the worker logs it, restarts from the servers'
    θ, and its later pushes are applied."""
    job, replicas = _ps("asgd", 1, servers=2, n_push=1, n_fetch=4)
    worker, model = job.workers[0], replicas.models[0]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for step in (1, 2):
            replicas.step(0, step)
            model[0].weight.data[0, 0] = math.nan  # in shard 0's slice
            worker.after_step(BATCH)
            assert torch.equal(ref.flat(model), job.server_theta)
    _steps(job, replicas, 0, 2)
    assert worker.pushes_rejected == 2
    assert [loop.shard.rejected_nonfinite for loop in job.loops] == [2, 0]
    assert [loop.shard.version for loop in job.loops] == [2, 4]
    assert torch.isfinite(job.server_theta).all() and torch.isfinite(ref.flat(model)).all()
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
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
    model[0].weight.data[0, 0] = math.nan
    w1.after_step(BATCH)  # against version 1, not finite: rejected
    assert w1.pushes_rejected == 1
    assert torch.equal(ref.flat(model), job.server_theta) and torch.equal(job.server_theta, centre)


# ---------------------------------------------------------------- reading θ across a restart
# A broken connection to shard 1 raises; its restart is an announcement and a fresh fake link.
BOUNDS = [(0, 3), (3, 6), (6, 9)]  # a 2 → 3 linear layer (9 values) over three shards
BROKEN = 1


class _CutLink(WorkerSide):
    """The connection to shard ``BROKEN`` breaks once ``cut`` is set (``"send"``: the request,
    ``"recv"``: the reply); ``stale``: from before the shard's restart, never to be used again."""

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


def _three_shard_job(link_type: type[WorkerSide], **cfg):
    """(model, job, worker, link): one asgd worker over three shards, θ = ``_values(1.0)``."""
    model = nn.Linear(2, 3)
    ref.set_flat(model, _values(1.0))
    job = ps_job(asgd_cfg(servers=3, **cfg), [model])
    worker = job.workers[0]
    link = link_type(worker.transport.net, worker.transport.rank, worker.stats)
    worker.transport = link
    return model, job, worker, link


def _restart_job():
    """A started worker (shard k at version 3 + 2k, 8·(k + 1) samples), then a local step."""
    model, job, worker, link = _three_shard_job(_CutLink, n_sync=4, max_restarts=1)
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
    """The lost shard's slice (replica and reference too) is its restart's θ_k at the restored
    version; the acknowledged version is reported, the reconnection counted and logged; later
    fetches use the restart's link only, with no further reconnection."""
    worker, model, link, job, store = _restart_job()
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
    link.stale = True
    _set_shards(job, _values(-7.0), versions=[20, 21, 22], samples=[96, 104, 112])
    theta, samples = worker.fetch_global_params()
    assert torch.equal(theta, _values(-7.0)) and samples == 96
    assert worker.shard_reconnects == 1 and worker.versions == [3, 4, 7]
    assert torch.equal(ref.flat(model), torch.cat([local[0:3], restored[3:6], local[6:9]]))


# ------------------------------------------------------------------- Δ computed as it leaves
class _ChunkedLink(WorkerSide):
    """Sends each payload in two chunks, ``prepare`` filling each just before; keeps them."""

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
    """Under the add rule ``prepare`` computes each chunk of Δ = θ_local − θ_fetched, exactly."""
    model, job, worker, link = _three_shard_job(_ChunkedLink, n_sync=1)
    worker.start()
    local = _values(1.0) + torch.tensor([3.0, -1.0, 0.5, 2.0, 4.0, -2.5, 1.5, 0.25, -0.75])
    ref.set_flat(model, local)
    worker.after_step(8)
    delta = local - _values(1.0)
    assert [t.tolist() for t in link.sent] == [delta[a:b].tolist() for a, b in BOUNDS]
    assert torch.equal(torch.cat([loop.shard.theta for loop in job.loops]), local)
    assert torch.equal(ref.flat(model), local)
