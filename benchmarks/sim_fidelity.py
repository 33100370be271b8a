"""Fidelity of the virtual cluster: the part of a run that is not step padding — communication
and waiting — as ``cloudburst simulate`` predicts it against a real ``cloudburst train`` of the
same flags on this machine, on configurations held out from the model's development (issue 25).

Each configuration runs twice per seed with the same flags: ``cloudburst train`` (W workers,
plus a server shard for asgd/easgd, local processes, gloo on loopback, the link emulated on
top) and ``cloudburst simulate`` (one process, virtual time). Every step is padded to
``--min-step-time-s`` on both sides (up to 5 processes share 2 cores), so the padding, steps ×
padding, is the same number on both sides and is taken out: the quantity scored is the
summary's ``wall_time_s`` − steps × padding, the time the ranks spent communicating and
waiting, which the simulator models (link formulas, who waits for whom) and the real run
measures. Ratio = real ÷ simulated per (configuration, seed); the claims: the median ratio
within 15 % with its paired interval (all held-out configurations, then each one).

Held out: ``HELD_OUT`` names the configurations before any run; the model was developed on
``DEVELOPED`` (W = 2 and 4 over a 50 Mbit/s, 1 ms link), so these use W = 3 and links of other
bandwidth and latency. Real and simulated runs are interleaved; the A/A control runs the first
configuration for real a second time per seed: its ratio is the noise floor of the real side.
A failed run is kept and counted as outside the tolerance.

    .venv/bin/python benchmarks/sim_fidelity.py [--quick] [--force] [--steps N] [--seeds N]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

DEVELOPED = "sync, asgd, easgd, local_sgd, diloco, gossip, daso × W 2, 4 × link 0.05,1"
HELD_OUT = (  # (strategy, W, --inter-node-link Gbit/s,ms): named before the run
    ("sync", 3, "0.2,5"),
    ("asgd", 3, "0.2,5"),
    ("easgd", 3, "0.02,2"),
    ("daso", 4, "0.02,2"),
)
PADDING_S = 0.04
TOLERANCE = 0.15


def argv(strategy: str, workers: int, link: str, steps: int) -> list[str]:
    a = ["--strategy", strategy, "--workers", str(workers), "--steps", str(steps)]
    a += ["--min-step-time-s", str(PADDING_S), "--nodes", "2", "--inter-node-link", link]
    a += ["--eval-every-s", "1e6", "--checkpoint-every", "0"]
    return a + (["--servers", "1"] if strategy in ("asgd", "easgd") else [])


def unpadded(run: harness.Run, steps: int) -> float | None:
    """Training time less the padding every step carries: communication and waiting."""
    return None if run.failed else run.summary["wall_time_s"] - steps * PADDING_S


def main() -> None:
    def add(p):
        p.add_argument("--steps", type=int, default=None, help="steps per worker (100)")

    args, prov = harness.start(__doc__, add)
    steps = args.steps or (20 if args.quick else 100)
    configs = HELD_OUT[:2] if args.quick else HELD_OUT
    label = {c: f"{c[0]} W{c[1]} link {c[2]}" for c in configs}
    arms = [
        harness.Arm(f"{label[c]} {m}", argv(*c, steps)) for c in configs for m in ("real", "sim")
    ]
    control = f"{label[configs[0]]} real"
    root = prov.runs_dir("sim_fidelity")

    def one(arm: harness.Arm, seed: int) -> harness.Run:
        command = ("simulate", "--overwrite") if arm.name.endswith(" sim") else ("train",)
        out = root / harness.slug(arm.name) / f"seed{seed}"
        return harness.run_train(arm, seed, out, 600.0, (*harness.CLI, *command))

    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    runs = harness.interleave(arms, seeds, control=control, run=one, prov=prov)
    by = harness.by_arm(runs)
    rep = harness.Report("sim_fidelity", "Fidelity of the virtual cluster: unpadded time", prov)
    real_all, sim_all, rows = [], [], []
    for c in configs:
        real = [unpadded(r, steps) for r in by[f"{label[c]} real"]]
        sim = [unpadded(r, steps) for r in by[f"{label[c]} sim"]]
        real_all += real
        sim_all += sim
        for r, p, x, y in zip(
            by[f"{label[c]} real"], by[f"{label[c]} sim"], real, sim, strict=True
        ):
            ratio = x / y if x is not None and y else None
            rows.append([label[c], r.seed, r.summary.get("wall_time_s"), x, y, ratio,
                         r.failed or p.failed or ""])  # fmt: skip
    aa = [unpadded(r, steps) for r in by[harness.aa_name(control)]]
    base = [unpadded(r, steps) for r in by[control]]
    target = f"1 ± {TOLERANCE:g}"

    def claim(name: str, real: list, sim: list) -> None:
        pairs = [(x, y) for x, y in zip(real, sim, strict=True) if x is not None and y]
        failed = len(real) - len(pairs)
        if not pairs:
            rep.claim(name, "failed", target, False, seeds=len(seeds))
            return
        ratio, lo, hi = harness.paired_ratio([x for x, _ in pairs], [y for _, y in pairs])
        ok = failed == 0 and abs(ratio - 1) <= TOLERANCE
        rep.claim(name, ratio, target, ok, aa=aa_ratio, interval=(lo, hi), seeds=len(seeds),
                  note=f"{failed} failed runs" if failed else "")  # fmt: skip

    ok_aa = [(x, y) for x, y in zip(aa, base, strict=True) if x is not None and y]
    aa_ratio = harness.paired_ratio(*zip(*ok_aa, strict=True))[0] if ok_aa else None
    claim(f"unpadded time, real ÷ simulated, {len(configs)} held-out configurations",
          real_all, sim_all)  # fmt: skip
    for i, c in enumerate(configs):
        n = len(seeds)
        claim(f"… {label[c]}", real_all[i * n : (i + 1) * n], sim_all[i * n : (i + 1) * n])
    rep.settings(
        f"MNIST-1D, the default CNN, {steps} steps per worker, batch 64, `--min-step-time-s "
        f"{PADDING_S}` (padding {steps * PADDING_S:g} s a run), `--nodes 2`, "
        f"`--eval-every-s 1e6`; seeds {seeds}. Held out (named before the run): "
        f"{', '.join(label.values())}. Developed on: {DEVELOPED}. A/A: {control}, repeated."
        f"\n\n{harness.about(__doc__)}"
    )
    rep.table("configuration | seed | real wall s | real unpadded s | simulated unpadded s | "
              "real ÷ sim | failed", rows)  # fmt: skip
    rep.write(runs)


if __name__ == "__main__":
    main()
