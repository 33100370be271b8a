"""Fidelity of the virtual cluster: the time an emulated link adds to a run, as ``cloudburst
simulate`` predicts it against real ``cloudburst train`` runs of the same flags on this
machine, on configurations held out from the model's development (issues 25 and 30).

Each configuration runs real and simulated, with and without the link, interleaved; claims:
real ÷ simulated link time within 15 % (paired interval), and the unpadded time. A failed run
counts as outside the tolerance. Details: benchmarks/README.md.

    .venv/bin/python benchmarks/sim_fidelity.py [--quick] [--force] [--steps N] [--seeds N]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

DEVELOPED = "sync, asgd, easgd, local_sgd, diloco, gossip, daso × W 2, 4 × link 0.05,1"
# (strategy, W, --inter-node-link Gbit/s,ms): named before the run
HELD_OUT = (
    ("sync", 3, "0.2,5"),
    ("asgd", 3, "0.2,5"),
    ("easgd", 3, "0.02,2"),
    ("daso", 4, "0.02,2"),
)
# Named on 2026-11-27 after the run at 43f3704 had shown the emulator hiding the ranks' skew in
# the link time (fixed since: a collective starts at its last member), before any run of them:
# the four above have now informed one change of the emulator, these have not.
FRESH = (("gossip", 3, "0.1,3"), ("diloco", 4, "0.1,3"))
PADDING_S = 0.04
TOLERANCE = 0.15
WAYS = ("real", "real, no link", "sim", "sim, no link")


def argv(strategy: str, workers: int, link: str | None, steps: int) -> list[str]:
    return ["--strategy", strategy, "--workers", str(workers), "--steps", str(steps),
            "--min-step-time-s", str(PADDING_S), "--nodes", "2", "--eval-every-s", "1e6",
            "--checkpoint-every", "0", *(["--inter-node-link", link] if link else []),
            *(["--servers", "1"] if strategy in ("asgd", "easgd") else [])]  # fmt: skip


def wall(run: harness.Run) -> float | None:
    return None if run.failed else run.summary["wall_time_s"]


def minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def main() -> None:
    def add(p):
        p.add_argument("--steps", type=int, default=None, help="steps per worker (100)")

    args, prov = harness.start(__doc__, add)
    steps = args.steps or (20 if args.quick else 100)
    padding = steps * PADDING_S
    configs = HELD_OUT[:2] if args.quick else HELD_OUT + FRESH
    label = {c: f"{c[0]} W{c[1]} link {c[2]}" for c in configs}
    arms = [harness.Arm(f"{label[c]} {w}", argv(*c[:2], None if "no link" in w else c[2], steps))
            for c in configs for w in WAYS]  # fmt: skip
    control, root = f"{label[configs[0]]} real", prov.runs_dir("sim_fidelity")

    def one(arm: harness.Arm, seed: int) -> harness.Run:
        command = harness.SIMULATE if " sim" in arm.name else (*harness.CLI, "train")
        out = root / harness.slug(arm.name) / f"seed{seed}"
        return harness.run_train(arm, seed, out, 600.0, command)

    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    runs = harness.interleave(arms, seeds, control=control, run=one, prov=prov)
    by = harness.by_arm(runs)
    rep = harness.Report("sim_fidelity", "Fidelity of the virtual cluster: the link's time", prov)
    target = f"1 ± {TOLERANCE:g}"
    added: dict[str, list] = {"real": [], "sim": []}
    unpadded: dict[str, list] = {"real": [], "sim": []}
    rows: list[list] = []
    for c in configs:
        w = {way: [wall(r) for r in by[f"{label[c]} {way}"]] for way in WAYS}
        for i, seed in enumerate(seeds):
            real = minus(w["real"][i], w["real, no link"][i])
            sim = minus(w["sim"][i], w["sim, no link"][i])
            for side, x in (("real", real), ("sim", sim)):
                added[side].append(x)
                unpadded[side].append(minus(w[side][i], padding))
            failed = [
                r.failed for way in WAYS for r in by[f"{label[c]} {way}"][i : i + 1] if r.failed
            ]
            rows.append([label[c], seed, w["real"][i], w["real, no link"][i], real, sim,
                         None if real is None or not sim else real / sim,
                         minus(w["real, no link"][i], padding), "; ".join(failed)])  # fmt: skip

    def claim(name: str, real: list, sim: list, aa: float | None) -> None:
        pairs = [(x, y) for x, y in zip(real, sim, strict=True) if x is not None and y]
        failed = len(real) - len(pairs)
        if not pairs:
            rep.claim(name, "failed", target, False, seeds=len(seeds))
            return
        ratio, lo, hi = harness.paired_ratio([x for x, _ in pairs], [y for _, y in pairs])
        ok = failed == 0 and 1 - TOLERANCE <= lo and hi <= 1 + TOLERANCE
        rep.claim(name, ratio, target, ok, aa=aa, interval=(lo, hi), seeds=len(seeds),
                  note=f"{failed} failed runs" if failed else "")  # fmt: skip

    base = [wall(r) for r in by[f"{label[configs[0]]} real, no link"]]
    aa_added = [minus(wall(r), b) for r, b in zip(by[harness.aa_name(control)], base, strict=True)]
    ctl = added["real"][: len(seeds)]
    ok_aa = [(x, y) for x, y in zip(aa_added, ctl, strict=True) if x is not None and y]
    aa = harness.paired_ratio(*zip(*ok_aa, strict=True))[0] if ok_aa else None
    n = len(seeds)
    claim(f"time the link adds, real ÷ simulated, {len(configs)} held-out configurations",
          added["real"], added["sim"], aa)  # fmt: skip
    for i, c in enumerate(configs):
        claim(f"… {label[c]}", added["real"][i * n : (i + 1) * n],
              added["sim"][i * n : (i + 1) * n], aa)  # fmt: skip
    fresh = [i for i, c in enumerate(configs) if c in FRESH]
    if fresh:
        pick = [j for i in fresh for j in range(i * n, (i + 1) * n)]
        claim(f"… the {len(fresh)} configurations named after the first run (never used)",
              [added["real"][j] for j in pick], [added["sim"][j] for j in pick], aa)  # fmt: skip
    claim(f"unpadded time (host overhead included), real ÷ simulated, {len(configs)} held-out "
          "configurations", unpadded["real"], unpadded["sim"], None)  # fmt: skip
    rep.settings(
        f"MNIST-1D, the default CNN, {steps} steps per worker, batch 64, `--min-step-time-s "
        f"{PADDING_S}` (padding {padding:g} s a run), `--nodes 2`, `--eval-every-s 1e6`; seeds "
        f"{seeds}. Held out (named before the run): {', '.join(label.values())} (the last "
        f"{len([c for c in configs if c in FRESH])} named after the first run). Developed on: "
        f"{DEVELOPED}. A/A: {control}, repeated.\n\n{harness.about(__doc__)}"
    )
    rep.table("configuration | seed | real wall s | real wall s, no link | link adds, real s | "
              "link adds, simulated s | real ÷ sim | host overhead (real, no link − padding) s | "
              "failed", rows)  # fmt: skip
    rep.write(runs)


if __name__ == "__main__":
    main()
