"""Training throughput per strategy on ResNet-20, and (on a GPU) the parameter-server
worker's staging rate against a plain pinned host<->device copy.

What runs: ``cloudburst train`` itself (harness.run_train), on a CIFAR-10-format directory of
random images made in a temporary folder (throughput does not depend on the pixels), SGD, no
evaluation during training, the arms interleaved with an A/A copy of ``sync W=1``. Samples/s
come from the workers' step records between 25 % and 100 % of the steps (start-up and the
DataLoader's first batches left out), summed over workers.

On ``--device cuda``, after the jobs, the asgd worker's staging copy (``AsgdStrategy.
_staged_copy``: device→pinned for Δ, pinned→device for θ, timed by CUDA events) is timed against
a plain pinned copy of the same bytes and an A/A copy of it, in this process, interleaved
between ResNet-20 training steps (``staging_check``); target ≥ 0.8. The jobs' own staging
counters are reported beside. With one GPU the workers share it (``sync`` reduces over gloo).

    .venv/bin/python benchmarks/throughput.py [--quick] [--force] [--device cuda]
"""

from __future__ import annotations

import os
import statistics
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


def staging_check(numel: int, reps: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """Per-copy bytes/s of asgd's staging (``AsgdStrategy._staged_copy``, the package's own
    method: one non-blocking copy between the device and a pinned buffer, timed by CUDA events)
    against a plain pinned ``copy_`` of the same bytes and an A/A copy of the plain one, in this
    process, interleaved: each step trains ResNet-20 once (the copies then meet the device as
    in training), then runs the three arms in an order rotated per step, device→host (Δ) then
    host→device (θ). Returns ``{direction: {arm: [median bytes/s of each repetition]}}``."""
    from types import SimpleNamespace

    from cloudburst.comm.stats import CommStats
    from cloudburst.strategies.asgd import AsgdStrategy

    model = build_model("resnet20", (3, 32, 32), 10, 0).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 3, 32, 32, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    dev, back = torch.randn(numel, device="cuda"), torch.empty(numel, device="cuda")
    host = torch.empty(numel, pin_memory=True)
    worker = SimpleNamespace(stats=CommStats())  # what _staged_copy reads and writes
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def plain(dst: torch.Tensor, src: torch.Tensor) -> float:
        events[0].record()
        dst.copy_(src, non_blocking=True)
        events[1].record()
        events[1].synchronize()
        return events[0].elapsed_time(events[1]) / 1e3

    def staged(dst: torch.Tensor, src: torch.Tensor) -> float:
        before = worker.stats.staging_s
        AsgdStrategy._staged_copy(worker, dst, src)
        return worker.stats.staging_s - before

    arms = {"staging": staged, "pinned": plain, harness.aa_name("pinned"): plain}
    out = {d: {a: [] for a in arms} for d in ("device→host", "host→device")}
    for rep in range(reps + 1):  # repetition 0 warms up and is not kept
        per = {(d, a): [] for d in out for a in arms}
        for step in range(steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            order = list(arms)[step % 3 :] + list(arms)[: step % 3]
            for direction, dst, src in (("device→host", host, dev), ("host→device", back, host)):
                for arm in order:
                    per[direction, arm].append(arms[arm](dst, src))
        if rep:
            for (direction, arm), ts in per.items():
                out[direction][arm].append(numel * 4 / statistics.median(ts))
    return out


def main() -> None:
    def add(p) -> None:
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
        p.add_argument("--steps", type=int, default=None, help="steps per worker (24; quick 8)")
        p.add_argument("--batch-size", type=int, default=64)

    # Ask NVML, not the CUDA runtime: a CUDA context here would be inherited by forked ranks.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    args, prov = harness.start(__doc__, add)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("throughput: --device cuda but no CUDA device is visible")
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
            [arm, harness.fmt(harness.median(rate[arm])), len(rs), sum(bool(r.failed) for r in rs)]
            for arm, rs in groups.items()
        ],
    )
    base, aa = harness.median(rate["sync W=1"]), harness.median(rate[harness.aa_name("sync W=1")])
    if base and aa:
        report.text(f"A/A: sync W=1 ÷ its copy = {harness.fmt(aa / base, 4)} (the noise floor).")
    staged = [r.values["staging_Bps"] for r in runs if "staging_Bps" in r.values]
    if staged:
        report.text(
            "In the asgd jobs the worker's staging counters read "
            f"{harness.fmt(harness.median(staged) / 1e9)} GB/s (one copy of Δ and one of θ per"
            " round, amid training; with W = 2 both workers share the GPU). The claims time the"
            " same method against a plain pinned copy side by side in one process."
        )
    if args.device == "cuda":  # after the jobs: CUDA in this process would break forked ranks
        staging_claims(report, reps=5 if not args.quick else 2, steps=40 if not args.quick else 5)
    report.write(runs)


def staging_claims(report: harness.Report, reps: int, steps: int) -> None:
    """The staging ratio per direction at ResNet-20's size and at 10M floats (40 MB)."""
    resnet = sum(p.numel() for p in build_model("resnet20", (3, 32, 32), 10, 0).parameters())
    rows = []
    for numel in (resnet, 10_000_000):
        for direction, rates in staging_check(numel, reps, steps).items():
            ratio, lo, hi = harness.bootstrap_ratio(rates["staging"], rates["pinned"])
            aa = harness.median(rates[harness.aa_name("pinned")]) / harness.median(rates["pinned"])
            report.claim(
                f"asgd staging ÷ pinned copy, {direction}, {numel * 4 / 1e6:.1f} MB",
                ratio,
                f"≥ {STAGING_TARGET}",
                ratio >= STAGING_TARGET,
                aa=aa,
                interval=(lo, hi),
                seeds=reps,
            )
            rows += [
                [f"{numel * 4 / 1e6:.1f} MB", direction, arm, harness.fmt(harness.median(r) / 1e9)]
                + [harness.fmt(v / 1e9) for v in r]
                for arm, r in rates.items()
            ]
    report.section("Staging against a pinned copy (GB/s; medians of per-copy times)")
    report.table(
        ["size", "direction", "arm", "median", *[f"rep {i + 1}" for i in range(reps)]], rows
    )
    report.text(
        f"{reps} repetitions × {steps} steps, each step one ResNet-20 training step (batch 64)"
        " then every arm once per direction, the order rotated per step; a repetition's rate is"
        " bytes ÷ its median per-copy time (CUDA events around the copy). `staging` is"
        " `AsgdStrategy._staged_copy` itself; `pinned` a plain non-blocking `copy_` between"
        " the device and page-locked memory; its A/A copy is the noise floor. The interval is"
        " a 95 % bootstrap of the ratio of medians over repetitions."
    )


if __name__ == "__main__":
    main()
