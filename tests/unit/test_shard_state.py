"""A parameter-server shard (:class:`ShardState`), pinned exactly: its version clock, staleness,
drops, rejections, counters and histograms; the update rules; the staleness compensators; Delayed
Nesterov's default; ``set_theta``; and its checkpoints (bit for bit; older ones load)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from cloudburst.comm.messages import Status
from cloudburst.strategies.asgd.compensation import make_compensator
from cloudburst.strategies.asgd.settings import COMPENSATIONS
from cloudburst.strategies.asgd.shard import (
    PushResult,
    ShardState,
    all_finite,
    overlapped_push_fetch,
)
from cloudburst.strategies.asgd.summary import mean_staleness
from cloudburst.strategies.async_diloco.rule import DelayedNesterov
from tests.support import same_state, shard_of, survivor_cfg

BETA = 0.95  # the documented β of DC-ASGD-a's mean square and gap-aware's mean step
EPS = 1e-7  # DC-ASGD-a's ε


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-6, atol: float = 0.0) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------- Compensator


@pytest.mark.parametrize("window, ring, clamped", [(0, [3], 1), (1, [3], 1), (2, [2, 3], 0)])
def test_the_ring_keeps_the_latest_max_1_window_thetas(window, ring, clamped):
    """A push against a version that left the ring reads its oldest θ, counted as clamped;
    ``updates`` counts every recorded push (dc too)."""
    comp = make_compensator("dc", _t(0.0), window, 0.25, 1.0)
    assert comp.window == max(1, window)
    for v in (1, 2, 3):
        comp.record(v, _t(float(v)))
    assert comp.state_dict()["ring_versions"] == ring
    assert torch.equal(comp.theta_then(2), _t(float(ring[0]))) and comp.clamped == clamped
    assert comp.updates == 3 and comp.state_dict()["updates"] == 3


def test_plain_dc_keeps_no_moment_while_adaptive_dc_and_gap_start_from_zeros():
    theta = _t(1.0, -2.0, 3.0)
    dc = make_compensator("dc", theta, 4, 0.25, 1.0)
    assert dc.moment is None and dc.state_dict()["moment"] is None
    for method in ("dc-adaptive", "gap"):
        comp = make_compensator(method, theta, 4, 0.25, 1.0)
        assert torch.equal(comp.moment, torch.zeros(3)) and comp.moment is not theta


def test_gaps_mean_push_is_the_first_push_then_its_running_mean_and_a_trial_leaves_it():
    """C = |Δ1|, then β·C + (1−β)·|Δ| of the worker's pushes (not the shard's λ-scaled step);
    ``commit=False`` leaves C alone; the ring holds copies of the recorded θ."""
    comp = make_compensator("gap", _t(0.0, 0.0), 8, 0.0, 1.0)
    mean, theta = None, _t(0.0, 0.0)
    for version, delta in enumerate([_t(1.0, -2.0), _t(0.5, 0.0), _t(-1.0, 4.0)], start=1):
        comp.compensate(delta, theta, version - 1)
        theta = theta + 0.25 * delta  # the shard's step (λ = 1/4) plays no part in C
        comp.record(version, theta)
        mean = delta.abs() if mean is None else BETA * mean + (1 - BETA) * delta.abs()
        assert comp.updates == version == comp.state_dict()["updates"]
        assert _close(comp.moment, mean)
    assert comp.state_dict()["ring_versions"] == [0, 1, 2, 3]
    before = comp.moment.clone()
    comp.compensate(_t(9.0, 9.0), theta, 3, commit=False)
    assert torch.equal(comp.moment, before)
    theta.fill_(99.0)
    assert torch.equal(comp.theta_then(3), _t(0.125, 0.5))


def test_dc_compensates_with_its_documented_formula():
    """DC-ASGD: g = −Δ/η, Δ̃ = −η·(g + λ·g⊙g⊙(θ_now − θ_then)); dyadic values, exact."""
    eta, lam = 0.5, 0.25
    comp = make_compensator("dc", _t(1.0, 2.0, -1.0), 4, lam, eta)
    comp.record(1, _t(1.5, 2.0, -2.0))
    theta_now, delta = _t(2.0, 0.0, -2.0), _t(0.5, -1.0, 0.25)
    g = -delta / eta
    for base, theta_then in [(0, _t(1.0, 2.0, -1.0)), (1, _t(1.5, 2.0, -2.0))]:
        expected = -eta * (g + lam * g * g * (theta_now - theta_then))
        assert torch.equal(comp.compensate(delta, theta_now, base), expected)


def test_adaptive_dc_updates_its_mean_square_first():
    """DC-ASGD-a: m ← β·m + (1−β)·g⊙g with this push's g, then λ = λ0/√(m + ε)."""
    eta, lam0 = 0.5, 0.25
    theta0, theta_now = _t(1.0, 2.0, -1.0), _t(2.0, 0.0, -2.0)
    comp = make_compensator("dc-adaptive", theta0, 4, lam0, eta)
    m = torch.zeros(3, dtype=torch.float64)
    for delta in (_t(0.5, -1.0, 0.25), _t(-0.25, 0.5, 2.0)):
        got = comp.compensate(delta, theta_now, 0)
        g = -delta.double() / eta
        m = BETA * m + (1 - BETA) * g * g
        expected = -eta * (g + lam0 / torch.sqrt(m + EPS) * g * g * (theta_now - theta0).double())
        assert _close(got, expected, atol=1e-7) and _close(comp.moment, m)


def test_gap_divides_by_one_plus_the_gap_over_the_mean_push():
    """Gap-aware: Δ̃ = Δ / (1 + |θ_now − θ_then| / C); G = 1 where C = 0."""
    comp = make_compensator("gap", _t(0.0, 0.0, 0.0), 4, 0.0, 1.0)
    first = _t(2.0, 4.0, 0.0)
    assert torch.equal(comp.compensate(first, _t(0.0, 0.0, 0.0), 0), first)  # no C yet: G = 1
    comp.record(1, _t(0.5, 1.0, 0.0))  # C = |first push| = (2, 4, 0)
    # against version 0: gap (4, 0, 8) over C (2, 4, 0) -> G = (3, 1, 1)
    got = comp.compensate(_t(1.0, 3.0, 5.0), _t(4.0, 0.0, 8.0), 0)
    assert torch.equal(got, _t(1.0 / 3.0, 3.0, 5.0))


def test_a_compensator_refuses_a_ring_with_fewer_thetas_than_versions():
    comp = make_compensator("dc", _t(0.0, 0.0), 8, 0.25, 1.0)
    for v in (1, 2):
        comp.record(v, _t(float(v), float(v)))
    state = comp.state_dict()
    state["ring"] = state["ring"][1:]  # versions 0, 1, 2 with two θ: not paired up wrong
    with pytest.raises(ValueError):
        comp.load_state_dict(state)


def test_a_compensator_loads_a_longer_ring_into_a_shorter_window_keeping_the_latest():
    """Its last versions, each with its own θ, copied (not shared with the saved state)."""
    big = make_compensator("gap", _t(0.0), 5, 0.0, 1.0)
    for v in (1, 2, 3, 4):
        big.record(v, _t(float(10 * v)))
    state = big.state_dict()
    small = make_compensator("gap", _t(7.0), 2, 0.0, 1.0)
    small.load_state_dict(state)
    assert small.state_dict()["ring_versions"] == [3, 4]
    assert torch.equal(small.theta_then(3), _t(30.0)) and torch.equal(small.theta_then(4), _t(40.0))
    assert torch.equal(small.moment, big.moment) and small.updates == 4
    small.record(5, _t(50.0))  # reuses the popped buffer: the saved state must not change
    assert torch.equal(state["ring"], torch.stack([_t(float(10 * v)) for v in range(5)]))


def test_delayed_nesterov_defaults_to_the_papers_rule_c_zero():
    """Between momentum updates plain SGD of lr η/N; at the N-th push θ ← θ − η·β·m − (η/N)·g.
    N = 2, η = β = 1/2: exact."""
    param = _t(1.0, -1.0)
    dn = DelayedNesterov(param, lr=0.5, beta=0.5, period=2)
    assert dn.c == 0.0
    g1, g2, g3 = _t(1.0, 2.0), _t(3.0, -2.0), _t(4.0, 8.0)
    theta = _t(1.0, -1.0) - 0.25 * g1
    dn.step(g1)
    assert torch.equal(param, theta)
    dn.step(g2)
    theta = theta - 0.5 * 0.5 * (g1 + g2) / 2 - 0.25 * g2
    assert torch.equal(param, theta)
    dn.step(g3)  # momentum is non-zero now; c = 0 applies none of it between updates
    assert torch.equal(param, theta - 0.25 * g3)


# ------------------------------------------------------------------------------- ShardState


def _wrong_compensator_state():
    state = _shard(torch.ones(4), "add", "dc").state_dict()
    _shard(torch.ones(4), "add", "gap").load_state_dict(state)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ShardState(_t(0.0), compensation="bogus"),
         "^unknown staleness compensation 'bogus'$"),
        (lambda: make_compensator("scale", _t(0.0), 4, 0.1, 1.0),
         "^'scale' is not a per-coordinate compensator$"),
        (lambda: ShardState(_t(0.0, 0.0), rule="avg"), "unknown server rule 'avg'"),
        (lambda: ShardState(_t(0.0, 0.0)).apply_push(_t(0.0, 0.0), base_version=1),
         "push against version 1, shard is at 0"),
        (lambda: ShardState(_t(0.0, 0.0)).apply_push(_t(0.0, 0.0, 0.0), base_version=0),
         r"push of shape \(3,\) for shard \(2,\)"),
        (_wrong_compensator_state, "^compensator state of 'dc', not 'gap'$"),
    ],
)  # fmt: skip
def test_what_a_shard_cannot_take_is_an_error_naming_it(make, message):
    """An unknown compensation or rule, a scalar compensation as a per-coordinate one, a push
    from the future or of another shape, another compensator's state."""
    with pytest.raises(ValueError, match=message):
        make()


def test_a_shards_compensation_defaults():
    """delay-adaptive with the default τ_C = 1: pushes at τ = 0 and 1 apply whole, τ = 2 half."""
    shard = ShardState(_t(0.0), compensation="delay-adaptive")
    _run(shard, [(_t(1.0), 0), (_t(2.0), 1), (_t(4.0), 2)])  # θ = 1, 3, then 3 + 4/2
    assert torch.equal(shard.theta, _t(5.0))
    # dc: Δ̃ = Δ − λ·Δ²·(θ_now − θ_then)/η with λ = 0.04, η = 1
    shard = ShardState(_t(0.0), compensation="dc")
    assert shard.staleness_scaling is False
    _run(shard, [(_t(1.0), 0), (_t(2.0), 1)])  # θ = 1 (τ = 0), then Δ̃ = 2 − 0.04·4·(1 − 0)
    assert shard.theta.item() == pytest.approx(2.84, rel=1e-6)
    # R = 16: θ after versions 0..15 is kept; once the 16th push is recorded, version 0 has
    # left the ring and a push against it is clamped (counted in ``stats``).
    shard = ShardState(_t(0.0), compensation="dc")
    _run(shard, [(_t(0.0), 0)] * 15 + [(_t(0.0), 15)])  # the last against version 0 at 15
    assert shard.stats()["compensation_clamped"] == 0
    _run(shard, [(_t(0.0), 16)])  # against version 0 at 16: the ring holds versions 1..16
    assert shard.stats()["compensation_clamped"] == 1


def _assert_the_ring_restarts_at(shard: ShardState, version: int, theta: torch.Tensor, d1, d2):
    """The ring holds ``theta`` alone, as ``version``: a push ``d1`` against that version sees
    no gap (Δ̃ = Δ), and the next one's (``d2``) θ_then is ``theta`` (dc, λ = 1/4, η = 1/2)."""
    eta, lam = 0.5, 0.25
    state = shard.compensator.state_dict()
    assert state["ring_versions"] == [version]
    assert torch.equal(state["ring"], theta[None])
    assert shard.apply_push(d1, version) == PushResult(Status.OK, 0)
    theta1 = theta + d1
    assert torch.equal(shard.theta, theta1)
    assert shard.apply_push(d2, version) == PushResult(Status.OK, 1)
    g = -d2 / eta
    assert torch.equal(shard.theta, theta1 + -eta * (g + lam * g * g * (theta1 - theta)))
    assert shard.compensator.clamped == 0


def test_set_theta_copies_theta_keeps_the_clock_and_restarts_the_ring_there():
    shard = ShardState(_t(0.0, 0.0), compensation="dc", dc_lambda=0.25, local_lr=0.5)
    shard.apply_push(_t(1.0, 1.0), 0)
    shard.apply_push(_t(1.0, -1.0), 1)
    source = _t(4.0, -2.0)
    shard.set_theta(source)
    source.fill_(0.0)  # a copy, not the caller's tensor
    assert torch.equal(shard.theta, _t(4.0, -2.0)) and shard.version == 2
    _assert_the_ring_restarts_at(shard, 2, _t(4.0, -2.0), _t(0.5, -0.25), _t(-1.0, 0.5))


def test_apply_push_takes_the_callers_finiteness_verdict():
    """Given ``finite``, its verdict decides unchecked: a push called non-finite is rejected,
    one called finite is not (though refused when θ + Δ would not be finite)."""
    shard = ShardState(_t(0.0, 0.0, 0.0))
    assert shard.apply_push(_t(1.0, 2.0, 3.0), 0, finite=False) == PushResult(Status.REJECTED, 0)
    assert shard.rejected_nonfinite == 1 and shard.version == 0
    assert torch.equal(shard.theta, torch.zeros(3))
    assert shard.apply_push(_t(1.0, 2.0, 3.0), 0, finite=True) == PushResult(Status.OK, 0)
    assert torch.equal(shard.theta, _t(1.0, 2.0, 3.0))
    inf = _t(float("inf"), 0.0, 0.0)
    assert shard.apply_push(inf, 1, finite=True) == PushResult(Status.REFUSED, 0)
    assert shard.rejected_nonfinite == 1 and shard.refused == 1
    assert shard.apply_push(inf, 1) == PushResult(Status.REJECTED, 0)
    assert shard.rejected_nonfinite == 2 and shard.version == 1
    assert torch.equal(shard.theta, _t(1.0, 2.0, 3.0))


def _script(n: int, numel: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """n pushes as (Δ, staleness): stalenesses up to 5, past a window of 3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tau = int(torch.randint(0, 6, (1,), generator=g)) if i else 0
        out.append((torch.randn(numel, generator=g) * 0.1, tau))
    return out


def _run(shard: ShardState, script) -> None:
    for delta, tau in script:
        assert shard.apply_push(delta, max(0, shard.version - tau), samples=2).status == Status.OK


def _shard(theta, rule: str, compensation: str) -> ShardState:
    return shard_of(theta, rule=rule, lr=0.3, momentum=0.5, compensation=compensation,
                    dc_lambda=0.5, compensation_window=3, local_lr=0.1, dn_period=3, dn_c=0.25,
                    delay_threshold=2)  # fmt: skip


@pytest.mark.parametrize("rule", ["add", "sgd", "adagrad", "dn"])
@pytest.mark.parametrize("compensation", ["none", "scale", "dc", "dc-adaptive", "gap"])
def test_a_restored_shard_continues_bit_for_bit(rule, compensation):
    """Saved, torch.save-d and loaded into a shard of another θ, a shard continues as the live
    one, state and all; the saved state is a snapshot that later pushes leave unchanged."""
    before, after = _script(13, 6, seed=1), _script(8, 6, seed=2)  # 13: mid-period for dn
    live = _shard(torch.randn(6, generator=torch.Generator().manual_seed(0)), rule, compensation)
    _run(live, before)
    state = live.state_dict()
    snapshot = copy.deepcopy(state)
    restored = _shard(torch.zeros(6), rule, compensation)
    buf = io.BytesIO()
    torch.save(state, buf)
    restored.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    assert same_state(restored.state_dict(), snapshot)
    _run(live, after)
    _run(restored, after)
    assert torch.equal(restored.theta, live.theta)
    assert same_state(restored.state_dict(), live.state_dict())
    assert same_state(state, snapshot)


def test_a_checkpoint_from_before_a_key_existed_loads():
    """Old ``staleness_sum``/``staleness_max`` spellings load (the new wins where both are);
    missing histograms load empty, ``refused_pushes`` as 0; refusals survive a checkpoint."""
    live = ShardState(_t(0.0), max_push_ratio=1.0)
    for base in (0, 0, 0, 1):
        live.apply_push(_t(1.0), base)
    assert live.apply_push(_t(1e3), 4).status == Status.REFUSED
    state = live.state_dict()
    assert (state["staleness_sum_versions"], state["staleness_max_versions"]) == (5, 2)
    restored = ShardState(_t(0.0), max_push_ratio=1.0)
    restored.load_state_dict(state)
    assert restored.refused == 1
    old = dict(state, staleness_sum=5, staleness_max=2)
    del old["staleness_sum_versions"], old["staleness_max_versions"], old["refused_pushes"]
    del old["staleness_histogram_versions"], old["push_scale_histogram"]
    restored.staleness_hist, restored.scale_hist = {7: 1}, {0.5: 1}
    restored.load_state_dict(old)
    assert (restored.staleness_sum, restored.staleness_max, restored.refused) == (5, 2, 0)
    assert restored.staleness_hist == {} and restored.scale_hist == {}
    assert restored.version == 4 and torch.equal(restored.theta, _t(4.0))
    restored.apply_push(_t(1.0), 3)
    assert restored.staleness_hist == {1: 1} and restored.scale_hist == {1.0: 1}
    restored.load_state_dict(dict(state, staleness_sum=100, staleness_max=100))
    assert (restored.staleness_sum, restored.staleness_max) == (5, 2)


@pytest.mark.parametrize("saved", ["none", "missing"])
def test_a_checkpoint_without_compensation_starts_the_ring_at_its_version(saved):
    """A checkpoint whose ``compensator`` is None or absent, loaded into a dc shard: the ring
    holds the loaded θ alone, as the loaded version, and the next pushes compensate against it."""
    plain = ShardState(_t(0.0, 0.0))
    plain.apply_push(_t(1.0, 2.0), 0)
    plain.apply_push(_t(1.0, -4.0), 1)
    state = plain.state_dict()
    assert state["compensator"] is None
    if saved == "missing":
        del state["compensator"]
    shard = ShardState(_t(9.0, 9.0), compensation="dc", dc_lambda=0.25, local_lr=0.5)
    shard.load_state_dict(state)
    _assert_the_ring_restarts_at(shard, 2, _t(2.0, -2.0), _t(0.5, 0.25), _t(-0.5, 1.0))


# ------------------------------------------------------------- the version clock and the rules
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
    "kw, theta, scales, scaling",
    [
        ({}, 2.5, {"1.0": 5}, False),
        (dict(staleness_scaling=True), 2.125, {"0.25": 1, "1.0": 4}, True),
        (dict(compensation="scale"), 2.125, {"0.25": 1, "1.0": 4}, True),
        (dict(compensation="delay-adaptive"), 2.125, {"0.25": 1, "1.0": 4}, False),  # τ_C = 1
    ],
)
def test_staleness_is_counted_exactly_and_scale_divides_the_push_by_it(kw, theta, scales, scaling):
    """θ ← θ + λ·s·Δ with s = 1/max(1, τ) under scale (by name or flag; ``staleness_scaling``
    says so), else 1; samples, staleness sum, max and mean, and both histograms, exact."""
    shard = ShardState(torch.zeros(1), lr=0.5, **kw)
    assert shard.staleness_scaling is scaling
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
    half = torch.tensor([1.5, 2.5], dtype=torch.float16)
    for theta in (half, half.double().requires_grad_()):
        shard = ShardState(theta)
        assert shard.theta.dtype == torch.float32 and shard.theta.tolist() == [1.5, 2.5]
        assert shard.param.requires_grad is False


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
