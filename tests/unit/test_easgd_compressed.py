"""Compressed EASGD (``--compress int8``): each round sends e = α(θ_i − θ̃') against the centre
of the worker's previous exchange, with error feedback; the shards add the decoded e (scaled for
staleness), the worker subtracts it. Over the fake comm, bit for bit against a reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cloudburst.comm.messages import Header, Status
from cloudburst.config import RunConfig
from tests import reference as ref
from tests.support import Done, WorkerSide, ps_job

BLOCK_VALUES = 256  # values per int8 block, one fp32 scale each


def _int8(x: torch.Tensor) -> torch.Tensor:
    """What an int8 message of the 1-D fp32 ``x`` decodes to."""
    return ref.quantise_round_trip(x, "int8")


def _unpack_int8(packet: torch.Tensor, n: int) -> torch.Tensor:
    """The values of an int8 message: codes padded to whole blocks, then a scale per block."""
    blocks = -(-n // BLOCK_VALUES)
    assert packet.dtype == torch.uint8 and packet.numel() == blocks * BLOCK_VALUES + 4 * blocks
    codes = packet[: blocks * BLOCK_VALUES].view(torch.int8).float().view(blocks, BLOCK_VALUES)
    scales = packet[blocks * BLOCK_VALUES :].view(torch.float32)
    return (codes * scales[:, None]).reshape(-1)[:n]


class _Int8Wire(WorkerSide):
    """A worker's end as ``PeerTransport(compress="int8")`` carries payloads: a request's bytes
    decoded on arrival; a reply's fp32 θ as its int8 round trip (no feedback)."""

    def __init__(self, net, rank, stats):
        super().__init__(net, rank, stats)
        self.numel: dict[int, int] = {}

    def send(self, k: int, header: Header, payload=None, final: bool = False) -> None:
        assert payload is None, "an fp32 request payload in a compressed elastic run"
        self.numel[k] = header.numel
        super().send(k, header)

    def isend_payload(self, k: int, payload: torch.Tensor, reply: bool, prepare=None):
        assert not reply and prepare is None
        self.net.payloads[self.rank, k].append(_unpack_int8(payload, self.numel[k]))
        return Done()

    def irecv_payload(self, k: int, out: torch.Tensor, reply: bool):
        assert reply

        def arrive() -> None:
            self.net.pump(k)
            out.copy_(_int8(self.net.reply_payloads[self.rank, k].popleft()))

        return Done(arrive)

    def recv_reply(self, k: int, out: torch.Tensor | None = None) -> Header:
        self.net.pump(k)
        header = self.net.replies[self.rank, k].popleft()
        if header.numel:
            out.copy_(_int8(self.net.reply_payloads[self.rank, k].popleft()))
        return header


class _Reference:
    """The compressed elastic protocol in plain PyTorch: the centre, and per worker θ_i, the
    centre θ̃' of its last exchange, its residuals and the versions it saw."""

    def __init__(self, theta0, workers, bounds, alpha, compensation, max_staleness):
        self.bounds, self.alpha = bounds, alpha
        self.compensation, self.max_staleness = compensation, max_staleness
        self.centre = theta0.clone()
        shards = len(bounds)
        self.version, self.samples = [0] * shards, [0] * shards
        fetched = self._wire_centre()  # start: every worker fetches θ̃ and adopts it
        self.theta = [fetched.clone() for _ in range(workers)]
        self.ref = [fetched.clone() for _ in range(workers)]
        self.seen = [[0] * shards for _ in range(workers)]
        self.residual: list[dict[str, torch.Tensor]] = [{} for _ in range(workers)]
        self.global_samples = [0] * workers
        self.pending = [0] * workers
        self.statuses: list[list[Status]] = []
        self.stalenesses: set[int] = set()

    def _wire_centre(self) -> torch.Tensor:
        return torch.cat([_int8(self.centre[a:b]) for a, b in self.bounds])

    def _factor(self, staleness: int) -> float:
        return 1.0 / max(1, staleness) if self.compensation == "scale" else 1.0

    def round(self, i: int, samples: int) -> None:
        self.pending[i] += samples
        e = (self.theta[i] - self.ref[i]) * self.alpha
        statuses, reset = [], False
        for k, (a, b) in enumerate(self.bounds):
            key = f"shard{k}"
            intended = e[a:b] + self.residual[i][key] if key in self.residual[i] else e[a:b]
            sent = _int8(intended)
            self.residual[i][key] = intended - sent
            before = _int8(self.centre[a:b])  # the reply: θ̃ before this push, as sent
            staleness = self.version[k] - self.seen[i][k]
            self.stalenesses.add(staleness)
            if not bool(torch.isfinite(sent).all()):
                statuses.append(Status.REJECTED)
                self.theta[i][a:b] = before  # restart from the centre
                self.ref[i][a:b] = before
                reset = True
            elif self.max_staleness is not None and staleness > self.max_staleness:
                statuses.append(Status.STALE_DROPPED)
                self.ref[i][a:b] = before  # the replica is left as it is
            else:
                statuses.append(Status.OK)
                f = self._factor(staleness)
                self.centre[a:b].add_(sent, alpha=f)
                self.version[k] += 1
                self.samples[k] += self.pending[i]
                self.theta[i][a:b].sub_(sent, alpha=f)
                self.ref[i][a:b] = before.add_(sent, alpha=f)
            self.seen[i][k] = self.version[k]
            if k == 0:
                self.global_samples[i] = self.samples[0]
        if reset:
            self.residual[i] = {}  # what was left out of a non-finite e is no use
        self.pending[i] = 0
        self.statuses.append(statuses)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(30, 20)  # 620 values: several int8 blocks per shard


def _cfg(**kw) -> RunConfig:
    """An int8-compressed easgd job of one local step per elastic round."""
    return RunConfig(strategy="easgd", dataset="synthetic", compress="int8", easgd_tau=1, **kw)


def _run(
    cfg: RunConfig, script: list[tuple[int, int | None]], alpha: float, bounds, device="cpu"
) -> _Reference:
    """Drive ``cfg``'s job through ``script`` ((worker, index poisoned with +inf or None): a
    step and round each) beside the reference, both checked after every round; the reference."""
    models = [_model().to(device) for _ in range(cfg.job.workers)]
    theta0 = ref.flat(models[0]).cpu()
    job = ps_job(cfg, models, theta0)
    reference = _Reference(theta0, cfg.job.workers, bounds, alpha,
                           cfg.asgd.staleness_compensation, cfg.asgd.max_staleness)  # fmt: skip
    for w in job.workers:
        w.transport = _Int8Wire(w.transport.net, w.transport.rank, w.stats)
        w.start()
    for i, model in enumerate(models):
        assert torch.equal(ref.flat(model).cpu(), reference.theta[i])
    g = torch.Generator().manual_seed(7)
    for step, (i, poison) in enumerate(script):
        # a local step's move, with magnitudes that differ from block to block
        drift = torch.randn(620, generator=g) * torch.linspace(0.01, 0.2, 620)
        if poison is not None:
            drift[poison] = math.inf
        ref.set_flat(models[i], ref.flat(models[i]) + drift.to(device))
        reference.theta[i].add_(drift)
        samples = 8 + step  # a different count each step: the samples each push carries
        reference.round(i, samples)
        worker = job.workers[i]
        worker.after_step(samples)
        assert torch.equal(ref.flat(models[i]).cpu(), reference.theta[i]), f"replica, round {step}"
        assert torch.equal(job.server_theta, reference.centre), f"centre, round {step}"
        assert worker.versions == reference.seen[i]
        assert worker.global_samples == reference.global_samples[i]
        assert [loop.shard.samples for loop in job.loops] == reference.samples
        feedback = worker.state_dict()["compress_feedback"]
        assert feedback.keys() == reference.residual[i].keys()
        for key, residual in reference.residual[i].items():
            assert torch.equal(feedback[key], residual), f"residual {key}, round {step}"
    return reference


@pytest.mark.parametrize(("workers", "servers"), [(3, 2), (2, 1)])
def test_compressed_elastic_rounds_match_the_reference_with_staleness_scaling(workers, servers):
    """Pushes 0–2 versions stale: shards add decoded e·1/max(1, τ), the worker subtracts it, keeps
    θ̃ + it as its reference, carries int8's residual, reads shard 0's samples (α = β/W)."""
    cfg = _cfg(workers=workers, servers=servers, staleness_compensation="scale")
    bounds = [(0, 310), (310, 620)] if servers == 2 else [(0, 620)]
    order = [0, 1, 2, 0, 1, 2, 2, 0] if workers == 3 else [0, 1, 1, 0, 0, 1]
    reference = _run(cfg, [(i, None) for i in order], alpha=0.9 / workers, bounds=bounds)
    assert all(s == Status.OK for round_ in reference.statuses for s in round_)
    assert {0, 1, 2} <= reference.stalenesses  # factors 1, 1 and 1/2 (and less)
    assert all(bool(r.abs().sum() > 0) for res in reference.residual for r in res.values())


def test_a_dropped_push_leaves_the_replica_and_a_rejected_one_resets_it_and_the_feedback():
    """max_staleness 0: a late push is dropped (replica kept, the centre its reference); a push
    +inf in shard 0's part is rejected there (reset to the centre, residuals dropped), not on 1."""
    cfg = _cfg(workers=2, servers=2, max_staleness=0, easgd_alpha=0.4)
    script = [(0, None), (1, None), (1, 3), (1, None), (0, None)]
    assert _run(cfg, script, alpha=0.4, bounds=[(0, 310), (310, 620)]).statuses == [
        [Status.OK, Status.OK],
        [Status.STALE_DROPPED, Status.STALE_DROPPED],
        [Status.REJECTED, Status.OK],
        [Status.OK, Status.OK],
        [Status.STALE_DROPPED, Status.STALE_DROPPED],
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compressed_elastic_rounds_of_cuda_replicas_match_the_reference():
    """Replicas on the GPU: e staged through host memory and back, the same values as on the
    CPU (factor 1: no rounding a fused multiply-add could change)."""
    cfg = _cfg(workers=2, servers=2, easgd_alpha=0.4)
    script = [(0, None), (1, None), (0, None), (1, None)]
    reference = _run(cfg, script, alpha=0.4, bounds=[(0, 310), (310, 620)], device="cuda")
    assert all(s == Status.OK for round_ in reference.statuses for s in round_)
