"""Scale of the virtual cluster on this machine: 128 workers of the MNIST-1D CNN in one process
(``cloudburst simulate``), its wall time, peak memory and cost per simulated worker-step,
projected to 128 × 1,000 worker-steps (≤ 10 min, ≤ 8 GB). Details: benchmarks/README.md.

    .venv/bin/python benchmarks/sim_scale.py [--quick] [--force] [--workers 128] [--steps 100]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

STRATEGIES = ("asgd", "sync")
CLAIM_STEPS = 1000
WALL_BOUND_S = 600.0
RSS_BOUND_GB = 8.0


def argv(strategy: str, workers: int, steps: int) -> list[str]:
    return ["--strategy", strategy, "--workers", str(workers), "--steps", str(steps),
            "--batch-size", "64", "--train-size", "40000", "--test-size", "1000",
            "--checkpoint-every", "0", "--log-every-steps", "100", "--eval-every-s", "1e6",
            "--step-time-s", "0.05", "--comm-timeout-s", "3600",
            *(["--servers", "1", "--n-sync", "1"] if strategy == "asgd" else [])]  # fmt: skip


def main() -> None:
    def add(p):
        p.add_argument("--workers", type=int, default=None, help="simulated workers (128)")
        p.add_argument("--steps", type=int, default=None, help="steps per worker (100)")

    args, prov = harness.start(__doc__, add)
    workers = args.workers or (16 if args.quick else 128)
    steps = args.steps or (20 if args.quick else 100)
    arms = [harness.Arm(s, argv(s, workers, steps)) for s in STRATEGIES]
    root = prov.runs_dir("sim_scale")

    def one(arm: harness.Arm, seed: int) -> harness.Run:
        run = harness.run_train(arm, seed, root / arm.name / f"seed{seed}", 600.0, harness.SIMULATE)
        if sim := run.summary.get("simulator", {}):
            run.values = {
                "wall_s": sim["wall_s"],
                "ms_per_worker_step": 1e3 * sim["wall_s_per_worker_step"],
                "peak_rss_gb": sim["max_rss_bytes"] / 1e9,
                "messages": sim["messages"],
                "task_switches_per_step": sim["task_switches"] / sim["worker_steps"],
            }
        return run

    runs = harness.interleave(arms, [0], run=one, prov=prov)
    rep = harness.Report("sim_scale", "The virtual cluster's scale on this machine", prov)
    rows = []
    for r in runs:
        v = r.values
        if r.failed or not v:
            rep.claim(
                f"{r.arm}: 128 × {CLAIM_STEPS} worker-steps",
                "failed",
                f"≤ {WALL_BOUND_S:.0f} s",
                False,
            )
            continue
        projected_s, rss = v["ms_per_worker_step"] / 1e3 * 128 * CLAIM_STEPS, v["peak_rss_gb"]
        rep.claim(f"{r.arm}: 128 workers × {CLAIM_STEPS} steps, wall time (projected)",
                  projected_s, f"≤ {WALL_BOUND_S:.0f} s", projected_s <= WALL_BOUND_S,
                  note=f"{v['ms_per_worker_step']:.2f} ms per worker-step measured")  # fmt: skip
        rep.claim(f"{r.arm}: peak memory (GB), {workers} workers", rss,
                  f"≤ {RSS_BOUND_GB:.0f}", rss <= RSS_BOUND_GB)  # fmt: skip
        rows.append([r.arm, *v.values(), r.summary.get("final_test_accuracy")])
    rep.settings(
        f"`cloudburst simulate` with {workers} workers × {steps} steps (scaled down from "
        f"{CLAIM_STEPS}; the wall time for {CLAIM_STEPS} is the measured cost per worker-step × "
        f"128 × {CLAIM_STEPS}), batch 64, MNIST-1D 40,000 train / 1,000 test, a given step time "
        "of 0.05 virtual s, free links, no evaluation but the final one, no checkpoints; asgd: 1 "
        "shard, n_sync 1. Start-up, data generation and the final evaluation are inside the "
        "per-step cost, so the projection is an upper bound."
    )
    rep.table("strategy | wall s | ms / worker-step | peak RSS GB | messages | "
              "task switches / step | final acc", rows)  # fmt: skip
    rep.write(runs)


if __name__ == "__main__":
    main()
