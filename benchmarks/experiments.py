"""Training experiments on MNIST-1D with 4 workers: accuracy and stragglers (details:
benchmarks/README.md).

    .venv/bin/python benchmarks/experiments.py accuracy [--quick] [--seeds N] [--epochs E]
    .venv/bin/python benchmarks/experiments.py stragglers [--quick] [--seeds N] [--steps N]

``accuracy``: every strategy at its defaults, final accuracy − sync's (within ±1 point) and
every seed ≥ 90 %. ``stragglers``: time to 90 % with worker 0 2× slower, each asynchronous arm
÷ sync (A/A: sync twice), samples to 90 %, async DiLoCo ÷ DiLoCo, and why, measured.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Arm, fmt, pct  # noqa: E402

STRATEGIES = ("sync", "asgd", "easgd", "gossip", "local_sgd", "diloco", "daso")
TARGET = 0.90
BAND_POINTS = 1.0  # each strategy's final accuracy within this many points of sync's
ASGD_BAND, ASGD_FLOOR = 0.5, 0.91  # issue 28: asgd at its defaults, and its worst seed
MIN_STEP_S = 0.02
RATIO_TARGET = 0.75  # asgd at its defaults ÷ sync (the earlier target, kept)
# issue 28's targets, fixed before any run: the best asynchronous arm ÷ sync (time to 90 %),
# its samples to hold 90 % ÷ sync's, async DiLoCo ÷ DiLoCo (time to DiLoCo's final − 1 point)
BEST_RATIO_TARGET = 0.70
SAMPLES_TARGET = 1.2
DILOCO_RATIO_TARGET = 0.75
DILOCO_BAND = 1.0  # points
IDEAL_RATIO = 4 / (2 * 3 + 1)
IDEAL_THROUGHPUT = (3 + 1 / 2) / 2  # asgd: 3 fast workers + one at half pace; sync: 4 at half
COMMON = ["--workers", "4"]
BATCH = 64  # the CLI's default batch size
# asgd's fast workers step about 1.8× as often as sync's lockstep (20 ms + push/fetch against
# 40 ms + all-reduce), so asgd gets 1.8× the steps to train about as long as sync.
ASGD_STEPS = 1.8
STEPS = 1200  # sync's step ceiling: ~55 s at the straggler's pace (46 ms), past the budget
# Every stragglers arm trains for the same time (issue 40: sync used to stop at 600 steps,
# ~27 s, while the asynchronous arms trained ~44 s): the budget ends each run, a censored run
# counts at it. The levels were named before the run from the runs at seeds 0-9 (older code):
# the lowest final accuracy of any arm there was 86.4 % (DiLoCo, 25 s), so all three lie below
# every arm's plateau; 85 % is the headline, the verdict is given at each.
BUDGET_S = 40.0
LEVELS = (0.80, 0.85, 0.88)
PRIMARY = 0.85


def seed_range(args) -> range:
    """``--seeds`` seeds from ``--first-seed``: fresh seeds confirm what others chose."""
    return range(args.first_seed, args.first_seed + (args.seeds or (1 if args.quick else 5)))


def accuracy(args, prov: harness.Provenance) -> None:
    seeds = seed_range(args)
    budget = (
        ["--steps", "30"] if args.quick else ["--epochs", str(args.epochs)] if args.epochs else []
    )
    budget += ["--eval-every-s", "10"]  # only the final accuracy counts here
    names = STRATEGIES  # --quick too: defaults.py --quick compares each of them
    if args.arms:
        names = tuple(dict.fromkeys(["sync", *args.arms.split(",")]))
    unknown = [n for n in names if n not in STRATEGIES and n not in STRAGGLER_ARMS]
    if unknown:
        sys.exit(f"accuracy: unknown arm(s) {unknown}; known: {', '.join(STRAGGLER_ARMS)}, "
                 f"{', '.join(STRATEGIES)}")  # fmt: skip
    flags = {n: STRAGGLER_ARMS[n][0] if n in STRAGGLER_ARMS else ["--strategy", n] for n in names}
    arms = [Arm(n, [*flags[n], *COMMON, *budget]) for n in names]
    runs = harness.interleave(arms, seeds, control="sync", prov=prov,
                              out_root=prov.runs_dir("accuracy"))  # fmt: skip
    groups = harness.by_arm(runs)
    title = "Final test accuracy of every strategy at its defaults"
    report = harness.Report("accuracy", title, prov)
    report.data["argv"] = {a.name: list(a.argv) for a in arms}
    sync = [r.final_accuracy for r in groups["sync"]]
    copy = [r.final_accuracy for r in groups.get(harness.aa_name("sync"), [])]
    rows = []
    for name, rs in groups.items():
        accs = [r.final_accuracy for r in rs]
        done = [a for a in accs if a is not None]
        challenger = not name.startswith("sync")
        if challenger and done and all(a is not None for a in sync):
            complete = len(done) == len(accs)
            bands = [(BAND_POINTS, "", "" if complete else f"{len(accs) - len(done)} runs failed")]
            if name == "asgd":  # issue 28's stricter target at its defaults, fixed before the run
                bands.append((ASGD_BAND, f", within ±{ASGD_BAND:g}", ""))
            for points, suffix, note in bands:
                harness.diff_claim(
                    report,
                    f"final accuracy, {name} − sync (points), W = 4, defaults{suffix}",
                    done,
                    sync,
                    f"within ±{points:g}",
                    lambda d, lo, hi, p=points, c=complete: -p <= lo and hi <= p and c,
                    paired=len(done) == len(sync),
                    seeds=len(accs),
                    note=note,
                    aa_copy=copy if complete and copy and None not in copy else None,
                )
            if name == "asgd":
                report.claim(
                    f"asgd at its defaults: every seed ≥ {100 * ASGD_FLOOR:.0f} %",
                    pct(min((a or 0.0) for a in accs)), f"≥ {100 * ASGD_FLOOR:.0f}",
                    all(a is not None and a >= ASGD_FLOOR for a in accs), seeds=len(accs),
                )  # fmt: skip
        rows.append([name, " / ".join(pct(a) for a in accs),
                     pct(statistics.fmean(done)) if done else "-", pct(min(done, default=None)),
                     sum(a is not None and a >= TARGET for a in accs),
                     fmt(statistics.median(r.summary.get("wall_time_s", 0.0) for r in rs)),
                     fmt(statistics.median(r.wall_s for r in rs))])  # fmt: skip
    worst = [min((r.final_accuracy or 0.0) for r in rs) for rs in groups.values()]
    report.claim(
        f"defaults train: every strategy, every seed ≥ {100 * TARGET:.0f} %",
        pct(min(worst)), f"≥ {100 * TARGET:.0f}", min(worst) >= TARGET, seeds=len(seeds),
    )  # fmt: skip
    report.settings(
        f"MNIST-1D (4000 train / 1000 test), the paper's CNN, 4 workers, every strategy's "
        f"defaults, `{' '.join(budget)}`, seeds {list(seeds)}, arms interleaved (order shuffled "
        "per seed). Final = the global model at the end (asgd/easgd: the servers' θ). The "
        "interval is a 95 % t interval of the mean difference, paired by seed; "
        '"within ±b" is a PASS only when the whole interval is. '
        "Sync runs twice per seed (its A/A copy, in the shuffled order): sync is "
        "deterministic on CPU for its seed, so the copy − sync is 0 when it is, and the noise "
        "is the seed-to-seed spread, which the interval carries; each difference is judged "
        "against both copies."
    )
    report.section("Every strategy").table(
        ["strategy", "final acc % (seeds)", "mean", "worst", f"seeds ≥ {100 * TARGET:.0f} %",
         "train s (median)", "command s (median)"], rows)  # fmt: skip
    report.write(runs)


def stragglers(args, prov: harness.Provenance) -> None:
    seeds = seed_range(args)
    steps, root = 40 if args.quick else args.steps, prov.runs_dir("stragglers")
    budget = 8.0 if args.quick else BUDGET_S
    compute_ms = step_compute_ms(root / "one_process", 100 if args.quick else 500)
    common = [*COMMON, "--min-step-time-s", str(MIN_STEP_S), "--eval-every-s", "0.5",
              "--max-train-time-s", str(budget)]  # fmt: skip
    wanted = args.arms.split(",") if args.arms else list(QUICK_ARMS if args.quick else DEFAULT_ARMS)
    wanted = list(STRAGGLER_ARMS) if wanted == ["all"] else wanted
    unknown = [a for a in wanted if a not in STRAGGLER_ARMS]
    if unknown:
        sys.exit(f"stragglers: unknown arm(s) {unknown}; known: {', '.join(STRAGGLER_ARMS)}")
    available, missing = supported(wanted, cli_help())
    length = {"lockstep": steps, "async": round(ASGD_STEPS * steps)}
    arms = []
    for name in available:  # the step counts are ceilings: the time budget ends every run
        flags, kind = STRAGGLER_ARMS[name]
        arms.append(Arm(f"{name} straggler", [*flags, *common, "--steps", str(length[kind]),
                                              "--straggler", "0:2"]))  # fmt: skip

    def run(arm: Arm, seed: int) -> harness.Run:
        out = root / harness.slug(arm.name) / f"seed{seed}"
        return measured_run(lambda: harness.run_train(arm, seed, out), out, BATCH)

    runs = harness.interleave(arms, seeds, control="sync straggler", run=run, prov=prov)
    groups = harness.by_arm(runs)
    times = {lv: {n: harness.times_to(rs, lv) for n, rs in groups.items()} for lv in LEVELS}
    samples = {name: [samples_to(r, PRIMARY) for r in rs] for name, rs in groups.items()}
    most = harness.censored_floor((samples_to(r, PRIMARY), r.evals[-1][1]) for r in runs if r.evals)
    title = (f"Time to {100 * PRIMARY:g} % with a 2× straggler, every arm {budget:g} s of "
             "training: asynchronous methods ÷ sync")  # fmt: skip
    report = harness.Report("stragglers", title, prov)
    sync_copy = harness.aa_name("sync straggler")
    asyncs = [n for n in available if STRAGGLER_ARMS[n][1] == "async"]
    for name in asyncs:
        bound = RATIO_TARGET if name == "asgd" else BEST_RATIO_TARGET
        target = f"≤ {bound} (ideal {IDEAL_RATIO:.2f})"
        for lv in sorted(LEVELS, key=lambda x: x != PRIMARY):  # the headline first
            t = times[lv]
            harness.ratio_claim(
                report, f"time to {100 * lv:g} %, {name} ÷ sync, W = 4, one worker 2× slower",
                t[f"{name} straggler"], t["sync straggler"], t[sync_copy], target,
                lambda r, b=bound: r <= b, budget,
            )  # fmt: skip
    for name in asyncs:
        harness.ratio_claim(
            report,
            f"samples to hold {100 * PRIMARY:g} %, {name} ÷ sync, W = 4, one worker 2× slower",
            samples[f"{name} straggler"],
            samples["sync straggler"],
            samples[sync_copy],
            f"≤ {SAMPLES_TARGET}",
            lambda r: r <= SAMPLES_TARGET,
            most,
            samples=True,
        )
    sync_final = [final_acc(r) for r in groups["sync straggler"]]
    copy_final = [final_acc(r) for r in groups[sync_copy]]
    for name in asyncs:  # what a user has when sync's time is up: the same budget
        accs = [final_acc(r) for r in groups[f"{name} straggler"]]
        if all(a is not None for a in accs + sync_final):
            harness.diff_claim(
                report,
                f"accuracy at the {budget:g} s budget, {name} − sync (points), W = 4, one "
                "worker 2× slower",
                accs,
                sync_final,
                f"≥ −{DILOCO_BAND:g}",
                lambda d, lo, hi: lo >= -DILOCO_BAND,
                seeds=len(accs),
                aa_copy=copy_final if None not in copy_final else None,
            )
    levels = diloco_levels(groups.get("diloco straggler", []))
    times = times[PRIMARY]
    for name in [n for n in asyncs if n.startswith("async_diloco")] if levels else []:
        rs, base = groups[f"{name} straggler"], groups["diloco straggler"]
        mine = [time_to_level(r, lv) for r, lv in zip(rs, levels, strict=True)]
        # DiLoCo's own time to its final accuracy: its whole run (its last evaluation; a
        # curve still rising at the end never holds final − 1 point for k evaluations)
        theirs = [None if r.failed or not r.evals else r.evals[-1][0] for r in base]
        harness.ratio_claim(
            report,
            f"time to DiLoCo's final accuracy − {DILOCO_BAND:g} point, {name} ÷ "
            "diloco, W = 4, one worker 2× slower",
            mine,
            theirs,
            None,
            f"≤ {DILOCO_RATIO_TARGET}",
            lambda r: r <= DILOCO_RATIO_TARGET,
            budget,
        )
        accs = [final_acc(r) for r in rs]
        if all(a is not None for a in accs):  # against each seed's level + DILOCO_BAND points
            harness.diff_claim(
                report,
                f"final accuracy, {name} − diloco (points), W = 4, one worker 2× slower",
                accs,
                [final_acc(r) for r in base],
                f"≥ −{DILOCO_BAND:g}",
                lambda d, lo, hi: lo >= -DILOCO_BAND,
                seeds=len(accs),
            )
    report.data["argv"] = {a.name: list(a.argv) for a in arms}
    report.data["not measured"] = missing
    report.data["targets"] = {
        "levels (time to)": LEVELS,
        "best async ÷ sync, time to each level": BEST_RATIO_TARGET,
        "asgd ÷ sync": RATIO_TARGET,
        f"samples to {100 * PRIMARY:g} % ÷ sync's": SAMPLES_TARGET,
        "accuracy at the budget − sync's (points)": -DILOCO_BAND,
        "async DiLoCo ÷ DiLoCo, time to DiLoCo's final − 1 point": DILOCO_RATIO_TARGET,
    }
    absent = (
        f" Not measured (this commit has no such flag): {', '.join(missing)}." if missing else ""
    )
    report.settings(
        f"MNIST-1D, the paper's CNN, 4 workers (parameter-server arms: 1 server shard, every "
        f"setting at its default unless the arm names it), batch {BATCH}, every step padded "
        f"by sleeping to ≥ {1000 * MIN_STEP_S:.0f} ms (in the layers' forward and backward "
        "hooks), worker 0's step ×2 (`--straggler 0:2`), evaluation every 0.5 s on worker 0, "
        f"off the clock. **Every arm trains for the same {budget:g} s of training time** "
        f"(`--max-train-time-s {budget:g}`, sync and its A/A copy too); the step counts, "
        f"lockstep arms {length['lockstep']} and asynchronous arms {length['async']}, are "
        "ceilings no arm reaches. Time to a level: first evaluation held ≥ the level for "
        f"{harness.K_CONSECUTIVE} evaluations, at each of "
        f"{', '.join(f'{100 * x:g} %' for x in LEVELS)} "
        f"(named before the run, below every arm's final accuracy in the runs of seeds 0-9 at "
        f"older code; {100 * PRIMARY:g} % the headline); runs that never hold it are censored "
        f"at the {budget:g} s budget and counted; samples at {most} "
        f"({harness.CENSORED_SAMPLES}). Accuracy at the budget: each arm's last evaluation, "
        "what a user has when sync's time is up. Async "
        "DiLoCo against DiLoCo: the level is each seed's DiLoCo final accuracy (last "
        f"evaluation) − {DILOCO_BAND:g} point, held {harness.K_CONSECUTIVE} evaluations, "
        "against DiLoCo's whole run (the time it took to its final accuracy); "
        f"ratios paired by seed ({harness.INTERVALS.split(';')[0]}). Seeds {list(seeds)}, arms "
        "in a seeded random order. Targets fixed in the script before the run: the best "
        "asynchronous arm "
        f"≤ {BEST_RATIO_TARGET} × sync's time (PASS only when the interval's upper bound is), "
        f"samples ≤ {SAMPLES_TARGET} × sync's, async DiLoCo ≤ {DILOCO_RATIO_TARGET} × DiLoCo's "
        f"time within ±{DILOCO_BAND:g} point of its final accuracy; asgd at its defaults keeps "
        f"the earlier ≤ {RATIO_TARGET}. Several asynchronous arms are compared with one "
        "sync: the best of them is the best of several draws, so read its interval, not its "
        "point." + absent
    )
    why = explain(groups, compute_ms, asyncs)
    report.data.update(why)
    report.section("Why: throughput, samples needed, CPU").text(why["text"])
    report.curves(groups, 0)
    rows = []
    for name, rs in groups.items():
        median, censored = harness.censored_median(times[name], budget)
        rows.append([name, " / ".join(fmt(t) for t in times[name]), fmt(median), censored,
                     " / ".join(pct(final_acc(r)) for r in rs), fmt(harness.median(samples[name])),
                     fmt(med(rs, "samples/s")), fmt(med(rs, "ms/step w0")),
                     fmt(harness.median(fast_ms(r) for r in rs)), fmt(med(rs, "wait ms/step")),
                     fmt(med(rs, "job cores")), fmt(med(rs, "CPU ms/step"))])  # fmt: skip
    report.section("Every arm").table(
        ["arm", f"time to {100 * PRIMARY:g} % per seed (s)", "median (s)", "censored",
         "last eval acc %", f"samples at {100 * PRIMARY:g} % (median)",
         "samples/s, all training", "ms/step straggler",
         "ms/step others", "comm wait ms/step", "job's cores", "CPU ms/worker step"], rows,
    )  # fmt: skip
    report.text(
        "Medians over seeds. *All training*: the window from 1 s after the clock started to "
        "the first worker's last step (every worker training). *ms/step*: the straggler "
        f"(worker 0; padded to ≥ {2000 * MIN_STEP_S:.0f} ms) and the median of the others "
        f"(≥ {1000 * MIN_STEP_S:.0f} ms in asynchronous arms, the straggler's pace in lockstep "
        "ones), communication waits included. *Job's cores*: CPU time of all the job's "
        "processes (/proc/<pid>/stat, the server's included) ÷ the window; *CPU ms/worker "
        f"step*: the same ÷ the workers' steps in it. *Samples at {100 * PRIMARY:g} %*: the "
        "global sample count at the evaluation that starts the held run."
    )
    report.write(runs)


# Each stragglers arm: (flags, "lockstep" | "async"). Compensators at the package's defaults
# (λ etc.): nothing is tuned on the runs that judge them.
COMPENSATORS = ("scale", "dc", "dc-adaptive", "gap", "delay-adaptive")
STRAGGLER_ARMS: dict[str, tuple[list[str], str]] = {
    "sync": (["--strategy", "sync"], "lockstep"),
    "asgd": (["--strategy", "asgd"], "async"),
    **{
        f"asgd {c}": (["--strategy", "asgd", "--staleness-compensation", c], "async")
        for c in COMPENSATORS
    },  # fmt: skip
    "diloco": (["--strategy", "diloco"], "lockstep"),
    "async_diloco": (["--strategy", "async_diloco"], "async"),
    "async_diloco dylu": (["--strategy", "async_diloco", "--dylu"], "async"),
}

# What a default run measures (7 arms with the A/A, 35 runs, ~19 min on an idle machine): the
# compensator is the one named before any run (DC-ASGD with adaptive λ, the variant Zheng et al.
# 2017 report best); ``--arms all`` adds the other four (~12 min more).
DEFAULT_ARMS = ("sync", "asgd", "asgd dc-adaptive", "diloco", "async_diloco", "async_diloco dylu")
QUICK_ARMS = ("sync", "asgd", "asgd scale", "diloco", "async_diloco")  # --quick's default


def cli_help() -> str:
    """``cloudburst train --help`` of the package under test (what flags this commit has)."""
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [*harness.CLI, "train", "--help"]
    return subprocess.run(cmd, cwd=harness.REPO, capture_output=True, text=True, env=env).stdout


def supported(names: Sequence[str], help_text: str) -> tuple[list[str], list[str]]:
    """(the arms this commit's ``--help`` has every flag and value of, the others); before
    ``--staleness-compensation``, ``scale`` was ``--staleness-scaling``."""
    ok, missing = [], []
    for name in names:
        flags, _ = STRAGGLER_ARMS[name]
        old = ["--staleness-compensation", "scale"]
        if "--staleness-compensation" not in help_text and flags[-2:] == old:
            flags = [*flags[:-2], "--staleness-scaling"]
        needs = [f for f in flags if f.startswith("--")]  # each flag, and the values of these
        needs += [v for f, v in zip(flags, flags[1:], strict=False)
                  if f in ("--strategy", "--staleness-compensation")]  # fmt: skip
        (ok if all(n in help_text for n in needs) else missing).append(name)
        STRAGGLER_ARMS[name] = (flags, STRAGGLER_ARMS[name][1])
    return ok, missing


def final_acc(r: harness.Run) -> float | None:
    """The run's last evaluated accuracy (the global model's), else its summary's final one."""
    return None if r.failed else r.evals[-1][2] if r.evals else r.final_accuracy


def diloco_levels(runs: Sequence[harness.Run]) -> list[float] | None:
    """Per seed, DiLoCo's final accuracy − ``DILOCO_BAND`` points (None if a run failed)."""
    accs = [final_acc(r) for r in runs]
    if not accs or any(a is None for a in accs):
        return None
    return [a - DILOCO_BAND / 100 for a in accs]  # type: ignore[operator]


def time_to_level(r: harness.Run, level: float) -> float | None:
    return None if r.failed else harness.time_to_target(r.evals, level)


def step_compute_ms(out_dir: Path, steps: int, flags: Sequence[str] = ()) -> float | None:
    """The real compute of one training step in ms (``flags``: the model, data, batch): one
    worker, no padding, ``steps`` steps (one process on an idle machine: time = CPU)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    argv = [*flags, "--strategy", "sync", "--workers", "1", "--steps", str(steps)]
    r = harness.run_train(Arm("one process", [*argv, "--eval-every-s", "1e6"]), 0, out_dir)
    wall = r.summary.get("wall_time_s")
    return None if r.failed or not wall else 1000 * wall / steps


def samples_to(r: harness.Run, target: float = TARGET) -> int | None:
    """The global samples at the evaluation where the held time to ``target`` starts."""
    t = time_to_level(r, target)
    return next((s for when, s, _ in r.evals if when == t), None)


def fast_ms(r: harness.Run) -> float | None:
    """The median ms/step of the workers other than worker 0 (the straggler)."""
    others = [v for k, v in r.values.items() if k.startswith("ms/step w") and k[9:] != "0"]
    return harness.median(others)


def med(rs: Sequence[harness.Run], key: str) -> float | None:
    """The median of the runs' ``values[key]``."""
    return harness.median(r.values.get(key) for r in rs)


def explain(
    groups: dict[str, list[harness.Run]], compute_ms: float | None, asyncs: Sequence[str] = ()
) -> dict:
    """Each time ratio decomposed by measurement: each arm ÷ sync in samples/s while every
    worker trains and in samples needed to hold ``PRIMARY``; and the CPU the job used."""
    sync = groups["sync straggler"]
    per_arm: dict[str, dict[str, float | None]] = {}
    for name, rs in groups.items():
        if name.startswith("sync ") or not name.endswith(" straggler"):
            continue
        thr = ratio(med(rs, "samples/s"), med(sync, "samples/s"))
        need = ratio(*(harness.median(samples_to(r, PRIMARY) for r in x) for x in (rs, sync)))
        per_arm[name.removesuffix(" straggler")] = {
            "throughput_ratio": thr,
            "samples_needed_ratio": need,
            "predicted_time_ratio": ratio(need, thr),
        }
    everyone = [r for rs in groups.values() for r in rs]
    cores, machine = med(everyone, "job cores"), med(everyone, "machine cores")
    ncores, padded, asgd = os.cpu_count() or 1, 1000 * MIN_STEP_S, per_arm.get("asgd", {})
    keys = ("throughput_ratio", "samples_needed_ratio", "predicted_time_ratio")
    out = {"one_process_step_ms": compute_ms, **{k: asgd.get(k) for k in keys},
           "per_arm": per_arm, "job_cores": cores, "machine_cores": machine}  # fmt: skip
    lines = []
    if compute_ms is not None:
        share = 4 * compute_ms / (ncores * padded)
        lines.append(
            f"- **Compute vs padding.** One process, no padding: {fmt(compute_ms)} ms of real "
            f"compute per step (batch {BATCH}). Four workers need 4 × {fmt(compute_ms)} ms per "
            f"{fmt(padded)} ms padded step of the {ncores} cores' {fmt(ncores * padded)} ms: "
            f"{100 * share:.0f} %, so the emulated step is "
            + ("sleep, not compute." if share < 0.5 else "**not** sleep-dominated.")
        )
    if cores is not None:
        lines.append(
            f"- **CPU in the runs.** All the job's processes together kept {fmt(cores)} of "
            f"the {ncores} cores busy while every worker trained (median over runs, servers, "
            f"communication and evaluation included; the whole machine: {fmt(machine)} "
            "cores). " + ("The job is not what limits the arms." if cores < 0.6 * ncores else
                          "**The job is CPU-bound here**: its steps are longer than the padding.")
        )  # fmt: skip
    if asyncs:
        fast = harness.median(fast_ms(r) for n in asyncs for r in groups[f"{n} straggler"])
        lines.append(
            f"- **Pace.** The asynchronous arms' fast workers take {fmt(fast)} ms per step "
            f"(padded {fmt(padded)}); sync moves at the straggler's "
            f"{fmt(med(sync, 'ms/step w0'))} ms per step (padded {fmt(2 * padded)}: its "
            "all-reduce and the evaluations' stalls add to it)."
        )
    need = {n: v["samples_needed_ratio"] for n, v in per_arm.items()}
    more = ", ".join(n for n, x in need.items() if x is not None and x > 1) or "none"
    lines += [
        f"- **Per arm, ÷ sync** (ideal throughput {IDEAL_THROUGHPUT:g} for an asynchronous "
        "arm): the time ratio is about samples needed ÷ throughput. Arms that needed more "
        f"samples than sync to hold {100 * PRIMARY:g} % (median): {more}.",
        "",
    ]
    lines += harness.md_table(
        [
            "arm",
            "samples/s ÷ sync's",
            f"samples to hold {100 * PRIMARY:g} % ÷ sync's",
            "predicted time ratio",
        ],
        [[n, *(fmt(v[k]) for k in keys)] for n, v in per_arm.items()],
    )
    out["text"] = "\n".join(lines) if per_arm or compute_ms else "(no measurements)"
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------- what a run used
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command name (None once the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


class CpuSampler:
    """CPU used over time by the machine and by the job's own ranks (pids from their ``start``
    records), read from /proc every ``every_s`` by a thread (a context manager)."""

    def __init__(self, out_dir: str | Path, every_s: float = 0.1):
        self.out_dir, self.every_s = Path(out_dir), every_s
        self.pids: set[int] = set()
        #: (wall, machine busy CPU-s, the job's CPU-s) per sample
        self.samples: list[tuple[float, float, float]] = []
        self._last_cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _find_pids(self) -> None:
        for path in self.out_dir.glob("metrics/rank*.jsonl"):
            try:
                with path.open() as f:
                    first = json.loads(f.readline())
            except (OSError, json.JSONDecodeError):
                continue
            if first.get("event") == "start" and isinstance(first.get("pid"), int):
                self.pids.add(first["pid"])

    def _sample(self) -> None:
        try:
            total, idle = harness.cpu_ticks()
        except (OSError, ValueError, IndexError):
            return
        for pid in self.pids:
            if (st := _stat(pid)) is not None:  # an exited rank keeps its last reading
                self._last_cpu[pid] = (int(st[11]) + int(st[12])) / TICKS_PER_S  # utime, stime
        busy = (total - idle) / TICKS_PER_S
        self.samples.append((time.time(), busy, sum(self._last_cpu.values())))

    def _loop(self) -> None:
        while True:
            self._find_pids()
            self._sample()
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def cores(self, t0_wall: float, t1_wall: float) -> tuple[float, float] | None:
        """(the machine's busy cores, the job's cores) on average between two wall times."""
        inside = [s for s in self.samples if t0_wall <= s[0] <= t1_wall]
        if len(inside) < 2:
            return None
        (w0, m0, j0), (w1, m1, j1) = inside[0], inside[-1]
        return (m1 - m0) / (w1 - w0), (j1 - j0) / (w1 - w0)


def worker_records(out_dir: str | Path) -> dict[int, list[dict]]:
    """Each worker's metrics records, by worker index (servers left out)."""
    files: dict[str, list[dict]] = {}
    for name, r in harness.records(out_dir):
        files.setdefault(name, []).append(r)
    out: dict[int, list[dict]] = {}
    for recs in files.values():
        role = next((r.get("role", "") for r in recs if r.get("event") == "start"), "")
        if role.startswith("worker") and role[6:].isdigit():
            out[int(role[6:])] = recs
    return out


def _interpolate(points: list[tuple[float, float]], t: float) -> float:
    i = bisect.bisect_left([p[0] for p in points], t)
    if i == 0 or i >= len(points):
        return float(points[min(i, len(points) - 1)][1])
    (t0, s0), (t1, s1) = points[i - 1], points[i]
    return s0 + (s1 - s0) * (t - t0) / (t1 - t0)


def pace(out_dir: str | Path, batch_size: int, cpu: CpuSampler) -> dict | None:
    """How a run trained while every worker did (1 s in, or a quarter of a short run, to the
    first worker's last step): samples/s, ms per step, waits, cores, CPU ms per worker step."""
    steps, waits, ends, firsts = {}, {}, [], []
    for w, recs in worker_records(out_dir).items():
        logged = [r for r in recs if r.get("event") == "step"]
        steps[w] = [(0.0, 0)] + [(r["time_s"], r["step"]) for r in logged]
        waits[w] = [(0.0, 0.0)] + [(r["time_s"], r.get("comm_wait_s", 0.0)) for r in logged]
        ends.append(steps[w][-1][0])
        firsts += [r["wall"] for r in recs if r.get("event") == "first_step"]
    end = min(ends, default=0.0)
    a, b = min(1.0, 0.25 * end), end - 0.2  # past the start-up, before the first worker's end
    if not firsts or b - a < 0.5:
        return None

    def gain(points: list[tuple[float, float]]) -> float:
        return _interpolate(points, b) - _interpolate(points, a)

    rates = {w: gain(p) / (b - a) for w, p in sorted(steps.items())}
    origin = min(firsts)  # the clock's origin, give or take the first step
    machine, job = cpu.cores(origin + a, origin + b) or (None, None)
    per_s = sum(rates.values()) * batch_size
    waits_ms = [1000 * gain(waits[w]) / (r * (b - a)) for w, r in rates.items() if r > 0]
    return {"samples/s": per_s, **{f"ms/step w{w}": 1000 / r for w, r in rates.items() if r > 0},
            "wait ms/step": statistics.median(waits_ms), "job cores": job, "machine cores": machine,
            "CPU ms/step": None if job is None else 1000 * job / (per_s / batch_size)}  # fmt: skip


def measured_run(run: Callable[[], harness.Run], out_dir: Path, batch_size: int) -> harness.Run:
    """``run()`` (a training job into ``out_dir``) with its CPU sampled and its :func:`pace` in
    the Run's ``values``."""
    shutil.rmtree(out_dir, ignore_errors=True)
    with CpuSampler(out_dir) as cpu:
        r = run()
    r.values.update(pace(out_dir, batch_size, cpu) or {})
    return r


def main() -> None:
    def add(p) -> None:
        p.add_argument("experiment", choices=("accuracy", "stragglers"))
        p.add_argument("--epochs", type=int, help="accuracy: epochs per worker (the CLI's 64)")
        p.add_argument("--steps", type=int, default=STEPS, help="stragglers: sync's steps/worker")
        p.add_argument("--first-seed", type=int, default=0, help="fresh seeds confirm a choice")
        p.add_argument(
            "--arms",
            help=f"comma-separated, of {', '.join(STRAGGLER_ARMS)}, or all "
            f"(stragglers' default: {','.join(DEFAULT_ARMS)}; accuracy's: every "
            "strategy, and sync always)",
        )

    args, prov = harness.start(__doc__, add)
    {"accuracy": accuracy, "stragglers": stragglers}[args.experiment](args, prov)


if __name__ == "__main__":
    main()
