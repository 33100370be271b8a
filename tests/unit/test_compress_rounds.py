"""Error feedback through the quantised all-reduce over several rounds on the virtual cluster:
the running sum tracks the true one within one rounding per quantisation (the senders' and,
from W = 3, the chunk owner's), where without feedback it drifts by one rounding per round."""

from __future__ import annotations

import pytest
import torch

from tests import reference as ref

ROUNDS = 8


def _inputs(rank: int, numel: int) -> torch.Tensor:
    # The same vector every round, with a bias: a rounding error repeats instead of averaging out.
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g) * (1.0 + rank) + 0.3


def _rounds(ctx, method: str, feedback: bool, numel: int) -> list[list[float]]:
    from cloudburst.comm.compress import ErrorFeedback, compressed_all_reduce_sum
    from cloudburst.comm.stats import CommStats

    state = ErrorFeedback() if feedback else None
    stats, outs = CommStats(), []
    for _ in range(ROUNDS):
        y = _inputs(ctx.rank, numel).clone()
        compressed_all_reduce_sum(y, None, stats, method, feedback=state, key="g", comm=ctx.comm)
        outs.append(y.tolist())
    return outs


# 1100 values: 5 blocks of 256, the last partial (at W = 3 chunks of 2, 1, 1 blocks); 700 at
# W = 4: 3 blocks, so one rank owns no chunk.
@pytest.mark.parametrize("workers, numel", [(2, 1100), (3, 1100), (4, 700)])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_error_feedback_keeps_the_running_sum_within_one_rounding(tmp_path, method, workers, numel):
    from cloudburst.config import RunConfig
    from cloudburst.sim.run import run_ranks

    cfg = RunConfig(strategy="sync", workers=workers, dataset="synthetic", out=str(tmp_path))
    with_ef = run_ranks(cfg, _rounds, method, True, numel)
    without = run_ranks(cfg, _rounds, method, False, numel)
    for runs in (with_ef, without):
        assert all(r == runs[0] for r in runs), "every rank gets the same bits every round"
    inputs = [_inputs(r, numel) for r in range(workers)]
    true = torch.stack(inputs).sum(0)
    # Σ_k out_k = k·Σx − (the last residuals): each sender's (one rounding of its vector)
    # and, where the sum is re-quantised by a chunk owner, the owner's (one of the sum).
    bound = 1.05 * (sum(ref.rounding_bound(x, method) for x in inputs)
                    + ref.rounding_bound(true, method)) + 1e-5  # fmt: skip
    running_ef, running_plain = torch.zeros(numel), torch.zeros(numel)
    for k in range(ROUNDS):
        running_ef += torch.tensor(with_ef[0][k])
        running_plain += torch.tensor(without[0][k])
        gap = (running_ef - (k + 1) * true).abs()
        assert bool((gap <= bound).all()), f"round {k + 1}: off by {float((gap - bound).max())}"
    # Without feedback the same rounding is lost every round: the drift grows with k.
    gap_ef = (running_ef - ROUNDS * true).abs().sum()
    gap_plain = (running_plain - ROUNDS * true).abs().sum()
    assert gap_plain > 3 * gap_ef
    # One round alone: the sum of the senders' reference round trips, within the owner's
    # rounding of that sum (none in the all-gather form).
    first = torch.tensor(without[0][0])
    sent = torch.stack([ref.quantise_round_trip(x, method) for x in inputs]).sum(0)
    assert bool(((first - sent).abs() <= ref.rounding_bound(sent, method) + 1e-5).all())
