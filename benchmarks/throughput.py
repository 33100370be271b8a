"""Training throughput per strategy on ResNet-20, and (on a GPU) the parameter-server
worker's staging rate against a plain pinned host<->device copy.

What runs: ``cloudburst train`` itself (harness.run_train), on a CIFAR-10-format directory of
random images made in a temporary folder (throughput does not depend on the pixels), SGD, no
evaluation during training, the arms interleaved with an A/A copy of ``sync W=1``. Samples/s
come from the workers' step records between 25 % and 100 % of the steps (start-up and the
DataLoader's first batches left out), summed over workers.

On ``--device cuda`` the asgd worker's own staging counters (``staging_bytes / staging_s``:
its device→pinned copy of Δ and pinned→device copy of θ, each timed by CUDA events) are divided
by a plain pinned copy of the same bytes timed the same way in this process after the jobs
(median of 50 pairs); target ≥ 0.8. With one GPU the workers share it (``sync`` reduces over
gloo then).

    .venv/bin/python benchmarks/throughput.py [--quick] [--force] [--device cuda]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import harness  # noqa: E402

from cloudburst.metrics import read_run  # noqa: E402
from cloudburst.models import build_model  # noqa: E402
from tests.datagen import write_cifar10  # noqa: E402

ARMS = {  # label: cloudburst train flags
    "sync W=1": ["--strategy", "sync", "--workers", "1"],
    "sync W=2": ["--strategy", "sync", "--workers", "2"],
    "asgd W=2 S=1": ["--strategy", "asgd", "--workers", "2", "--servers", "1"],
}
STAGING_TARGET = 0.8


def steady_rate(out: Path, steps: int) -> float | None:
    """Samples/s of every worker between 25 % and 100 % of its steps, summed."""
    total = 0.0
    for records in read_run(out).values():
        logs = [r for r in records if r["event"] == "step"]
        first = next((r for r in logs if r["step"] >= steps // 4), None)
        if first is None or logs[-1]["time_s"] <= first["time_s"]:
            continue
        total += (logs[-1]["samples"] - first["samples"]) / (logs[-1]["time_s"] - first["time_s"])
    return total or None


def pinned_copy_rate(numel: int, reps: int = 50) -> float:
    """Bytes/s of a device→pinned→device copy pair of ``numel`` floats (CUDA events, median)."""
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
    return 2 * numel * 4 / sorted(times[5:])[reps // 2]


def main() -> None:
    def add(p) -> None:
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
        p.add_argument("--steps", type=int, default=None, help="steps per worker (24; quick 8)")
        p.add_argument("--batch-size", type=int, default=64)

    args = harness.parse_args(__doc__, add)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("throughput: --device cuda but no CUDA device is visible")
    # Ask NVML, not the CUDA runtime: a CUDA context here would be inherited by forked ranks.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    prov = harness.Provenance.capture(args)
    steps = args.steps or (8 if args.quick else 24)
    seeds = list(range(args.seeds or 1))
    with tempfile.TemporaryDirectory() as tmp:
        data = write_cifar10(Path(tmp) / "data", per_batch=args.batch_size * 4, test=64)
        common = [
            *("--dataset", f"cifar10:{data}", "--model", "resnet20", "--steps", str(steps)),
            *("--batch-size", str(args.batch_size), "--lr", "0.02", "--device", args.device),
            *("--eval-every-s", "1e9", "--log-every-steps", "2", "--checkpoint-every", "0"),
        ]
        arms = [harness.Arm(label, [*flags, *common]) for label, flags in ARMS.items()]
        runs = harness.interleave(
            arms, seeds, control="sync W=1", prov=prov, out_root=Path(tmp) / "runs"
        )
        for r in runs:
            if not r.failed:
                r.values["samples_per_s"] = steady_rate(Path(r.out_dir), steps)
                finals = [
                    rec
                    for recs in read_run(r.out_dir).values()
                    for rec in recs
                    if rec["event"] == "final" and rec.get("role") == "worker"
                ]
                staged_s = sum(f.get("staging_s", 0.0) for f in finals)
                if staged_s > 0:
                    r.values["staging_Bps"] = sum(f["staging_bytes"] for f in finals) / staged_s
    groups = harness.by_arm(runs)
    report = harness.Report(
        f"throughput_{args.device}", f"Training throughput per strategy ({args.device})", prov
    )
    report.settings(
        f"ResNet-20 on random CIFAR-10-format images, batch {args.batch_size} per worker, "
        f"{steps} steps per worker, {len(seeds)} seed(s), interleaved with an A/A copy of "
        "sync W=1; samples/s between 25 % and 100 % of the steps, summed over workers."
    )
    rate = {
        arm: [r.values.get("samples_per_s") for r in rs if not r.failed]
        for arm, rs in groups.items()
    }
    report.table(
        ["arm", "samples/s (median)", "runs", "failed"],
        [
            [arm, harness.fmt(_median(rate[arm])), len(rs), sum(bool(r.failed) for r in rs)]
            for arm, rs in groups.items()
        ],
    )
    base, aa = _median(rate["sync W=1"]), _median(rate[harness.aa_name("sync W=1")])
    if base and aa:
        report.text(f"A/A: sync W=1 ÷ its copy = {harness.fmt(aa / base, 4)} (the noise floor).")
    staged = [r.values["staging_Bps"] for r in runs if "staging_Bps" in r.values]
    if staged:  # after the jobs: CUDA in this process would break a later job's forked ranks
        numel = sum(p.numel() for p in build_model("resnet20", (3, 32, 32), 10, 0).parameters())
        ratio = _median(staged) / pinned_copy_rate(numel)
        report.claim("asgd staging ÷ pinned copy", ratio, f"≥ {STAGING_TARGET}", ratio >= 0.8)
    report.write(runs)


def _median(values: list[float | None]) -> float | None:
    import statistics

    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


if __name__ == "__main__":
    main()
