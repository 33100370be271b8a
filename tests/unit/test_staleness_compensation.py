"""Staleness compensation on the shards and async DiLoCo's Delayed Nesterov rule against
tests/reference.py under scripted push orders; their settings, summaries and short runs."""

from __future__ import annotations

import pytest
import torch

from cloudburst.comm.messages import Status
from cloudburst.config import ConfigError, RunConfig, Straggler
from cloudburst.strategies.asgd.compensation import (
    PER_COORDINATE,
    SCALAR_FACTORS,
    add_rule_alpha,
    staleness_factor,
)
from cloudburst.strategies.asgd.rules import ASGD_RULES, ServerRule
from cloudburst.strategies.asgd.settings import COMPENSATIONS, SERVER_RULES
from cloudburst.strategies.asgd.shard import ShardState, make_shard
from cloudburst.strategies.asgd.summary import histogram_quantiles, merged_histogram, server_summary
from tests.reference import compensated_server, delayed_nesterov_server
from tests.support import run_sim, shard_of

NUMEL = 50
LOCAL_LR = 0.1
SETTINGS = dict(lr=0.5, local_lr=LOCAL_LR, dc_lambda=0.5, threshold=2)


def _script(workers: int = 4, pushes: int = 40, seed: int = 0) -> list[tuple]:
    """Random workers push, most then fetch: stalenesses from 0 to well past W occur."""
    g = torch.Generator().manual_seed(seed)
    events: list[tuple] = [("fetch", w) for w in range(workers)]
    for _ in range(pushes):
        w = int(torch.randint(workers, (1,), generator=g))
        events.append(("push", w, torch.randn(NUMEL, generator=g) * 0.05))
        if float(torch.rand(1, generator=g)) < 0.7:
            events.append(("fetch", w))
    return events


def _shard(method: str, theta0: torch.Tensor, window: int = 1000, **kw) -> ShardState:
    return ShardState(theta0, lr=SETTINGS["lr"], compensation=method,
                      dc_lambda=SETTINGS["dc_lambda"], delay_threshold=SETTINGS["threshold"],
                      compensation_window=window, local_lr=LOCAL_LR, **kw)  # fmt: skip


def _play(shard: ShardState, events) -> list[int]:
    fetched, stalenesses = {}, []
    for event in events:
        if event[0] == "fetch":
            fetched[event[1]] = shard.version
        else:
            result = shard.apply_push(event[2], fetched[event[1]], samples=1)
            assert result.status == Status.OK
            stalenesses.append(result.staleness)
    return stalenesses


def _theta0() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))


# (method, seed, ring window): 1000 is never reached; 3 makes old pushes read its oldest θ
CASES = [(m, seed, 1000) for m in COMPENSATIONS for seed in (0, 1)]
CASES += [("dc", 2, 3), ("gap", 2, 3)]


@pytest.mark.parametrize("method, seed, window", CASES)
def test_each_compensator_matches_the_reference(method, seed, window):
    events = _script(seed=seed)
    shard = _shard(method, _theta0(), window=window)
    stalenesses = _play(shard, events)
    expected, expected_staleness = compensated_server(
        _theta0(), events, method, window=window, **SETTINGS
    )
    assert stalenesses == expected_staleness and max(stalenesses) > SETTINGS["threshold"]
    torch.testing.assert_close(shard.theta, expected, rtol=1e-5, atol=1e-6)
    if method != "none":  # the compensation changes the result: the comparison has teeth
        plain, _ = compensated_server(_theta0(), events, "none", **SETTINGS)
        assert (shard.theta - plain).abs().max() > 1e-3
    if window == 3:
        assert shard.compensator.clamped == sum(s >= 3 for s in stalenesses) > 0
        assert len(shard.compensator.ring) == 3


# α of the add rule for a push of staleness τ, by hand: λ·s, with s = 1/τ under scale (also
# spelled staleness_scaling=True), τ_C/τ past τ_C under delay-adaptive, 1 under none.
@pytest.mark.parametrize(
    "lr, compensation, tau_c, tau, alpha",
    [
        (1.0, False, 1, 2, 1.0),
        (0.25, False, 1, 2, 0.25),
        (0.7, True, 1, 2, 0.35),
        (0.3, "none", 2, 4, 0.3),
        (0.3, "scale", 2, 4, 0.075),
        (0.3, "delay-adaptive", 2, 4, 0.15),
    ],
)
def test_worker_rebuilds_the_servers_theta_bit_for_bit(lr, compensation, tau_c, tau, alpha):
    """Overlapped PUSH_FETCH: θ before the push plus add_rule_alpha·Δ is the server's θ after."""
    g = torch.Generator().manual_seed(4)
    kw = {"staleness_scaling" if isinstance(compensation, bool) else "compensation": compensation}
    shard = ShardState(torch.randn(1000, generator=g), lr=lr, delay_threshold=tau_c, **kw)
    for _ in range(tau + 1):
        shard.apply_push(torch.randn(1000, generator=g), 0)  # make later pushes stale
    before = shard.theta.clone()
    delta = torch.randn(1000, generator=g) * 1e-3
    assert shard.apply_push(delta, base_version=1).staleness == tau
    assert add_rule_alpha(lr, tau, compensation, tau_c) == alpha  # the worker's α
    # the server: θ + αΔ, by hand (to float32 rounding: add_ may fuse the multiply-add)
    torch.testing.assert_close(shard.theta, before + alpha * delta, rtol=0, atol=1e-6)
    assert not torch.allclose(shard.theta, before + 2 * alpha * delta, rtol=0, atol=1e-6)
    assert torch.equal(before.add_(delta, alpha=alpha), shard.theta)  # its rebuild, bit for bit


@pytest.mark.parametrize(
    "fn, args, expected",
    [
        # delay-adaptive: τ ≤ τ_C gives 1 (τ = 0 under τ_C = 0 included), beyond it τ_C/τ
        (staleness_factor, ("delay-adaptive", 0, 0), 1.0),
        (staleness_factor, ("delay-adaptive", 0, 5), 1.0),
        (staleness_factor, ("delay-adaptive", 5, 5), 1.0),  # at the threshold: still 1
        (staleness_factor, ("delay-adaptive", 6, 3), 0.5),
        (add_rule_alpha, (0.5, 4, "delay-adaptive", 2), 0.25),
        (add_rule_alpha, (0.5, 2, "delay-adaptive", 2), 0.5),
        # τ_C defaults to 1: τ = 2 is scaled by 1/2, τ = 3 by 1/3, τ = 1 not at all
        (staleness_factor, ("delay-adaptive", 1), 1.0),
        (staleness_factor, ("delay-adaptive", 2), 0.5),
        (staleness_factor, ("delay-adaptive", 3), 1 / 3),
        (add_rule_alpha, (0.5, 2, "delay-adaptive"), 0.25),
        (add_rule_alpha, (0.5, 1, "delay-adaptive"), 0.5),
        (add_rule_alpha, (0.25, 7), 0.25),  # no compensation by default: α = λ at any τ
        (add_rule_alpha, (0.5, 4, True), 0.125),  # the staleness_scaling spelling
        (add_rule_alpha, (0.7, 0, True), 0.7),
        (add_rule_alpha, (0.7, 4, True), 0.175),
    ],
)
def test_the_scalar_factors_and_the_add_rules_alpha(fn, args, expected):
    assert fn(*args) == expected


def test_staleness_scaling_is_the_scale_compensation_and_contradictions_are_refused():
    assert RunConfig(strategy="asgd", staleness_scaling=True).asgd.staleness_compensation == "scale"
    assert RunConfig(strategy="asgd", staleness_compensation="scale").asgd.staleness_scaling
    with pytest.raises(ConfigError, match="^staleness_scaling: .*contradicts") as e:
        RunConfig(strategy="asgd", staleness_scaling=True, staleness_compensation="dc")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^staleness_compensation: gap applies to asgd"):
        RunConfig(strategy="easgd", workers=2, staleness_compensation="gap")
    with pytest.raises(ConfigError, match="^staleness_compensation: 'dcx' is not allowed"):
        RunConfig(strategy="asgd", staleness_compensation="dcx")
    cfg = RunConfig(strategy="asgd", workers=3, staleness_compensation="dc-adaptive")
    assert (
        cfg.asgd.dc_lambda_value,
        cfg.asgd.delay_threshold_value(cfg),
        cfg.asgd.compensation_window_value(cfg),
    ) == (2.0, 3, 12)
    bounded = RunConfig(strategy="asgd", max_staleness=5)
    assert bounded.asgd.compensation_window_value(bounded) == 6
    # λ's default: 1/W; under scale (W − 1)/W, which moves θ by a push of the usual staleness
    # W − 1 as plain asgd's 1/W does, with no warning; an optimizer rule keeps 1/W
    scaled = RunConfig(strategy="asgd", workers=16, staleness_compensation="scale")
    assert (scaled.asgd.server_lr, scaled.warnings()) == (15 / 16, [])
    assert add_rule_alpha(scaled.asgd.server_lr, 15, "scale") == pytest.approx(1 / 16)
    assert add_rule_alpha(scaled.asgd.server_lr, 11, "scale") > 1 / 16 > add_rule_alpha(
        scaled.asgd.server_lr, 27, "scale")  # fmt: skip
    assert RunConfig(strategy="asgd", workers=1, staleness_compensation="scale").asgd.server_lr == 1
    assert RunConfig(strategy="asgd", workers=16).asgd.server_lr == 1 / 16
    assert RunConfig(strategy="asgd", workers=16, staleness_compensation="scale",
                     server_rule="sgd").asgd.server_lr == 1 / 16  # fmt: skip
    assert RunConfig(strategy="asgd", workers=16, server_lr=1.0).warnings()
    assert RunConfig(strategy="asgd", workers=16, staleness_compensation="scale",
                     server_lr=2.0).warnings()  # fmt: skip
    shard = make_shard(
        RunConfig(strategy="asgd", workers=3, staleness_compensation="gap", compensation_window=7),
        torch.zeros(4),
    )
    assert (shard.compensation, shard.compensator.window) == ("gap", 7)


def test_merged_histogram_adds_the_shards_counts_under_the_key_in_value_order():
    stats = [{"h": {"1": 2, "3": 1}, "other": {"9": 9}}, {"h": {"1": 5, "0.5": 4}}, {}, {"h": None}]
    merged = merged_histogram(stats, "h")
    assert merged == {0.5: 4, 1.0: 7, 3.0: 1} and list(merged) == [0.5, 1.0, 3.0]


def test_the_summary_of_the_shards_adds_their_counters_and_lists_their_versions_by_shard():
    """A job's summary from its shards' reports: counters summed (a missing one counts 0), the
    histograms merged, versions in shard order (a report without one is shard 0's)."""
    counters = ["compensation_clamped", "rejected_nonfinite", "refused_pushes", "dropped_stale",
                "shard_restarts", "pushes_lost", "shard_failovers"]  # fmt: skip
    one = dict(shard=1, version=5, staleness_max_versions=3, pushes_applied=5,
               staleness_sum_versions=6, staleness_compensation="gap", rejoined_workers=[4, 2],
               push_scale_histogram={"0.5": 5}, staleness_histogram_versions={"1": 2, "3": 3},
               **{k: i for i, k in enumerate(counters)})  # fmt: skip
    zero = dict(version=2, staleness_max_versions=1, pushes_applied=1, staleness_sum_versions=1,
                rejoined_workers=[2], staleness_histogram_versions={"1": 1},
                shard_failovers=10)  # fmt: skip
    quantiles = {"p50": 1.0, "p90": 3.0, "p99": 3.0, "max": 3.0}
    assert server_summary([one, zero]) == {
        "mean_staleness_versions": 7 / 6, "max_staleness_versions": 3,
        "staleness_compensation": "gap", "staleness_quantiles_versions": quantiles,
        "staleness_histogram_versions": {"1": 3, "3": 3}, "push_scale_histogram": {"0.5": 5},
        "push_scale_quantiles": dict.fromkeys(["p50", "p90", "p99", "max"], 0.5),
        "compensation_clamped": 0, "pushes_rejected": 1, "pushes_refused": 2,
        "pushes_dropped_stale": 3, "rejoined_workers": [2, 4], "shard_restarts": 4,
        "pushes_lost": 5, "shard_failovers": 16, "shard_versions": [2, 5],
    }  # fmt: skip


@pytest.mark.parametrize(
    "hist, qs, expected",
    [
        ({1.0: 1, 2.0: 1}, (0.5,), {"p50": 1.0, "max": 2.0}),  # half the counts at or below 1
        ({1.0: 1, 2.0: 3}, (0.25, 0.26), {"p25": 1.0, "p26": 2.0, "max": 2.0}),
        ({0.0: 2, 1.0: 2, 4.0: 1}, None, {"p50": 1.0, "p90": 4.0, "p99": 4.0, "max": 4.0}),
        ({}, None, None),
    ],
)
def test_a_histogram_quantile_is_the_smallest_value_reaching_its_share(hist, qs, expected):
    """By default p50, p90, p99 and the max; an empty histogram has none."""
    assert histogram_quantiles(hist, **({} if qs is None else {"qs": qs})) == expected


@pytest.mark.parametrize("period,c", [(3, 0.0), (2, 0.5), (1, 0.0)])
def test_delayed_nesterov_matches_the_reference(period, c):
    g = torch.Generator().manual_seed(5)
    deltas = [torch.randn(NUMEL, generator=g) for _ in range(10)]
    shard = shard_of(_theta0(), rule="dn", lr=0.7, momentum=0.9, dn_period=period, dn_c=c)
    for d in deltas:
        shard.apply_push(d, shard.version)
    # The pushes carry Δ = θ_local − θ_start: the pseudo-gradient is −Δ.
    expected = delayed_nesterov_server(_theta0(), [-d for d in deltas], 0.7, 0.9, period, c)
    torch.testing.assert_close(shard.theta, expected, rtol=1e-5, atol=1e-5)
    if period == 1:  # N = 1 is torch's Nesterov SGD (dampening 0) on the pseudo-gradient
        p = torch.nn.Parameter(_theta0())
        opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
        for d in deltas:
            p.grad = -d
            opt.step()
        torch.testing.assert_close(shard.theta, p.data, rtol=1e-5, atol=1e-5)


def test_the_registries_are_the_flags_and_a_shard_applies_any_rule_it_is_given():
    """The CLI's names are the registries' keys; a rule written outside asgd runs on a shard as
    asgd's do: scaled for staleness, compensated and bounded before it lands."""
    assert set(SCALAR_FACTORS) | set(PER_COORDINATE) == set(COMPENSATIONS)
    assert tuple(ASGD_RULES) == SERVER_RULES

    class SignRule(ServerRule):  # θ ← θ + λ·s·sign(Δ)
        name = "sign"

        def update(self, push, factor):
            return push.sign().mul_(self.lr * factor), True, None

        def step(self, push, factor):
            self.param.add_(push.sign(), alpha=self.lr * factor)

    shard = ShardState(torch.zeros(3), rule=SignRule(0.5), compensation="scale",
                       max_push_ratio=1.0)  # fmt: skip
    assert shard.apply_push(torch.tensor([2.0, -3.0, 0.0]), 0).status == Status.OK
    assert shard.apply_push(torch.tensor([1.0, 1.0, 1.0]), 0).status == Status.OK  # τ = 1
    assert shard.apply_push(torch.tensor([-1.0, -1.0, -1.0]), 0).status == Status.OK  # s = 1/2
    assert torch.equal(shard.theta, torch.tensor([0.75, -0.25, 0.25]))
    assert (shard.rule, shard.lr, shard.version) == ("sign", 0.5, 3)
    big = ShardState(torch.zeros(3), rule=SignRule(5.0), max_push_ratio=1.0)  # ‖u‖ = 5√3 > 1
    assert big.apply_push(torch.ones(3), 0).status == Status.REFUSED
    assert torch.equal(big.theta, torch.zeros(3))


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in COMPENSATIONS if m != "none"])
def test_each_compensator_learns_on_the_virtual_cluster(tmp_path, method):
    # a push every step from 3 workers, one 2x slower: stale pushes to compensate
    cfg = RunConfig(strategy="asgd", workers=3, steps=24, dataset="synthetic", model="mlp",
                    batch_size=32, lr=0.05, momentum=0.9, seed=0, eval_every_s=1000.0,
                    out=str(tmp_path), staleness_compensation=method,
                    stragglers=[Straggler(2, 2.0)], n_sync=1)  # fmt: skip
    summary = run_sim(cfg)
    assert summary["staleness_compensation"] == method
    assert summary["final_test_accuracy"] >= 0.9
    assert summary["staleness_quantiles_versions"]["max"] == summary["max_staleness_versions"] >= 2
    assert sum(summary["staleness_histogram_versions"].values()) == sum(summary["shard_versions"])
    scale = summary["push_scale_quantiles"]
    if method in ("scale", "gap"):  # stale pushes are applied at less than their size
        assert scale["p50"] < 1.0
