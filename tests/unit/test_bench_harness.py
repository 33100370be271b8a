"""The benchmark harness's statistics and bookkeeping on scripted curves, values by hand."""

from __future__ import annotations

import json
import math
import platform
import random
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import evidence, harness
from benchmarks.harness import Arm, Run


def curve(*accuracies: float) -> list[tuple[float, int, float]]:
    """Evaluations at t = 1, 2, 3, … s (samples = 100 t)."""
    return [(float(t), 100 * t, a) for t, a in enumerate(accuracies, 1)]


NOISY = curve(0.85, 0.91, 0.89, 0.90, 0.92, 0.93, 0.88)


def test_time_to_target_is_the_first_evaluation_held_for_k_and_censors_a_run_too_short():
    # 0.91 at t = 2 drops to 0.89 at t = 3; from t = 4 on: 0.90, 0.92, 0.93 (three) then 0.88.
    assert harness.time_to_target(NOISY, 0.9, k=1) == 2.0
    assert harness.time_to_target(NOISY, 0.9, k=2) == 4.0
    assert harness.time_to_target(NOISY, 0.9, k=3) == 4.0
    assert harness.time_to_target(NOISY, 0.9, k=4) is None  # 0.88 at t = 7 breaks the run
    assert harness.time_to_target(NOISY, 0.9) == 4.0  # k = 3 by default
    # reached at t = 2 but only two evaluations remain: not held for 3
    assert harness.time_to_target(curve(0.8, 0.95, 0.96), 0.9, k=3) is None
    assert harness.time_to_target(curve(0.8, 0.95, 0.96), 0.9, k=2) == 2.0
    assert harness.time_to_target([], 0.9) is None
    with pytest.raises(ValueError, match="k must be >= 1"):
        harness.time_to_target(NOISY, 0.9, k=0)


def test_censored_median_counts_censored_runs_above_every_time():
    assert harness.censored_median([10.0, None, 30.0], 100) == (30.0, 1)
    assert harness.censored_median([10.0, 20.0, 30.0, None], 100) == (25.0, 1)
    # half censored: the median is the mean of 20 and a censored value, so above the budget
    assert harness.censored_median([10.0, 20.0, None, None], 100) == ("> 100 s", 2)
    assert harness.censored_median([None, None, 5.0], 42.5) == ("> 42.5 s", 2)
    with pytest.raises(ValueError):
        harness.censored_median([], 100)


# Student t's 97.5th percentiles, from a printed table (not from the code under test)
T975 = {1: 12.706204736174698, 2: 4.302652729911275, 4: 2.7764451051977987}


def reference_t(values: list[float], df: int) -> tuple[float, float, float]:
    """The textbook one-sample interval: mean ± t · sd / √n."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, mean - T975[df] * sd / math.sqrt(n), mean + T975[df] * sd / math.sqrt(n)


def test_ratio_interval_exact_on_constants_budget_for_censored_paired_on_the_log_ratio():
    assert harness.ratio_interval([2.0] * 3, [1.0] * 3) == pytest.approx((2.0, 2.0, 2.0))
    # a = [budget 10, 4, 4] over 2s: the geometric mean of 5, 2, 2 = 20^(1/3)
    got = harness.ratio_interval([None, 4.0, 4.0], [2.0] * 3, budget_s=10, paired=True)
    assert got[0] == pytest.approx(20 ** (1 / 3))
    # one pair: no spread to estimate, so no bound
    assert harness.ratio_interval([2.0], [1.0], paired=True) == (2.0, 0.0, math.inf)
    with pytest.raises(ValueError, match="budget_s"):
        harness.ratio_interval([None, 4.0], [2.0])
    with pytest.raises(ValueError, match="positive"):
        harness.ratio_interval([1.0], [0.0])
    # paired: the t interval of the mean log ratio of per-pair ratios 0.5, 1, 2 (geometric mean 1)
    a, b = [1.0, 4.0, 16.0], [2.0, 4.0, 8.0]
    mean, lo, hi = reference_t([math.log(x / y) for x, y in zip(a, b, strict=True)], df=2)
    assert harness.paired_ratio(a, b) == pytest.approx((math.exp(mean), math.exp(lo), math.exp(hi)))
    assert harness.ratio_interval(a, b, paired=True) == harness.paired_ratio(a, b)
    # the stragglers shape: a/b = 0.77 each seed, seeds spread: unpaired the interval is wide
    b = [20.1, 25.2, 20.8, 23.3, 20.6]
    a = [0.77 * x for x in b]
    assert harness.paired_ratio(a, b) == pytest.approx((0.77, 0.77, 0.77))
    _, lo, hi = harness.ratio_interval(a, b)
    assert hi - lo > 0.1
    assert harness.paired_ratio([None, 2.0], [4.0, 4.0], budget_s=8)[0] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="pairs"):
        harness.paired_ratio([1.0, 2.0], [1.0])


def test_the_paired_interval_covers_the_true_difference_95_percent_of_the_time_at_n_5():
    # what the bootstrap of the mean did not (~85 % at n = 5): 4,000 simulated 5-seed studies
    rng = random.Random(0)
    hits = 0
    for _ in range(4000):
        seed_effect = [rng.gauss(0, 3) for _ in range(5)]
        a = [e + 0.5 + rng.gauss(0, 1) for e in seed_effect]
        b = [e + rng.gauss(0, 1) for e in seed_effect]
        _, lo, hi = harness.difference_interval(a, b)
        hits += lo <= 0.5 <= hi
    assert 0.935 <= hits / 4000 <= 0.965


def test_interleave_shuffles_each_seeds_order_from_a_seed_and_records_it():
    calls = []

    def fake(arm: Arm, seed: int) -> Run:
        calls.append((arm.name, arm.argv, seed))
        return Run(arm.name, seed, wall_s=1.0, values={"x": 1.0})

    arms = [Arm("sync", ["--strategy", "sync"]), Arm("asgd", ["--strategy", "asgd"])]
    seeds = list(range(8))
    runs = harness.interleave(arms, seeds, control="sync", run=fake)
    names = {"sync", "asgd", "sync (A/A)"}
    orders = [tuple(n for n, _, s in calls if s == seed) for seed in seeds]
    assert all(set(o) == names and len(o) == 3 for o in orders)  # each arm once a seed
    assert len(set(orders)) > 1  # shuffled, not one fixed order
    # the A/A copy does not always run right before sync (what rotation did)
    assert any(o.index("sync (A/A)") + 1 != o.index("sync") for o in orders)
    assert [r.position for r in runs] == [0, 1, 2] * len(seeds)
    calls.clear()
    harness.interleave(arms, seeds, control="sync", run=fake)
    assert [tuple(n for n, _, s in calls if s == seed) for seed in seeds] == orders  # replayable
    calls.clear()
    harness.interleave(arms, seeds, control="sync", run=fake, order_seed=1)
    assert [tuple(n for n, _, s in calls if s == seed) for seed in seeds] != orders
    assert all(argv == ("--strategy", "sync") for n, argv, _ in calls if n.startswith("sync"))
    assert all(r.load_before is not None and r.load_after is not None for r in runs)
    with pytest.raises(ValueError, match="control arm 'ddp'"):
        harness.interleave(arms, [0], control="ddp", run=fake)


def test_read_evals_prefers_the_training_clock(tmp_path):
    (tmp_path / "metrics").mkdir()
    records = [
        {"event": "step", "time_s": 0.5},
        {"event": "eval", "time_s": 2.0, "train_time_s": 1.5, "samples": 64, "test_accuracy": 0.5,
         "test_loss": 2.0},
        {"event": "eval", "time_s": 1.0, "samples": 32, "test_accuracy": 0.25},
    ]  # fmt: skip
    text = "\n".join(json.dumps(r) for r in records) + '\n{"event": "ev'  # a cut-off line
    (tmp_path / "metrics" / "rank0.jsonl").write_text(text)
    assert harness.read_evals(tmp_path) == [(1.0, 32, 0.25), (1.5, 64, 0.5)]
    # the loss, negated: the records that have one
    assert harness.read_evals(tmp_path, "test_loss", -1.0) == [(1.5, 64, -2.0)]


def provenance(tmp_path, monkeypatch) -> harness.Provenance:
    monkeypatch.setattr(harness, "git_commit", lambda: ("abc1234", []))
    return harness.Provenance(
        command="bench", cwd="/", commit="abc1234", dirty=[], forced=False, quick=False,
        started_utc="2026-01-01 00:00:00", python="3.11", torch="2.13.0", cpu="cpu", nproc=2,
        gpu=None, host="h", platform="p", busy_fraction_before=0.0, load_before=0.1,
        args=SimpleNamespace(out=str(tmp_path / "demo.md")),
    )  # fmt: skip


@pytest.fixture(autouse=True)
def runs_here(tmp_path, monkeypatch) -> None:
    """Run directories and journals of the harness go to the test's directory."""
    monkeypatch.setattr(harness, "RUNS", tmp_path / "runs")


@pytest.fixture
def host(monkeypatch) -> None:
    """Provenance.capture's host facts without ``uname -p`` (a process) or git."""
    monkeypatch.setattr(platform, "platform", lambda: "p")
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(harness, "git_commit", lambda: ("abc1234", []))


def test_a_result_records_the_numerics_a_bit_for_bit_replay_depends_on(monkeypatch, host):
    line = harness.numerics()
    assert line.startswith(f"numpy {version('numpy')}, scipy {version('scipy')}, mnist1d ")
    assert "; CPU " in line
    monkeypatch.setattr(harness, "numerics", lambda: "numpy 9; CPU avx2")
    monkeypatch.setattr(harness, "cpu_busy_fraction", lambda: 0.0)
    prov = harness.Provenance.capture(SimpleNamespace(quick=True))
    assert prov.numerics == "numpy 9; CPU avx2" and prov.to_dict()["numerics"] == prov.numerics
    header = "\n".join(harness.Report("d", "D", prov).header())
    assert "torch 2.13.0" in header and "; numpy 9; CPU avx2" in header


def test_a_busy_machine_refuses_a_measurement_but_not_a_replay_measuring_nothing(monkeypatch, host):
    monkeypatch.setattr(harness, "cpu_busy_fraction", lambda: 0.9)
    for replay, verify in ((None, 0), ("r.json", 1)):  # runs made or re-simulated here
        with pytest.raises(SystemExit, match="the machine is busy"):
            harness.Provenance.capture(SimpleNamespace(replay=replay, verify=verify))
    prov = harness.Provenance.capture(SimpleNamespace(replay="r.json", verify=0))
    assert not prov.forced and prov.busy_fraction_before == 0.9  # recorded all the same


def test_report_writes_claims_with_the_aa_ratio_and_censoring(tmp_path, monkeypatch):
    prov = provenance(tmp_path, monkeypatch)
    report = harness.Report("demo", "A demo", prov)
    # a: one censored run (counted as the 10 s budget) and two at 4 s; b and aa at 2 s
    claim = harness.ratio_claim(
        report, "time to 90 %, a ÷ b", [None, 4.0, 4.0], [2.0] * 3, [2.0] * 3, "≤ 0.75",
        lambda r: r <= 0.75, budget_s=10,
    )  # fmt: skip
    mean, lo, hi = reference_t([math.log(5), math.log(2), math.log(2)], df=2)
    assert claim.value == pytest.approx(math.exp(mean)) and claim.seeds == 3
    assert claim.interval == pytest.approx((math.exp(lo), math.exp(hi)))
    assert claim.aa == pytest.approx(1.0) and claim.aa_interval == pytest.approx((1.0, 1.0))
    # ratios 5, 2, 2: the interval reaches below 0.75 (lo ≈ 0.73), so no verdict
    assert claim.verdict == "inconclusive" and "1 censored" in claim.note
    assert not claim.aa_differs
    report.table(["run", "s"], [["a", 1.5], ["b", None]])
    path = report.write([Run("a", 0, 1.0, failed="exit 1: boom")])
    text = path.read_text()
    row = f"| time to 90 %, a ÷ b | **2.71** | ≤ 0.75 | 1 [1, 1] | [{harness.fmt(math.exp(lo))}, "
    assert row in text and "| 3 | inconclusive (against the A/A copy" in text
    assert harness.INTERVALS in text  # the method is said in the file
    assert "| a | 1.5 |" in text and "| b | - |" in text and "commit: `abc1234`" in text
    data = json.loads(path.with_suffix(".json").read_text())
    assert data["claims"][0]["aa"] == pytest.approx(1.0)
    assert data["runs"][0]["failed"] == "exit 1: boom"
    assert data["provenance"]["commit"] == "abc1234"


def test_history_prints_the_recorded_command_of_each_result_the_package_changed_under(
    tmp_path, monkeypatch
):
    commands = {  # commit: the command its result records
        "a1": "/v/bin/python benchmarks/x.py --cell pareto --replay r/a.json --verify 1 --force",
        "b2": "python benchmarks/experiments.py accuracy --arms 'asgd,asgd dc' --verify=2 --out o",
        "c3": "python benchmarks/y.py",  # the package unchanged since: current
        "d4": "python -c pass",  # names no script
    }
    for commit, command in commands.items():
        result = {"provenance": {"commit": commit, "command": command}, "claims": [{}]}
        (tmp_path / f"{commit}.json").write_text(json.dumps(result))
    monkeypatch.setattr(evidence, "package_changed", lambda commit, repo=None: commit != "c3")
    assert evidence.history(tmp_path) == [
        "benchmarks/x.py --cell pareto",
        "benchmarks/experiments.py accuracy --arms 'asgd,asgd dc' --out o",
    ]


def test_evidence_table_replaces_only_the_text_between_the_markers_it_finds(tmp_path, monkeypatch):
    prov = provenance(tmp_path, monkeypatch)
    report = harness.Report("demo", "A demo", prov)
    report.claim("step ÷ DDP", 0.98, "≤ 1.05", True, aa=1.01, seeds=5)
    report.write()
    (tmp_path / "other.json").write_text('{"no": "claims"}')  # ignored
    monkeypatch.setattr(evidence, "package_changed", lambda commit, repo=None: None)
    lines = evidence.table(tmp_path)
    assert len(lines) == 5
    assert "| step ÷ DDP | **0.98** | ≤ 1.05 | 1.01 | - | 5 | PASS |" in lines[4]
    readme = f"intro\n{evidence.BEGIN}\nold\n{evidence.END}\nrest\n"
    assert evidence.splice(readme, ["new"]) == readme.replace("old", "new")
    with pytest.raises(SystemExit, match="exactly one"):
        evidence.splice("no markers", ["new"])
    # the markers are found in README.md or docs/*.md, once; the advice's markers too
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("intro\n" + "\nx\n".join(evidence.CHOOSING) + "\n")
    marks = (evidence.BEGIN, evidence.END)
    (tmp_path / "docs" / "evidence.md").write_text("\n".join([*marks, ""]))
    assert evidence.marked(marks, tmp_path) == tmp_path / "docs/evidence.md"
    assert evidence.marked(evidence.CHOOSING, tmp_path) == tmp_path / "README.md"
    assert evidence.marked(("<!-- nowhere -->", ""), tmp_path) is None
    (tmp_path / "docs" / "more.md").write_text(evidence.BEGIN)
    with pytest.raises(SystemExit, match="in 2 files"):
        evidence.marked(marks, tmp_path)
    readme = "a\n<!-- choosing:begin -->\nold\n<!-- choosing:end -->\nb\n"
    assert evidence.splice(readme, ["new"], evidence.CHOOSING) == readme.replace("old", "new")


def test_difference_interval_of_means():
    # means 0.92 and 0.90: the difference 0.02 on constants, no spread
    assert harness.difference_interval([0.92] * 5, [0.90] * 5) == pytest.approx((0.02,) * 3)
    # paired differences 0 and 0.04: mean 0.02 ± t(1) · 0.02
    got = harness.difference_interval([0.9, 0.94], [0.9, 0.9])
    assert got == pytest.approx(reference_t([0.0, 0.04], df=1))
    # seed effects of ±5 points shared by both sides; a − b = +0.5 on every seed
    b = [0.85, 0.95, 0.90, 0.80, 1.0]
    a = [x + 0.005 for x in b]
    assert harness.difference_interval(a, b) == pytest.approx((0.005,) * 3)
    _, lo, hi = harness.difference_interval(a, b, paired=False)
    assert lo < -0.01 and hi > 0.02  # unpaired: the seed effects swamp it
    # Welch, equal sizes and variances (1 each): se = √(1/3 + 1/3), df = 4
    diff, lo, hi = harness.difference_interval([0.0, 1.0, 2.0], [1.0, 2.0, 3.0], paired=False)
    half = T975[4] * math.sqrt(2 / 3)
    assert (diff, lo, hi) == pytest.approx((-1.0, -1.0 - half, -1.0 + half))
    with pytest.raises(ValueError, match="pairs"):
        harness.difference_interval([0.9, 0.9], [0.9])


def test_a_difference_is_judged_on_the_aa_copy_and_a_loss_kept_in_nats_by_a_rescore(tmp_path):
    # a − b = +2 points on every seed, a − copy = +1: the interval spans [1, 2]
    b = [0.85, 0.95, 0.90, 0.80, 0.88]
    a, copy = [x + 0.02 for x in b], [x + 0.01 for x in b]
    ok = lambda d, lo, hi: lo >= 1.5  # noqa: E731
    claim = harness.diff_claim(harness.Report("d", "", None), "a − b", a, b, "≥ 1.5", ok,
                               aa_copy=copy, seeds=5)  # fmt: skip
    assert (claim.value, claim.interval) == (pytest.approx(2.0), pytest.approx((1.0, 2.0)))
    assert claim.verdict == "inconclusive" and "against the A/A copy [1, 1]" in claim.note
    assert claim.inputs["aa"] == copy
    # the A/A column: copy − b = +1 point on every seed, an interval that excludes 0
    assert (claim.aa, claim.aa_interval) == (pytest.approx(1.0), pytest.approx((1.0, 1.0)))
    assert claim.aa_differs and "A/A interval excludes 0" in claim.row()[-1]
    # a copy that scatters around b: its interval holds 0, nothing flagged
    noisy = [x + d for x, d in zip(b, (0.01, -0.01, 0.005, -0.005, 0.0), strict=True)]
    calm = harness.diff_claim(harness.Report("d", "", None), "a − b", a, b, "≥ 1.5", ok,
                              aa_copy=noisy, seeds=5)  # fmt: skip
    assert calm.aa == pytest.approx(0.0) and not calm.aa_differs
    # a loss 0.03 nats above b on every seed, judged ≤ 0.05 nats (not ×100 as points are)
    b = [2.51, 2.48, 2.50]
    ok = lambda d, lo, hi: hi <= 0.05  # noqa: E731
    loss = harness.diff_claim(harness.Report("n", "", None), "loss a − b", [x + 0.03 for x in b],
                              b, "≤ 0.05", ok, scale=1.0, digits=4, seeds=3)  # fmt: skip
    assert loss.value == pytest.approx(0.03) and loss.verdict == "PASS"
    stored(tmp_path, "diffs", [claim, loss])
    path = tmp_path / "results" / "diffs.json"
    evidence.rescore(path, "def5678")
    again, nats = json.loads(path.read_text())["claims"]
    assert again["interval"] == pytest.approx([1.0, 2.0])  # the copy still in the verdict
    assert nats["value"] == pytest.approx(0.03) and nats["interval"] == pytest.approx([0.03] * 2)


def test_ratio_claim_bounds_a_censored_median_and_takes_a_given_aa(tmp_path, monkeypatch):
    report = harness.Report("demo", "A demo", provenance(tmp_path, monkeypatch))
    at_most = lambda r: r <= 0.75  # noqa: E731
    claim = lambda a, b: harness.ratio_claim(report, "x", a, b, None, "≤ 0.75", at_most, 10)  # noqa: E731
    # a censored on every seed (counted as 10): 10 / 4 = 2.5 on each pair, a lower bound: MISS
    c = claim([None] * 3, [4.0] * 3)
    assert (c.value, c.verdict) == ("≥ 2.5", "MISS") and c.interval == pytest.approx((2.5, 2.5))
    # a's median censored but one seed at 1 / 4: ratios 2.5, 2.5, 0.25, the interval reaches 0.75
    c = claim([None, None, 1.0], [4.0] * 3)
    assert (c.value, c.verdict) == ("≥ 1.16", "inconclusive")
    # b censored on every seed: 2 / 10 = 0.2 an upper bound on each pair, ≤ 0.75 holds
    c = claim([2.0] * 3, [None] * 3)
    assert (c.value, c.verdict) == ("≤ 0.2", "PASS")
    # b's median censored, one seed at 2 / 1: the upper bound's interval reaches past 0.75
    c = claim([2.0] * 3, [None, None, 1.0])
    assert (c.value, c.verdict) == ("≤ 0.431", "inconclusive")
    c = claim([None] * 2, [None] * 2)
    assert (c.value, c.verdict) == ("both censored", "inconclusive")
    # an A/A ratio computed elsewhere is taken as given
    c = harness.ratio_claim(report, "x", [2.0] * 3, [4.0] * 3, 1.03, "≤ 1", lambda r: r <= 1)
    assert (c.value, c.aa, c.ok, c.seeds) == (0.5, 1.03, True, 3)


def test_ratio_claim_is_judged_against_both_copies_and_flags_an_aa_that_excludes_1(
    tmp_path, monkeypatch
):
    report = harness.Report("demo", "A demo", provenance(tmp_path, monkeypatch))
    # seed i's a is 0.8 × seed i's b, the seeds far apart: paired, every ratio is 0.8
    b = [10.0, 20.0, 40.0, 80.0, 160.0]
    a = [0.8 * x for x in b]
    aa_of_a = [1.1 * x for x in a]  # a's copy, 10 % slower: against it a ÷ b is 0.88
    c = harness.ratio_claim(report, "x", a, b, aa_of_a, "≤ 0.9", lambda r: r <= 0.9, aa_of="a")
    assert c.value == pytest.approx(0.8) and c.interval == pytest.approx((0.8, 0.88))
    assert c.aa == pytest.approx(1.1)  # aa ÷ a, not aa ÷ b (0.88)
    assert c.verdict == "PASS" and c.inputs["paired"] and c.inputs["a"] == a
    assert c.aa_differs and "A/A interval excludes 1" in c.row()[-1]
    # the copy of b 20 % faster: a ÷ copy = 1.0, so ≤ 0.9 does not hold against both copies
    c = harness.ratio_claim(report, "x", a, b, [0.8 * x for x in b], "≤ 0.9", lambda r: r <= 0.9)
    assert c.interval == pytest.approx((0.8, 1.0)) and c.verdict == "inconclusive"
    # unpaired, the same data: Welch's interval of the log ratio straddles 0.9
    c = harness.ratio_claim(report, "x", a, b, None, "≤ 0.9", lambda r: r <= 0.9, paired=False)
    assert c.value == pytest.approx(0.8) and c.interval[1] > 0.9 and c.verdict == "inconclusive"
    with pytest.raises(ValueError, match="aa_of"):
        harness.ratio_claim(report, "x", a, b, None, "≤ 1", lambda r: r <= 1, aa_of="c")


@pytest.mark.parametrize(
    ("target", "bounds"),
    [
        ("≤ 0.75 (ideal 0.57)", (None, 0.75)),
        ("<= 1", (None, 1.0)),
        ("≥ −1", (-1.0, None)),
        ("> 0.85", (0.85, None)),
        ("within ±1", (-1.0, 1.0)),
        ("1 ± 0.05", (0.95, 1.05)),
        ("⌈T/H⌉/T = 0.125 ± 2 %", (0.1225, 0.1275)),
        ("(reference)", None),
        ("(none: < 1 is faster)", None),
        ("14 / 14", None),
        ("reproduced", None),
    ],
)
def test_parse_target_reads_the_rule_a_target_states(target, bounds):
    got = harness.parse_target(target)
    assert (got if got is None else (got.lo, got.hi)) == (bounds and pytest.approx(bounds))


@pytest.mark.parametrize(
    ("target", "interval", "verdict"),
    [
        ("≤ 1.05", (0.95, 1.05), "PASS"),  # the upper bound on the line still passes
        ("≤ 1.05", (0.84, 1.17), "inconclusive"),  # overhead W = 2 at 33c712c
        ("≤ 1.05", (1.06, 1.2), "MISS"),
        ("≥ 0.8", (0.8, 1.1), "PASS"),
        ("≥ 0.8", (0.7, 0.9), "inconclusive"),
        ("≥ 0.85", (0.51, 0.69), "MISS"),
        ("within ±1", (-0.9, 0.88), "PASS"),
        ("within ±1", (-1.28, -0.2), "inconclusive"),  # easgd − sync at 33c712c
        ("within ±1", (-17.6, -9.3), "MISS"),
        ("within ±1", (1.1, 2.0), "MISS"),
        ("within ±1", (-2.0, 2.0), "inconclusive"),  # wider than the band on both sides
    ],
)
def test_a_claim_passes_only_when_its_whole_interval_does(target, interval, verdict):
    rule = harness.parse_target(target)
    assert harness.interval_verdict(rule, *interval) == verdict
    point = sum(interval) / 2
    claim = harness.Claim("x", point, target, True, interval=interval).judge()
    assert claim.verdict == verdict


def test_judge_keeps_a_miss_given_for_another_reason_and_leaves_unjudgeable_claims():
    # interval inside the band, but the caller's own condition failed (e.g. a seed < 90 %)
    miss = harness.Claim("x", 0.1, "within ±1", False, interval=(-0.5, 0.5))
    assert miss.judge().verdict == "MISS"
    # no interval, no rule, no target: the caller's verdict as given
    assert harness.Claim("x", 0.97, "≤ 1", True).judge().verdict == "PASS"
    assert harness.Claim("x", 3, "14 / 14", True, interval=(1, 5)).judge().verdict == "PASS"
    assert harness.Claim("x", 3, "≤ 1", None, interval=(1, 5)).judge().verdict == "-"


def test_step_s_is_the_median_window_after_the_skipped_steps():
    # rank a: steps 0→16 in 1.6 s (0.1 s a step), 16→32 in 3.2 s (0.2); rank b: 16→32 in 4.8 s
    times = {"a": [[0, 0.0], [16, 1.6], [32, 4.8]], "b": [[16, 0.0], [32, 4.8]]}
    assert harness.step_s(times) == pytest.approx(0.2)  # median of 0.1, 0.2, 0.3
    assert harness.step_s(times, skip_steps=16) == pytest.approx(0.25)  # of 0.2, 0.3
    assert harness.step_s(times, skip_steps=32) is None


def test_about_drops_the_title_and_the_command_lines_and_tables_take_a_header_string(
    tmp_path, monkeypatch
):
    doc = "Title line.\n\nFirst paragraph\ngoes on.\n\n    .venv/bin/python x.py\n\nLast one.\n"
    assert harness.about(doc) == "First paragraph\ngoes on.\n\nLast one."
    report = harness.Report("demo", "A demo", provenance(tmp_path, monkeypatch))
    report.table("a | b c", [[1, "x"]])
    assert report.body[:3] == ["| a | b c |", "|---|---|", "| 1 | x |"]


@pytest.mark.spawns
def test_run_train_runs_a_command_and_reads_its_run_directory(tmp_path):
    # A stand-in for `cloudburst train`: writes the summary and one eval record where --out says.
    script = (
        "import json, pathlib, sys; a = sys.argv; out = pathlib.Path(a[a.index('--out') + 1]);"
        "(out / 'metrics').mkdir(parents=True);"
        "seed = a[a.index('--seed') + 1];"
        "(out / 'summary.json').write_text(json.dumps({'config': {}, 'seed': seed}));"
        "(out / 'metrics' / 'rank0.jsonl').write_text(json.dumps({'event': 'eval', 'time_s': 1.0,"
        " 'samples': 8, 'test_accuracy': 0.5}) + '\\n')"
    )  # fmt: skip
    command = (sys.executable, "-c", script)
    r = harness.run_train(Arm("a", ["--flag"]), 7, tmp_path / "run", command=command)
    assert (r.failed, r.summary, r.evals) == (None, {"seed": "7"}, [(1.0, 8, 0.5)])
    r = harness.run_train(Arm("b"), 7, tmp_path / "none", command=(sys.executable, "-c", "0"))
    assert r.failed == "no summary.json"
    r = harness.run_train(Arm("c"), 7, tmp_path / "x", command=(sys.executable, "-c", "exit(3)"))
    assert r.failed.startswith("exit 3")


def stored(tmp_path, name: str, claims: list[harness.Claim], **extra) -> None:
    data = {"provenance": {"commit": "abc1234"}, "claims": [c.__dict__ for c in claims], **extra}
    (tmp_path / "results").mkdir(exist_ok=True)
    (tmp_path / "results" / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "results" / f"{name}.md").write_text(
        "# t\n\n- commit: `abc1234`\n- load\n\n## Claims\n\n| old |\n|---|\n| row |\n\n"
        "## Settings\n"
    )


def test_the_table_rejudges_stored_verdicts_and_the_advice_links_each_sentence(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(evidence, "package_changed", lambda commit, repo=None: None)
    claim = harness.Claim
    stored(tmp_path, "stragglers", [
        claim("time to 85 %, asgd ÷ sync, W = 4", 0.85, "≤ 0.75", False, 1.12, (0.68, 0.88), 5,
              aa_interval=(1.05, 1.2)),
        claim("time to 80 %, asgd ÷ sync, W = 4", 0.6, "≤ 0.75", True, 1.0, (0.5, 0.7), 5),
        claim("time to 88 %, asgd ÷ sync, W = 4", 0.8, "≤ 0.75", False, 1.0, (0.7, 0.9), 5),
    ])  # fmt: skip
    stored(tmp_path, "overhead", [
        claim("sync step ÷ plain loop, W = 1", 1.02, "≤ 1.05", True, 0.99, (0.99, 1.05), 20),
        claim("sync step ÷ raw DDP, W = 4", 1.02, "≤ 1.05", True, 0.94, (0.94, 1.1), 20),
    ])  # fmt: skip
    where = tmp_path / "docs" / "evidence.md"
    lines = evidence.table(tmp_path / "results", where)
    assert lines[4].startswith('| <a id="c-overhead-1"></a>[overhead](../results/overhead.md) |')
    assert "| [0.94, 1.1] | 20 | inconclusive (re-judged from PASS) | `abc1234` |" in lines[5]
    flagged = "| 1.12 [1.05, 1.2] | [0.68, 0.88] | 5 | inconclusive — **A/A interval excludes 1**"
    assert f"{flagged} (re-judged from MISS) |" in lines[6]
    advice = evidence.choosing(tmp_path / "results", where, tmp_path / "README.md")
    assert advice[0].split(" | ")[:3] == ["| situation", "strategy", "link"]
    straggler = next(x for x in advice if x.startswith("| One worker of four 2× slower (real"))
    assert "| 0.85× sync's time to 85 % [0.68, 0.88]: **inconclusive** (target ≤ 0.75, its " in (
        straggler
    )
    # the verdict at the result's other levels, where it differs from the headline's
    assert "excludes 1); at 80 %: PASS; the same at 88 % | not measured | [time](docs/" in (
        straggler
    )
    sync = next(x for x in advice if x.startswith("| No straggler"))
    assert "1.02× raw DDP's step time [0.94, 1.1]: **inconclusive** (target ≤ 1.05)" in sync
    assert "[time](docs/evidence.md#c-overhead-2)" in sync
    # a row whose claims are all missing is left out; every row links to a claim row
    assert not any("GPT" in line for line in advice)
    assert all("#c-" in line for line in advice[2:])


def test_an_advice_cell_says_on_how_many_seeds_the_baseline_reached_a_bounded_ratio():
    c = harness.Claim("time to 90 %, a ÷ sync", "≤ 0.6", "≤ 0.7", True,
                      inputs={"a": [1.0, 2.0, 3.0], "b": [5.0, None, None]})  # fmt: skip
    assert evidence.bound(c) == " (a bound: the baseline reached it on 1 of 3 seeds)"
    c.value, c.inputs["a"][1:] = "≥ 1.4", [None, None]  # the arm's own median censored
    assert evidence.bound(c) == " (a bound: it reached it on 1 of 3 seeds)"
    assert evidence.bound(harness.Claim("time to 90 %, a ÷ sync", 0.6, "≤ 0.7", True)) == ""


def test_rescore_rederives_paired_claims_from_stored_inputs_and_stamps_the_files(tmp_path):
    b = [10.0, 20.0, 40.0, 80.0, 160.0]
    inputs = {"a": [0.8 * x for x in b], "b": b, "aa": [1.01 * x for x in b], "budget_s": None}
    # stored at the old rules: the ratio of medians, an interval from unpaired resampling
    old = harness.Claim("x ÷ y", 0.8, "≤ 0.9", True, 1.01, (0.2, 3.2), 5, inputs=inputs)
    count = harness.Claim("bytes ÷ sync", 0.125, "0.125 ± 2 %", True, seeds=5)
    stored(tmp_path, "demo", [old, count])
    path = tmp_path / "results" / "demo.json"
    assert evidence.rescore(path, "def5678") == ["bytes ÷ sync"]
    data = json.loads(path.read_text())
    new = data["claims"][0]
    # against b 0.8 on every seed, against b's copy (1.01 × b) 0.792: judged on both
    assert new["value"] == pytest.approx(0.8)
    assert new["interval"] == pytest.approx([0.8 / 1.01, 0.8])
    assert new["aa"] == pytest.approx(1.01) and new["ok"] is True
    assert "re-scored; was 0.8 PASS" in new["note"]  # as the file said it
    assert "not re-scored: no interval" in data["claims"][1]["note"]
    md = path.with_suffix(".md").read_text()
    assert "re-scored at `def5678`" in md and "`abc1234`'s" in md and "| row |" not in md
    assert "| x ÷ y | **0.8** | ≤ 0.9 | 1.01 [1.01, 1.01] | [0.792, 0.8] | 5 | PASS" in md
    evidence.rescore(path, "def5678")  # again: one stamp, not two
    assert path.with_suffix(".md").read_text().count("re-scored at") == 1


def test_replay_reports_on_a_results_stored_runs_and_says_whose_they_are(tmp_path, monkeypatch):
    prov = provenance(tmp_path, monkeypatch)
    assert prov.replayed_runs() is None  # no --replay: the arms run
    stored_runs = [Run("sync", 0, 1.5, evals=[(1.0, 8, 0.5)]), Run("asgd", 0, 1.0)]
    result = tmp_path / "old.json"
    result.write_text(json.dumps({"provenance": {"commit": "0ld0ld0", "load_before": 0.3},
                                  "runs": [r.to_dict() for r in stored_runs]}))  # fmt: skip
    prov.args = SimpleNamespace(out=str(tmp_path / "demo.md"), replay=result)
    runs = prov.replayed_runs()
    assert [(r.arm, r.wall_s) for r in runs] == [("sync", 1.5), ("asgd", 1.0)]
    assert runs[0].evals == [[1.0, 8, 0.5]]  # as JSON stored them
    header = "\n".join(harness.Report("demo", "A demo", prov).header())
    assert "**runs replayed** from the result of `0ld0ld0` (started None UTC, load 0.3" in header
    assert "; its numerics not recorded" in header  # made before results recorded them
    # a replay of that replay still names the result that made the runs
    again = tmp_path / "again.json"
    again.write_text(json.dumps({"provenance": {"commit": "n3wn3w0", **prov.to_dict()},
                                 "runs": [r.to_dict() for r in stored_runs]}))  # fmt: skip
    replay = harness.Provenance(**{**prov.to_dict(), "args": SimpleNamespace(replay=again)})
    replay.replayed_runs()
    assert replay.replayed_from == prov.replayed_from and "0ld0ld0" in replay.replayed_from
    # --verify K: the stored runs are what later choices see; K of each batch re-simulated
    # here, each compared bit for bit with the stored one
    fresh = {"sync": Run("sync", 0, 9.0, evals=[(1.0, 8, 0.5)]),
             "asgd": Run("asgd", 0, 1.0, summary={"final_test_accuracy": 0.25})}  # fmt: skip
    monkeypatch.setattr(harness, "run_train", lambda arm, seed, *a: fresh[arm.name])
    prov.args.verify, prov._stored = 2, None
    jobs = [(Arm("sync"), 0, tmp_path / "s"), (Arm("asgd"), 0, tmp_path / "a")]
    assert harness.simulate_all(jobs, prov) == [prov.stored_runs()[("sync", 0, None)], runs[1]]
    assert sorted(prov.verified) == [("asgd", 0, False), ("sync", 0, True)]
    header = "\n".join(harness.Report("demo", "A demo", prov).header())
    assert "re-simulated at this commit, **these differ**: asgd" in header
    prov.verified = [("sync", 0, True)]
    header = "\n".join(harness.Report("demo", "A demo", prov).header())
    assert "1 of them, drawn at random, re-simulated at this commit (`--verify`)" in header
    # a calibrated step time is a measurement: only the maths must agree
    calibrated = {"clock_model": {"step_time_source": "calibrated"}, "train_time_s": 1.0}
    one = Run("a", 0, 1.0, summary=calibrated, evals=[(1.0, 8, 0.5)])
    two = Run("a", 0, 1.0, summary={**calibrated, "train_time_s": 2.0}, evals=[(2.0, 8, 0.5)])
    assert harness.same_run(one, two)
    assert not harness.same_run(one, Run("a", 0, 1.0, summary=calibrated, evals=[(1.0, 8, 0.6)]))
    modelled = {"clock_model": {"step_time_source": "modelled"}}
    assert not harness.same_run(
        Run("a", 0, 1.0, summary=modelled, evals=[(1.0, 8, 0.5)]),
        Run("a", 0, 1.0, summary=modelled, evals=[(2.0, 8, 0.5)]),
    )
    # a job the result lacks (an arm added since) is simulated here and counted as new
    fresh["daso"] = Run("daso", 0, 3.0)
    verified, new = list(prov.verified), prov.new_runs
    assert harness.simulate_all([(Arm("daso"), 0, tmp_path / "d")], prov) == [fresh["daso"]]
    assert prov.verified == verified and prov.new_runs == new + 1
    # Batches that repeat an arm's name (W = 4 and W = 16): each job gets its own stored run,
    # found by its directory below runs/ (the stored one was made in another checkout).
    small, big = (Run("sync", 0, w, out_dir=f"/old/runs/bench/x/W_{w}/sync/seed0") for w in (4, 16))
    result.write_text(json.dumps({"runs": [small.to_dict(), big.to_dict()]}))
    prov.verified, prov._stored = [], None
    jobs = [(Arm("sync"), 0, tmp_path / f"runs/bench/x/W_{w}/sync/seed0") for w in (4, 16)]
    assert [r.wall_s for r in harness.simulate_all(jobs, prov)] == [4, 16]


def test_interleave_replays_a_results_runs_by_phase_and_runs_only_the_ones_it_lacks(
    tmp_path, monkeypatch
):
    prov = provenance(tmp_path, monkeypatch)
    stored = [Run("sync", s, 10.0 + s, out_dir=f"/old/runs/bench/x/{p}/sync/seed{s}")
              for p, s in (("tune", 0), ("confirm", 0), ("confirm", 1))]  # fmt: skip
    result = tmp_path / "old.json"
    result.write_text(json.dumps({"provenance": {"commit": "0ld0ld0"},
                                  "runs": [r.to_dict() for r in stored]}))  # fmt: skip
    prov.args = SimpleNamespace(out=str(tmp_path / "demo.md"), replay=result)
    made = []

    def fake(arm: Arm, seed: int) -> Run:
        made.append((arm.name, seed))
        return Run(arm.name, seed, wall_s=1.0)

    runs = harness.interleave([Arm("sync")], [0, 1, 2], run=fake, prov=prov, phase="confirm")
    assert [r.wall_s for r in runs] == [10.0, 11.0, 1.0] and made == [("sync", 2)]
    assert prov.new_runs == 1  # the header says which runs are this commit's
    assert "**1 run(s) made at this commit**" in "\n".join(harness.Report("d", "D", prov).header())
    # a replay of this result names both commits whose runs it holds
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"provenance": {**prov.to_dict(), "commit": "n3wn3w0"}}))
    again = harness.Provenance(**{**prov.to_dict(), "args": SimpleNamespace(replay=later)})
    again.replayed_runs()
    assert again.replayed_from.startswith("0ld0ld0` (")
    assert again.replayed_from.endswith(" and `n3wn3w0` (1 runs it added)")
    with pytest.raises(SystemExit, match="stored 2 runs of sync seed 0"):  # phases not named
        harness.interleave([Arm("sync")], [0], run=fake, prov=prov)
    # without --replay every run is made, none counted as new against a stored result
    prov.args.replay, prov._stored, made[:] = None, None, []
    harness.interleave([Arm("sync")], [0], run=fake, prov=prov, phase="confirm")
    assert made == [("sync", 0)] and prov.new_runs == 1


@pytest.mark.spawns  # git
def test_evidence_marks_a_result_history_once_the_package_changed_since_its_runs(tmp_path):
    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True)
        return out.stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@t"), git("config", "user.name", "t")
    (tmp_path / "cloudburst").mkdir()
    commits = []
    for text in ("a = 1\n", "a = 2\n"):  # the package at two commits, then a docs-only commit
        (tmp_path / "cloudburst" / "x.py").write_text(text)
        git("add", "-A"), git("commit", "-qm", text)
        commits.append(git("rev-parse", "--short", "HEAD"))
    (tmp_path / "notes.md").write_text("docs\n")
    git("add", "-A"), git("commit", "-qm", "docs")
    old, new = commits
    assert evidence.made_at({"commit": new}, tmp_path) == (f"`{new}`", False)
    history = (f"`{old}` — history: the package changed since", True)
    assert evidence.made_at({"commit": old}, tmp_path) == history
    # replayed runs are their maker's, unless every re-simulated one was bit for bit the same
    replayed = {"commit": new, "replayed_from": f"{old}` (started …) and `{new}` (2 runs it added)"}
    assert evidence.made_at(replayed, tmp_path)[0].startswith(f"`{old}`, `{new}` — history")
    assert evidence.made_at({**replayed, "verified": [["a", 0, True]]}, tmp_path)[1] is False
    assert evidence.made_at({"commit": "0000000"}, tmp_path) == ("`0000000`", False)  # unknown
    # a commit given to a machine whose copy had no .git is still that commit
    given = {"commit": f"{old} (given; tree without .git)"}
    assert evidence.made_at(given, tmp_path) == history


def test_a_replay_whose_run_directories_are_gone_keeps_the_figure_drawn_with_its_runs(
    tmp_path, monkeypatch
):
    report = harness.Report("demo", "A demo", provenance(tmp_path, monkeypatch))
    gone = harness.Run("sync", 0, 1.0, evals=[(1.0, 64, 0.5)], out_dir=str(tmp_path / "gone"))
    report.curves({"sync": [gone]}, 0)
    assert report.body == []  # no figure, and none to draw
    (tmp_path / "demo.png").write_bytes(b"\x89PNG")
    report.curves({"sync": [gone]}, 0)
    assert report.body[0] == "![test error against time and samples, seed 0](demo.png)"
    assert (tmp_path / "demo.png").read_bytes() == b"\x89PNG"  # kept as drawn


def test_a_journal_keeps_each_run_as_it_ends_and_a_replay_of_it_resumes(tmp_path, monkeypatch):
    prov = provenance(tmp_path, monkeypatch)
    path = tmp_path / "journal" / "demo.jsonl"
    prov.journal_file = str(path)
    for s in (0, 1):
        prov.journal(Run("sync", s, 1.0 + s, evals=[(1.0, 64, 0.5)]))
    with path.open("a") as f:
        f.write('{"arm": "sync", "seed": 2, "wa')  # the stop cut the last line short
    again = provenance(tmp_path, monkeypatch)
    again.args.replay, again.args.verify = path, 0
    stored = again.stored_runs()
    assert sorted(stored) == [("sync", 0, None), ("sync", 1, None)]
    assert stored[("sync", 1, None)].wall_s == 2.0 and again.replayed_from.startswith("abc1234`")
    # the runs still missing are made, and journaled again
    made = []

    def make(arm: Arm, seed: int) -> Run:
        made.append(seed)
        return Run(arm.name, seed, 9.0)

    runs = harness.interleave([Arm("sync", [])], [0, 1, 2], prov=again, run=make)
    assert made == [2] and [r.wall_s for r in runs] == [1.0, 2.0, 9.0] and again.new_runs == 1
    journal = Path(again.journal_file)  # a journal of its own: provenance, the new run
    assert journal.parent == tmp_path / "runs" / "journal" and journal.read_text().count("\n") == 2
