"""Training experiments on MNIST-1D with 4 workers: accuracy and stragglers.

    .venv/bin/python benchmarks/experiments.py accuracy [--quick] [--seeds N] [--epochs E]
    .venv/bin/python benchmarks/experiments.py stragglers [--quick] [--seeds N] [--steps N]

``accuracy`` — every strategy at its defaults (``cloudburst train --strategy S --workers 4``,
the MNIST-1D paper's CNN, 64 epochs of each worker's shard), 5 seeds, interleaved: each
strategy's mean final test accuracy minus sync's, within ±1 point, with a bootstrap
interval; and every seed ≥ 90 % (the defaults train). No device emulation: this is about
accuracy, not speed.

``stragglers`` — time to 90 % (held for k = 3 evaluations), asgd ÷ sync, worker 0 2× slower,
every step padded to an emulated 20 ms device step (4 CPU-bound workers and a server share 2
cores here: without the padding compute contention, not the straggler, would decide). Ideal
W / (s(W − 1) + 1) = 4/7 = 0.57 with s = 2: sync moves at the straggler's pace, asgd's
throughput is that of 3.5 workers. Target ≤ 0.75. sync runs twice per seed (the A/A control);
``--context`` adds both strategies without the straggler (the ratio an even machine gives).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Arm, fmt, pct  # noqa: E402

from cloudburst.plot import plot_runs  # noqa: E402

STRATEGIES = ("sync", "asgd", "easgd", "gossip", "local_sgd", "diloco", "daso")
TARGET = 0.90
BAND_POINTS = 1.0  # each strategy's final accuracy within this many points of sync's
MIN_STEP_S = 0.02
RATIO_TARGET = 0.75
IDEAL_RATIO = 4 / (2 * 3 + 1)
COMMON = ["--workers", "4"]


def samples_per_s(r: harness.Run) -> float:
    return r.summary.get("samples", 0) / (r.summary.get("wall_time_s") or float("inf"))


def accuracy(args) -> None:
    prov = harness.Provenance.capture(args)
    seeds = range(args.seeds or (1 if args.quick else 5))
    budget = ["--steps", "30"] if args.quick else []
    if args.epochs and not args.quick:
        budget = ["--epochs", str(args.epochs)]
    budget += ["--eval-every-s", "10"]  # only the final accuracy counts here
    names = ("sync", "asgd") if args.quick else STRATEGIES
    arms = [Arm(s, ["--strategy", s, *COMMON, *budget]) for s in names]
    runs = harness.interleave(arms, seeds, prov=prov, out_root=prov.runs_dir("accuracy"))
    groups = harness.by_arm(runs)
    report = harness.Report(
        "accuracy", "Final test accuracy of every strategy at its defaults", prov
    )
    report.data["argv"] = {a.name: list(a.argv) for a in arms}
    sync = [r.final_accuracy for r in groups["sync"]]
    rows = []
    for name, rs in groups.items():
        accs = [r.final_accuracy for r in rs]
        done = [a for a in accs if a is not None]
        if name != "sync" and done and all(a is not None for a in sync):
            diff, lo, hi = harness.bootstrap_difference(done, sync)
            report.claim(
                f"final accuracy, {name} − sync (points), W = 4, defaults",
                round(100 * diff, 2), f"within ±{BAND_POINTS:g}",
                abs(100 * diff) <= BAND_POINTS and len(done) == len(accs),
                interval=(round(100 * lo, 2), round(100 * hi, 2)), seeds=len(accs),
                note="" if len(done) == len(accs) else f"{len(accs) - len(done)} runs failed",
            )  # fmt: skip
        rows.append(
            [
                name,
                " / ".join(pct(a) for a in accs),
                pct(statistics.fmean(done)) if done else "-",
                pct(min(done, default=None)),
                sum(a is not None and a >= TARGET for a in accs),
                fmt(statistics.median(r.summary.get("wall_time_s", 0.0) for r in rs)),
                fmt(statistics.median(r.wall_s for r in rs)),
            ]
        )
    worst = [min((r.final_accuracy or 0.0) for r in rs) for rs in groups.values()]
    report.claim(
        f"defaults train: every strategy, every seed ≥ {100 * TARGET:.0f} %",
        pct(min(worst)), f"≥ {100 * TARGET:.0f}", min(worst) >= TARGET, seeds=len(seeds),
    )  # fmt: skip
    report.settings(
        f"MNIST-1D (4000 train / 1000 test), the paper's CNN, 4 workers, every strategy's "
        f"defaults, `{' '.join(budget)}`, seeds {list(seeds)}, arms interleaved (order rotated "
        "per seed). Final = the global model at the end (asgd/easgd: the servers' θ). The "
        "interval is a bootstrap 95 % interval of the difference of means (seeds resampled). "
        "No A/A pair: sync is deterministic on CPU for its seed (twice gives the same run), "
        "so the noise is the seed-to-seed spread, which the interval carries."
    )
    report.section("Every strategy").table(
        ["strategy", "final acc % (seeds)", "mean", "worst", f"seeds ≥ {100 * TARGET:.0f} %",
         "train s (median)", "command s (median)"],
        rows,
    )  # fmt: skip
    report.write(runs)


def stragglers(args) -> None:
    prov = harness.Provenance.capture(args)
    seeds = range(args.seeds or (1 if args.quick else 5))
    steps = 40 if args.quick else args.steps
    common = [*COMMON, "--steps", str(steps), "--min-step-time-s", str(MIN_STEP_S)]
    common += ["--eval-every-s", "0.5"]
    conditions = {"straggler": ["--straggler", "0:2"]}
    if args.context:
        conditions["none"] = []
    arms = [
        Arm(f"{s} {c}", ["--strategy", s, *common, *extra])
        for c, extra in conditions.items()
        for s in ("sync", "asgd")
    ]
    runs = harness.interleave(
        arms, seeds, control="sync straggler", prov=prov, out_root=prov.runs_dir("stragglers")
    )
    groups = harness.by_arm(runs)
    budget = harness.budget_of(runs)
    times = {name: harness.times_to(rs, TARGET) for name, rs in groups.items()}
    report = harness.Report("stragglers", "Time to 90 % with a 2× straggler: asgd ÷ sync", prov)
    harness.ratio_claim(
        report, "time to 90 %, asgd ÷ sync, W = 4, one worker 2× slower",
        times["asgd straggler"], times["sync straggler"],
        times[harness.aa_name("sync straggler")], f"≤ {RATIO_TARGET} (ideal {IDEAL_RATIO:.2f})",
        lambda r: r <= RATIO_TARGET, budget,
    )  # fmt: skip
    if "none" in conditions:
        harness.ratio_claim(
            report, "time to 90 %, asgd ÷ sync, no straggler (context)",
            times["asgd none"], times["sync none"], None, "-", lambda r: None, budget,
        )  # fmt: skip
    rows = []
    for name, rs in groups.items():
        median, censored = harness.censored_median(times[name], budget)
        rows.append(
            [name, " / ".join(fmt(t) for t in times[name]), fmt(median), censored,
             " / ".join(pct(r.final_accuracy) for r in rs),
             fmt(statistics.median(samples_per_s(r) for r in rs))]
        )  # fmt: skip
    report.settings(
        f"MNIST-1D, the paper's CNN, 4 workers (asgd: 1 server shard, λ = 1/W), {steps} steps "
        f"per worker, every step padded by sleeping to ≥ {1000 * MIN_STEP_S:.0f} ms, worker 0's "
        "step ×2 (`--straggler 0:2`), evaluation every 0.5 s on worker 0, off the clock. The "
        "straggler is the evaluator because under asgd the fast workers finish their steps "
        "first: a fast evaluator would stop evaluating while the straggler still trains. "
        "Time to 90 %: first "
        f"evaluation held ≥ 90 % for {harness.K_CONSECUTIVE} evaluations; runs that never hold "
        f"it are censored at {fmt(budget)} s and counted. Seeds {list(seeds)}, arms interleaved."
    )
    first = [rs[0] for rs in groups.values() if rs[0].out_dir and rs[0].evals]
    png = report.path().with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_runs([r.out_dir for r in first], str(png), "seed 0", [r.arm for r in first])
    report.figure(png, "test error against time and samples, seed 0")
    report.section("Every arm").table(
        ["arm", "time to 90 % per seed (s)", "median (s)", "censored", "final acc %",
         "samples/s (median)"],
        rows,
    )  # fmt: skip
    report.write(runs)


def main() -> None:
    def add(p) -> None:
        p.add_argument("experiment", choices=("accuracy", "stragglers"))
        p.add_argument("--epochs", type=int, help="accuracy: epochs per worker (the CLI's 64)")
        p.add_argument("--steps", type=int, default=700, help="stragglers: steps per worker")
        p.add_argument(
            "--context", action="store_true", help="stragglers: also run both with no straggler"
        )

    args = harness.parse_args(__doc__, add)
    {"accuracy": accuracy, "stragglers": stragglers}[args.experiment](args)


if __name__ == "__main__":
    main()
