"""Quality at sync's training time over a real slow link (issue 43's real-run measurement):
2 emulated nodes × 2 workers joined by 1 Gbit/s, DASO, local SGD, DiLoCo and Streaming DiLoCo
against a tuned sync.

    .venv/bin/python benchmarks/slow_link.py            # results/slow_link.{md,json}
    .venv/bin/python benchmarks/slow_link.py --quick    # smoke test, runs/bench-quick/

daso.md's setting: 4 workers on 2 emulated nodes, traffic between them delayed as a 1 Gbit/s,
1 ms link would (``--inter-node-link 1,1``), the wide CNN of ``bench_models.py`` (528 k
parameters: sync's all-reduce costs ~37 ms of link per step), batch 64 per worker, every step
padded to ≥ 50 ms by sleeping inside the forward and backward passes (4 CPU-bound ranks share
2 cores here: the device is emulated, the link and the collectives are real gloo).

1. Sync's lr on {0.1, 0.2} for 24 epochs (seeds 0–2, best mean final accuracy); T = the median
   training time of those runs, and the target A* = their mean final accuracy − 0.5 points
   (named here, before the confirmation runs, from other seeds).
2. Every relaxed arm for T (``--max-train-time-s T``; seeds 0–2): DASO at its defaults and with
   a schedule for a slow link (1 warm-up epoch, B = 8, S = 2, bf16 between nodes) at lr 0.1
   and 0.2 (sync's grid), that with the node-local all-reduce every 2nd batch (L = 2: on 2
   shared cores it is not free as NVLink is), and that without Heat's blocking global average
   at every epoch's end (``--daso-no-epoch-end-sync``: an epoch here is 16 batches, Heat's are
   thousands); local SGD (H = 8) at lr 0.1 and 0.2; DiLoCo (H = 8, its defaults), Streaming
   DiLoCo (4 fragments, τ = 1, α = 0) and DiLoCo with a node's two workers as one replica
   (``--replica node``) at lr 0.1. The DASO arm and the other arm with the shortest
   geometric-mean time to A* (the claim's own quantity; a run that never holds A* counts at T)
   are confirmed. (The run at 626d327 chose by accuracy at T and tuned no DASO lr.)
3. Confirmation (seeds 3–10): sync (and its A/A copy), the two chosen arms, interleaved in a
   seeded random order per seed, every arm for T (sync too). Targets from the issue: DASO
   reaches A* in ≤ 0.66× sync's time (its paper's claim), the best of the others in ≤ 0.7×;
   (named here) at T each ends ≥ sync − 0.5 points. Ratios and differences are judged against
   both sync copies; a run that never holds A* for 3 evaluations is censored at the budget.
   The time claims are judged again at A* − 1 and A* − 2 points (each verdict stands alone).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experiments  # noqa: E402
import harness  # noqa: E402
import peers  # noqa: E402
from harness import Arm, fmt, pct  # noqa: E402

MODEL = ["--dataset", "mnist1d", "--model", "benchmarks.bench_models:mnist1d_wide_cnn"]
BATCH = 64
COMMON = [*MODEL, *f"--device cpu --workers 4 --nodes 2 --inter-node-link 1,1 --min-step-time-s "
          f"0.05 --batch-size {BATCH} --momentum 0.9 --eval-every-s 0.5".split()]  # fmt: skip
SYNC_LRS, SYNC_EPOCHS = (0.1, 0.2), 24
SLOW = ["--daso-warmup-epochs", "1", "--daso-global-skip", "8", "--daso-batches-to-wait", "2",
        "--daso-cycling-downcast", "bf16"]  # fmt: skip
NO_END = "--daso-no-epoch-end-sync"
STREAM = ["--fragments", "4", "--fragment-delay", "1"]  # α = 0: per_sample.md
DASO = {  # name: (flags, lr)
    "daso lr 0.1": (["--strategy", "daso"], 0.1),
    "daso slow-link lr 0.1": (["--strategy", "daso", *SLOW], 0.1),
    "daso slow-link lr 0.2": (["--strategy", "daso", *SLOW], 0.2),
    "daso slow-link L=2 lr 0.1": (["--strategy", "daso", *SLOW, "--daso-local-skip", "2"], 0.1),
    "daso slow-link no-end lr 0.2": (["--strategy", "daso", *SLOW, NO_END], 0.2),
}
OTHERS = {  # name: (flags, lr)
    "local_sgd lr 0.1": (["--strategy", "local_sgd", "--period", "8"], 0.1),
    "local_sgd lr 0.2": (["--strategy", "local_sgd", "--period", "8"], 0.2),
    "diloco lr 0.1": (["--strategy", "diloco", "--period", "8"], 0.1),
    "streaming lr 0.1": (["--strategy", "diloco", "--period", "8", *STREAM], 0.1),
    "diloco node lr 0.1": (["--strategy", "diloco", "--period", "8", "--replica", "node"], 0.1),
}
TUNE, CONFIRM = (0, 1, 2), (3, 4, 5, 6, 7, 8, 9, 10)
BAND, DASO_TARGET, OTHER_TARGET, ACC_POINTS = 0.005, 0.66, 0.7, 0.5
LOWER = (0.01, 0.02)  # the time claims again at A* − 1 and − 2 points (issue 40: three levels)


def main() -> None:
    args, prov = harness.start(__doc__)
    quick, root = args.quick, prov.runs_dir("slow_link")
    tune, confirm = ((0,), (1,)) if quick else (TUNE, CONFIRM)
    epochs = 2 if quick else SYNC_EPOCHS

    def run(arm: Arm, seed: int, phase: str) -> harness.Run:
        return measure(arm, seed, root / phase / harness.slug(arm.name) / f"seed{seed}")

    rep = harness.Report("slow_link", "DASO, local SGD and (Streaming) DiLoCo against a tuned "
                         "sync over a real 1 Gbit/s link, 2 × 2 workers", prov)  # fmt: skip
    rep.settings(harness.about(__doc__))

    # 1. sync's lr, the budget T and the target A*
    sync_arms = [Arm(f"sync lr {lr:g}", ["--strategy", "sync", "--lr", f"{lr:g}", *COMMON,
                                          "--epochs", str(epochs)]) for lr in SYNC_LRS]  # fmt: skip
    runs = harness.interleave(sync_arms, tune, run=lambda a, s: run(a, s, "tune"), prov=prov)
    g = harness.by_arm(runs)
    mean = {a.name: statistics.mean(r.final_accuracy or 0.0 for r in g[a.name]) for a in sync_arms}
    best_sync = max(sync_arms, key=lambda a: mean[a.name])
    lr = best_sync.argv[best_sync.argv.index("--lr") + 1]
    budget = statistics.median(r.summary.get("train_time_s", 0.0) for r in g[best_sync.name])
    target = mean[best_sync.name] - BAND
    rep.section("1. Sync's lr, the budget T, the target A* (seeds 0–2)").table(
        "arm | final accuracy per seed | mean | training time per seed (s)",
        [[a.name, " / ".join(pct(r.final_accuracy) for r in g[a.name]), pct(mean[a.name]),
          " / ".join(fmt(r.summary.get("train_time_s")) for r in g[a.name])]
         for a in sync_arms],  # fmt: skip
    ).text(f"Chosen: lr {lr}; T = {fmt(budget)} s of training for every arm below; "
           f"A* = {pct(target)}.")  # fmt: skip

    # 2. every relaxed arm for T on the tuning seeds
    sync = timed_arm("sync", budget, float(lr))
    relaxed = [timed_arm(n, budget) for n in (*DASO, *OTHERS)]
    tuned = harness.interleave(relaxed, tune, run=lambda a, s: run(a, s, "tune"), prov=prov)
    runs += tuned
    tg = harness.by_arm(tuned)
    score = {a.name: tuning_score(tg[a.name], target, budget) for a in relaxed}
    best_daso = max((a for a in relaxed if a.name in DASO), key=lambda a: score[a.name])
    best_other = max((a for a in relaxed if a.name in OTHERS), key=lambda a: score[a.name])
    rep.section("2. Every relaxed arm for T (seeds 0–2)").table(
        HEADERS, [table_row(a.name, tg[a.name], target, budget) for a in relaxed]
    ).text(f"Chosen for confirmation: **{best_daso.name}** and **{best_other.name}** (the "
           "shortest geometric-mean time to A* of the DASO arms and of the others; a run that "
           "never holds A* counts at T).")  # fmt: skip

    # 3. confirmation on fresh seeds, interleaved, with sync's A/A copy
    arms = [sync, best_daso, best_other]
    confirmed = harness.interleave(arms, confirm, control="sync", prov=prov,
                                   run=lambda a, s: run(a, s, "confirm"))  # fmt: skip
    runs += confirmed
    cg = harness.by_arm(confirmed)
    copy = harness.aa_name("sync")
    bound = harness.budget_of(confirmed)
    finals = {n: [r.final_accuracy or 0.0 for r in rs] for n, rs in cg.items()}
    goals = ((best_daso, DASO_TARGET), (best_other, OTHER_TARGET))

    def time_claim(arm: Arm, goal: float, level: float, label: str) -> None:
        times = {n: harness.times_to(cg[n], level) for n in (arm.name, "sync", copy)}
        harness.ratio_claim(rep, f"time to {label} = {pct(level)}, {arm.name} ÷ sync, 2 × 2, "
                            "1 Gbit/s", times[arm.name], times["sync"], times[copy],
                            f"≤ {goal:g}", lambda x: x <= goal, bound)  # fmt: skip

    for arm, goal in goals:
        time_claim(arm, goal, target, "A*")
    for arm in (best_daso, best_other):
        harness.diff_claim(rep, f"accuracy at sync's time T, {arm.name} − sync (points), 2 × 2, "
                           "1 Gbit/s", finals[arm.name], finals["sync"], f"≥ {-ACC_POINTS:g}",
                           lambda d, lo, hi: lo >= -ACC_POINTS, aa_copy=finals[copy],
                           seeds=len(confirm))  # fmt: skip
    # The same ratios at two lower levels (a rule named before any run; added to the report
    # after the 85d1cea runs, by --replay, when A* turned out to sit at sync's plateau there):
    # a level sync holds on most seeds makes its ratio a measurement rather than a bound.
    for arm, goal in goals:
        for drop in LOWER:
            time_claim(arm, goal, target - drop, f"A* − {100 * drop:g}")
    names = ["sync", copy, best_daso.name, best_other.name]
    rep.section(f"3. Confirmation (seeds {confirm[0]}–{confirm[-1]})").table(
        HEADERS, [table_row(n, cg[n], target, bound) for n in names]
    ).text("Equal samples: the accuracy at sync's samples is the relaxed arm's last evaluation "
           "at or before the samples sync's run of that seed trained on.")  # fmt: skip
    rep.table("arm | accuracy at sync's samples per seed",
              [[n, " / ".join(pct(harness.at_samples(r, s.summary.get("samples", 0)))
                              for r, s in zip(cg[n], cg["sync"], strict=True))]
               for n in names])  # fmt: skip
    rep.data.update(budget_s=budget, sync_lr=float(lr), target=target,
                    tuning_scores={n: {"mean_log_time": -t, "accuracy": a}
                                   for n, (t, a) in score.items()},
                    chosen=[best_daso.name, best_other.name])  # fmt: skip
    rep.write(runs)


def tuning_score(runs: list[harness.Run], target: float, budget: float) -> tuple[float, float]:
    """How an arm ranks on its tuning runs, higher better: the claim's own quantity, minus the
    mean log time to ``target`` (a run that never holds it counts at ``budget``), then the mean
    accuracy at the end on ties."""
    return (-harness.mean_log_time(runs, target, budget),
            statistics.mean(r.final_accuracy or 0.0 for r in runs))  # fmt: skip


def timed_arm(name: str, budget: float, sync_lr: float | None = None) -> Arm:
    """Step 2's and 3's arm ``name`` ("sync" at ``sync_lr``, or one of :data:`DASO` and
    :data:`OTHERS` at its own lr), trained for ``budget`` s."""
    timed = [*COMMON, "--epochs", "64", "--max-train-time-s", f"{budget:.4g}"]
    if name == "sync":
        return Arm("sync", ["--strategy", "sync", "--lr", f"{sync_lr:g}", *timed])
    flags, lr = {**DASO, **OTHERS}[name]
    return Arm(name, [*flags, "--lr", f"{lr:g}", *timed])


def measure(arm: Arm, seed: int, out: Path) -> harness.Run:
    """One run of ``arm`` into ``out``, its CPU and pace measured."""
    return experiments.measured_run(lambda: peers.run_arm(arm, seed, out), out, BATCH)


HEADERS = ("arm | accuracy at T per seed | mean | time to A* per seed (s) | inter-node MB "
           "per worker | samples/s")  # fmt: skip


def table_row(
    name: str, runs: list[harness.Run], target: float, budget: float,
    value: Callable[[harness.Run], float | None] = lambda r: r.final_accuracy,
    show: Callable[[float | None], str] = pct, per_sample: int = 1,
) -> list[str]:  # fmt: skip
    """An arm's row of :data:`HEADERS`: ``value`` per seed and its mean (shown by ``show``),
    time to ``target`` (censored at ``budget``), inter-node MB per worker, ``per_sample`` ×
    samples/s (lm_slow_link: the GPT's tokens per window)."""
    ok = [r for r in runs if not r.failed]
    if not ok:
        return [name, "FAILED", "", "", "", ""]
    times = harness.times_to(runs, target)
    nodes = [r.summary.get("inter_node_bytes", 0) / max(1, r.summary.get("workers", 1)) for r in ok]
    rates = [r.values.get("samples/s") for r in ok if r.values.get("samples/s")]
    return [name, " / ".join(show(value(r)) for r in runs),
            show(statistics.mean(value(r) or 0.0 for r in ok)),
            " / ".join(fmt(t) if t is not None else f"> {fmt(budget)}" for t in times),
            fmt(statistics.mean(nodes) / 1e6),
            fmt(per_sample * statistics.median(rates)) if rates else "-"]  # fmt: skip


if __name__ == "__main__":
    main()
