"""The GPT's outer step by number of replicas (issue 43's equal-token GPT targets): DiLoCo with
one replica (the outer step alone) and with two, against sync, at equal tokens.

    .venv/bin/python benchmarks/lm_replicas.py            # results/lm_replicas.{md,json}
    .venv/bin/python benchmarks/lm_replicas.py --quick    # smoke test, runs/bench-quick/
    .venv/bin/python benchmarks/lm_replicas.py --replay benchmarks/results/lm_replicas.json \
        --verify 1  # 2bee55e's runs (1 of each batch re-simulated), the second round's new

Virtual cluster, flat network (the claims are per token; the virtual cluster computes what gloo
does): the default GPT (2 layers, width 64, 4 heads, context 64: 120,576 parameters) on
text:stdlib and its recipe (AdamW 4.2e-3, weight decay 0.1, warm-up 30 then cosine, clip 1),
1,600 steps of 64 windows (sync: 4 workers × 16), so DiLoCo at H = 8 takes 200 outer steps.
Arms, each named before any run (a run of 1,600 steps costs ~3 minutes on this machine): sync
(its recipe is the GPT's default, tuned for sync); DiLoCo M = 1 (one worker of 64 windows:
Lookahead with an outer Nesterov step, Charles et al. 2025's M = 1), its outer lr and momentum
tuned on seeds 0–2 on {0.4, 0.7} × {0.5, 0.9} (0.4 is their best for M = 1 at H = 30, our H = 8
gives smaller pseudo-gradients; with few outer steps they advise momentum ~0.5; 0.4 with 0.9
alone was +0.077 nats, a MISS, at 04f65c0); DiLoCo M = 2 (4 workers on 2 nodes, each node one
replica of 32 windows, `--replica node`) with the GPT's default outer step (plain averaging,
docs/lm.md), alone or with DES-LOC's moment averages (docs/algorithms.md#des-loc) every (3, 6)
outer periods, the paper's, or (1, 1), tuned on seeds 0–2 among the three. Seeds 3–7 confirm
(the GPT's defaults were chosen on seeds 0 and 1). Targets, from the issue before any run: M = 1
≤ sync's loss (the outer step alone helps in Charles et al.: −0.1 % to −0.4 %), M = 2 ≤ sync +
0.05 nats. A family given several arms (``ARMS``) is tuned on seeds 0–2 first.

A second round for M = 2, named after the first confirmation missed (+0.055 [0.050, 0.060]
against 0.05) and before any of its runs: three levers §9 of ALGORITHMS.md lists and the first
round did not try, each on plain averaging's replicas — an outer Nesterov step at lr 0.7 with
momentum 0.5 (M = 1's chosen step here; Charles et al.'s best outer lr at M = 2 is ≈ 0.6 and
they advise momentum ~0.5 for few outer steps), at lr 1 with momentum 0.5 (averaging plus
momentum), and the inner lr scaled by M^0.29 (4.2e-3 × 1.22 = 5.1e-3). The best of all six
M = 2 arms on seeds 0–2 is confirmed on 5 fresh seeds (8–12) beside sync, its claim judged on
those seeds alone; the first confirmation (seeds 3–7, which chose nothing) is kept as it was.

A second confirmation for M = 1, named after the first left it inconclusive (−0.009 nats
[−0.032, +0.014] against ≤ 0) and before its runs: the chosen M = 1 arm beside sync on 20 fresh
seeds (8–27; sync's runs of seeds 8–12 are the M = 2 round's), sized from the first's spread
(sd 0.018 over 5 seeds: 20 seeds give a half-width ≈ 0.009, so the interval can clear 0 if
the first's estimate holds). Its claim is judged on those seeds alone.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Arm, fmt  # noqa: E402

BASE = ["--model", "gpt", "--dataset", "text:stdlib", "--period", "8", "--eval-every-s", "1e5",
        "--checkpoint-every", "0", "--comm-timeout-s", "86400"]  # fmt: skip
ARMS = {  # name: (family, flags)
    "sync": ("sync", ["--strategy", "sync", "--workers", "4"]),
    **{f"M=1 outer {lr:g} μ {mu:g}": ("M=1", ["--strategy", "diloco", "--workers", "1",
                                             "--batch-size", "64", "--diloco-outer-lr", f"{lr:g}",
                                             "--diloco-outer-momentum", f"{mu:g}"])
       for lr in (0.4, 0.7) for mu in (0.5, 0.9)},
    "M=2 averaging": ("M=2", ["--strategy", "diloco", "--workers", "4", "--nodes", "2",
                              "--replica", "node"]),
    **{f"M=2 DES-LOC {k1},{k2}": ("M=2", ["--strategy", "diloco", "--workers", "4", "--nodes",
                                          "2", "--replica", "node", "--desloc-first-every",
                                          str(k1), "--desloc-second-every", str(k2)])
       for k1, k2 in ((3, 6), (1, 1))},
}  # fmt: skip
M2 = ["--strategy", "diloco", "--workers", "4", "--nodes", "2", "--replica", "node"]
ROUND2 = {  # the second round's M = 2 arms (name: flags), named after the first's MISS
    **{f"M=2 outer {lr:g} μ 0.5": [*M2, "--diloco-outer-lr", f"{lr:g}",
                                   "--diloco-outer-momentum", "0.5"] for lr in (0.7, 1.0)},
    "M=2 inner lr 5.1e-3": [*M2, "--lr", "5.1e-3"],
}  # fmt: skip
TARGETS = {"M=1": 0.0, "M=2": 0.05}  # nats above sync's final test loss, at most
TUNE, CONFIRM, CONFIRM2, STEPS = (0, 1, 2), (3, 4, 5, 6, 7), (8, 9, 10, 11, 12), 1600
CONFIRM_M1 = tuple(range(8, 28))


def loss(r: harness.Run) -> float:
    return float(r.summary.get("final_test_loss", float("inf")))


def main() -> None:
    args, prov = harness.start(__doc__)
    quick, root = args.quick, prov.runs_dir("lm_replicas")
    quick_seeds = ((0,), (1, 2), (3, 4), (3, 4, 5), 40)
    tune, confirm, confirm2, confirm_m1, steps = quick_seeds if quick else (
        TUNE, CONFIRM, CONFIRM2, CONFIRM_M1, STEPS)  # fmt: skip
    report = harness.Report("lm_replicas", "The GPT's outer step by number of replicas: DiLoCo "
                            "M = 1 and M = 2 against sync at equal tokens", prov)  # fmt: skip
    report.settings(harness.about(__doc__))
    arms = [Arm(n, [*f, *BASE, "--steps", str(steps)]) for n, (_, f) in ARMS.items()]
    several = {fam for fam, _ in ARMS.values() if sum(f == fam for f, _ in ARMS.values()) > 1}
    tune = tune if several else ()  # one arm per family: nothing to choose
    jobs = [(a, s, root / "tune" / harness.slug(a.name) / f"seed{s}")
            for a in arms for s in tune if ARMS[a.name][0] in several]  # fmt: skip
    tuned = harness.simulate_all(jobs, prov, timeout_s=3600.0) if jobs else []
    g = harness.by_arm(tuned)
    mean = {n: statistics.mean(loss(r) for r in rs) for n, rs in g.items()}
    chosen = {fam: min((a for a in arms if ARMS[a.name][0] == fam),
                       key=lambda a: mean.get(a.name, 0.0)) for fam in TARGETS}  # fmt: skip
    if tuned:
        tuning_table(report, "Tuning", tune, g, mean).text(
            "Chosen: " + ", ".join(f"{f}: {a.name}" for f, a in chosen.items()) + "."
        )
    confirmed = confirmation(report, [arms[0], *chosen.values()], confirm, "confirm", steps)

    # the second round: three more M = 2 arms, the best M = 2 arm on fresh seeds
    more = [Arm(n, [*f, *BASE, "--steps", str(steps)]) for n, f in ROUND2.items()]
    jobs = [(a, s, root / "tune" / harness.slug(a.name) / f"seed{s}") for a in more for s in tune]
    tuned2 = harness.simulate_all(jobs, prov, timeout_s=3600.0)
    g2 = {**{n: rs for n, rs in g.items() if ARMS[n][0] == "M=2"}, **harness.by_arm(tuned2)}
    mean2 = {n: statistics.mean(loss(r) for r in rs) for n, rs in g2.items()}
    best = min([*(a for a in arms if ARMS[a.name][0] == "M=2"), *more], key=lambda a: mean2[a.name])
    tuning_table(report, "Second round for M = 2: tuning", tune, g2, mean2).text(
        f"Chosen: {best.name}."
    )
    confirmed2 = confirmation(report, [arms[0], best], confirm2, "confirm2", steps,
                              "Second round for M = 2: confirmation")  # fmt: skip

    # M = 1's second confirmation, on 20 fresh seeds (sync's first five are the round's above)
    confirmed3 = confirmation(report, [arms[0], chosen["M=1"]], confirm_m1, "confirm2", steps,
                              "Second confirmation for M = 1", have=confirmed2)  # fmt: skip
    report.data.update(chosen={fam: a.name for fam, a in chosen.items()}, tuning=mean,
                       chosen_round2=best.name, tuning_round2=mean2)  # fmt: skip
    report.write([*tuned, *confirmed, *tuned2, *confirmed2, *confirmed3])


def tuning_table(
    report: harness.Report, title: str, seeds: tuple[int, ...], groups: dict, means: dict
) -> harness.Report:
    """A tuning section: each arm's final test loss per seed and its mean."""
    rows = [[n, " / ".join(fmt(loss(r), 4) for r in rs), fmt(means[n], 4)]
            for n, rs in groups.items()]  # fmt: skip
    return report.section(f"{title} (seeds {', '.join(map(str, seeds))})").table(
        "arm | final test loss per seed (nats/byte) | mean", rows
    )


def confirmation(
    report: harness.Report,
    arms: list[Arm],
    seeds: tuple[int, ...],
    phase: str,
    steps: int,
    title: str = "Confirmation",
    have: Sequence[harness.Run] = (),
) -> list[harness.Run]:
    """Sync (``arms[0]``) and the chosen arms on ``seeds``: a claim per arm against its
    family's target, and the table. A run of an arm and seed in ``have`` (an earlier
    confirmation's) is used, not simulated again; the runs simulated here are returned."""
    root = report.prov.runs_dir("lm_replicas")
    made = {(r.arm, r.seed): r for r in have if r.seed in seeds}
    jobs = [(a, s, root / phase / harness.slug(a.name) / f"seed{s}")
            for a in arms for s in seeds if (a.name, s) not in made]  # fmt: skip
    confirmed = harness.simulate_all(jobs, report.prov, timeout_s=3600.0)
    names = {a.name for a in arms}
    cg = harness.by_arm([*(r for r in made.values() if r.arm in names), *confirmed])
    sync = [loss(r) for r in cg["sync"]]
    for arm in arms[1:]:
        target = TARGETS[family(arm.name)]
        d, lo, hi = harness.difference_interval([loss(r) for r in cg[arm.name]], sync)
        report.claim(f"final test loss at equal tokens, {arm.name} − sync (nats/byte), "
                     f"{steps} steps, H = 8" + (f", seeds {seeds[0]}–{seeds[-1]}"
                                                if phase != "confirm" else ""),
                     round(d, 4), f"≤ {target:g}", hi <= target,
                     interval=(round(lo, 4), round(hi, 4)), seeds=len(seeds))  # fmt: skip
    report.section(f"{title} (seeds {', '.join(map(str, seeds))})").table(
        "arm | final test loss per seed (nats/byte) | mean | outer steps | MB sent per worker",
        [
            [
                a.name,
                " / ".join(fmt(loss(r), 4) for r in cg[a.name]),
                fmt(statistics.mean(loss(r) for r in cg[a.name]), 4),
                steps // 8,
                fmt(
                    statistics.mean(
                        r.summary.get("sent_bytes", 0) / r.summary.get("workers", 1)
                        for r in cg[a.name]
                    )
                    / 1e6
                ),
            ]
            for a in arms
        ],  # fmt: skip
    )
    return confirmed


def family(name: str) -> str:
    return ARMS[name][0] if name in ARMS else "M=2"  # ROUND2's arms are all M = 2


if __name__ == "__main__":
    main()
