"""Training throughput per strategy on ResNet-20, and (on a GPU) the parameter-server
worker's staging rate against a plain pinned host<->device copy.

``cloudburst train`` itself on random CIFAR-10-format images (made in a temporary folder), no
evaluation, the arms interleaved with an A/A copy of ``sync W=1``; samples/s from the workers'
step records between 25 % and 100 % of the steps, summed over workers. On ``--device cuda`` the
claim: the bytes the asgd workers staged in the job (``staging_s``: device↔pinned copies of Δ
and θ) at the copy bandwidth measured alone after the jobs (``copy_bandwidth``, with an A/A
copy) ÷ their staging time, target ≥ 0.8.

    .venv/bin/python benchmarks/throughput.py [--quick] [--force] [--device cuda --seeds 3]
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

from cloudburst.models import build_model  # noqa: E402
from cloudburst.records.metrics import read_run  # noqa: E402
from tests.datagen import write_cifar10  # noqa: E402

ARMS = {
    "sync W=1": ["--strategy", "sync", "--workers", "1"],  # label: cloudburst train flags
    "sync W=2": ["--strategy", "sync", "--workers", "2"],
    "asgd W=2 S=1": ["--strategy", "asgd", "--workers", "2", "--servers", "1"],
}
STAGING_TARGET = 0.8
BATCH = 64  # per worker


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


def copy_bandwidth(numel: int, reps: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """``{direction: {arm: [median bytes/s of each repetition]}}`` of a plain non-blocking pinned
    ``copy_`` and its A/A copy, timed by CUDA events, each step after one ResNet-20 training step
    (the copies then meet the device as in training), the arms' order alternating per step."""
    model = build_model("resnet20", (3, 32, 32), 10, 0).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 3, 32, 32, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    dev, back = torch.randn(numel, device="cuda"), torch.empty(numel, device="cuda")
    host = torch.empty(numel, pin_memory=True)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def plain(dst: torch.Tensor, src: torch.Tensor) -> float:
        events[0].record()
        dst.copy_(src, non_blocking=True)
        events[1].record()
        events[1].synchronize()
        return events[0].elapsed_time(events[1]) / 1e3

    arms = ("pinned", harness.aa_name("pinned"))
    out = {d: {a: [] for a in arms} for d in ("device→host", "host→device")}
    for rep in range(reps + 1):  # repetition 0 warms up and is not kept
        per = {(d, a): [] for d in out for a in arms}
        for step in range(steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            for direction, dst, src in (("device→host", host, dev), ("host→device", back, host)):
                for arm in arms[step % 2 :] + arms[: step % 2]:
                    per[direction, arm].append(plain(dst, src))
        if rep:
            for (direction, arm), ts in per.items():
                out[direction][arm].append(numel * 4 / harness.median(ts))
    return out


def staging_claim(report: harness.Report, runs: list[harness.Run], reps: int, steps: int) -> None:
    """asgd's staging in the jobs ÷ what its bytes need at the measured copy bandwidth."""
    numel = sum(p.numel() for p in build_model("resnet20", (3, 32, 32), 10, 0).parameters())
    bw = copy_bandwidth(numel, reps, steps)
    # a round stages Δ (device→host) and θ (host→device), as many bytes each way: both
    # copies together move bytes at 2 ÷ (1/bw_d2h + 1/bw_h2d)
    both = {arm: [2 / (1 / d + 1 / h) for d, h in zip(d2h, bw["host→device"][arm], strict=True)]
            for arm, d2h in bw["device→host"].items()}  # fmt: skip
    jobs = [x for r in runs for x in r.values.get("staging_Bps_workers", [])]
    name = "asgd's staging in the training job ÷ its bytes at the measured pinned-copy bandwidth"
    if not jobs:
        report.claim(name, "not measured", f"≥ {STAGING_TARGET}", None, note="no asgd job staged")
    else:
        aa = harness.ratio_interval(both[harness.aa_name("pinned")], both["pinned"])[0]
        ratio, lo, hi = harness.ratio_interval(jobs, both["pinned"])
        report.claim(name, ratio, f"≥ {STAGING_TARGET}", ratio >= STAGING_TARGET, aa=aa,
                     interval=(lo, hi), seeds=len(jobs),
                     note=f"{len(jobs)} asgd workers' jobs, {reps} copy repetitions")  # fmt: skip
    width = max(reps, len(jobs))
    rows = [[arm, d, harness.median(r) / 1e9, *[v / 1e9 for v in r]]
            for d, arms in bw.items() for arm, r in arms.items()]  # fmt: skip
    rows += [["asgd workers in the jobs", "both", (harness.median(jobs) or 0) / 1e9]
             + [v / 1e9 for v in jobs]]  # fmt: skip
    report.section(f"Staging against the copy bandwidth (GB/s, {numel * 4 / 1e6:.1f} MB)")
    report.table(["what", "direction", "median", *[f"#{i + 1}" for i in range(width)]],
                 [r + [None] * (3 + width - len(r)) for r in rows])  # fmt: skip
    report.text(
        f"Copy bandwidth: {reps} repetitions × {steps} steps, each step one ResNet-20 "
        "training step (batch 64) then each arm once per direction; a repetition's "
        "rate is bytes ÷ its median per-copy time. Jobs: each asgd worker's staging bytes "
        "÷ staging seconds (its final record). The claim divides the jobs' rate by the "
        "copy's over both directions (a round moves Δ down and θ up): below 1, the job's "
        "copies took longer than their bytes need; the A/A (the copy's repeat ÷ the copy) "
        "is the noise floor."
    )


def main() -> None:
    def add(p) -> None:
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
        p.add_argument("--steps", type=int, default=None, help="steps per worker (24; quick 8)")

    # Ask NVML, not the CUDA runtime: a CUDA context here would be inherited by forked ranks.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    args, prov = harness.start(__doc__, add)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("throughput: --device cuda but no CUDA device is visible")
    steps = args.steps or (8 if args.quick else 24)
    seeds = list(range(args.seeds or 1))
    with tempfile.TemporaryDirectory() as tmp:
        data = write_cifar10(Path(tmp) / "data", per_batch=BATCH * 4, test=64)
        options = (
            f"--model resnet20 --steps {steps} --batch-size {BATCH} --lr 0.02 "
            f"--device {args.device} --eval-every-s 1e6 --log-every-steps 2 --checkpoint-every 0"
        )
        common = ["--dataset", f"cifar10:{data}", *options.split()]  # the path is not split
        arms = [harness.Arm(label, [*flags, *common]) for label, flags in ARMS.items()]
        root = Path(tmp) / "runs"
        runs = harness.interleave(arms, seeds, control="sync W=1", prov=prov, out_root=root)
        for r in (r for r in runs if not r.failed):
            r.values["samples_per_s"] = steady_rate(Path(r.out_dir), steps)
            finals = [rec for recs in read_run(r.out_dir).values() for rec in recs
                      if rec["event"] == "final" and rec.get("role") == "worker"]  # fmt: skip
            if (staged_s := sum(f.get("staging_s", 0.0) for f in finals)) > 0:
                r.values["staging_Bps"] = sum(f["staging_bytes"] for f in finals) / staged_s
                per = [f["staging_bytes"] / f["staging_s"] for f in finals if f.get("staging_s")]
                r.values["staging_Bps_workers"] = per
    groups = harness.by_arm(runs)
    name, title = f"throughput_{args.device}", f"Training throughput per strategy ({args.device})"
    report = harness.Report(name, title, prov)
    report.settings(
        f"ResNet-20 on random CIFAR-10-format images, batch {BATCH} per worker, "
        f"{steps} steps per worker, {len(seeds)} seed(s), interleaved with an A/A copy "
        "of sync W=1; samples/s between 25 % and 100 % of the steps, summed over "
        "workers."
    )
    rate = {arm: [r.values.get("samples_per_s") for r in rs if not r.failed]
            for arm, rs in groups.items()}  # fmt: skip
    rows = [[arm, harness.median(rate[arm]), len(rs), sum(bool(r.failed) for r in rs)]
            for arm, rs in groups.items()]  # fmt: skip
    report.table(["arm", "samples/s (median)", "runs", "failed"], rows)
    base, aa = harness.median(rate["sync W=1"]), harness.median(rate[harness.aa_name("sync W=1")])
    if base and aa:
        report.text(
            f"A/A: the copy of sync W=1 ÷ sync W=1 = {harness.fmt(aa / base, 4)} (the noise floor)."
        )
    if args.device == "cuda":  # after the jobs: CUDA in this process would break forked ranks
        reps, copy_steps = (2, 5) if args.quick else (5, 40)
        staging_claim(report, runs, reps, copy_steps)
    report.write(runs)


if __name__ == "__main__":
    main()
