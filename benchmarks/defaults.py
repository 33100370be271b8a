"""The defaults against the best known alternatives, 5 seeds, interleaved (4 workers, the
accuracy benchmark's budget).

    .venv/bin/python benchmarks/defaults.py [--quick] [--seeds N] [--only asgd|others]

``others``: each default against ``CANDIDATES`` on its seeds in ``results/accuracy.json``
(claim: defaults − best candidate ≥ −1 point). ``asgd``: candidates chosen on seeds 0-4, the
choice confirmed on seeds 5-9 (within ±0.5 points of sync, judged against sync and its A/A
copy, every seed ≥ 91 %). Details:
benchmarks/README.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from experiments import ASGD_BAND, ASGD_FLOOR  # noqa: E402
from harness import Arm, fmt, pct  # noqa: E402

#: The best known alternatives to each default (issue 25 item 4), named before the run:
#: DiLoCo's outer lr over SGD (default 0.1) and over Adam (inner lr 1e-3; 0.7 is its default
#: there), EASGD's communication period τ = 4 (default 10), gossip's random peers. asgd's
#: candidates (``--n-sync 1``, a compensator) are the ``asgd`` part's.
ADAM = ["--optimizer", "adam", "--lr", "0.001"]
CANDIDATES: dict[str, list[list[str]]] = {
    "diloco": [
        ["--diloco-outer-lr", "0.3"],
        ["--diloco-outer-lr", "0.7"],
        [*ADAM, "--diloco-outer-lr", "0.3"],
        [*ADAM, "--diloco-outer-lr", "0.7"],
    ],
    "easgd": [["--easgd-tau", "4"]],
    "gossip": [["--gossip-schedule", "random"]],
}
BAND_POINTS = 1.0
COMPENSATOR = "dc-adaptive"
ASGD_ARMS = {
    "sync": ["--strategy", "sync"],
    "asgd": ["--strategy", "asgd"],
    "asgd --n-sync 1": ["--strategy", "asgd", "--n-sync", "1"],
    f"asgd --staleness-compensation {COMPENSATOR}": [
        "--strategy", "asgd", "--staleness-compensation", COMPENSATOR,
    ],
}  # fmt: skip
COMMON = ["--workers", "4", "--eval-every-s", "10"]  # the accuracy benchmark's (64 epochs)


def others(args, prov: harness.Provenance, report: harness.Report) -> list[harness.Run]:
    source = prov.results_dir() / "accuracy.json"
    if not source.is_file():
        sys.exit(f"defaults: {source} does not exist; run experiments.py accuracy first")
    accuracy = json.loads(source.read_text())
    defaults: dict[str, dict[int, float | None]] = {}
    for r in accuracy["runs"]:
        defaults.setdefault(r["arm"], {})[r["seed"]] = r["summary"].get("final_test_accuracy")
    # the seeds of the defaults' runs (experiments.py accuracy: 5-9, which chose nothing)
    seeds = sorted(defaults.get("sync", {}))[: args.seeds or (1 if args.quick else 5)]
    strategies = [s for s in CANDIDATES if s in defaults]
    missing = [(s, i) for s in strategies for i in seeds if i not in defaults[s]]
    if missing or not strategies:
        sys.exit(f"defaults: {source} lacks the defaults' runs {missing or list(CANDIDATES)}")
    # the same budget as the defaults' runs: accuracy.json's --steps/--epochs flags
    common = accuracy["data"]["argv"]["sync"][2:]  # after "--strategy sync"
    arms = [Arm(f"{s} {' '.join(c)}", ["--strategy", s, *common, *c])
            for s in strategies for c in CANDIDATES[s]]  # fmt: skip
    runs = harness.interleave(arms, seeds, prov=prov, out_root=prov.runs_dir("defaults"))
    groups = harness.by_arm(runs)
    rows = []
    for s in strategies:
        default = [defaults[s][i] or 0.0 for i in seeds]
        rows.append([f"{s} (defaults, from accuracy.json)", " / ".join(pct(a) for a in default)])
        cands = {
            arm: [r.final_accuracy or 0.0 for r in groups[arm]]
            for arm in (f"{s} {' '.join(c)}" for c in CANDIDATES[s])
        }
        rows += [[arm, " / ".join(pct(a) for a in accs)] for arm, accs in cands.items()]
        best_accs = max(cands.values(), key=statistics.fmean)  # the first best on a tie
        harness.diff_claim(report, f"{s}: defaults − best candidate (points)", default, best_accs,
                           f"≥ −{BAND_POINTS:g}", lambda d, lo, hi: d >= -BAND_POINTS,
                           seeds=len(seeds))  # fmt: skip
    report.section("Every strategy's candidates").text(
        f"`{' '.join(common)}`, seeds {list(seeds)}, arms interleaved; the defaults' runs from "
        f"`{source.name}` (commit `{accuracy['provenance']['commit']}`). A failed run counts "
        "as 0 %; the interval is the paired t interval of the mean difference."
    ).table(["arm", "final acc % (seeds)"], rows)
    return runs


def asgd(args, prov: harness.Provenance, report: harness.Report) -> list[harness.Run]:
    n = args.seeds or (1 if args.quick else 5)
    choose, confirm = range(n), range(n, 2 * n)
    common = [*COMMON[:2], "--steps", "30", *COMMON[2:]] if args.quick else COMMON
    arms = [Arm(name, [*flags, *common]) for name, flags in ASGD_ARMS.items()]
    root = prov.runs_dir("defaults_asgd")
    runs = harness.interleave(arms, choose, control="sync", prov=prov, out_root=root)
    g = harness.by_arm(runs)
    acc = {a: [r.final_accuracy or 0.0 for r in rs] for a, rs in g.items()}
    train = {a: [r.summary.get("wall_time_s") for r in rs] for a, rs in g.items()}
    rows, winners = [], []
    for name in g:
        d_acc = 100 * (statistics.fmean(acc[name]) - statistics.fmean(acc["asgd"]))
        t = None not in train[name] + train["asgd"]
        t_ratio = harness.paired_ratio(train[name], train["asgd"])[0] if t else None
        wins = name.startswith("asgd ") and d_acc > 0 and t_ratio is not None and t_ratio <= 1
        winners += [(d_acc, name)] if wins else []
        rows.append([name, " / ".join(pct(a) for a in acc[name]), pct(statistics.fmean(acc[name])),
                     pct(min(acc[name])), fmt(d_acc), fmt(harness.median(train[name])),
                     fmt(t_ratio), "wins" if wins else "-"])  # fmt: skip
    chosen = max(winners)[1] if winners else "asgd"
    _asgd_claims(report, acc, "asgd", f"seeds {choose[0]}-{choose[-1]}")
    report.section("asgd at the defaults: choosing (issue 28 item 3)").text(
        f"`{' '.join(common)}`, seeds {list(choose)}, arms interleaved. A candidate wins when "
        "its mean final accuracy is above asgd's defaults AND the median of its per-seed "
        "train-time ratios to them is ≤ 1; the best winner is confirmed below on other seeds."
        f" Chosen: **{chosen}**" + ("" if winners else " (no candidate won: the default stays)")
    ).table(["arm", "final acc % (seeds)", "mean", "worst", "− asgd default (points)",
             "train s (median)", "train time ÷ asgd default's (paired median)", "verdict"],
            rows)  # fmt: skip
    keep = ["sync", "asgd"] + ([chosen] if chosen != "asgd" else [])
    arms2 = [a for a in arms if a.name in keep]
    runs2 = harness.interleave(arms2, confirm, control="sync", prov=prov, out_root=root)
    acc2 = {a: [r.final_accuracy or 0.0 for r in rs] for a, rs in harness.by_arm(runs2).items()}
    _asgd_claims(report, acc2, chosen, f"confirmed on seeds {confirm[0]}-{confirm[-1]}")
    report.section("asgd at the defaults: confirming on other seeds").text(
        f"Seeds {list(confirm)}, which chose nothing, arms interleaved."
    ).table(
        ["arm", "final acc % (seeds)", "mean", "worst"],
        [
            [a, " / ".join(pct(x) for x in v), pct(statistics.fmean(v)), pct(min(v))]
            for a, v in acc2.items()
        ],
    )
    report.data["asgd"] = {"chosen": chosen, "winners": winners, "argv": dict(ASGD_ARMS)}
    return runs + runs2


def _asgd_claims(report: harness.Report, acc: dict[str, list[float]], name: str, last: str):
    """``name`` − sync within ±``ASGD_BAND`` points (paired interval) and its worst seed."""
    seeds = len(acc[name])
    harness.diff_claim(report, f"final accuracy, {name} − sync (points), W = 4, defaults, {last}",
                       acc[name], acc["sync"], f"within ±{ASGD_BAND:g}",
                       lambda d, lo, hi: abs(d) <= ASGD_BAND, seeds=seeds,
                       aa_copy=acc.get(harness.aa_name("sync")))  # fmt: skip
    report.claim(
        f"{name}: every seed ≥ {100 * ASGD_FLOOR:.0f} %, W = 4, defaults, {last}",
        pct(min(acc[name])),
        f"≥ {100 * ASGD_FLOOR:.0f}",
        min(acc[name]) >= ASGD_FLOOR,
        seeds=seeds,
    )


def main() -> None:
    def add(p) -> None:
        p.add_argument("--only", choices=("asgd", "others"), help="one of the two parts")

    args, prov = harness.start(__doc__, add)
    report = harness.Report("defaults", "The defaults against the candidates", prov)
    report.settings("MNIST-1D, the paper's CNN, 4 workers.\n\n" + harness.about(__doc__))
    runs = []
    if args.only != "asgd":
        runs += others(args, prov, report)
    if args.only != "others":
        runs += asgd(args, prov, report)
    report.write(runs)


if __name__ == "__main__":
    main()
