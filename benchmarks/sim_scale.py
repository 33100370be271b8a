"""Scale of the virtual cluster on this machine (issue 14): 128 workers of the MNIST-1D CNN for
1,000 steps each, in one process — its wall time, peak memory and overhead per simulated step.

    flock /tmp/cloudburst-bench.lock .venv/bin/python benchmarks/sim_scale.py \
        [--strategies asgd,sync,gossip]

Each strategy's simulation runs in a child process under ``/usr/bin/time -v`` (wall time and
peak RSS measured from outside; the summary's ``simulator`` block has the same from inside).
Bounds: <= 10 min of wall time and <= 8 GB of memory per run. The overhead per simulated
worker-step is split into the real compute of the steps — a plain single-process loop of the
same model, batch and data pipeline over 128 replicas in turn, timed in this script — and the
rest, the simulator's own cost (scheduling, task switches, messages, collectives, evaluation,
metrics). A timing measurement: run it alone on an idle machine.
Writes ``results/sim_scale.md`` and ``results/sim_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402

WALL_BOUND_S = 600.0
RSS_BOUND_BYTES = 8e9
RUNS = benchutil.REPO / "runs" / "sim_scale"


def settings(strategy: str, workers: int, steps: int, batch: int, train_size: int) -> dict:
    servers = 1 if strategy in ("asgd", "easgd") else 0
    return {
        "strategy": strategy,
        "workers": workers,
        "servers": servers,
        "steps": steps,
        "batch_size": batch,
        "train_size": train_size,
        "test_size": 1000,
        "checkpoint_every": 0,
        "eval_every_s": steps * 0.05 / 5,  # 5 evaluations during the run (+ the final one)
        "log_every_steps": 100,
        "comm_timeout_s": 3600.0,
        "progress": False,
    }


def child(args: argparse.Namespace) -> int:
    """One simulation (run under /usr/bin/time by the parent); prints its summary as JSON."""
    from cloudburst.config import RunConfig
    from cloudburst.config.simulation import SimulationConfig
    from cloudburst.sim.run import simulate

    kw = settings(args.child, args.workers, args.steps, args.batch_size, args.train_size)
    cfg = RunConfig(**kw, out=str(RUNS / args.child), overwrite=True)
    summary = simulate(cfg, SimulationConfig(step_time_s=0.05))
    print(
        "SUMMARY "
        + json.dumps({k: summary[k] for k in ("simulator", "final_test_accuracy", "wall_time_s")})
    )
    return 0


def plain_loop(workers: int, rounds: int, batch: int, train_size: int) -> dict:
    """Seconds per step of the same model, batch and data pipeline with no simulator:
    ``workers`` replicas (each with its optimizer and its shard's batch stream) stepped in turn,
    ``rounds`` steps each."""
    import torch
    from torch import nn

    from cloudburst.config import RunConfig
    from cloudburst.data import batch_stream, load_dataset, worker_source
    from cloudburst.models import build_model
    from cloudburst.train import make_optimizer

    torch.set_num_threads(1)
    cfg = RunConfig(workers=workers, batch_size=batch, train_size=train_size)
    data = load_dataset(cfg.dataset, cfg.train_size, cfg.test_size, cfg.image_size)
    reps = []
    for w in range(workers):
        model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
        stream = batch_stream(
            worker_source(data, w, workers),
            batch,
            seed=cfg.seed * 1000 + w,
            preprocess=data.preprocess(augment=cfg.augment),
        )
        reps.append((model, make_optimizer(cfg, model.parameters()), stream))
    loss_fn = nn.CrossEntropyLoss()

    def step(model, opt, stream) -> float:
        xb, yb = next(stream)
        loss = loss_fn(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    for rep in reps:  # warm-up, untimed
        step(*rep)
    start = time.perf_counter()
    for _ in range(rounds):
        for rep in reps:
            step(*rep)
    seconds = time.perf_counter() - start
    return {
        "steps": rounds * workers,
        "seconds": seconds,
        "s_per_step": seconds / (rounds * workers),
    }


def run_child(strategy: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        strategy,
        "--workers",
        str(args.workers),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--train-size",
        str(args.train_size),
    ]
    timer = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists() else None)
    if timer:
        cmd = [timer, "-v", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{strategy}: the simulation failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("SUMMARY "))
    result = json.loads(line[len("SUMMARY ") :])
    result["outside_wall_s"] = wall
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    result["outside_max_rss_bytes"] = int(m.group(1)) * 1024 if m else None
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr)
    result["time_v_elapsed"] = m.group(1) if m else None
    result["measured_by"] = "/usr/bin/time -v" if timer else "the summary only"
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="asgd,sync")
    ap.add_argument("--workers", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--train-size", type=int, default=40_000)
    ap.add_argument("--plain-rounds", type=int, default=100, help="plain loop: steps per replica")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)

    load_start = os.getloadavg()
    plain = plain_loop(args.workers, args.plain_rounds, args.batch_size, args.train_size)
    print(f"plain loop: {plain['s_per_step'] * 1e3:.3f} ms per step ({plain['steps']} steps)")
    results = {}
    for strategy in args.strategies.split(","):
        r = run_child(strategy, args)
        results[strategy] = r
        s = r["simulator"]
        print(
            f"{strategy}: {r['outside_wall_s']:.1f} s, {s['wall_s_per_worker_step'] * 1e3:.3f} "
            f"ms per worker-step, RSS {r['outside_max_rss_bytes']}",
            flush=True,
        )

    worker_steps = args.workers * args.steps
    rows, verdicts = [], {}
    for strategy, r in results.items():
        s = r["simulator"]
        per_step = s["wall_s"] / worker_steps
        own = per_step - plain["s_per_step"]
        rss = r["outside_max_rss_bytes"] or s["max_rss_bytes"]
        ok_wall = r["outside_wall_s"] <= WALL_BOUND_S
        ok_rss = rss <= RSS_BOUND_BYTES
        verdicts[strategy] = ok_wall and ok_rss
        rows.append(
            [
                strategy,
                s["tasks"],
                f"{r['outside_wall_s']:.1f} "
                f"({benchutil.verdict(r['outside_wall_s'], WALL_BOUND_S, False)})",
                f"{s['wall_s']:.1f}",
                f"{rss / 1e9:.2f} ({'PASS' if ok_rss else 'MISS'})",
                f"{s['max_rss_bytes'] / 1e9:.2f}",
                f"{per_step * 1e3:.3f}",
                f"{plain['s_per_step'] * 1e3:.3f} ({plain['s_per_step'] / per_step:.0%})",
                f"{own * 1e3:.3f} ({own / per_step:.0%})",
                f"{s['task_switches'] / worker_steps:.2f}",
                f"{own / max(1, s['task_switches'] / worker_steps) * 1e6:.0f}",
                s["messages"],
                s["collectives"],
                f"{r['final_test_accuracy']:.3f}",
                f"{r['wall_time_s']:.1f}",
            ]
        )
    header = [
        "strategy",
        "tasks",
        "wall s, outside (≤ 600)",
        "wall s, simulator's own",
        "peak RSS GB, outside (≤ 8)",
        "peak RSS GB, inside",
        "ms per worker-step",
        "of which compute (plain loop)",
        "of which simulator",
        "task switches per step",
        "µs of simulator per switch",
        "messages",
        "collectives",
        "final acc",
        "virtual s",
    ]
    lines = [
        "# The virtual cluster's scale on this machine",
        "",
        *benchutil.provenance_lines(),
        f"- load average at the start: {' '.join(f'{x:.2f}' for x in load_start)}",
        "- run under `flock /tmp/cloudburst-bench.lock` (benchmarks that take the lock waited; the "
        "load averages show what else ran); "
        "each simulation in its own child process with `OMP_NUM_THREADS=1`, measured from "
        f"outside by {next(iter(results.values()))['measured_by']}",
        "",
        f"Claim (issue 14): {args.workers} workers of the MNIST-1D CNN for {args.steps:,} steps "
        "each in ≤ 10 min of wall time and ≤ 8 GB of memory, with the simulator's overhead per "
        "simulated step reported.",
        "",
        f"Settings: `cloudburst.sim.run.simulate` with `--workers {args.workers} --steps "
        f"{args.steps} --batch-size {args.batch_size} --train-size {args.train_size}`, a given "
        "step time of 0.05 virtual s (no calibration), free links, 6 evaluations of the global "
        "model on the 1000 test samples, no checkpoints, a step record every 100 steps; asgd: "
        "1 server shard, n_sync 1 (a push and a fetch every step: the most messages), "
        "λ = 1/W; gossip: pull, exponential peers, a serving task per worker. "
        f"{worker_steps:,} worker-steps per run.",
        "",
        *benchutil.table(header, rows),
        "",
        f"Compute: a plain loop of the same CNN, batch {args.batch_size} and batch stream over "
        f"{args.workers} replicas in turn (each with its optimizer and shard), "
        f"{plain['steps']:,} steps ({args.plain_rounds} per replica) timed in this process "
        f"before the simulations: {plain['s_per_step'] * 1e3:.3f} ms per step; the simulator's "
        "own cost is the rest of its wall time per worker-step (start-up, data generation, "
        "evaluation and metrics included).",
        "",
        "Verdict: "
        + ", ".join(
            f"{s}: {'PASS' if ok else 'MISS'} (≤ 10 min and ≤ 8 GB)" for s, ok in verdicts.items()
        )
        + ".",
    ]
    benchutil.write_markdown(benchutil.RESULTS / "sim_scale.md", lines)
    (benchutil.RESULTS / "sim_scale.json").write_text(
        json.dumps(
            {
                "command": benchutil.command_line(),
                "git_commit": benchutil.git_revision(),
                "provenance": benchutil.provenance_lines(),
                "settings": vars(args),
                "plain_loop": plain,
                "runs": results,
                "bounds": {"wall_s": WALL_BOUND_S, "rss_bytes": RSS_BOUND_BYTES},
                "pass": verdicts,
            },
            indent=1,
        )
        + "\n"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
