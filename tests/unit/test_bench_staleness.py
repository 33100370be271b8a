"""The straggler and staleness benchmarks' bookkeeping on scripted runs, values by hand."""

from __future__ import annotations

import pytest

from benchmarks import harness
from benchmarks.harness import Run


# fixtures: only the process running these tests pays for importing matplotlib
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
    scale = ["--strategy", "asgd", "--staleness-scaling"]
    assert experiments.STRAGGLER_ARMS["asgd scale"][0] == scale
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


def test_every_arm_is_judged_at_its_first_crossing_of_sync_final_less_a_band(staleness):
    # sync ends at 0.90: level 0.895, first reached at t = 3 (300 samples); asgd at t = 1
    # (150): time 1/3, samples 1/2; async DiLoCo never: censored at T = 3 s (time) and at the
    # fewest samples any censored run had processed by then (its own 600)
    sync = run("sync", [(1.0, 100, 0.5), (2.0, 200, 0.8), (3.0, 300, 0.9)])
    asgd = run("asgd", [(1.0, 150, 0.9), (2.0, 300, 0.91), (3.0, 450, 0.92)])
    slow = run("x", [(1.0, 200, 0.5), (2.0, 400, 0.6), (3.0, 600, 0.7)])
    assert staleness.first_at(asgd, 0.895) == (1.0, 150)
    assert staleness.first_at(slow, 0.895) == (None, None)
    report = harness.Report("t", "t", None)
    runs = {"sync": [sync, sync], "asgd": [asgd, asgd], "local_sgd H=8": [slow, slow],
            "diloco H=8": [asgd, asgd], "async_diloco": [slow, slow]}  # fmt: skip
    staleness.claims(report, runs, 3.0, "here", 2)
    got = {c.name.removesuffix(", here"): c for c in report.claims}
    assert got["time to sync's final − 0.5, asgd ÷ sync"].value == pytest.approx(1 / 3)
    assert got["samples to sync's final − 0.5, asgd ÷ sync"].value == pytest.approx(0.5)
    assert got["time to sync's final − 0.5, async_diloco ÷ sync"].value == "≥ 1"
    assert got["samples to sync's final − 0.5, async_diloco ÷ sync"].value == "≥ 2"  # 600 ÷ 300
    # at T: 92 − 90 and 92 − 70 points; async DiLoCo − DiLoCo at DiLoCo's samples (450): 0.6
    assert got["accuracy at sync's time T, asgd − sync (points)"].value == 2.0
    assert got["accuracy at T, asgd − local_sgd H=8 (points)"].value == 22.0
    assert got["accuracy at DiLoCo's samples, async_diloco − diloco H=8 (points)"].value == -32.0
    assert [c.verdict for c in report.claims if "− 2," in c.name] == ["PASS", "MISS"]


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


def test_a_censored_runs_samples_count_at_the_fewest_any_censored_run_processed_by_the_budget(
    staleness,
):
    # sync never holds 80 % within 10 s (it processed 400 and 300 samples by then); async does
    # at 900 samples and goes on to 5000: the censored count is 300, a lower bound of both
    # sync runs (the most any run processed, 5000, would overstate sync and flatter the ratio)
    sync = [run("sync", [(0.0, 0, 0.1), (5.0, 200, 0.5), (10.0, s, 0.6)]) for s in (400, 300)]
    fast = run("async", [(0.0, 0, 0.1), (2.0, 900, 0.85), (3.0, 1200, 0.86), (4.0, 1500, 0.87),
                         (10.0, 5000, 0.9)])  # fmt: skip

    def floor(runs):  # as staleness.py calls it
        return harness.censored_floor((staleness.first_at(r, 0.8)[1], r.evals[-1][1]) for r in runs)

    assert floor([*sync, fast]) == 300
    assert floor([fast]) == 5000  # none censored: any value will do


def test_slow_link_levels_are_the_highest_every_pilot_run_held_within_the_budget():
    """A level counts only when held for 3 evaluations in a row before the budget; the three
    levels step down one grid step (a point, or 0.01 nats of a negated loss) from the lowest
    run's best such level."""
    from benchmarks import slow_link_levels

    held = (0.5, 0.893, 0.9, 0.895)  # then 0.99 from t = 5, held 3 times past it
    a = run("sync", [(t, 0, x) for t, x in enumerate((*held, 0.99, 0.99, 0.99, 0.99), 1)])
    b = run("daso", [(1, 0, 0.95), (2, 0, 0.95), (3, 0, 0.95), (4, 0, 0.2)])
    assert slow_link_levels.held_levels([a, b], budget=5) == [0.89, 0.88, 0.87]
    assert slow_link_levels.held_levels([b], budget=5) == [0.95, 0.94, 0.93]
    loss = run("gpt", [(1, 0, -2.5), (2, 0, -2.4578), (3, 0, -2.45), (4, 0, -2.44)])  # −loss
    assert slow_link_levels.held_levels([loss], budget=5) == [-2.46, -2.47, -2.48]
    with pytest.raises(SystemExit, match="fewer than 3 evaluations"):
        slow_link_levels.held_levels([a], budget=2.5)
