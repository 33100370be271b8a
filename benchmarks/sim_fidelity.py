"""Fidelity of the virtual cluster: ``cloudburst simulate``'s predicted training time against a
real ``cloudburst train`` of the same flags on this machine, every strategy (issue 14).

Each configuration (strategy × W) runs twice with the same flags: ``cloudburst train`` (W
workers, plus a server shard for asgd/easgd, local processes, gloo on loopback, the link
emulated on top) and ``cloudburst simulate`` (one process, virtual time). The simulated step
time is the run's ``--min-step-time-s`` padding (up to 5 processes share 2 cores: the padding
keeps steps above the compute); both put the ranks on 2 emulated nodes joined by the same
``--inter-node-link``; evaluation is pushed out of the run (it is free in virtual time); no
checkpoints. Measured: the summary's ``wall_time_s`` (training, start-up excluded); ratio =
real ÷ simulated, target within 15 %. Real and simulated runs are interleaved; the A/A control
runs ``sync`` W = 2 for real a second time: its ratio to the first is the noise floor of the
real measurement. A failed run is kept and counted outside the tolerance. ``comm wait s``: the
summary's ``comm_wait_s`` (summed over ranks).

    .venv/bin/python benchmarks/sim_fidelity.py [--quick] [--force] [--steps N]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

STRATEGIES = ("sync", "asgd", "easgd", "local_sgd", "diloco", "gossip", "daso")
TOLERANCE = 0.15
CONTROL = "sync W2 real"


def run_cli(command: str, arm: harness.Arm, seed: int, out: Path) -> harness.Run:
    """``python -m cloudburst <command> --overwrite <arm.argv>`` (:func:`harness.run_train`)."""
    return harness.run_train(arm, seed, out, 600.0, (*harness.CLI, command, "--overwrite"))


def argv(strategy: str, workers: int, steps: int) -> list[str]:
    a = ["--strategy", strategy, "--workers", str(workers), "--steps", str(steps)]
    a += ["--min-step-time-s", "0.04", "--nodes", "2", "--inter-node-link", "0.05,1"]
    a += ["--eval-every-s", "1e6", "--checkpoint-every", "0"]
    return a + (["--servers", "1"] if strategy in ("asgd", "easgd") else [])


def main() -> None:
    def add(p):
        p.add_argument("--steps", type=int, default=None, help="steps per worker (100)")

    args, prov = harness.start(__doc__, add)
    steps = args.steps or (20 if args.quick else 100)
    strategies = ("sync", "asgd") if args.quick else STRATEGIES
    workers = (2,) if args.quick else (2, 4)
    configs = [(s, w) for s in strategies for w in workers]
    arms = [
        harness.Arm(f"{s} W{w} {mode}", argv(s, w, steps))
        for s, w in configs
        for mode in ("real", "sim")
    ]
    root = prov.runs_dir("sim_fidelity")

    def one(arm: harness.Arm, seed: int) -> harness.Run:
        command = "simulate" if arm.name.endswith(" sim") else "train"
        return run_cli(command, arm, seed, root / harness.slug(arm.name) / f"seed{seed}")

    seeds = list(range(args.seeds or 1))
    runs = harness.interleave(arms, seeds, control=CONTROL, run=one, prov=prov)
    by = harness.by_arm(runs)

    def walls(name: str) -> list[float | None]:
        return [None if r.failed else r.summary["wall_time_s"] for r in by[name]]

    rows, within = [], 0
    for s, w in configs:
        real, sim = by[f"{s} W{w} real"], by[f"{s} W{w} sim"]
        for r, p in zip(real, sim, strict=True):
            ok = not (r.failed or p.failed)
            ratio = r.summary["wall_time_s"] / p.summary["wall_time_s"] if ok else None
            within += ratio is not None and abs(ratio - 1) <= TOLERANCE
            comm = [x.summary.get("comm_wait_s") for x in (r, p)]
            rows.append([s, w, r.seed, *[x.summary.get("wall_time_s") for x in (p, r)], ratio,
                         *comm, r.failed or p.failed or ""])  # fmt: skip
    total = len(rows)
    rep = harness.Report("sim_fidelity", "Fidelity of the virtual cluster: real ÷ simulated", prov)
    aa, base = walls(harness.aa_name(CONTROL)), walls(CONTROL)
    aa_ratio = (
        harness.statistics.median(a / b for a, b in zip(aa, base, strict=True) if a and b)
        if any(aa) and any(base)
        else None
    )
    rep.claim("configurations with real ÷ simulated training time within 15 %",
              f"{within} / {total}", f"{total} / {total}", within == total, aa=aa_ratio,
              seeds=len(seeds), note="A/A: sync W = 2 real, repeated")  # fmt: skip
    rep.settings(
        f"MNIST-1D, the default CNN, {steps} steps per worker (scaled down from 200 to fit the "
        "benchmark budget), batch 64, `--min-step-time-s 0.04`, `--nodes 2 --inter-node-link "
        f"0.05,1` (50 Mbit/s, 1 ms), `--eval-every-s 1e6`.\n\n{harness.about(__doc__)}"
    )
    rep.table("strategy | W | seed | simulated s | real s | real ÷ sim | comm wait s real | "
              "comm wait s sim | failed", rows)  # fmt: skip
    rep.write(runs)


if __name__ == "__main__":
    main()
