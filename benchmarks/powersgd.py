"""PowerSGD tuned as its authors run it, the baseline daso.md withdrew as a straw man (rank 1,
compressing from step 2: it never reached 85 %), against DASO and sync in daso.md's setting.

    .venv/bin/python benchmarks/powersgd.py            # results/powersgd.{md,json}
    .venv/bin/python benchmarks/powersgd.py --quick    # smoke test, runs/bench-quick/

daso.md's setting (``daso.COMMON``): 4 workers on 2 emulated nodes joined by 1 Gbit/s, 1 ms,
the wide CNN of ``bench_models.py`` (528 k parameters), batch 64, lr 0.1, momentum 0.9, every
step padded to ≥ 50 ms by sleeping inside the forward and backward passes (4 CPU-bound ranks
share 2 cores here: the device is emulated, the link and the collectives are real gloo), every
arm 40 s of training. PowerSGD (Vogels et al. 2019, PyTorch's ``powerSGD_hook``): error
feedback and warm start on, rank r, plain all-reduce until step s (``--compress
powersgd:r:s``; its authors start after the learning rate's warm-up, PyTorch's documentation
suggests about a tenth of the training).

1. Tuning (seeds 5–6): r ∈ {2, 4} × s ∈ {50, 150} (sync takes ~480 steps in the budget: about
   10 % and 30 % of them). Chosen: the shortest geometric-mean time to 85 % (a run that never
   holds it counts at the budget), then the highest mean final accuracy.
2. Confirmation (seeds 0–4, which chose nothing): sync (and its A/A copy), the chosen PowerSGD
   and DASO at its defaults, interleaved per seed in a seeded random order, every arm the same
   budget. Targets, named here before the run: DASO reaches 85 % in ≤ 1× the tuned PowerSGD's
   time (daso.md's withdrawn claim, against a tuned baseline); the tuned PowerSGD's final
   accuracy within ±1 point of sync's (a baseline at sync's quality, not a straw man). The
   time claim is judged again at 80 and 88 % (each verdict stands alone).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daso  # noqa: E402
import experiments  # noqa: E402
import harness  # noqa: E402
import peers  # noqa: E402
from harness import Arm  # noqa: E402
from slow_link import HEADERS, table_row  # noqa: E402

RANKS, STARTS = (2, 4), (50, 150)
TUNE, CONFIRM = (5, 6), (0, 1, 2, 3, 4)
DASO_TARGET, ACC_POINTS = 1.0, 1.0
LEVELS = (0.80, 0.88)  # the time claim again at 80 and 88 % (issue 40: three levels)


def main() -> None:
    args, prov = harness.start(__doc__)
    root = prov.runs_dir("powersgd")
    tune, confirm = ((5,), (0,)) if args.quick else (TUNE, CONFIRM)
    length = ["--epochs", "2"] if args.quick else [
        "--epochs", str(daso.EPOCHS), "--max-train-time-s", f"{daso.BUDGET_S:g}"]  # fmt: skip
    target = daso.TARGET

    def arm(name: str, flags: list[str]) -> Arm:
        return Arm(name, [*flags, *daso.COMMON, *length])

    def run(a: Arm, seed: int, phase: str) -> harness.Run:
        out = root / phase / harness.slug(a.name) / f"seed{seed}"
        return experiments.measured_run(lambda: peers.run_arm(a, seed, out), out, daso.BATCH)

    rep = harness.Report("powersgd", "PowerSGD tuned as its authors run it against DASO and "
                         "sync, 2 × 2 emulated nodes at 1 Gbit/s", prov)  # fmt: skip
    rep.settings(harness.about(__doc__))

    # 1. the rank and the first compressed step, on seeds that confirm nothing
    grid = [arm(f"powersgd r={r} s={s}", ["--strategy", "sync", "--compress", f"powersgd:{r}:{s}"])
            for r in RANKS for s in STARTS]  # fmt: skip
    tuned = harness.interleave(grid, tune, run=lambda a, s: run(a, s, "tune"), prov=prov,
                               phase="tune")  # fmt: skip
    tg, budget = harness.by_arm(tuned), harness.budget_of(tuned)
    score = {a.name: (-harness.mean_log_time(tg[a.name], target, budget),
                      statistics.mean(r.final_accuracy or 0.0 for r in tg[a.name]))
             for a in grid}  # fmt: skip
    best = max(grid, key=lambda a: score[a.name])
    rep.section(f"1. Tuning (seeds {', '.join(map(str, tune))})").table(
        HEADERS, [table_row(a.name, tg[a.name], target, budget) for a in grid]
    ).text(f"A* = {100 * target:g} %. Chosen: **{best.name}** (the shortest geometric-mean "
           "time to A*; a run that never holds it counts at the budget).")  # fmt: skip

    # 2. confirmation on fresh seeds, interleaved, with sync's A/A copy
    sync, dso = arm("sync", ["--strategy", "sync"]), arm("daso", ["--strategy", "daso"])
    chosen = Arm("powersgd tuned", best.argv)
    confirmed = harness.interleave([sync, chosen, dso], confirm, control="sync", prov=prov,
                                   run=lambda a, s: run(a, s, "confirm"),
                                   phase="confirm")  # fmt: skip
    cg, bound = harness.by_arm(confirmed), harness.budget_of(confirmed)
    copy = harness.aa_name("sync")
    finals = {n: [r.final_accuracy or 0.0 for r in rs] for n, rs in cg.items()}

    def time_claim(level: float) -> None:
        """DASO ÷ the tuned PowerSGD to ``level``; the A/A column sync (A/A) ÷ sync."""
        at = {n: harness.times_to(cg[n], level) for n in ("daso", chosen.name, "sync", copy)}
        harness.ratio_claim(rep, f"time to {100 * level:g} %, daso ÷ tuned PowerSGD "
                            f"({best.name}), 2 × 2 nodes, 1 Gbit/s", at["daso"], at[chosen.name],
                            harness.paired_ratio(at[copy], at["sync"], bound)[0],
                            f"≤ {DASO_TARGET:g}", lambda x: x <= DASO_TARGET, bound)  # fmt: skip

    time_claim(target)
    harness.diff_claim(rep, f"final accuracy, tuned PowerSGD ({best.name}) − sync (points), "
                       "2 × 2 nodes, at the budget", finals[chosen.name], finals["sync"],
                       f"within ±{ACC_POINTS:g}", lambda d, lo, hi: -ACC_POINTS <= lo and
                       hi <= ACC_POINTS, aa_copy=finals[copy], seeds=len(confirm))  # fmt: skip
    # The same ratio at the stragglers results' other two levels (added to the report after
    # the 6bb3272 runs, by --replay; each verdict stands alone).
    for level in LEVELS:
        time_claim(level)
    names = ["sync", copy, chosen.name, "daso"]
    rep.section(f"2. Confirmation (seeds {confirm[0]}–{confirm[-1]})").table(
        HEADERS, [table_row(n, cg[n], target, bound) for n in names]
    ).text("The time ratio's A/A column is sync (A/A) ÷ sync, the distance from 1 this machine "
           "gives two identical arms; a run that never holds the target for 3 evaluations is "
           "censored at the budget.")  # fmt: skip
    rep.data.update(chosen=best.name, tuning_scores={
        n: {"mean_log_time": -t, "accuracy": a} for n, (t, a) in score.items()})  # fmt: skip
    rep.write(tuned + confirmed)


if __name__ == "__main__":
    main()
