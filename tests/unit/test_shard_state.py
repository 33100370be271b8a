"""A parameter-server shard's state, pinned exactly: the staleness compensators (ring, moments,
counters, formulas), Delayed Nesterov's default, the shard's compensation defaults and
refusals, ``set_theta``, ``apply_push``'s finiteness verdict and ``state_dict``/
``load_state_dict`` (bit for bit; older checkpoints load). References in plain PyTorch, most
with dyadic values (exact floats)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from cloudburst.comm.messages import Status
from cloudburst.strategies.asgd.compensation import make_compensator
from cloudburst.strategies.asgd.shard import PushResult, ShardState
from cloudburst.strategies.async_diloco.rule import DelayedNesterov
from tests.helpers import shard_of
from tests.support import same_state

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


def test_staleness_scaling_says_whether_the_compensation_is_scale():
    """True exactly for ``scale``, asked for by name or by the flag."""
    assert ShardState(_t(0.0)).staleness_scaling is False
    assert ShardState(_t(0.0), staleness_scaling=True).staleness_scaling is True
    assert ShardState(_t(0.0), compensation="scale").staleness_scaling is True
    assert ShardState(_t(0.0), compensation="delay-adaptive").staleness_scaling is False
    assert ShardState(_t(0.0), compensation="dc").staleness_scaling is False


def test_a_shards_compensation_defaults():
    """delay-adaptive with the default τ_C = 1: pushes at τ = 0 and 1 apply whole, τ = 2 half."""
    shard = ShardState(_t(0.0), compensation="delay-adaptive")
    _run(shard, [(_t(1.0), 0), (_t(2.0), 1), (_t(4.0), 2)])  # θ = 1, 3, then 3 + 4/2
    assert torch.equal(shard.theta, _t(5.0))
    # dc: Δ̃ = Δ − λ·Δ²·(θ_now − θ_then)/η with λ = 0.04, η = 1
    shard = ShardState(_t(0.0), compensation="dc")
    _run(shard, [(_t(1.0), 0)])  # τ = 0: no gap, applied as is: θ = 1
    _run(shard, [(_t(2.0), 1)])  # τ = 1: θ_then = 0, Δ̃ = 2 − 0.04·4·1 = 1.84
    assert shard.theta.item() == pytest.approx(2.84, rel=1e-6)
    # R = 16: θ after versions 0..15 is kept; once the 16th push is recorded, version 0 has
    # left the ring and a push against it is clamped (counted in ``stats``).
    shard = ShardState(_t(0.0), compensation="dc")
    _run(shard, [(_t(0.0), 0)] * 15)
    _run(shard, [(_t(0.0), 15)])  # against version 0 at 15: the ring holds versions 0..15
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
        base = max(0, shard.version - tau)
        assert shard.apply_push(delta, base, samples=2).status == Status.OK


def _shard(theta, rule: str, compensation: str) -> ShardState:
    return shard_of(theta, rule=rule, lr=0.3, momentum=0.5, compensation=compensation,
                    dc_lambda=0.5, compensation_window=3, local_lr=0.1, dn_period=3, dn_c=0.25,
                    delay_threshold=2)  # fmt: skip


@pytest.mark.parametrize("rule", ["add", "sgd", "adagrad", "dn"])
@pytest.mark.parametrize("compensation", ["none", "scale", "dc", "dc-adaptive", "gap"])
def test_a_restored_shard_continues_bit_for_bit(rule, compensation):
    """state_dict → torch.save → load_state_dict into a shard of another θ: the same state, θ,
    counters, histograms and compensator state after further pushes as the uninterrupted
    shard; the saved state is a snapshot that later pushes leave unchanged."""
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
    """The old ``staleness_sum``/``staleness_max`` spellings load (the new one wins where both
    are); missing histograms load empty and a missing ``refused_pushes`` as 0, and the shard
    counts on from there; refusals survive a checkpoint."""
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
