"""The issue-28 benchmarks' bookkeeping on scripted runs (no processes): which arms a commit
can run, DiLoCo's level, the virtual-time budget, equal pushes, the per-arm "why" ratios.

Expected values are worked out by hand in the comments.
"""

from __future__ import annotations

import math

import pytest

from benchmarks import harness
from benchmarks.harness import Run


# benchmarks.experiments imports matplotlib (~0.9 CPU-s; staleness imports experiments): as
# fixtures, only the test process that runs these tests pays for it, not every xdist worker
# at collection.
@pytest.fixture(scope="module")
def experiments():
    from benchmarks import experiments

    return experiments


@pytest.fixture(scope="module")
def staleness():
    from benchmarks import staleness

    return staleness


def run(arm: str, evals: list[tuple[float, int, float]], **values: float) -> Run:
    return Run(arm, 0, 1.0, {"final_test_accuracy": evals[-1][2]}, evals, values=values)


def test_supported_arms_follow_the_help_text_and_scale_falls_back_to_the_old_flag(
    monkeypatch, experiments
):
    monkeypatch.setattr(experiments, "STRAGGLER_ARMS", dict(experiments.STRAGGLER_ARMS))
    old = "--strategy {sync,asgd,diloco} --staleness-scaling --period"
    ok, missing = experiments.supported(
        ["sync", "asgd scale", "asgd dc", "diloco", "async_diloco", "async_diloco dylu"], old
    )
    assert ok == ["sync", "asgd scale", "diloco"]
    assert missing == ["asgd dc", "async_diloco", "async_diloco dylu"]
    assert experiments.STRAGGLER_ARMS["asgd scale"][0] == [
        "--strategy", "asgd", "--staleness-scaling"
    ]  # fmt: skip
    # a commit with the option but not every value: the value is what is missing
    new = "--strategy {sync,asgd,async_diloco} --staleness-compensation {none,scale,dc} --dylu"
    ok, missing = experiments.supported(["asgd dc", "asgd gap", "async_diloco dylu"], new)
    assert (ok, missing) == (["asgd dc", "async_diloco dylu"], ["asgd gap"])


def test_async_diloco_is_timed_to_diloco_final_accuracy_less_one_point(experiments):
    diloco = run("diloco straggler", [(1.0, 10, 0.80), (2.0, 20, 0.925), (3.0, 30, 0.93),
                                      (4.0, 40, 0.935), (5.0, 50, 0.93)])  # fmt: skip
    levels = experiments.diloco_levels([diloco])
    assert levels is not None and abs(levels[0] - 0.92) < 1e-12  # 0.93 (last) − 1 point
    fast = run("async_diloco straggler", [(0.5, 10, 0.90), (1.0, 20, 0.921), (1.5, 30, 0.92),
                                          (2.0, 40, 0.93), (2.5, 50, 0.94)])  # fmt: skip
    # held ≥ 0.92 from t = 1.0 for three evaluations; DiLoCo from t = 2.0
    assert experiments.time_to_level(fast, levels[0]) == 1.0
    assert experiments.time_to_level(diloco, levels[0]) == 2.0
    failed = run("diloco straggler", [(1.0, 10, 0.5)])
    failed.failed = "exit 1"
    assert experiments.diloco_levels([diloco, failed]) is None


def test_the_virtual_budget_cuts_evaluations_and_counts_from_the_first(staleness):
    # first evaluation at 10 s: times from there; budget 3 s keeps t ≤ 13
    r = run("x", [(10.0, 0, 0.1), (11.0, 64, 0.81), (12.0, 128, 0.82), (13.0, 192, 0.83),
                  (14.0, 256, 0.9)])  # fmt: skip
    assert staleness.within(r, 3.0) == [(0.0, 0, 0.1), (1.0, 64, 0.81), (2.0, 128, 0.82),
                                        (3.0, 192, 0.83)]  # fmt: skip
    assert staleness.time_to(r, 0.8, 3.0) == 1.0
    assert staleness.samples_to(r, 0.8, 3.0) == 64
    assert staleness.time_to(r, 0.8, 2.5) is None  # held only 2 evaluations within 2.5 s
    assert staleness.acc_at(r, 2.5) == 0.82
    # equal pushes: the last evaluation at most at the other arm's samples
    assert staleness.acc_at_samples(r, 200) == 0.83
    assert staleness.acc_at_samples(r, 192) == 0.83  # exactly the other arm's samples
    assert staleness.acc_at_samples(r, 63) == 0.1


def test_why_gives_each_arm_its_throughput_and_samples_ratio_to_sync(experiments):
    sync_evals = [(t, 1000 * t, a) for t, a in [(1, 0.9), (2, 0.91), (3, 0.92)]]
    asgd_evals = [(t, 1500 * t, a) for t, a in [(1, 0.5), (2, 0.9), (3, 0.9), (4, 0.9)]]
    groups = {
        "sync straggler": [run("sync straggler", sync_evals, **{"samples/s": 100.0})],
        "asgd straggler": [run("asgd straggler", asgd_evals, **{"samples/s": 180.0})],
        "sync straggler (A/A)": [run("sync straggler (A/A)", sync_evals)],
    }
    why = experiments.explain(groups, None, ["asgd"])
    # samples/s 180 ÷ 100; samples at the held evaluation 3000 (t = 2) ÷ 1000 (t = 1)
    assert why["per_arm"] == {
        "asgd": {"throughput_ratio": 1.8, "samples_needed_ratio": 3.0,
                 "predicted_time_ratio": 3.0 / 1.8}
    }  # fmt: skip
    assert "| asgd | 1.8 | 3 | 1.67 |" in why["text"]


def test_a_lockstep_arm_is_sized_by_its_slowest_worker_the_straggler_or_the_largest_draw(staleness):
    assert staleness.slowest(1, "pareto:2") == pytest.approx(1.0)  # one draw: the mean
    # E[max of 3 Pareto(2) draws, x_m = 1/2] = ½·Γ(4)Γ(½)/Γ(3½) = ½·6·√π/(15√π/8) = 1.6
    assert staleness.slowest(3, "pareto:2") == pytest.approx(1.6)
    assert staleness.slowest(1, "lognormal:0.3") == pytest.approx(1 / (1 + 0.09) ** 0.5)
    steps = {w: int(staleness.argv("sync", w, "pareto:2", 30.0)[5]) for w in (16, 64)}
    # W = 16: the 4× straggler is the slowest (as before); W = 64: the largest of 63 draws
    assert steps == {16: math.ceil(1.3 * 30 / (4 * 0.02 * 0.8)), 64: 346}


def test_a_censored_runs_samples_count_at_the_fewest_any_censored_run_processed_by_the_budget(
    experiments, staleness
):
    # sync never holds 80 % within 10 s (it processed 400 and 300 samples by then); async does
    # at 900 samples and goes on to 5000: the censored count is 300, a lower bound of both
    # sync runs (the most any run processed, 5000, would overstate sync and flatter the ratio)
    sync = [run("sync", [(0.0, 0, 0.1), (5.0, 200, 0.5), (10.0, s, 0.6)]) for s in (400, 300)]
    fast = run("async", [(0.0, 0, 0.1), (2.0, 900, 0.85), (3.0, 1200, 0.86), (4.0, 1500, 0.87),
                         (10.0, 5000, 0.9)])  # fmt: skip

    def floor(runs):  # as staleness.py and experiments.py call it
        return harness.censored_floor(
            (staleness.samples_to(r, 0.8, 10.0), staleness.within(r, 10.0)[-1][1]) for r in runs
        )

    assert floor([*sync, fast]) == 300
    assert floor([fast]) == 5000  # none censored: any value will do
