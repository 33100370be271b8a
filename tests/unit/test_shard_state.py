"""A parameter-server shard's state, pinned exactly: the staleness compensators' ring, moments
and counters (``make_compensator``), Delayed Nesterov's default, the shard's compensation
defaults and refusals, ``set_theta``, the caller's finiteness verdict in ``apply_push``, and
``state_dict``/``load_state_dict`` (a restored shard behaves bit for bit as the uninterrupted
one; older and compensation-free checkpoints load; a mismatched state is refused). The
references are written out here in plain PyTorch, most with dyadic values (exact floats)."""

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

BETA = 0.95  # the documented β of DC-ASGD-a's mean square and gap-aware's mean step
EPS = 1e-7  # DC-ASGD-a's ε


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-6, atol: float = 0.0) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)


def _same(a, b) -> bool:
    """Deep, bit-exact equality of state dicts (tensors by value, dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------------------- Compensator


@pytest.mark.parametrize("window", [0, 1])
def test_a_window_of_one_keeps_only_the_latest_theta(window):
    """The ring holds max(1, window) versions: with one, a push against the version before
    the latest reads the latest θ and is counted as clamped."""
    comp = make_compensator("dc", _t(0.0, 0.0), window, 0.25, 1.0)
    assert comp.window == 1
    comp.record(1, _t(1.0, 2.0))
    comp.record(2, _t(3.0, 4.0))
    assert comp.state_dict()["ring_versions"] == [2]
    assert torch.equal(comp.theta_then(1), _t(3.0, 4.0))
    assert comp.clamped == 1


def test_a_window_of_two_keeps_the_two_latest_thetas():
    comp = make_compensator("dc", _t(0.0), 2, 0.25, 1.0)
    for v in (1, 2, 3):
        comp.record(v, _t(float(v)))
    assert comp.state_dict()["ring_versions"] == [2, 3]
    assert torch.equal(comp.theta_then(2), _t(2.0)) and comp.clamped == 0
    assert comp.updates == 3 and comp.state_dict()["updates"] == 3  # dc counts pushes too


def test_plain_dc_keeps_no_moment_while_adaptive_dc_and_gap_start_from_zeros():
    """DC-ASGD with a fixed λ has no running mean: none is kept or saved (a state from it loads
    into another dc shard without one); dc-adaptive and gap start theirs at zero."""
    theta = _t(1.0, -2.0, 3.0)
    dc = make_compensator("dc", theta, 4, 0.25, 1.0)
    assert dc.moment is None and dc.state_dict()["moment"] is None
    for method in ("dc-adaptive", "gap"):
        comp = make_compensator(method, theta, 4, 0.25, 1.0)
        assert torch.equal(comp.moment, torch.zeros(3)) and comp.moment is not theta


def test_record_counts_every_applied_push_and_gap_keeps_the_running_mean_push():
    """``updates`` counts the recorded pushes; gap's C starts at the first push's |Δ| and then
    is the running mean β·C + (1−β)·|Δ| of the pushes judged so far (a worker's update, not
    the shard's λ-scaled step)."""
    comp = make_compensator("gap", _t(0.0, 0.0), 8, 0.0, 1.0)
    pushes = [_t(1.0, -2.0), _t(0.5, 0.0), _t(-1.0, 4.0)]
    mean, theta = None, _t(0.0, 0.0)
    for version, delta in enumerate(pushes, start=1):
        comp.compensate(delta, theta, version - 1)
        theta = theta + 0.25 * delta  # the shard's step (λ = 1/4) plays no part in C
        comp.record(version, theta)
        mean = delta.abs() if mean is None else BETA * mean + (1 - BETA) * delta.abs()
        assert comp.updates == version
        assert comp.state_dict()["updates"] == version
        assert _close(comp.moment, mean)
    assert comp.state_dict()["ring_versions"] == [0, 1, 2, 3]
    # a trial (commit=False) leaves C alone
    before = comp.moment.clone()
    comp.compensate(_t(9.0, 9.0), theta, 3, commit=False)
    assert torch.equal(comp.moment, before)
    # the ring holds copies: changing a recorded tensor afterwards does not reach it
    theta.fill_(99.0)
    assert torch.equal(comp.theta_then(3), _t(0.125, 0.5))


def test_dc_compensates_with_its_documented_formula():
    """DC-ASGD: g = −Δ/η, Δ̃ = −η·(g + λ·g⊙g⊙(θ_now − θ_then)); dyadic values, exact."""
    eta, lam = 0.5, 0.25
    comp = make_compensator("dc", _t(1.0, 2.0, -1.0), 4, lam, eta)
    comp.record(1, _t(1.5, 2.0, -2.0))
    theta_now = _t(2.0, 0.0, -2.0)
    delta = _t(0.5, -1.0, 0.25)
    g = -delta / eta
    expected = -eta * (g + lam * g * g * (theta_now - _t(1.0, 2.0, -1.0)))
    assert torch.equal(comp.compensate(delta, theta_now, 0), expected)
    g1 = -delta / eta  # against version 1: θ_then is the recorded θ
    expected1 = -eta * (g1 + lam * g1 * g1 * (theta_now - _t(1.5, 2.0, -2.0)))
    assert torch.equal(comp.compensate(delta, theta_now, 1), expected1)


def test_adaptive_dc_updates_its_mean_square_first():
    """DC-ASGD-a: m ← β·m + (1−β)·g⊙g with this push's g, then λ = λ0/√(m + ε)."""
    eta, lam0 = 0.5, 0.25
    theta0 = _t(1.0, 2.0, -1.0)
    comp = make_compensator("dc-adaptive", theta0, 4, lam0, eta)
    theta_now = _t(2.0, 0.0, -2.0)
    m = torch.zeros(3, dtype=torch.float64)
    for delta in (_t(0.5, -1.0, 0.25), _t(-0.25, 0.5, 2.0)):
        got = comp.compensate(delta, theta_now, 0)
        g = -delta.double() / eta
        m = BETA * m + (1 - BETA) * g * g
        lam = lam0 / torch.sqrt(m + EPS)
        expected = -eta * (g + lam * g * g * (theta_now - theta0).double())
        assert _close(got, expected, atol=1e-7)
        assert _close(comp.moment, m)


def test_gap_divides_by_one_plus_the_gap_over_the_mean_push():
    """Gap-aware: Δ̃ = Δ / (1 + |θ_now − θ_then| / C); G = 1 where C = 0."""
    comp = make_compensator("gap", _t(0.0, 0.0, 0.0), 4, 0.0, 1.0)
    first = _t(2.0, 4.0, 0.0)
    assert torch.equal(comp.compensate(first, _t(0.0, 0.0, 0.0), 0), first)  # no C yet: G = 1
    comp.record(1, _t(0.5, 1.0, 0.0))  # C = |first push| = (2, 4, 0)
    theta_now = _t(4.0, 0.0, 8.0)
    delta = _t(1.0, 3.0, 5.0)
    # against version 0: gap (4, 0, 8) over C (2, 4, 0) -> G = (3, 1, 1)
    assert torch.equal(comp.compensate(delta, theta_now, 0), _t(1.0 / 3.0, 3.0, 5.0))


def test_a_compensator_refuses_a_ring_with_fewer_thetas_than_versions():
    """Each ring version needs its θ: a state whose ring is short of its version list is an
    error, not a ring silently paired up wrong."""
    comp = make_compensator("dc", _t(0.0, 0.0), 8, 0.25, 1.0)
    state = {
        "method": "dc",
        "ring_versions": [3, 4, 5],
        "ring": torch.stack([_t(1.0, 1.0), _t(2.0, 2.0)]),
        "moment": None,
        "updates": 5,
        "clamped": 0,
    }
    with pytest.raises(ValueError):
        comp.load_state_dict(state)


def test_a_compensator_loads_a_longer_ring_into_a_shorter_window_keeping_the_latest():
    """A ring saved with a larger window loads into a smaller one: its last versions, each
    with its own θ (copied, not shared with the state)."""
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


# --------------------------------------------------------------------------- DelayedNesterov


def test_delayed_nesterov_defaults_to_the_papers_rule_c_zero():
    """Without ``c``: between momentum updates plain SGD of lr η/N, and at the N-th push
    θ ← θ − η·β·m − (η/N)·g (c = 0). N = 2, η = β = 1/2: exact."""
    param = _t(1.0, -1.0)
    dn = DelayedNesterov(param, lr=0.5, beta=0.5, period=2)
    assert dn.c == 0.0
    g1, g2, g3 = _t(1.0, 2.0), _t(3.0, -2.0), _t(4.0, 8.0)
    theta = _t(1.0, -1.0)
    dn.step(g1)
    theta = theta - 0.25 * g1
    assert torch.equal(param, theta)
    dn.step(g2)
    m = (g1 + g2) / 2
    theta = theta - 0.5 * 0.5 * m - 0.25 * g2
    assert torch.equal(param, theta)
    dn.step(g3)  # momentum is non-zero now; c = 0 applies none of it between updates
    theta = theta - 0.25 * g3
    assert torch.equal(param, theta)


# ------------------------------------------------------------------------------- ShardState


def test_an_unknown_or_scalar_compensation_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^unknown staleness compensation 'bogus'$"):
        ShardState(_t(0.0), compensation="bogus")
    # only dc, dc-adaptive and gap keep per-coordinate state
    with pytest.raises(ValueError, match=r"^'scale' is not a per-coordinate compensator$"):
        make_compensator("scale", torch.zeros(2), 4, 0.1, 1.0)


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


def test_set_theta_replaces_theta_without_advancing_the_clock():
    shard = ShardState(_t(0.0, 0.0))
    shard.apply_push(_t(1.0, 1.0), 0)
    source = _t(5.0, -3.0)
    shard.set_theta(source)
    assert torch.equal(shard.theta, _t(5.0, -3.0)) and shard.version == 1
    source.fill_(0.0)  # a copy, not the caller's tensor
    assert torch.equal(shard.theta, _t(5.0, -3.0))


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


def test_set_theta_restarts_the_compensators_ring_at_the_current_version():
    """After a warm start the ring holds the new θ alone, as the current version."""
    shard = ShardState(_t(0.0, 0.0), compensation="dc", dc_lambda=0.25, local_lr=0.5)
    shard.apply_push(_t(1.0, 1.0), 0)
    shard.apply_push(_t(1.0, -1.0), 1)
    shard.set_theta(_t(4.0, -2.0))
    _assert_the_ring_restarts_at(shard, 2, _t(4.0, -2.0), _t(0.5, -0.25), _t(-1.0, 0.5))


def test_apply_push_takes_the_callers_finiteness_verdict():
    """``finite`` given: the caller checked the push already; its verdict decides, unchecked
    here (a push it calls non-finite is rejected even when finite, and one it calls finite is
    not rejected, though it is refused when θ + Δ would not be finite)."""
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


def test_apply_push_add_rule_arithmetic():
    """θ ← θ + λ·s·Δ with s = 1/max(1, τ) under ``scale``; staleness counted exactly."""
    shard = ShardState(_t(1.0, -1.0), lr=0.5, compensation="scale")
    pushes = [(_t(2.0, 4.0), 0), (_t(-4.0, 8.0), 0), (_t(8.0, 16.0), 0), (_t(1.0, 1.0), 2)]
    theta = _t(1.0, -1.0)
    for delta, base in pushes:
        tau = shard.version - base
        assert shard.apply_push(delta, base, samples=3) == PushResult(Status.OK, tau)
        theta = theta + 0.5 * (1.0 / max(1, tau)) * delta
        assert torch.equal(shard.theta, theta)
    assert shard.version == 4 and shard.samples == 12
    assert shard.staleness_sum == 4 and shard.staleness_max == 2
    assert shard.staleness_hist == {0: 1, 1: 2, 2: 1}
    assert shard.scale_hist == {1.0: 3, 0.5: 1}


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
    """state_dict → load_state_dict into a fresh shard (another θ): the same state, and the
    same θ, counters, histograms and compensator state after further pushes as the shard
    that was never interrupted. The saved state is a snapshot: later pushes leave it unchanged
    (the restored shard's torch optimizer adopts the loaded tensors, torch's own
    ``load_state_dict``: it gets a copy, through ``torch.save``, here)."""
    before, after = _script(13, 6, seed=1), _script(8, 6, seed=2)  # 13: mid-period for dn
    live = _shard(torch.randn(6, generator=torch.Generator().manual_seed(0)), rule, compensation)
    _run(live, before)
    state = live.state_dict()
    snapshot = copy.deepcopy(state)
    restored = _shard(torch.zeros(6), rule, compensation)
    buf = io.BytesIO()  # through torch.save, as a checkpoint carries it
    torch.save(state, buf)
    restored.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    assert _same(restored.state_dict(), snapshot)
    _run(live, after)
    _run(restored, after)
    assert torch.equal(restored.theta, live.theta)
    assert _same(restored.state_dict(), live.state_dict())
    assert _same(state, snapshot)


def test_loading_another_compensators_state_into_a_shard_is_refused():
    state = _shard(torch.ones(4), "add", "dc").state_dict()
    with pytest.raises(ValueError, match=r"^compensator state of 'dc', not 'gap'$"):
        _shard(torch.ones(4), "add", "gap").load_state_dict(state)


def test_a_checkpoint_with_the_old_staleness_keys_loads():
    """Checkpoints written before the metrics carried their unit say ``staleness_sum`` and
    ``staleness_max``; where both spellings are present the new one wins."""
    live = ShardState(_t(0.0))
    for base in (0, 0, 0, 1):
        live.apply_push(_t(1.0), base)
    state = live.state_dict()
    assert (state["staleness_sum_versions"], state["staleness_max_versions"]) == (5, 2)
    old = dict(state)
    old["staleness_sum"] = old.pop("staleness_sum_versions")
    old["staleness_max"] = old.pop("staleness_max_versions")
    restored = ShardState(_t(0.0))
    restored.load_state_dict(old)
    assert (restored.staleness_sum, restored.staleness_max) == (5, 2)
    both = dict(state, staleness_sum=100, staleness_max=100)
    restored.load_state_dict(both)
    assert (restored.staleness_sum, restored.staleness_max) == (5, 2)


def test_a_checkpoint_without_histograms_loads_with_empty_ones():
    """Checkpoints written before the staleness and scale histograms existed load with both
    empty; the shard then counts the pushes it applies."""
    live = ShardState(_t(0.0))
    live.apply_push(_t(1.0), 0)
    state = live.state_dict()
    del state["staleness_histogram_versions"], state["push_scale_histogram"]
    restored = ShardState(_t(0.0))
    restored.staleness_hist, restored.scale_hist = {7: 1}, {0.5: 1}
    restored.load_state_dict(state)
    assert restored.staleness_hist == {} and restored.scale_hist == {}
    assert restored.version == 1 and torch.equal(restored.theta, _t(1.0))
    restored.apply_push(_t(1.0), 0)
    assert restored.staleness_hist == {1: 1} and restored.scale_hist == {1.0: 1}


@pytest.mark.parametrize("saved", ["none", "missing"])
def test_a_checkpoint_without_compensation_starts_the_ring_at_its_version(saved):
    """A checkpoint from a shard without a per-coordinate compensator (``compensator``: None
    or absent) loaded into a dc shard: the ring holds the loaded θ alone, as the loaded
    version, and the next pushes are compensated against it."""
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
