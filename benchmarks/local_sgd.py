"""local SGD and DiLoCo against sync, PyTorch's averager and torchft (issue 4).

    .venv/bin/python benchmarks/local_sgd.py [--quick] [--seeds N] [--epochs E] [--force]

H = 8 everywhere, MNIST-1D, 4 workers, no emulated device or link (the CPU cost of each
mechanism is what is timed). Reported: time per step of local_sgd ÷ each peer and diloco ÷
torchft's (paired by seed, local_sgd A/A beside; torchft runs as many steps as the others),
bytes per sample ÷ sync's against ⌈T/H⌉ / T, final accuracy − sync (judged against sync and its
A/A copy). Details: benchmarks/README.md.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import peers  # noqa: E402
import torchft_peer  # noqa: E402
from harness import Arm, fmt, pct  # noqa: E402

from cloudburst.cli import build_config, build_parser  # noqa: E402

H = 8
COMMON = (f"--dataset mnist1d --model cnn --workers 4 --batch-size 64 --lr 0.1 --momentum 0.9 "
          f"--period {H} --eval-every-s 5 --log-every-steps 16").split()  # fmt: skip
CLOUDBURST = ("sync", "local_sgd", "diloco", "torch_periodic")  # arm = --strategy
TORCHFT = {"torchft_localsgd": "localsgd", "torchft_diloco": "diloco"}
# (a, b): a's time per step ÷ b's, target ≤ 1
STEP_CLAIMS = [("local_sgd", "torch_periodic"), ("local_sgd", "torchft_localsgd"),
               ("diloco", "torchft_diloco")]  # fmt: skip
BYTES_TOLERANCE = 0.02
ACC_POINTS = 1.0


def main() -> None:
    def add(p) -> None:
        p.add_argument("--epochs", type=int, default=24, help="epochs per worker (15 steps each)")

    args, prov = harness.start(__doc__, add)
    seeds = range(args.seeds or (1 if args.quick else 5))
    length = ["--steps", "48"] if args.quick else ["--epochs", str(args.epochs)]
    ft_steps = 48 if args.quick else 15 * args.epochs  # as many steps as cloudburst's arms
    arms = [Arm(n, ["--strategy", n, *COMMON, *length]) for n in CLOUDBURST]
    arms += [Arm(n, COMMON) for n in TORCHFT]
    arms.append(Arm(harness.aa_name("sync"), arms[0].argv))  # sync's A/A copy
    versions = torchft_peer.peer_versions()
    root = prov.runs_dir("local_sgd")

    def run(arm: Arm, seed: int) -> harness.Run:
        out = root / harness.slug(arm.name) / f"seed{seed}"
        if arm.name not in TORCHFT:
            r = peers.run_arm(arm, seed, out)
            r.values["step_s"] = None if r.failed else harness.run_step_s(out)
            return r
        cfg = build_config(build_parser().parse_args(["train", *arm.argv, "--seed", str(seed)]))
        error = versions.get("error")
        return torchft_peer.run_arm(arm.name, seed, cfg, TORCHFT[arm.name], out, ft_steps, error)

    runs = harness.interleave(arms, seeds, control="local_sgd", run=run, prov=prov)
    report(prov, runs, length, list(seeds), ft_steps, versions)


def report(prov, runs, length: list[str], seeds: list[int], ft_steps: int, versions) -> None:
    groups = harness.by_arm(runs)
    rep = harness.Report("local_sgd", "local SGD and DiLoCo: bytes, accuracy, step time", prov)
    step = {n: [r.values.get("step_s") for r in rs] for n, rs in groups.items()}
    aa = harness.pairs(step[harness.aa_name("local_sgd")], step["local_sgd"])
    aa_ratio = harness.paired_ratio(*aa)[0] if aa[0] else None
    for a, b in STEP_CLAIMS:
        ok_a, ok_b = harness.pairs(step[a], step[b])
        if not ok_a:
            rep.claim(f"time per step, {a} ÷ {b}", None, "≤ 1", False, note=f"{b} did not run")
            continue
        both = a == "local_sgd" and len(aa[0]) == len(ok_a)  # judged against both copies
        harness.ratio_claim(rep, f"time per step, {a} ÷ {b}, W = 4, H = {H}", ok_a, ok_b,
                            aa[0] if both else aa_ratio, "≤ 1", lambda x: x <= 1,
                            aa_of="a")  # fmt: skip
    sync_rs = groups["sync"]
    copy = [r.final_accuracy for r in groups.get(harness.aa_name("sync"), [])]
    for name in ("local_sgd", "diloco"):
        rs = groups[name]
        steps = rs[0].summary.get("steps_per_worker")
        both = zip(map(bytes_per_sample, rs), map(bytes_per_sample, sync_rs), strict=True)
        per = [a / b for a, b in both if a and b]
        if steps and per:
            expect = math.ceil(steps / H) / steps  # one |θ| all-reduce per average, sync per step
            measured = statistics.median(per)
            rep.claim(
                f"bytes per sample, {name} ÷ sync (counters), H = {H}",
                round(measured, 5),
                f"⌈T/H⌉/T = {expect:.4g} ± {100 * BYTES_TOLERANCE:g} %",
                abs(measured / expect - 1) <= BYTES_TOLERANCE,
                seeds=len(per),
            )
        accs, sync_accs = [r.final_accuracy for r in rs], [r.final_accuracy for r in sync_rs]
        if None not in accs + sync_accs:
            harness.diff_claim(rep, f"final accuracy, {name} − sync (points), H = {H}", accs,
                               sync_accs, f"within ±{ACC_POINTS:g}",
                               lambda d, lo, hi: abs(d) <= ACC_POINTS, seeds=len(accs),
                               aa_copy=copy if copy and None not in copy else None)  # fmt: skip
    peer = versions.get("error") or f"torch {versions['torch']}, torchft {versions['torchft']}"
    rep.settings(
        f"{harness.about(__doc__)}\n\nFlags: `{' '.join(COMMON + length)}`; "
        f"torchft: {ft_steps} steps ({peer}); seeds {seeds}. The A/A column is local_sgd (A/A) ÷ "
        "local_sgd: the distance from 1 this machine gives two identical arms."
    )
    rows = [
        [
            name,
            " / ".join(fmt(1000 * x if x else None) for x in step[name]),
            " / ".join(pct(r.final_accuracy) for r in rs),
            fmt(statistics.median([bytes_per_sample(r) or 0 for r in rs])),
            "; ".join(f"seed {r.seed}: {r.failed}" for r in rs if r.failed) or "-",
        ]
        for name, rs in groups.items()
    ]
    headers = ["arm", "ms per step per seed", "final acc % per seed", "B/sample (median)", "failed"]
    rep.section("Every arm").table(headers, rows)
    rep.write(runs)


def bytes_per_sample(r: harness.Run) -> float | None:
    s = r.summary
    return s["sent_bytes"] / s["samples"] if s.get("samples") and "sent_bytes" in s else None


if __name__ == "__main__":
    main()
