"""The defaults against the settings they were chosen from: each strategy with a knob that
mattered, at its defaults and with each candidate (``cloudburst train --strategy S --workers 4
--epochs 32`` plus the candidate's flags), interleaved, final test accuracy.

    .venv/bin/python benchmarks/defaults.py [--quick] [--seeds N]

Claim per strategy: the defaults' accuracy minus the best candidate's ≥ −1 point (a default
no worse than what it was chosen against). That every strategy's defaults train at all, over
5 seeds, is ``experiments.py accuracy``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Arm, pct  # noqa: E402

CANDIDATES: dict[str, list[list[str]]] = {
    "diloco": [
        ["--diloco-outer-lr", "0.7", "--optimizer", "adam", "--lr", "0.001"],
        ["--diloco-outer-lr", "0.7"],
    ],
    "asgd": [["--server-lr", "1"]],
    "easgd": [["--easgd-tau", "4"]],
    "gossip": [["--gossip-schedule", "random"]],
}
BAND_POINTS = 1.0


def main() -> None:
    args = harness.parse_args(__doc__)
    prov = harness.Provenance.capture(args)
    seeds = range(args.seeds or 1)
    budget = ["--steps", "30"] if args.quick else ["--epochs", "32"]
    common = ["--workers", "4", *budget, "--eval-every-s", "10"]
    strategies = ["asgd"] if args.quick else list(CANDIDATES)
    arms = []
    for s in strategies:
        arms.append(Arm(f"{s} defaults", ["--strategy", s, *common]))
        arms += [Arm(f"{s} {' '.join(c)}", ["--strategy", s, *common, *c]) for c in CANDIDATES[s]]
    runs = harness.interleave(arms, seeds, prov=prov, out_root=harness.RUNS / "defaults")
    groups = harness.by_arm(runs)
    report = harness.Report("defaults", "The defaults against the candidates", prov)

    def mean_acc(name: str) -> float:
        return statistics.fmean(r.final_accuracy or 0.0 for r in groups[name])

    rows = []
    for s in strategies:
        default = mean_acc(f"{s} defaults")
        best = max(mean_acc(f"{s} {' '.join(c)}") for c in CANDIDATES[s])
        diff = round(100 * (default - best), 2)
        report.claim(
            f"{s}: defaults − best candidate (points)", diff, f"≥ −{BAND_POINTS:g}",
            diff >= -BAND_POINTS, seeds=len(seeds),
        )  # fmt: skip
        for name in [f"{s} defaults", *(f"{s} {' '.join(c)}" for c in CANDIDATES[s])]:
            rows.append([name, " / ".join(pct(r.final_accuracy) for r in groups[name])])
    report.settings(
        f"MNIST-1D, the paper's CNN, 4 workers, `{' '.join(budget)}`, seeds {list(seeds)}, "
        "arms interleaved. A failed run counts as 0 % (see the runs in the .json)."
    )
    report.section("Every arm").table(["arm", "final acc % (seeds)"], rows)
    report.write(runs)


if __name__ == "__main__":
    main()
