"""The parameter-server shard's rules and version clock, with no processes."""

import pytest
import torch

from cloudburst.comm.messages import Status
from cloudburst.strategies.asgd.shard import ShardState
from cloudburst.strategies.asgd.summary import mean_staleness

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


def test_exact_staleness_accounting():
    shard = ShardState(torch.zeros(3))
    results = play(shard, torch.ones(3))
    assert [s for _, s in results] == [0, 1, 0, 1, 4]
    assert all(status == Status.OK for status, _ in results)
    assert shard.version == 5 and shard.samples == 50
    assert shard.staleness_sum == 6 and shard.staleness_max == 4
    assert mean_staleness([shard.stats()]) == pytest.approx(6 / 5)
    assert torch.equal(shard.theta, torch.full((3,), 5.0))  # add rule, λ = 1: θ = Σ Δ


def test_max_staleness_drops_old_pushes():
    shard = ShardState(torch.zeros(2), max_staleness=2)
    results = play(shard, torch.ones(2))
    assert results[-1] == (Status.STALE_DROPPED, 4)
    assert shard.version == 4 and shard.dropped_stale == 1
    assert torch.equal(shard.theta, torch.full((2,), 4.0))


def test_staleness_scaling_divides_by_staleness():
    shard = ShardState(torch.zeros(1), staleness_scaling=True, lr=0.5)
    play(shard, torch.ones(1))
    # staleness 0,1,0,1,4 -> scales 1,1,1,1,1/4; times λ = 0.5
    assert shard.theta.item() == pytest.approx(0.5 * (4 + 0.25))


def test_non_finite_push_is_rejected_and_counted():
    shard = ShardState(torch.zeros(2))
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


def test_state_dict_round_trip():
    shard = ShardState(torch.zeros(3), rule="sgd", lr=0.1, momentum=0.5)
    play(shard, torch.ones(3))
    again = ShardState(torch.zeros(3), rule="sgd", lr=0.1, momentum=0.5)
    again.load_state_dict(shard.state_dict())
    assert again.stats() == shard.stats()
    d = torch.randn(3)
    shard.apply_push(d, shard.version)
    again.apply_push(d, again.version)
    torch.testing.assert_close(again.theta, shard.theta)


# α of the add rule for a push of staleness 2, by hand: λ, or λ/2 with staleness scaling.
@pytest.mark.parametrize(
    "lr, scaling, alpha", [(1.0, False, 1.0), (0.25, False, 0.25), (0.7, True, 0.35)]
)
def test_worker_rebuilds_the_servers_theta_bit_for_bit(lr, scaling, alpha):
    # The overlapped PUSH_FETCH: the reply carries θ before the push; the worker adds its own
    # Δ with add_rule_alpha and must get exactly the θ the server holds after applying it.
    from cloudburst.strategies.asgd.compensation import add_rule_alpha

    g = torch.Generator().manual_seed(0)
    shard = ShardState(torch.randn(1000, generator=g), lr=lr, staleness_scaling=scaling)
    for _ in range(3):
        shard.apply_push(torch.randn(1000, generator=g), 0)  # make later pushes stale
    before = shard.theta.clone()
    delta = torch.randn(1000, generator=g) * 1e-3
    result = shard.apply_push(delta, base_version=1)
    assert result.staleness == 2 and add_rule_alpha(lr, 2, scaling) == alpha
    # the server: θ + αΔ, by hand (to float32 rounding: add_ may fuse the multiply-add)
    torch.testing.assert_close(shard.theta, before + alpha * delta, rtol=0, atol=1e-6)
    assert not torch.allclose(shard.theta, before + 2 * alpha * delta, rtol=0, atol=1e-6)
    rebuilt = before.clone().add_(delta, alpha=add_rule_alpha(lr, result.staleness, scaling))
    assert torch.equal(rebuilt, shard.theta)  # the worker's rebuild, bit for bit
    assert add_rule_alpha(0.7, 0, True) == 0.7 and add_rule_alpha(0.7, 4, True) == 0.175
