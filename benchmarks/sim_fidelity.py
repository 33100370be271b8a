"""Fidelity of the virtual cluster: ``cloudburst simulate``'s predicted training time against a
real ``cloudburst train`` of the same flags on this machine, every strategy (issue 14).

Each configuration (strategy × W) runs twice with the same flags: ``cloudburst train`` (W
workers, plus a server shard for asgd/easgd, local processes, gloo) and ``cloudburst simulate``
(one process, virtual time). The simulated step time is the run's ``--min-step-time-s``
padding; both put the ranks on 2 emulated nodes joined by the same ``--inter-node-link``;
evaluation is pushed out of the run (it is free in virtual time). Measured: the summary's
``wall_time_s`` (training, start-up excluded); ratio = real ÷ simulated, target within 15 %.
Real and simulated runs are interleaved by the harness; the A/A control runs ``sync`` W = 2 for
real a second time: its ratio to the first is the noise floor of the real measurement. A failed
run is kept and counted outside the tolerance.

    .venv/bin/python benchmarks/sim_fidelity.py [--quick] [--force] [--steps N]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

STRATEGIES = ("sync", "asgd", "easgd", "local_sgd", "diloco", "gossip", "daso")
TOLERANCE = 0.15
CONTROL = "sync W2 real"


def run_cli(
    command: str, arm: harness.Arm, seed: int, out: Path, timeout_s: float = 600.0
) -> harness.Run:
    """``python -m cloudburst <command> <arm.argv> --seed S --out D`` in a subprocess
    (``OMP_NUM_THREADS=1``); a failure or timeout is kept in the Run's ``failed``."""
    cmd = [sys.executable, "-m", "cloudburst", command, *arm.argv, "--seed", str(seed)]
    cmd += ["--out", str(out), "--overwrite", "--no-progress"]
    started, failed = time.monotonic(), None
    try:
        proc = subprocess.run(
            cmd,
            cwd=harness.REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            failed = f"exit {proc.returncode}: {tail[0][:300]}"
    except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout_s:g} s"
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() and not failed else {}
    summary.pop("config", None)
    if not failed and not summary:
        failed = "no summary.json"
    wall = round(time.monotonic() - started, 3)
    return harness.Run(arm.name, seed, wall, summary, failed=failed, out_dir=str(out))


def argv(strategy: str, workers: int, steps: int) -> list[str]:
    a = ["--strategy", strategy, "--workers", str(workers), "--steps", str(steps)]
    a += ["--min-step-time-s", "0.04", "--nodes", "2", "--inter-node-link", "0.05,1"]
    a += ["--eval-every-s", "1e6", "--checkpoint-every", "0"]
    return a + (["--servers", "1"] if strategy in ("asgd", "easgd") else [])


def main() -> None:
    def add(p):
        p.add_argument("--steps", type=int, default=None, help="steps per worker (100)")

    args = harness.parse_args(__doc__, add)
    prov = harness.Provenance.capture(args)
    steps = args.steps or (20 if args.quick else 100)
    strategies = ("sync", "asgd") if args.quick else STRATEGIES
    workers = (2,) if args.quick else (2, 4)
    configs = [(s, w) for s in strategies for w in workers]
    arms = [
        harness.Arm(f"{s} W{w} {mode}", argv(s, w, steps))
        for s, w in configs
        for mode in ("real", "sim")
    ]
    root = prov.runs_dir("sim_fidelity")

    def one(arm: harness.Arm, seed: int) -> harness.Run:
        command = "simulate" if arm.name.endswith(" sim") else "train"
        return run_cli(command, arm, seed, root / harness._slug(arm.name) / f"seed{seed}")

    seeds = list(range(args.seeds or 1))
    runs = harness.interleave(arms, seeds, control=CONTROL, run=one, prov=prov)
    by = harness.by_arm(runs)

    def walls(name: str) -> list[float | None]:
        return [None if r.failed else r.summary["wall_time_s"] for r in by[name]]

    rows, within = [], 0
    for s, w in configs:
        real, sim = by[f"{s} W{w} real"], by[f"{s} W{w} sim"]
        for r, p in zip(real, sim, strict=True):
            ok = not (r.failed or p.failed)
            ratio = r.summary["wall_time_s"] / p.summary["wall_time_s"] if ok else None
            within += ratio is not None and abs(ratio - 1) <= TOLERANCE
            comm = [x.summary.get("comm_wait_s") for x in (r, p)]
            rows.append([s, w, r.seed, *[x.summary.get("wall_time_s") for x in (p, r)], ratio,
                         *comm, r.failed or p.failed or ""])  # fmt: skip
    total = len(rows)
    rep = harness.Report("sim_fidelity", "Fidelity of the virtual cluster: real ÷ simulated", prov)
    aa, base = walls(harness.aa_name(CONTROL)), walls(CONTROL)
    aa_ratio = (
        harness.statistics.median(a / b for a, b in zip(aa, base, strict=True) if a and b)
        if any(aa) and any(base)
        else None
    )
    rep.claim(
        "configurations with real ÷ simulated training time within 15 %",
        f"{within} / {total}",
        f"{total} / {total}",
        within == total,
        aa=aa_ratio,
        seeds=len(seeds),
        note="A/A: sync W = 2 real, repeated",
    )
    rep.settings(
        f"MNIST-1D, the default CNN, {steps} steps per worker (scaled down from 200 to fit the "
        "benchmark budget), batch 64, `--min-step-time-s 0.04`, `--nodes 2 --inter-node-link "
        "0.05,1` (50 Mbit/s, 1 ms), evaluation pushed out (`--eval-every-s 1e6`), no "
        "checkpoints; asgd and easgd with one server shard (W + 1 processes). Real: `cloudburst "
        "train` (gloo on loopback, the link emulated on top); simulated: `cloudburst simulate` "
        "with the same flags (step time = the padding). Up to 5 processes share 2 cores: the "
        "padding keeps steps above the compute."
    )
    rep.table(
        ["strategy", "W", "seed", "simulated s", "real s", "real ÷ sim", "comm wait s real",
         "comm wait s sim", "failed"],
        rows,
    )  # fmt: skip
    rep.text(
        "`comm wait s`: the summary's `comm_wait_s` (summed over ranks). The A/A column of the "
        "claim is the repeated real run ÷ the first: differences of that size are noise."
    )
    rep.write(runs)


if __name__ == "__main__":
    main()
