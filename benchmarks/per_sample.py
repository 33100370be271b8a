"""Quality per sample: local SGD, DiLoCo and Streaming DiLoCo int8 against a tuned sync at
equal samples (issue 43's per-sample targets), 4 and 16 workers, H = 8.

    .venv/bin/python benchmarks/per_sample.py            # results/per_sample.{md,json}
    .venv/bin/python benchmarks/per_sample.py --quick    # smoke test, runs/bench-quick/
    .venv/bin/python benchmarks/per_sample.py --w64      # int8 at W = 64: per_sample_w64

Virtual cluster, flat network: the claims are about samples, not time, and the virtual
cluster computes what gloo does (the reference-parity tests), deterministically. MNIST-1D's
CNN, SGD with momentum 0.9, batch 64 per worker. W = 4: local_sgd.md's run (4,000 training
samples, 24 epochs: 375 steps per worker, 46 outer steps at H = 8); W = 16: batch 32, 16,000
samples, 12 epochs (the same 375 steps per worker). Every arm sees the same samples.

Arms: sync; local SGD (H = 8); DiLoCo (H = 8) at its defaults over SGD (outer Nesterov lr 0.5,
momentum 0.8); DiLoCo with the previous defaults (0.1, 0.9), the change's evidence; Streaming
DiLoCo (4 fragments, τ = 1, α = 0, its default) with int8 and error feedback, at DiLoCo's lr
(its comparison is with DiLoCo fp32). A first run with α = 0.5 (the mixing of the Streaming
DiLoCo paper, and of equal_time.md's arm) ended 2.8 / 3.1 points below DiLoCo fp32 at W = 4 /
16 (seeds 3–7); on the tuning seeds at W = 16 the parts cost: int8 +0.5 points (DiLoCo int8
93.9 % against fp32's 93.4 %), 4 fragments −0.1, τ = 1 −0.5, α = 0.5 −3.7 (stream fp32 89.2 %):
the mixing, not the int8, is what lost, so α = 0 is the arm confirmed here.
Tuning (seeds 0–2): every arm but Streaming DiLoCo gets its inner lr from {0.05, 0.1, 0.2, 0.4}
(best mean final accuracy; sync on the same grid as its challengers). Confirmation (seeds 3–7,
not used to choose), targets from the issue before any run: local SGD and DiLoCo ≥ sync − 1
point, Streaming DiLoCo int8 ≥ DiLoCo fp32 − 1 point; and (named here) DiLoCo's defaults ≥ the
previous defaults, and DiLoCo with a synchronous warm start (post-local SGD's;
`--local-sgd-warmup-steps K`, K tuned on {32, 64, 128} at DiLoCo's lr on seeds 0–2) ≥ DiLoCo
without: the warm start becomes a default only if the whole interval is above 0.
Two levers added after the run at f71d3fd missed the W = 16 targets (DiLoCo −2.3, local SGD
−4.72 points), both from ALGORITHMS.md §9 and tuned on seeds 0–2 like the rest: local SGD
with the same warm start (post-local SGD, Lin et al.; K on the same grid) ≥ local SGD
without; and DiLoCo with its outer step tuned at its inner lr, lr {0.3, 0.5, 0.7, 0.9} ×
momentum {0.5, 0.7, 0.9} (Charles et al.: the best outer lr grows with the replicas, ≈ 0.8 at
M = 8 over AdamW) ≥ sync − 1 point.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Arm, fmt, pct  # noqa: E402

BASE = ["--dataset", "mnist1d", "--model", "cnn", "--momentum", "0.9", "--period", "8",
        "--eval-every-s", "1e5", "--checkpoint-every", "0",
        "--comm-timeout-s", "86400"]  # fmt: skip
SCALES = {  # name: flags
    "W = 4": ["--workers", "4", "--batch-size", "64", "--epochs", "24"],
    "W = 16": ["--workers", "16", "--batch-size", "32", "--train-size", "16000", "--epochs", "12"],
}
OLD = ["--diloco-outer-lr", "0.1", "--diloco-outer-momentum", "0.9"]
TUNED = {  # name: flags; each tuned on LRS
    "sync": ["--strategy", "sync"],
    "local_sgd": ["--strategy", "local_sgd"],
    "diloco": ["--strategy", "diloco"],
    "diloco 0.1/0.9": ["--strategy", "diloco", *OLD],
}
STREAM = ["--strategy", "diloco", "--fragments", "4", "--fragment-delay", "1",
          "--compress", "int8"]  # fmt: skip
LRS = (0.05, 0.1, 0.2, 0.4)
WARMS = (32, 64, 128)  # the synchronous warm start K (steps), tuned at each arm's chosen lr
OUTER = [(lr, m) for lr in (0.3, 0.5, 0.7, 0.9) for m in (0.5, 0.7, 0.9)]  # DiLoCo's outer step
TUNE, CONFIRM = (0, 1, 2), (3, 4, 5, 6, 7)
CLAIMS = [  # (a, b, points): a − b ≥ −points
    ("local_sgd", "sync", 1.0),
    ("diloco", "sync", 1.0),
    ("streaming int8", "diloco", 1.0),
    ("diloco", "diloco 0.1/0.9", 0.0),
]


def lr_of(arm: Arm) -> float:
    return float(arm.argv[arm.argv.index("--lr") + 1])


W64 = ["--workers", "64", "--batch-size", "8", "--train-size", "16000", "--epochs", "12"]


def main() -> None:
    def add(p) -> None:
        p.add_argument("--w64", action="store_true", help="Streaming DiLoCo int8 against DiLoCo "
                       "fp32 at W = 64 alone (results/per_sample_w64)")  # fmt: skip

    args, prov = harness.start(__doc__, add)
    if args.w64:
        return w64(args, prov)
    quick, root = args.quick, prov.runs_dir("per_sample")
    scales = {"W = 4": [*SCALES["W = 4"][:-1], "2"]} if quick else SCALES
    tune, confirm, lrs = ((0,), (1, 2), LRS[1:3]) if quick else (TUNE, CONFIRM, LRS)
    report = harness.Report("per_sample", "Quality per sample: local SGD, DiLoCo and Streaming "
                            "DiLoCo int8 against a tuned sync (virtual cluster)", prov)  # fmt: skip
    report.settings(harness.about(__doc__))
    runs, chosen_all = [], {}
    for scale, flags in scales.items():
        tag = harness.slug(scale)
        grid = [Arm(f"{name} lr {lr:g}", [*f, "--lr", f"{lr:g}", *flags, *BASE])
                for name, f in TUNED.items() for lr in lrs]  # fmt: skip
        tuned, mean = simulate(grid, tune, root / tag / "tune", prov)
        runs += tuned
        chosen = {name: max((a for a in grid if a.name.startswith(f"{name} lr ")),
                            key=lambda a: mean[a.name]) for name in TUNED}  # fmt: skip
        report.section(f"{scale}: tuning (seeds {', '.join(map(str, tune))})").table(
            "arm | " + " | ".join(f"lr {lr:g}" for lr in lrs),
            [[name, *(pct(mean[f"{name} lr {lr:g}"]) for lr in lrs)] for name in TUNED],
        ).text("Mean final accuracy per inner lr; chosen: "
               + ", ".join(f"{n} lr {lr_of(a):g}" for n, a in chosen.items()) + ".")  # fmt: skip
        final_arms = [Arm(name, a.argv) for name, a in chosen.items()]
        dlr = f"{lr_of(chosen['diloco']):g}"
        final_arms.append(Arm("streaming int8", [*STREAM, "--lr", dlr, *flags, *BASE]))
        # the synchronous warm start K of DiLoCo and local SGD, at each one's lr (K = 0 is it)
        warms = WARMS[:1] if quick else WARMS
        for name in ("diloco", "local_sgd"):
            warm_grid = [Arm(f"{name} warm {k}", [*chosen[name].argv,
                                                  "--local-sgd-warmup-steps", str(k)])
                         for k in warms]  # fmt: skip
            warm_runs, warm_mean = simulate(warm_grid, tune, root / tag / "tune", prov)
            runs += warm_runs
            best_warm = max(warm_grid, key=lambda a: warm_mean[a.name])
            report.text(f"{name}'s synchronous warm start at its lr (mean final accuracy, the "
                        f"tuning seeds): K = 0 {pct(mean[chosen[name].name])}, "
                        + ", ".join(f"K = {a.name.split()[-1]} {pct(warm_mean[a.name])}"
                                    for a in warm_grid)
                        + f"; confirmed: {best_warm.name}.")  # fmt: skip
            final_arms.append(Arm(f"{name} warm", best_warm.argv))
        # DiLoCo's outer step tuned at its inner lr (Charles et al.: its best lr grows with M)
        outer = OUTER[:2] if quick else OUTER
        outer_grid = [Arm(f"diloco outer {lr:g}/{m:g}", [*chosen["diloco"].argv,
                          "--diloco-outer-lr", f"{lr:g}", "--diloco-outer-momentum", f"{m:g}"])
                      for lr, m in outer]  # fmt: skip
        outer_runs, outer_mean = simulate(outer_grid, tune, root / tag / "tune", prov)
        runs += outer_runs
        best_outer = max(outer_grid, key=lambda a: outer_mean[a.name])
        moms = sorted({m for _, m in outer})
        report.table("diloco's outer lr | " + " | ".join(f"momentum {m:g}" for m in moms),
                     [[f"{lr:g}", *(pct(outer_mean.get(f"diloco outer {lr:g}/{m:g}"))
                                    for m in moms)]
                      for lr in sorted({lr for lr, _ in outer})]).text(
            f"DiLoCo's outer step at inner lr {dlr} (mean final accuracy, the tuning seeds; its "
            f"default 0.5/0.8: {pct(mean[chosen['diloco'].name])}); confirmed: "
            f"{best_outer.name}.")  # fmt: skip
        final_arms.append(Arm("diloco outer", best_outer.argv))
        confirmed, _ = simulate(final_arms, confirm, root / tag / "confirm", prov)
        for r in confirmed:
            r.values["scale"] = scale
        runs += confirmed
        cg = harness.by_arm(confirmed)
        extra = [("diloco warm", "diloco", 0.0), ("local_sgd warm", "local_sgd", 0.0),
                 ("diloco outer", "sync", 1.0)]  # fmt: skip
        for a, b, points in [*CLAIMS, *extra]:
            xa = [r.final_accuracy or 0.0 for r in cg[a]]
            xb = [r.final_accuracy or 0.0 for r in cg[b]]
            harness.diff_claim(report, f"final accuracy at equal samples, {a} − {b} (points), "
                               f"{scale}, H = 8", xa, xb, f"≥ {0 - points:g}",
                               lambda d, lo, hi, p=points: lo >= -p,
                               seeds=len(confirm))  # fmt: skip
        report.section(f"{scale}: confirmation (seeds {', '.join(map(str, confirm))})").table(
            "arm | lr | final accuracy per seed | mean | MB sent per worker",
            [row(a, cg[a.name]) for a in final_arms],
        )
        chosen_all[scale] = {n: lr_of(a) for n, a in chosen.items()}
    report.data.update(chosen_lr=chosen_all)
    report.write(runs)


def w64(args, prov) -> None:
    """The int8 target at W = 64 (the same 375 steps per worker, batch 8, global batch 512):
    DiLoCo's inner lr on {0.05, 0.1, 0.2} (seeds 0–2), then DiLoCo fp32 and Streaming DiLoCo
    int8 (4 fragments, τ = 1, α = 0) at that lr on seeds 3–7."""
    quick, root = args.quick, prov.runs_dir("per_sample_w64")
    tune, confirm, lrs = ((0,), (1, 2), (0.1,)) if quick else (TUNE, CONFIRM, LRS[:3])
    flags = [*W64[:-1], "1"] if quick else W64
    report = harness.Report("per_sample_w64", "Quality per sample at 64 workers: Streaming "
                            "DiLoCo int8 against DiLoCo fp32 (virtual cluster)", prov)  # fmt: skip
    report.settings(harness.about(__doc__) + "\n\n" + " ".join(w64.__doc__.split()))
    grid = [Arm(f"diloco lr {lr:g}", [*TUNED["diloco"], "--lr", f"{lr:g}", *flags, *BASE])
            for lr in lrs]  # fmt: skip
    tuned, mean = simulate(grid, tune, root / "tune", prov)
    best = max(grid, key=lambda a: mean[a.name])
    arms = [
        Arm("diloco", best.argv),
        Arm("streaming int8", [*STREAM, "--lr", f"{lr_of(best):g}", *flags, *BASE]),
    ]
    confirmed, _ = simulate(arms, confirm, root / "confirm", prov)
    cg = harness.by_arm(confirmed)
    acc = {n: [r.final_accuracy or 0.0 for r in rs] for n, rs in cg.items()}
    harness.diff_claim(report, "final accuracy at equal samples, streaming int8 − diloco "
                       "(points), W = 64, H = 8", acc["streaming int8"], acc["diloco"], "≥ -1",
                       lambda d, lo, hi: lo >= -1.0, seeds=len(confirm))  # fmt: skip
    report.section(f"Tuning (seeds {', '.join(map(str, tune))})").table(
        "arm | " + " | ".join(f"lr {lr:g}" for lr in lrs),
        [["diloco", *(pct(mean[f"diloco lr {lr:g}"]) for lr in lrs)]],
    ).text(f"Chosen: diloco lr {lr_of(best):g}.")
    report.section(f"Confirmation (seeds {', '.join(map(str, confirm))})").table(
        "arm | lr | final accuracy per seed | mean | MB sent per worker",
        [row(a, cg[a.name]) for a in arms],
    )
    report.data.update(chosen_lr=lr_of(best))
    report.write([*tuned, *confirmed])


def simulate(arms: list[Arm], seeds, where: Path, prov) -> tuple[list[harness.Run], dict]:
    """Each arm on each seed (run directories under ``where``): the runs, and each arm's mean
    final accuracy."""
    jobs = [(a, s, where / harness.slug(a.name) / f"seed{s}") for a in arms for s in seeds]
    runs = harness.simulate_all(jobs, prov, timeout_s=3600.0)
    groups = harness.by_arm(runs)
    mean = {a.name: statistics.mean(r.final_accuracy or 0.0 for r in groups[a.name]) for a in arms}
    return runs, mean


def row(arm: Arm, runs: list[harness.Run]) -> list[str]:
    accs = [r.final_accuracy for r in runs]
    ok = [a for a in accs if a is not None]
    sent = [r.summary.get("sent_bytes", 0) / max(1, r.summary.get("workers", 1)) for r in runs]
    return [arm.name, f"{lr_of(arm):g}", " / ".join(pct(a) for a in accs),
            pct(statistics.mean(ok)) if ok else "-", fmt(statistics.mean(sent) / 1e6)]  # fmt: skip


if __name__ == "__main__":
    main()
