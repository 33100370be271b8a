"""How long from ``cloudburst train`` to the first training step of a local 4-worker job,
against ``python -c "import torch"`` measured in the same run, interleaved.

    .venv/bin/python benchmarks/startup.py --before /tmp/cb-before --repeats 5

``--before DIR`` is a checkout of an older commit (``git worktree add DIR COMMIT``) run with the
same interpreter (``PYTHONPATH=DIR``); each round runs import torch, the older tree, this tree,
in that order. The first step is seen from outside — the first ``step`` record in the metrics
(``--log-every-steps 1``), polled every 10 ms — so both trees are measured alike; the job is
then stopped. For this tree, the ranks' own records also split the time: until every rank has
joined the job (``start``), and until the first step (``first_step``). Writes
results/startup.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchutil import RESULTS, git_revision, provenance_lines, table, write_markdown

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--workers", "4", "--steps", "100000", "--log-every-steps", "1", "--no-progress"]


def import_torch() -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - started


def first_step(tree: Path, out: Path) -> dict[str, float]:
    """Seconds from the command to its first step record (and this tree's phases)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    started_wall, started = time.time(), time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cloudburst", "train", *ARGS, "--out", str(out)],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    seen = None
    try:
        while seen is None and time.monotonic() - started < 120:
            for path in (out / "metrics").glob("rank*.jsonl"):
                if '"event": "step"' in path.read_text(errors="ignore"):
                    seen = time.monotonic() - started
                    break
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    result = {"first_step_s": seen if seen is not None else float("nan")}
    starts, firsts = [], []
    for path in (out / "metrics").glob("rank*.jsonl"):
        for line in path.read_text(errors="ignore").splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("event") == "start" and "wall" in r:
                starts.append(r["wall"])
            if r.get("event") == "first_step":
                firsts.append(r["wall"])
    if starts:
        result["ranks_joined_s"] = max(starts) - started_wall
    if firsts:
        result["first_step_own_s"] = min(firsts) - started_wall
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="checkout of the older commit")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    before_rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=args.before, capture_output=True, text=True
    ).stdout.strip()
    rows: dict[str, list[dict[str, float]]] = {"import torch": [], "before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            rows["import torch"].append({"first_step_s": import_torch()})
            rows["before"].append(first_step(args.before, Path(tmp) / f"before{i}"))
            rows["after"].append(first_step(REPO, Path(tmp) / f"after{i}"))
            print(json.dumps({k: v[-1] for k, v in rows.items()}), flush=True)
    (RESULTS / "startup.json").write_text(json.dumps(rows, indent=2) + "\n")

    def med(name: str, key: str) -> float:
        values = [r[key] for r in rows[name] if key in r]
        return statistics.median(values) if values else float("nan")

    base = med("import torch", "first_step_s")
    lines = [
        "# Start-up: from `cloudburst train` to the first training step",
        "",
        *provenance_lines(),
        f"- before: commit `{before_rev}` (a worktree, same interpreter); after: "
        f"`{git_revision()}`",
        "",
        f"A local job of 4 workers (MNIST-1D CNN, the default dataset, cached), "
        f"`cloudburst train {' '.join(ARGS)}`; the first step is the first `step` record in "
        f"its metrics, polled every 10 ms from outside. Median of {args.repeats} launches each, "
        "interleaved (import torch, before, after, ...).",
        "",
        *table(
            ["", "median s", "÷ import torch", "runs (s)"],
            [
                [
                    name,
                    f"{med(name, 'first_step_s'):.2f}",
                    f"{med(name, 'first_step_s') / base:.2f}",
                    ", ".join(f"{r['first_step_s']:.2f}" for r in rows[name]),
                ]
                for name in rows
            ],
        ),
        "",
        f"Target: ≤ 2.5 × import torch = {2.5 * base:.2f} s → "
        f"{'PASS' if med('after', 'first_step_s') <= 2.5 * base else 'MISS'}.",
        "",
        "After, from the ranks' own records (median s from the command): every rank joined "
        f"the job {med('after', 'ranks_joined_s'):.2f}, first step done "
        f"{med('after', 'first_step_own_s'):.2f}.",
    ]
    write_markdown(RESULTS / "startup.md", lines)


if __name__ == "__main__":
    main()
