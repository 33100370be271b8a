"""The parameter-server shard's rules and version clock, with no processes: staleness, drops and
rejections and their counters and histograms, the update rules, which rules reply before
applying, the checkpoint state, and the mean staleness a run reports."""

import math

import pytest
import torch

from cloudburst.comm.messages import Status
from cloudburst.strategies.asgd.settings import COMPENSATIONS
from cloudburst.strategies.asgd.shard import (
    PushResult,
    ShardState,
    all_finite,
    overlapped_push_fetch,
)
from cloudburst.strategies.asgd.summary import histogram_quantiles, mean_staleness
from tests.helpers import shard_of
from tests.support import survivor_cfg

# (worker, action) — a scripted interleaving of three workers against one shard.
SCHEDULE = [
    ("A", "fetch"),
    ("B", "fetch"),
    ("A", "push"),  # base 0, applied at 0 -> staleness 0, version 1
    ("B", "push"),  # base 0, applied at 1 -> staleness 1, version 2
    ("C", "fetch"),
    ("A", "fetch"),  # both at version 2
    ("C", "push"),  # base 2 at 2 -> 0, version 3
    ("A", "push"),  # base 2 at 3 -> 1, version 4
    ("B", "push"),  # base 0 at 4 -> 4, version 5
]


def play(shard: ShardState, delta: torch.Tensor) -> list[tuple[Status, int]]:
    fetched = {}
    results = []
    for worker, action in SCHEDULE:
        if action == "fetch":
            fetched[worker] = shard.version
        else:
            r = shard.apply_push(delta, fetched[worker], samples=10)
            results.append((r.status, r.staleness))
    return results


def test_exact_staleness_accounting_and_max_staleness_drops_old_pushes():
    shard = ShardState(torch.zeros(3))
    results = play(shard, torch.ones(3))
    assert [s for _, s in results] == [0, 1, 0, 1, 4]
    assert all(status == Status.OK for status, _ in results)
    assert shard.version == 5 and shard.samples == 50
    assert shard.staleness_sum == 6 and shard.staleness_max == 4
    assert mean_staleness([shard.stats()]) == pytest.approx(6 / 5)
    assert torch.equal(shard.theta, torch.full((3,), 5.0))  # add rule, λ = 1: θ = Σ Δ
    # max_staleness drops older pushes
    shard = ShardState(torch.zeros(2), max_staleness=2)
    results = play(shard, torch.ones(2))
    assert results[-1] == (Status.STALE_DROPPED, 4)
    assert shard.version == 4 and shard.dropped_stale == 1
    assert torch.equal(shard.theta, torch.full((2,), 4.0))


@pytest.mark.parametrize("kw", [dict(staleness_scaling=True), dict(compensation="scale")])
def test_staleness_scaling_divides_by_staleness_and_counts_the_distributions_exactly(kw):
    shard = ShardState(torch.zeros(1), lr=0.5, **kw)
    assert [s for _, s in play(shard, torch.ones(1))] == [0, 1, 0, 1, 4]
    # staleness 0,1,0,1,4 -> scales 1,1,1,1,1/4; times λ = 0.5
    assert shard.theta.item() == pytest.approx(0.5 * (4 + 0.25))
    stats = shard.stats()
    assert stats["staleness_histogram_versions"] == {"0": 2, "1": 2, "4": 1}
    assert stats["push_scale_histogram"] == {"0.25": 1, "1.0": 4}
    hist = {0.0: 2, 1.0: 2, 4.0: 1}
    assert histogram_quantiles(hist) == {"p50": 1.0, "p90": 4.0, "p99": 4.0, "max": 4.0}
    assert histogram_quantiles({}) is None


@pytest.mark.parametrize("rule", ["add", "elastic"])
def test_non_finite_push_is_rejected_and_counted(rule):
    shard = shard_of(torch.zeros(2), rule=rule)
    r = shard.apply_push(torch.tensor([1.0, float("nan")]), 0)
    assert r.status == Status.REJECTED and shard.rejected_nonfinite == 1
    assert shard.version == 0 and torch.equal(shard.theta, torch.zeros(2))
    r = shard.apply_push(torch.tensor([float("inf"), 0.0]), 0)
    assert r.status == Status.REJECTED and shard.rejected_nonfinite == 2


def test_push_from_the_future_or_wrong_shape_is_an_error():
    shard = ShardState(torch.zeros(2))
    with pytest.raises(ValueError, match="push against version 1, shard is at 0"):
        shard.apply_push(torch.zeros(2), base_version=1)
    with pytest.raises(ValueError, match=r"push of shape \(3,\) for shard \(2,\)"):
        shard.apply_push(torch.zeros(3), base_version=0)
    with pytest.raises(ValueError, match="unknown server rule 'avg'"):
        ShardState(torch.zeros(2), rule="avg")


def test_sgd_rule_is_momentum_sgd_on_minus_delta():
    lr, mu = 0.3, 0.9
    shard = ShardState(torch.zeros(4), rule="sgd", lr=lr, momentum=mu)
    deltas = [torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    theta, buf = torch.zeros(4), None
    for d in deltas:
        shard.apply_push(d, shard.version)
        g = -d
        buf = g.clone() if buf is None else mu * buf + g
        theta = theta - lr * buf
    torch.testing.assert_close(shard.theta, theta)


def test_adagrad_rule_matches_adagrad():
    lr, eps = 0.1, 1e-10
    shard = ShardState(torch.ones(3), rule="adagrad", lr=lr)
    theta, acc = torch.ones(3), torch.zeros(3)
    for i in range(4):
        d = torch.randn(3, generator=torch.Generator().manual_seed(i))
        shard.apply_push(d, shard.version)
        acc += d * d
        theta = theta - lr * (-d) / (acc.sqrt() + eps)
    torch.testing.assert_close(shard.theta, theta)


def test_a_push_whose_sum_overflows_is_finite_and_applied():
    big = torch.tensor([3e38, 3e38])  # finite, but its sum is not
    assert all_finite(big)
    assert not all_finite(torch.tensor([3e38, float("inf")]))
    shard = ShardState(torch.zeros(2))
    assert shard.apply_push(big, 0) == PushResult(Status.OK, 0)
    assert torch.equal(shard.theta, big)


def test_the_sgd_rule_has_no_momentum_and_no_staleness_scaling_unless_asked():
    shard = ShardState(torch.zeros(3), rule="sgd", lr=0.5)
    shard.apply_push(torch.tensor([1.0, 2.0, 3.0]), 0)
    shard.apply_push(torch.tensor([4.0, 0.0, -2.0]), 1)
    assert shard.theta.tolist() == [2.5, 1.0, 0.5]  # 0.5·(Δ1 + Δ2)
    shard = ShardState(torch.zeros(2), rule="sgd", lr=1.0)
    for _ in range(3):
        shard.apply_push(torch.ones(2), 0)  # staleness 0, 1, 2
    assert shard.theta.tolist() == [3.0, 3.0]


def test_a_shard_holds_a_detached_fp32_copy_of_theta():
    """θ_k is an fp32 copy of the given θ (half or double) that autograd does not track."""
    shard = ShardState(torch.tensor([1.5, 2.5], dtype=torch.float16))
    assert shard.theta.dtype == torch.float32 and shard.theta.tolist() == [1.5, 2.5]
    theta = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    shard = ShardState(theta)
    assert shard.param.requires_grad is False
    assert shard.theta.dtype == torch.float32 and shard.theta.tolist() == [1.0, 2.0]


def test_a_fresh_shard_counts_nothing_and_a_push_without_samples_counts_none():
    shard = ShardState(torch.zeros(2))
    assert shard.stats() == {
        "version": 0,
        "samples": 0,
        "pushes_applied": 0,
        "staleness_sum_versions": 0,
        "staleness_max_versions": 0,
        "dropped_stale": 0,
        "rejected_nonfinite": 0,
        "refused_pushes": 0,
        "staleness_compensation": "none",
        "staleness_histogram_versions": {},
        "push_scale_histogram": {},
        "compensation_clamped": 0,
    }
    shard.apply_push(torch.ones(2), 0)
    stats = shard.stats()
    assert stats["samples"] == 0 and stats["staleness_max_versions"] == 0
    assert stats["staleness_histogram_versions"] == {"0": 1}


def test_rejected_and_dropped_pushes_report_their_staleness_and_are_all_counted():
    shard = ShardState(torch.zeros(2), max_staleness=1)
    for version in range(3):
        shard.apply_push(torch.ones(2), version)
    assert shard.apply_push(torch.tensor([math.nan, 0.0]), 1) == PushResult(Status.REJECTED, 2)
    assert shard.apply_push(torch.ones(2), 0) == PushResult(Status.STALE_DROPPED, 3)
    assert shard.apply_push(torch.ones(2), 1) == PushResult(Status.STALE_DROPPED, 2)
    assert (shard.dropped_stale, shard.rejected_nonfinite, shard.version) == (2, 1, 3)


def test_a_state_without_optimizer_state_loads_into_any_rule_and_back():
    add = ShardState(torch.zeros(2))
    add.apply_push(torch.ones(2), 0)
    add_state = add.state_dict()
    assert add_state["optimizer"] == {}
    sgd = ShardState(torch.zeros(2), rule="sgd", lr=1.0)
    sgd.load_state_dict(add_state)
    assert sgd.theta.tolist() == [1.0, 1.0] and sgd.version == 1
    sgd.apply_push(torch.ones(2), 1)
    again = ShardState(torch.zeros(2))
    again.load_state_dict(sgd.state_dict())
    assert again.theta.tolist() == [2.0, 2.0] and again.version == 2


@pytest.mark.parametrize(
    "strategy, kw, overlapped",
    [
        ("asgd", dict(server_rule="add"), True),
        ("asgd", dict(server_rule="sgd"), False),
        ("asgd", dict(server_rule="adagrad"), False),
        ("easgd", dict(server_rule="add"), True),
    ]
    + [  # a per-coordinate compensator needs θ_now at the apply: no overlapped reply
        ("asgd", dict(staleness_compensation=method), overlapped)
        for method, overlapped in zip(
            COMPENSATIONS, [True, True, False, False, False, True], strict=True
        )
    ],
)
def test_only_add_and_elastic_rules_without_per_coordinate_compensation_reply_first(
    strategy, kw, overlapped
):
    assert overlapped_push_fetch(survivor_cfg(strategy, 2, **kw)) is overlapped


def test_mean_staleness_counts_missing_fields_as_zero_and_nothing_as_nan():
    assert mean_staleness([{"pushes_applied": 2, "staleness_sum_versions": 3}, {}]) == 1.5
    two = [{"pushes_applied": 2, "staleness_sum_versions": 4}, {"pushes_applied": 2}]
    assert mean_staleness(two) == 1
    assert math.isnan(mean_staleness([{"pushes_applied": 0, "staleness_sum_versions": 0}]))
    assert math.isnan(mean_staleness([]))
