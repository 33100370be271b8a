"""The reliability table (issue 5): injected faults × strategies → what happened.

    .venv/bin/python benchmarks/reliability.py            # results/reliability.{md,json}
    .venv/bin/python benchmarks/reliability.py --quick    # smoke test, under runs/bench/ only

Every strategy runs once undisturbed and once per fault, same seed, same settings: MNIST-1D,
the MNIST-1D CNN, 4 workers (asgd/easgd: + 1 server shard; daso: 2 emulated nodes × 2),
batch 32, 480 steps per worker, each step padded to 20 ms by sleeping (4 ranks share 2 cores:
compute is emulated, as everywhere in these benchmarks), a checkpoint every 50 steps,
``--max-restarts 1``, ``--comm-timeout-s 10``, ``--heartbeat-timeout-s 3``. The faults hit
the worker of global rank ``VICTIM`` (the last worker) after step 175:

- ``kill``: SIGKILL; ``stop``: SIGSTOP (a hung peer: only timeouts find it);
- ``nan``: its loss (so its gradient) at step 175 is NaN;
- ``slow``: every step of that worker takes 2× (``slow:RANK:2``, from the start).

The standby's cost (``--shard-standby``, every applied push forwarded to another server and
answered before the worker's reply): asgd, 4 workers, 2 shards, MNIST-1D MLP, steps padded to
20 ms by sleeping, pushes every step (n_sync 1: the cost at its highest); arms without and with
the standby interleaved per seed (3 seeds, rotated, with an A/A pair of the plain arm), pushes
applied per second of training = the shards' final version clocks ÷ wall time.

Columns: the outcome (completed / restarted from a checkpoint / rejoined / finished without
the worker / failed), steps lost (the fault's step − the step training resumed from; for a
worker that never came back, its steps not done), time to recover (wall clock from the fault
to the ``resume`` record of the restarted rank), the run's wall time ÷ the undisturbed run's,
and final test accuracy against the undisturbed run's. Single seed: accuracy differences of a
point are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchutil  # noqa: E402
import harness  # noqa: E402

from cloudburst.config import RunConfig  # noqa: E402
from cloudburst.launch import JobFailed, run_local_job  # noqa: E402
from cloudburst.metrics import read_jsonl  # noqa: E402

REPO = benchutil.REPO
FAULT_STEP = 175
STRATEGIES: dict[str, dict[str, Any]] = {
    "sync": {},
    "daso": dict(nodes=2, daso_global_skip=4, daso_batches_to_wait=1),
    "local_sgd": dict(period=8),
    "diloco": dict(period=8, diloco_outer_lr=0.1),
    "gossip": dict(gossip_variant="pull"),
    "asgd": dict(servers=1, n_sync=4, server_lr=0.25),
    "easgd": dict(servers=1, easgd_tau=4),
}
FAULTS = ("none", "kill", "stop", "nan", "slow")


def settings(quick: bool) -> dict[str, Any]:
    return dict(
        dataset="mnist1d",
        model="cnn",
        workers=4,
        batch_size=32,
        lr=0.05,
        momentum=0.9,
        steps=60 if quick else 480,
        min_step_time_s=0.02,
        checkpoint_every=20 if quick else 50,
        max_restarts=1,
        comm_timeout_s=10.0,
        heartbeat_timeout_s=3.0,
        eval_every_s=2.0,
        seed=0,
        progress=False,
    )


def fault_spec(fault: str, victim: int, step: int) -> list[str]:
    if fault == "none":
        return []
    if fault == "slow":
        return [f"slow:{victim}:2"]
    return [f"{fault}:{victim}@{step}"]


def events(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / "metrics" / f"rank{rank}.jsonl"
    return read_jsonl(path) if path.is_file() else []


def run_one(root: Path, strategy: str, fault: str, quick: bool) -> dict[str, Any]:
    values = {**settings(quick), "strategy": strategy, **STRATEGIES[strategy]}
    servers = values.get("servers", 0)
    victim = servers + values["workers"] - 1
    step = FAULT_STEP if not quick else 30
    out = root / f"{strategy}-{fault}"
    values.update(out=str(out), inject_fault=fault_spec(fault, victim, step))
    cfg = RunConfig.from_dict(values)
    print(f"== {strategy} / {fault}", flush=True)
    t0 = time.monotonic()
    try:
        summary = run_local_job(cfg, progress=False)
        failed = None
    except JobFailed as e:
        summary, failed = None, str(e)
    wall = time.monotonic() - t0
    victim_events = events(out, victim)
    fired = [e for e in victim_events if e["event"] == "fault"]
    resumes = [e for e in victim_events if e["event"] == "resume"]
    starts = [e for e in victim_events if e["event"] == "start"]
    finals = [e for e in victim_events if e["event"] == "final"]
    total = cfg.steps
    row: dict[str, Any] = {
        "strategy": strategy,
        "fault": fault,
        "spec": cfg.inject_fault,
        "launch_to_summary_s": wall,
        "failed": failed,
        "final_accuracy": summary["final_test_accuracy"] if summary else None,
        "lost_workers": summary["lost_workers"] if summary else None,
        "skipped_nonfinite": finals[-1].get("steps_skipped_nonfinite") if finals else None,
        "victim_starts": len(starts),
    }
    if fired and fault in ("kill", "stop"):
        if resumes:
            row["steps_lost"] = fired[0]["step"] - resumes[-1]["step"]
            row["recover_s"] = resumes[-1]["wall"] - fired[0]["wall"]
        elif len(starts) > 1:  # restarted before its first checkpoint: from step 0
            row["steps_lost"] = fired[0]["step"]
        else:
            row["steps_lost"] = total - fired[0]["step"]  # never came back
    row["outcome"] = outcome(row, resumes, summary, strategy)
    print(f"   {row['outcome']}; accuracy {row['final_accuracy']}; {wall:.1f} s", flush=True)
    return row


def outcome(row, resumes, summary, strategy) -> str:
    if summary is None:
        return "failed"
    if row["lost_workers"]:
        return "finished without the worker"
    if resumes and row["victim_starts"] > 1:
        return "rejoined" if strategy in ("asgd", "easgd") else "restarted from checkpoint"
    if row["fault"] == "nan":
        return f"completed, {row['skipped_nonfinite']} step(s) skipped"
    return "completed"


def standby_cost(quick: bool) -> tuple[list[str], list[dict[str, Any]]]:
    """Pushes/s without and with --shard-standby, interleaved (see the module docstring)."""
    steps = 40 if quick else 200
    common = ["--strategy", "asgd", "--workers", "4", "--servers", "2", "--n-sync", "1",
              "--dataset", "mnist1d", "--model", "mlp", "--batch-size", "32",
              "--steps", str(steps), "--min-step-time-s", "0.02"]  # fmt: skip
    arms = [harness.Arm("plain", common), harness.Arm("standby", [*common, "--shard-standby"])]
    root = REPO / "runs" / "bench" / ("standby-quick" if quick else "standby")
    runs = harness.interleave(arms, [0] if quick else [0, 1, 2], control="plain", out_root=root)
    rate = {}
    for r in runs:
        if not r.failed and r.summary.get("wall_time_s"):
            pushes = sum(r.summary.get("shard_versions", []))
            rate.setdefault(r.arm, []).append(pushes / r.summary["wall_time_s"])
    rows = [
        [arm, len(v), f"{min(v):.0f}", f"{sorted(v)[len(v) // 2]:.0f}", f"{max(v):.0f}"]
        for arm, v in rate.items()
    ]
    lines = [
        "## The standby's throughput cost",
        "",
        *benchutil.table(["arm", "runs", "min pushes/s", "median", "max"], rows),
        "",
    ]
    return lines, [r.to_dict() for r in runs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--no-standby-cost", action="store_true", help="skip the standby's cost")
    args = p.parse_args()
    os.chdir(REPO)
    root = REPO / "runs" / "bench" / ("reliability-quick" if args.quick else "reliability")
    rows = []
    for strategy in args.strategies.split(","):
        for fault in args.faults.split(","):
            rows.append(run_one(root, strategy, fault, args.quick))
    base = {r["strategy"]: r for r in rows if r["fault"] == "none"}
    table_rows = []
    for r in rows:
        ref = base.get(r["strategy"])
        ratio = (
            r["launch_to_summary_s"] / ref["launch_to_summary_s"]
            if ref and not r["failed"]
            else None
        )
        table_rows.append(
            [
                r["strategy"],
                r["fault"],
                r["outcome"],
                r.get("steps_lost", 0 if r["fault"] in ("none", "nan", "slow") else "-"),
                f"{r['recover_s']:.1f}" if r.get("recover_s") is not None else "-",
                f"{ratio:.2f}" if ratio else "-",
                f"{100 * r['final_accuracy']:.1f}" if r["final_accuracy"] is not None else "-",
                f"{100 * ref['final_accuracy']:.1f}" if ref and ref["final_accuracy"] else "-",
            ]
        )
    s = settings(args.quick)
    lines = [
        "# Reliability: injected faults × strategies",
        "",
        *benchutil.provenance_lines(),
        "",
        f"MNIST-1D CNN, {s['workers']} workers, batch {s['batch_size']}, {s['steps']} steps "
        f"per worker padded to {1000 * s['min_step_time_s']:.0f} ms (sleep: 4+ ranks share 2 "
        f"cores), checkpoint every {s['checkpoint_every']} steps, --max-restarts "
        f"{s['max_restarts']}, --comm-timeout-s {s['comm_timeout_s']:g}, "
        f"--heartbeat-timeout-s {s['heartbeat_timeout_s']:g}; the fault hits the last worker "
        f"after step {FAULT_STEP if not args.quick else 30} (slow: 2x from the start). "
        "Settings per strategy: " + "; ".join(f"{k} {v}" for k, v in STRATEGIES.items() if v) + ".",
        "",
        *benchutil.table(
            [
                "strategy",
                "fault",
                "outcome",
                "steps lost",
                "time to recover (s)",
                "wall ÷ undisturbed",
                "final acc (%)",
                "undisturbed acc (%)",
            ],
            table_rows,
        ),
        "",
    ]
    standby_runs = []
    if not args.no_standby_cost:
        standby_lines, standby_runs = standby_cost(args.quick)
        lines += standby_lines
    dest = REPO / "benchmarks" / "results" if not args.quick else root
    benchutil.write_markdown(dest / "reliability.md", lines)
    (dest / "reliability.json").write_text(
        json.dumps({"faults": rows, "standby_cost": standby_runs}, indent=2) + "\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
