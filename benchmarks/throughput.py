"""Training throughput per strategy on ResNet-20 (and the cuda-convnet-style ConvNet), and the
parameter-server staging rate against a plain pinned host<->device copy.

What runs: ``cloudburst train`` itself (through :func:`cloudburst.launch.run_local_job`), on a
CIFAR-10-format directory of random images written to a temporary folder (throughput does not
depend on the pixels; nothing is downloaded), batch 128 per worker, SGD, no evaluation during
training. Each configuration runs ``--steps`` steps per worker; samples/s is measured from the
workers' step logs between 25% and 100% of the steps (start-up, cuDNN autotuning and the
DataLoader's first batches excluded) and summed over workers.

The staging rate is the GPU A-SGD worker's own copy of Δ to pinned host memory and of the
fetched θ back to the GPU (``staging_bytes / staging_s`` of the worker's report: each copy is
one non-blocking copy timed by CUDA events around it), divided by a plain pinned copy of the
same number of bytes (device->pinned host, pinned host->device, timed the same way, median of
50) measured in this process after the jobs of the same run. Target >= 0.8.

The whole round trip of a push+fetch through the CPU-side server (gloo over 127.0.0.1) is
reported as well, as bytes moved per second of the worker's communication wait.

    python benchmarks/throughput.py --device cuda    # on a GPU machine
    .venv/bin/python benchmarks/throughput.py --device cpu --steps 40

With one GPU, several workers share it: ``sync`` then reduces over gloo (NCCL cannot run two
ranks on one GPU), and each number's backend is in the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.benchutil import RESULTS, provenance_lines, table, verdict, write_markdown  # noqa: E402
from cloudburst.config import RunConfig  # noqa: E402
from cloudburst.launch import JobFailed, run_local_job  # noqa: E402
from cloudburst.metrics import read_run  # noqa: E402
from cloudburst.models import build_model  # noqa: E402
from tests.datagen import write_cifar10  # noqa: E402

CONFIGS = [
    # (label, model, strategy, workers, extra config)
    ("sync W=1", "resnet20", "sync", 1, {}),
    ("sync W=2", "resnet20", "sync", 2, {}),
    ("asgd W=1 S=1 n_sync=1", "resnet20", "asgd", 1, {"servers": 1, "n_sync": 1}),
    ("asgd W=2 S=1 n_sync=1", "resnet20", "asgd", 2, {"servers": 1, "n_sync": 1}),
    ("asgd W=2 S=1 n_sync=10", "resnet20", "asgd", 2, {"servers": 1, "n_sync": 10}),
    ("sync W=1", "convnet", "sync", 1, {}),
    ("asgd W=1 S=1 n_sync=1", "convnet", "asgd", 1, {"servers": 1, "n_sync": 1}),
]


def steady_rate(out: Path, steps: int) -> float:
    """Samples/s summed over workers, between 25% and 100% of each worker's steps."""
    total = 0.0
    for records in read_run(out).values():
        logs = [r for r in records if r["event"] == "step"]
        if not logs:
            continue
        first = next(r for r in logs if r["step"] >= steps // 4)
        last = logs[-1]
        if last["time_s"] > first["time_s"]:
            total += (last["samples"] - first["samples"]) / (last["time_s"] - first["time_s"])
    return total


def worker_finals(out: Path) -> list[dict]:
    return [
        r
        for records in read_run(out).values()
        for r in records
        if r["event"] == "final" and r.get("role") == "worker"
    ]


def pinned_copy_rate(numel: int, reps: int = 50) -> float:
    """Bytes/s of a plain device->pinned and pinned->device copy, timed like the worker's.

    Each copy is timed with CUDA events around it (as the worker's staging counters are);
    the median of ``reps`` pairs.
    """
    dev = torch.randn(numel, device="cuda")
    host = torch.empty(numel, pin_memory=True)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    times = []
    for _ in range(reps + 5):
        ev[0].record()
        host.copy_(dev, non_blocking=True)
        ev[1].record()
        ev[1].synchronize()
        ev[2].record()
        dev.copy_(host, non_blocking=True)
        ev[3].record()
        ev[3].synchronize()
        times.append((ev[0].elapsed_time(ev[1]) + ev[2].elapsed_time(ev[3])) / 1e3)
    times = sorted(times[5:])
    return 2 * numel * 4 / times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--only", nargs="*", help="labels of configurations to run (default all)")
    ap.add_argument("--out", default=None, help="Markdown file (default: results/)")
    args = ap.parse_args()
    # Ask NVML, not the CUDA runtime: a CUDA context here would be inherited by forked ranks.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("throughput: --device cuda but no CUDA device is visible")
    md = Path(args.out or RESULTS / f"throughput_{args.device}.md")
    rows, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        per_batch = max(args.batch_size * 4 // 5, 64) * 10  # 5 batches: 8 x batch per worker
        data = write_cifar10(Path(tmp) / "data", per_batch=per_batch, test=256)
        for label, model, strategy, workers, extra in CONFIGS:
            if args.only and label not in args.only:
                continue
            out = Path(tmp) / f"{model}-{label.replace(' ', '_').replace('=', '')}"
            cfg = RunConfig(
                strategy=strategy,
                workers=workers,
                dataset=f"cifar10:{data}",
                model=model,
                steps=args.steps,
                batch_size=args.batch_size,
                lr=0.02,
                momentum=0.9,
                server_lr=1.0 / workers,
                device=args.device,
                eval_every_s=1e9,
                log_every_steps=10,
                checkpoint_every=0,
                progress=False,
                out=str(out),
                **extra,
            )
            t0 = time.perf_counter()
            try:
                summary = run_local_job(cfg, progress=False)
            except JobFailed as e:
                print(f"{label} {model}: {e}", flush=True)
                for log in sorted(out.glob("logs/**/*.log")):
                    print(f"--- {log}\n{log.read_text()[-3000:]}", flush=True)
                continue
            wall = time.perf_counter() - t0
            rate = steady_rate(out, args.steps)
            finals = worker_finals(out)
            staged_bytes = sum(f.get("staging_bytes", 0) for f in finals)
            staged_s = sum(f.get("staging_s", 0.0) for f in finals)
            numel = sum(p.numel() for p in build_model(model, (3, 32, 32), 10, 0).parameters())
            row = {
                "label": label,
                "model": model,
                "strategy": strategy,
                "workers": workers,
                "device": summary["device"],
                "backend": summary["backend"] if strategy == "sync" and workers > 1 else "-",
                "samples_per_s": rate,
                "final_test_accuracy": summary["final_test_accuracy"],
                "job_wall_s": wall,
            }
            row["parameters"] = numel
            if staged_s > 0:
                row["staging_GBps"] = staged_bytes / staged_s / 1e9
            if strategy == "asgd":
                wait = sum(f["comm_wait_s"] for f in finals)
                moved = sum(f["sent_bytes"] + f["received_bytes"] for f in finals)
                row["round_trip_GBps"] = moved / wait / 1e9 if wait else None
            records.append(row)
            print(json.dumps(row), flush=True)
    # After the jobs: CUDA initialised in this process would break the next job's forked ranks.
    for r in records:
        if "staging_GBps" in r:
            r["pinned_copy_GBps"] = pinned_copy_rate(r["parameters"]) / 1e9
            r["staging_ratio"] = r["staging_GBps"] / r["pinned_copy_GBps"]
    for r in records:
        rows.append(
            [
                r["model"],
                r["label"],
                r["device"],
                r["backend"],
                f"{r['samples_per_s']:.0f}",
                f"{r['staging_GBps']:.2f}" if "staging_GBps" in r else "-",
                f"{r['pinned_copy_GBps']:.2f}" if "pinned_copy_GBps" in r else "-",
                f"{r['staging_ratio']:.2f} {verdict(r['staging_ratio'], 0.8, True)}"
                if "staging_ratio" in r
                else "-",
                f"{r['round_trip_GBps']:.2f}" if r.get("round_trip_GBps") else "-",
            ]
        )
    lines = [
        f"# Throughput per strategy ({args.device})",
        "",
        *provenance_lines(),
    ]
    if args.device == "cuda":
        lines.append(f"- GPU: `{torch.cuda.get_device_name(0)}` x {torch.cuda.device_count()}")
    lines += [
        f"- settings: batch {args.batch_size} per worker, {args.steps} steps per worker, "
        "CIFAR-10-format random images (32x32), augmentation on, 2 DataLoader processes per "
        "worker, SGD lr 0.02 momentum 0.9, asgd add rule with lambda = 1/W; samples/s between "
        "25% and 100% of the steps, summed over workers",
        "",
        *table(
            [
                "model",
                "run",
                "device",
                "sync backend",
                "samples/s",
                "staging GB/s",
                "pinned copy GB/s",
                "staging / pinned (target >= 0.8)",
                "push+fetch round trip GB/s",
            ],
            rows,
        ),
        "",
        "staging: the asgd worker's device->pinned copy of Δ and pinned->device copy of the "
        "fetched θ (one non-blocking copy each, timed by CUDA events around it), from its own "
        "counters over the whole run; pinned copy: the same bytes copied device->pinned->device "
        "by this script after the jobs, timed the same way. With W=2 both workers share one GPU "
        "and their copies compete with the other worker's kernels. Round trip: bytes pushed and "
        "fetched per second of the worker's communication wait, through a CPU server over gloo "
        "on 127.0.0.1.",
    ]
    write_markdown(md, lines)
    md.with_suffix(".json").write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {md}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
