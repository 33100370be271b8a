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
from cloudburst.strategies.asgd.summary import mean_staleness
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


@pytest.mark.parametrize(
    "kw, theta, scales",
    [
        ({}, 2.5, {"1.0": 5}),
        (dict(staleness_scaling=True), 2.125, {"0.25": 1, "1.0": 4}),
        (dict(compensation="scale"), 2.125, {"0.25": 1, "1.0": 4}),
    ],
)
def test_staleness_is_counted_exactly_and_scale_divides_the_push_by_it(kw, theta, scales):
    """θ ← θ + λ·s·Δ with s = 1/max(1, τ) under scale (by name or flag), else 1; samples,
    staleness sum, max and mean, and both histograms, exact."""
    shard = ShardState(torch.zeros(1), lr=0.5, **kw)
    assert play(shard, torch.ones(1)) == [(Status.OK, s) for s in (0, 1, 0, 1, 4)]
    assert torch.equal(shard.theta, torch.tensor([theta]))  # scales 1, 1, 1, 1, 1/4 times λ
    assert (shard.version, shard.samples, shard.staleness_sum, shard.staleness_max) == (5, 50, 6, 4)
    assert mean_staleness([shard.stats()]) == pytest.approx(6 / 5)
    assert shard.stats()["staleness_histogram_versions"] == {"0": 2, "1": 2, "4": 1}
    assert shard.stats()["push_scale_histogram"] == scales


def test_a_push_staler_than_max_staleness_is_dropped_and_a_non_finite_one_rejected_first():
    """Neither moves θ or the version; each reports its staleness and is counted."""
    shard = ShardState(torch.zeros(2), max_staleness=1)
    for version in range(3):
        shard.apply_push(torch.ones(2), version)
    assert shard.apply_push(torch.tensor([math.nan, 0.0]), 1) == PushResult(Status.REJECTED, 2)
    assert shard.apply_push(torch.ones(2), 0) == PushResult(Status.STALE_DROPPED, 3)
    assert shard.apply_push(torch.ones(2), 1) == PushResult(Status.STALE_DROPPED, 2)
    assert shard.apply_push(torch.ones(2), 2) == PushResult(Status.OK, 1)  # τ = max: applied
    assert (shard.dropped_stale, shard.rejected_nonfinite, shard.version) == (2, 1, 4)
    assert torch.equal(shard.theta, torch.full((2,), 4.0))


@pytest.mark.parametrize("rule", ["add", "elastic"])
def test_non_finite_push_is_rejected_and_counted(rule):
    shard = shard_of(torch.zeros(2), rule=rule)
    r = shard.apply_push(torch.tensor([1.0, float("nan")]), 0)
    assert r.status == Status.REJECTED and shard.rejected_nonfinite == 1
    assert shard.version == 0 and torch.equal(shard.theta, torch.zeros(2))
    r = shard.apply_push(torch.tensor([float("inf"), 0.0]), 0)
    assert r.status == Status.REJECTED and shard.rejected_nonfinite == 2


@pytest.mark.parametrize("rule, kw", [("sgd", dict(momentum=0.5)), ("sgd", {}), ("adagrad", {})])
def test_the_optimizer_rules_step_on_minus_delta_unscaled_by_staleness(rule, kw):
    """sgd: momentum SGD (momentum 0 unless asked), adagrad: Adagrad (ε = 1e-10), each on the
    gradient −Δ of every push whatever its staleness; dyadic pushes: sgd exact."""
    lr, mu, gen = 0.5, kw.get("momentum", 0.0), torch.Generator().manual_seed(0)
    shard = ShardState(torch.ones(4), rule=rule, lr=lr, **kw)
    theta, buf, acc = torch.ones(4), torch.zeros(4), torch.zeros(4)
    for i, base in enumerate([0, 0, 1, 3, 2]):
        d = torch.randint(-8, 9, (4,), generator=gen) / 4
        assert shard.apply_push(d, base).staleness == i - base
        buf, acc = mu * buf - d, acc + d * d
        theta = theta - lr * buf if rule == "sgd" else theta + lr * d / (acc.sqrt() + 1e-10)
    if rule == "sgd":
        assert torch.equal(shard.theta, theta)
    torch.testing.assert_close(shard.theta, theta)


def test_a_push_whose_sum_overflows_is_finite_and_applied():
    big = torch.tensor([3e38, 3e38])  # finite, but its sum is not
    assert all_finite(big)
    assert not all_finite(torch.tensor([3e38, float("inf")]))
    shard = ShardState(torch.zeros(2))
    assert shard.apply_push(big, 0) == PushResult(Status.OK, 0)
    assert torch.equal(shard.theta, big)


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
    assert shard.stats() == dict(
        version=0, samples=0, pushes_applied=0, staleness_sum_versions=0, staleness_max_versions=0,
        dropped_stale=0, rejected_nonfinite=0, refused_pushes=0, staleness_compensation="none",
        staleness_histogram_versions={}, push_scale_histogram={}, compensation_clamped=0,
    )  # fmt: skip
    shard.apply_push(torch.ones(2), 0)
    stats = shard.stats()
    assert stats["samples"] == 0 and stats["staleness_max_versions"] == 0
    assert stats["staleness_histogram_versions"] == {"0": 1}


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


OVERLAPPED = [
    ("asgd", dict(server_rule="add"), True),
    ("asgd", dict(server_rule="sgd"), False),
    ("asgd", dict(server_rule="adagrad"), False),
    ("easgd", dict(server_rule="add"), True),
] + [  # a per-coordinate compensator needs θ_now at the apply: no overlapped reply
    ("asgd", dict(staleness_compensation=m), o)
    for m, o in zip(COMPENSATIONS, [True, True, False, False, False, True], strict=True)
]


@pytest.mark.parametrize("strategy, kw, overlapped", OVERLAPPED)
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
