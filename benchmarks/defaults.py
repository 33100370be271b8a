"""The defaults against the settings they were chosen from: each strategy with a knob that
mattered, run with each candidate (``cloudburst train --strategy S --workers 4`` plus the
candidate's flags), final test accuracy against the same seeds' runs at the defaults in
``results/accuracy.json`` (``experiments.py accuracy``, which runs first in ``make bench``).

    .venv/bin/python benchmarks/defaults.py [--quick] [--seeds N]

Claim per strategy: the defaults' mean accuracy minus the best candidate's ≥ −1 point (a
default no worse than what it was chosen against).
"""

from __future__ import annotations

import json
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
    args, prov = harness.start(__doc__)
    source = prov.results_dir() / "accuracy.json"
    if not source.is_file():
        sys.exit(f"defaults: {source} does not exist; run experiments.py accuracy first")
    accuracy = json.loads(source.read_text())
    defaults: dict[str, dict[int, float | None]] = {}
    for r in accuracy["runs"]:
        defaults.setdefault(r["arm"], {})[r["seed"]] = r["summary"].get("final_test_accuracy")
    seeds = range(args.seeds or 1)
    strategies = [s for s in CANDIDATES if s in defaults]
    missing = [(s, i) for s in strategies for i in seeds if i not in defaults[s]]
    if missing or not strategies:
        sys.exit(f"defaults: {source} lacks the defaults' runs {missing or list(CANDIDATES)}")
    # the same budget as the defaults' runs: accuracy.json's --steps/--epochs flags
    common = accuracy["data"]["argv"]["sync"][2:]  # after "--strategy sync"
    arms = [
        Arm(f"{s} {' '.join(c)}", ["--strategy", s, *common, *c])
        for s in strategies
        for c in CANDIDATES[s]
    ]
    runs = harness.interleave(arms, seeds, prov=prov, out_root=prov.runs_dir("defaults"))
    groups = harness.by_arm(runs)
    report = harness.Report("defaults", "The defaults against the candidates", prov)
    rows = []
    for s in strategies:
        default = [defaults[s][i] or 0.0 for i in seeds]
        rows.append([f"{s} (defaults, from accuracy.json)", " / ".join(pct(a) for a in default)])
        best = -1.0
        for c in CANDIDATES[s]:
            rs = groups[f"{s} {' '.join(c)}"]
            best = max(best, statistics.fmean(r.final_accuracy or 0.0 for r in rs))
            rows.append([rs[0].arm, " / ".join(pct(r.final_accuracy) for r in rs)])
        diff = round(100 * (statistics.fmean(default) - best), 2)
        report.claim(
            f"{s}: defaults − best candidate (points)", diff, f"≥ −{BAND_POINTS:g}",
            diff >= -BAND_POINTS, seeds=len(seeds),
        )  # fmt: skip
    report.settings(
        f"MNIST-1D, the paper's CNN, `{' '.join(common)}`, seeds {list(seeds)}, arms "
        f"interleaved; the defaults' runs from `{source.name}` (commit "
        f"`{accuracy['provenance']['commit']}`). A failed run counts as 0 %."
    )
    report.section("Every arm").table(["arm", "final acc % (seeds)"], rows)
    report.write(runs)


if __name__ == "__main__":
    main()
