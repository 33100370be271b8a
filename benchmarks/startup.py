"""How long from ``cloudburst train`` to the first training step of a local 4-worker job,
against ``python -c "import torch"``, interleaved with an A/A copy of the import.

The first step is the first ``step`` record in the metrics, polled every 10 ms; the ranks'
``start`` and ``first_step`` records split the time. Target: first step ≤ 2.5 × import torch.

    .venv/bin/python benchmarks/startup.py [--quick] [--force] [--seeds N]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

TRAIN = ["--workers", "4", "--steps", "100000", "--log-every-steps", "1", "--no-progress"]
TARGET = 2.5  # first step ÷ import torch, at most


def first_step(out: Path) -> dict[str, float]:
    """Seconds from the command to its first step record, and the ranks' own phases."""
    started_wall, started = time.time(), time.monotonic()
    proc = subprocess.Popen([*harness.CLI, "train", *TRAIN, "--out", str(out)], cwd=harness.REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    seen = None
    try:
        while seen is None and time.monotonic() - started < 120 and proc.poll() is None:
            for path in (out / "metrics").glob("rank*.jsonl"):
                if '"event": "step"' in path.read_text(errors="ignore"):
                    seen = time.monotonic() - started
                    break
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if seen is None:
        raise RuntimeError(f"no step record within 120 s (exit {proc.returncode})")
    walls = {"start": [], "first_step": []}
    for _, r in harness.records(out):
        if r.get("event") in walls:
            walls[r["event"]].append(r["wall"])
    result = {"seconds": seen}
    if walls["start"]:
        result["ranks_joined_s"] = max(walls["start"]) - started_wall
    if walls["first_step"]:
        result["first_step_own_s"] = min(walls["first_step"]) - started_wall
    return result


def main() -> None:
    args, prov = harness.start(__doc__)
    seeds = list(range(args.seeds or (1 if args.quick else 5)))
    with tempfile.TemporaryDirectory() as tmp:

        def run(arm: harness.Arm, seed: int) -> harness.Run:
            started = time.monotonic()
            try:
                if arm.name.startswith("import torch"):
                    subprocess.run([sys.executable, "-c", "import torch"], check=True)
                    values = {"seconds": time.monotonic() - started}
                else:
                    values = first_step(Path(tmp) / f"seed{seed}")
            except (RuntimeError, subprocess.CalledProcessError) as e:
                return harness.Run(arm.name, seed, time.monotonic() - started, failed=str(e))
            return harness.Run(arm.name, seed, values["seconds"], values=values)

        arms = [harness.Arm("import torch"), harness.Arm("cloudburst train")]
        runs = harness.interleave(arms, seeds, control="import torch", run=run, prov=prov)
    groups = harness.by_arm(runs)

    def seconds(arm: str, key: str = "seconds") -> list[float]:
        return [r.values[key] for r in groups.get(arm, []) if not r.failed and key in r.values]

    base, train = seconds("import torch"), seconds("cloudburst train")
    report = harness.Report("startup", "Start-up: from `cloudburst train` to the first step", prov)
    report.settings(
        f"A local job, `cloudburst train {' '.join(TRAIN)}` (MNIST-1D CNN, the default "
        f"data set, cached); {len(seeds)} launch(es) of each, interleaved with an A/A "
        "import."
    )
    if base and train:
        aa = seconds(harness.aa_name("import torch"))
        harness.ratio_claim(report, "first step ÷ import torch", train, base, aa, f"≤ {TARGET}",
                            lambda x: x <= TARGET)  # fmt: skip
    rows = [[arm, harness.median(seconds(arm)), ", ".join(f"{s:.2f}" for s in seconds(arm))]
            for arm in groups]  # fmt: skip
    report.table("arm | median s | runs (s)", rows)
    joined = seconds("cloudburst train", "ranks_joined_s")
    own = seconds("cloudburst train", "first_step_own_s")
    if joined and own:
        report.text(
            f"From the ranks' own records (median s from the command): every rank joined "
            f"{harness.median(joined):.2f}, first step done {harness.median(own):.2f}."
        )
    report.write(runs)


if __name__ == "__main__":
    main()
