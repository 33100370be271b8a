"""The defaults sweep: does ``cloudburst train --strategy S --workers 4`` with no other flag
train? Every strategy at its defaults (asgd/easgd with the one server shard the CLI gives
them), 3 seeds, on MNIST-1D; plus the candidate settings the defaults were chosen from.

    .venv/bin/python benchmarks/defaults.py            # writes results/defaults.{md,json}

Each run is timed as a user sees it: the wall time of the whole ``cloudburst train``
process (launch included) beside the run's own training time. Runs go one after another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchutil import RESULTS, provenance_lines, table, write_markdown

REPO = Path(__file__).resolve().parent.parent
STRATEGIES = ("sync", "asgd", "easgd", "gossip", "local_sgd", "diloco", "daso")
TARGET = 0.90
# Candidates tried for the defaults (besides the defaults themselves), one seed each unless a
# default depends on them: what each strategy's own knob does at the default budget.
CANDIDATES: dict[str, list[list[str]]] = {
    "diloco": [
        ["--diloco-outer-lr", "0.7", "--optimizer", "adam", "--lr", "0.001"],
        ["--diloco-outer-lr", "0.7"],
    ],
    "asgd": [["--server-lr", "1"]],
    "easgd": [["--easgd-tau", "4"]],
    "gossip": [["--gossip-schedule", "exponential"]],
}


def run(strategy: str, seed: int, extra: list[str], workdir: Path) -> dict:
    out = workdir / f"{strategy}-{seed}-{abs(hash(tuple(extra))) % 10**6}"
    cmd = [sys.executable, "-m", "cloudburst", "train", "--strategy", strategy, "--workers", "4"]
    cmd += ["--seed", str(seed), "--no-progress", "--out", str(out), *extra]
    if strategy in ("asgd", "easgd") and "--servers" not in extra:
        cmd += ["--servers", "1"]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        return {"strategy": strategy, "seed": seed, "extra": extra, "error": proc.stderr[-400:]}
    s = json.loads((out / "summary.json").read_text())
    return {
        "strategy": strategy,
        "seed": seed,
        "extra": extra,
        "accuracy": s["final_test_accuracy"],
        "train_s": s["wall_time_s"],
        "command_s": wall,
        "steps_per_worker": s["steps_per_worker"],
        "warnings": [ln for ln in proc.stderr.splitlines() if "warning" in ln],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--no-candidates", action="store_true")
    args = p.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for strategy in args.strategies:
                records.append(run(strategy, seed, [], Path(tmp)))
                print(json.dumps(records[-1]), flush=True)
        if not args.no_candidates:
            for strategy, variants in CANDIDATES.items():
                if strategy not in args.strategies:
                    continue
                for extra in variants:
                    records.append(run(strategy, 0, extra, Path(tmp)))
                    print(json.dumps(records[-1]), flush=True)
    (RESULTS / "defaults.json").write_text(json.dumps(records, indent=2) + "\n")
    write_report(records, args.seeds)


def write_report(records: list[dict], seeds: int) -> None:
    rows = []
    for strategy in STRATEGIES:
        rs = [r for r in records if r["strategy"] == strategy and not r["extra"]]
        if not rs:
            continue
        accs = [r.get("accuracy", float("nan")) for r in rs]
        ok = all(a >= TARGET for a in accs)
        rows.append(
            [
                f"`{strategy}`",
                rs[0].get("steps_per_worker", "-"),
                " / ".join(f"{100 * a:.1f}" for a in accs),
                f"{100 * min(accs):.1f}",
                f"{statistics.median(r.get('train_s', 0) for r in rs):.1f}",
                f"{statistics.median(r.get('command_s', 0) for r in rs):.1f}",
                "PASS" if ok else "MISS",
            ]
        )
    cand = [
        [
            f"`{r['strategy']}`",
            f"`{' '.join(r['extra'])}`",
            f"{100 * r['accuracy']:.1f}" if "accuracy" in r else r.get("error", "")[:80],
            f"{r.get('train_s', 0):.1f}",
        ]
        for r in records
        if r["extra"]
    ]
    lines = [
        "# Defaults: `cloudburst train --strategy S --workers 4`, no other flag",
        "",
        *provenance_lines(),
        "",
        f"MNIST-1D (4000 train / 1000 test), the paper's CNN, 4 workers (+1 server shard for "
        f"asgd/easgd), {seeds} seeds, one run at a time. Target: every seed ≥ "
        f"{100 * TARGET:.0f} % final test accuracy. `train s` is the run's own clock, "
        "`command s` the whole command as a user waits for it (launch included).",
        "",
        *table(
            [
                "strategy",
                "steps/worker",
                "accuracy % (seeds)",
                "worst %",
                "train s (median)",
                "command s (median)",
                f"≥ {100 * TARGET:.0f} %",
            ],
            rows,
        ),  # fmt: skip
        "",
        "## Candidates (seed 0): the settings the defaults were chosen against",
        "",
        *table(["strategy", "flags beside the defaults", "accuracy %", "train s"], cand),
    ]
    write_markdown(RESULTS / "defaults.md", lines)


if __name__ == "__main__":
    main()
