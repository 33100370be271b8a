"""Compressed local SGD, DiLoCo and asgd pushes against the plain-PyTorch references with the
reference quantiser (tests/reference.py: block-wise int8 / fp8 with error feedback)."""

from __future__ import annotations

import pytest
import torch

from tests import reference as ref
from tests.support import assert_follows_reference, drive_strategy

STEPS, PERIOD, WORKERS = 13, 4, 2  # three averages and a final one after a partial period
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _drive(ctx, strategy_name: str) -> list[list[float]]:
    from cloudburst.strategies.diloco import DilocoStrategy
    from cloudburst.strategies.local_sgd import LocalSgdStrategy

    cls = DilocoStrategy if strategy_name == "diloco" else LocalSgdStrategy
    model = ref.tiny_model()
    return drive_strategy(ctx, cls(ctx), model, ref.sgd()(model), STEPS)


def _reference(strategy: str, reduce) -> list[list[torch.Tensor]]:
    replicas = ref.Replicas(WORKERS, ref.sgd())
    if strategy == "local_sgd":
        return ref.local_sgd(replicas.models, replicas.step, STEPS, PERIOD, reduce=reduce)
    return ref.diloco(replicas.models, replicas.step, STEPS, PERIOD, OUTER_LR, OUTER_MOMENTUM,
                      nesterov=True, reduce=reduce)  # fmt: skip


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("strategy", ["local_sgd", "diloco"])
def test_compressed_averages_follow_the_reference_quantiser(tmp_path, strategy, method):
    from cloudburst.config import RunConfig
    from cloudburst.sim.run import run_ranks

    cfg = RunConfig(strategy=strategy, workers=WORKERS, dataset="synthetic", period=PERIOD,
                    compress=method, out=str(tmp_path),
                    **({"diloco_outer_lr": OUTER_LR, "diloco_outer_momentum": OUTER_MOMENTUM}
                       if strategy == "diloco" else {}))  # fmt: skip
    runs = run_ranks(cfg, _drive, strategy)
    expected = _reference(strategy, ref.QuantisedSum(method))
    assert_follows_reference(runs, expected, STEPS)
    # The compression shows: without feedback, or uncompressed, the run is another one.
    for other in (ref.QuantisedSum(method, feedback=False), None):
        gap = (torch.tensor(runs[0][-1]) - _reference(strategy, other)[0][-1]).abs().max()
        assert gap > 1e-4, other


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_asgd_pushes_are_the_reference_quantiser_with_a_residual_per_shard(method):
    # Six pushes of the same Δ by one worker to two shards: each shard's slice (contiguous,
    # sizes differing by at most one: docs/algorithms.md) goes as C(Δ_k + e_k); what the
    # servers apply is C⁻¹ of it, and e_k keeps the rest. The bytes sent decode to that.
    from cloudburst.comm.quantise import decode
    from tests.support import ps_job, references_cfg

    cfg = references_cfg(strategy="asgd", workers=1, servers=2, compress=method)
    [worker] = ps_job(cfg, [ref.tiny_model()]).workers
    n, shards = ref.NUMEL, 2
    sizes = [n // shards + (1 if k < n % shards else 0) for k in range(shards)]
    bounds = [(sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(shards)]
    assert [tuple(b) for b in worker.bounds] == bounds
    g = torch.Generator().manual_seed(5)
    delta = torch.randn(n, generator=g) * 0.01 + 0.002
    residuals = [torch.zeros(b - a) for a, b in bounds]
    applied_sum = torch.zeros(n)
    for _ in range(6):
        sent = delta.clone()
        packets = worker._compress_push(sent)
        for k, (a, b) in enumerate(bounds):
            x = delta[a:b] + residuals[k]
            expected = ref.quantise_round_trip(x, method)
            residuals[k] = x - expected
            torch.testing.assert_close(sent[a:b], expected, rtol=0, atol=1e-7)
            torch.testing.assert_close(decode(packets[k], b - a, method), expected, rtol=0,
                                       atol=1e-7)  # fmt: skip
        applied_sum += sent
    # Over the rounds the servers applied 6Δ less the last residuals (one rounding).
    torch.testing.assert_close(applied_sum + torch.cat(residuals), 6 * delta, rtol=0, atol=1e-6)
