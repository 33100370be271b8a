"""slow_link's and lm_slow_link's time claims at three levels named before the runs, on fresh
seeds (issue 40's rule: targets from a pilot on other seeds, below every arm's plateau, judged
at each of three levels).

    .venv/bin/python benchmarks/slow_link_levels.py          # results/slow_link_levels.{md,json}
    .venv/bin/python benchmarks/slow_link_levels.py --workload lm_slow_link
        # results/lm_slow_link_levels.{md,json}
    .venv/bin/python benchmarks/slow_link_levels.py --quick  # smoke test, runs/bench-quick/

slow_link.md's A* (sync's tuning mean − 0.5 points) sat on sync's plateau on its confirmation
seeds (sync held it on 1 of 16 runs), and its lower levels A* − 1 and − 2 were added after the
runs; lm_slow_link.md's L* (sync's tuning mean loss + 0.01) likewise (sync held it on half of
its runs), its looser levels named after the runs. Here the pilot is that result's stored runs
(every seed and phase): the same setting (real runs, 2 × 2 workers on emulated nodes: the wide
CNN at 1 Gbit/s, or the GPT at 100 Mbit/s; the scripts' docstrings), its two chosen arms, and
sync with its budget T, all read from that file.

1. Levels, by a rule fixed before any run here: the three best values on a grid of 1 point of
   accuracy (0.01 nats of test loss) that every pilot run of sync (its tuning runs at the
   chosen lr, the confirmations and the A/A copies) and of both chosen arms held for 3
   evaluations within T.
2. Confirmation on 8 fresh seeds (11–18 for slow_link, 18–25 for lm_slow_link): sync (and its
   A/A copy) and the two arms, in a seeded random order per seed, every arm for T. Targets
   from issue 43: DASO reaches each level in ≤ 0.66× sync's time, Streaming DiLoCo in ≤ 0.7×
   (slow_link); DiLoCo and Streaming DiLoCo in ≤ 0.6× (the GPT); at T each ends ≥ sync − 0.5
   points (≤ sync + 0.05 nats). Each level's verdict stands alone; ratios and differences are
   judged against both sync copies; a run that never holds a level is censored at the budget.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import lm_slow_link  # noqa: E402
import slow_link  # noqa: E402
from harness import Arm, fmt, pct  # noqa: E402

GRID = 0.01  # one point of accuracy, or 0.01 nats (the GPT's evaluations are its negated loss)


@dataclass
class Workload:
    """What differs between the image and the GPT workload."""

    seeds: tuple[int, ...]
    title: str
    where: str
    goal: Callable[[str], float]  # an arm's time target
    arm: Callable[[str, dict, float], Arm]  # (name, pilot data, T): that arm, trained for T
    run: Callable[[Arm, int, Path], harness.Run]
    show: Callable[[float], str]  # a level (an evaluation's value) as the claims name it
    final: Callable[[harness.Run], float]
    diff: dict  # diff_claim's target, ok, scale and digits for "at T − sync"
    row: Callable[[str, list[harness.Run], float, float], list[str]]
    headers: str


def chosen(data: dict) -> list[str]:
    picked = data["chosen"]
    return list(picked.values()) if isinstance(picked, dict) else list(picked)


WORKLOADS = {
    "slow_link": Workload(
        tuple(range(11, 19)), "2 × 2 workers, 1 Gbit/s", "2 × 2, 1 Gbit/s, fresh seeds",
        lambda n: slow_link.DASO_TARGET if n.startswith("daso") else slow_link.OTHER_TARGET,
        lambda n, data, t: slow_link.timed_arm(n, t, data["sync_lr"]), slow_link.measure,
        pct, lambda r: r.final_accuracy or 0.0,
        dict(target=f"≥ {-slow_link.ACC_POINTS:g}", scale=100.0, digits=2, what="points",
             measure="accuracy", ok=lambda d, lo, hi: lo >= -slow_link.ACC_POINTS),
        slow_link.table_row, slow_link.HEADERS,
    ),
    "lm_slow_link": Workload(
        tuple(range(18, 26)), "the GPT, 2 × 2 workers, 100 Mbit/s",
        "GPT, 2 × 2, 100 Mbit/s, fresh seeds", lambda n: lm_slow_link.TIME_TARGET,
        lambda n, data, t: lm_slow_link.capped_arm(n, data["steps"],
                                                   ["--max-train-time-s", f"{t:.4g}"]),
        lm_slow_link.measure, lambda v: f"{fmt(-v, 4)} nats", lm_slow_link.loss,
        dict(target=f"≤ {lm_slow_link.LOSS_NATS:g}", scale=1.0, digits=4, what="nats/byte",
             measure="test loss", ok=lambda d, lo, hi: hi <= lm_slow_link.LOSS_NATS),
        lambda n, rs, level, b: lm_slow_link.table_row(n, rs, -level, b), lm_slow_link.HEADERS,
    ),
}  # fmt: skip


def held_levels(runs: list[harness.Run], budget: float, count: int = 3) -> list[float]:
    """The ``count`` highest multiples of :data:`GRID` that every run held for
    ``harness.K_CONSECUTIVE`` evaluations within ``budget`` s, highest first."""
    reach = []
    for r in runs:  # the highest level a run holds: its best k-evaluation running minimum
        evals = [e for e in r.evals if e[0] <= budget]
        k = harness.K_CONSECUTIVE
        windows = [min(e[2] for e in evals[i : i + k]) for i in range(len(evals) - k + 1)]
        if not windows:
            raise SystemExit(f"pilot run {r.arm} seed {r.seed} has fewer than {k} evaluations")
        reach.append(max(windows))
    top = math.floor(min(reach) / GRID + 1e-9)
    return [round((top - i) * GRID, 6) for i in range(count)]


def level_claims(
    rep: harness.Report, w: Workload, g: dict[str, list[harness.Run]], names: list[str],
    levels: list[float], seeds: int, sync: str = "sync", where: str | None = None,
) -> None:  # fmt: skip
    """The claims of arms ``names`` against "sync" and its A/A copy in ``g`` (runs by arm):
    time to each level ÷ sync's, each against its goal, then the value at T − sync's. The
    claims say ``sync`` for the control and ``where`` (default: the workload's) for the
    setting."""
    copy, bound, where = harness.aa_name("sync"), harness.budget_of(
        [r for rs in g.values() for r in rs]), where or w.where  # fmt: skip
    for arm in names:
        goal = w.goal(arm)
        for level in levels:
            times = {n: harness.times_to(g[n], level) for n in (arm, "sync", copy)}
            harness.ratio_claim(rep, f"time to {w.show(level)} (named before), {arm} ÷ {sync}, "
                                f"{where}", times[arm], times["sync"], times[copy],
                                f"≤ {goal:g}", lambda x, goal=goal: x <= goal, bound)  # fmt: skip
    finals = {n: [w.final(r) for r in rs] for n, rs in g.items()}
    d = w.diff
    for arm in names:
        harness.diff_claim(rep, f"{d['measure']} at sync's time T, {arm} − sync ({d['what']}), "
                           f"{where}", finals[arm], finals["sync"], d["target"], d["ok"],
                           scale=d["scale"], digits=d["digits"], aa_copy=finals[copy],
                           seeds=seeds)  # fmt: skip


def main() -> None:
    def add(p) -> None:
        p.add_argument("--workload", choices=sorted(WORKLOADS), default="slow_link")

    args, prov = harness.start(__doc__, add)
    w = WORKLOADS[args.workload]
    path = harness.REPO / "benchmarks" / "results" / f"{args.workload}.json"
    pilot = json.loads(path.read_text())
    data = pilot["data"]
    budget, names = data["budget_s"], chosen(data)
    sync_names = {"sync", harness.aa_name("sync")}
    sync_names |= {f"sync lr {data['sync_lr']:g}"} if "sync_lr" in data else set()
    used = [harness.Run(**r) for r in pilot["runs"] if r["arm"] in sync_names | set(names)]
    levels = held_levels(used, budget)
    seeds = w.seeds[:1] if args.quick else w.seeds
    made = (pilot["provenance"].get("replayed_from") or pilot["provenance"]["commit"]).split("`")[0]

    name = f"{args.workload}_levels"
    rep = harness.Report(name, f"{args.workload}'s time claims at three levels named before the "
                         f"runs, fresh seeds, {w.title}", prov)  # fmt: skip
    rep.settings(harness.about(__doc__))
    rep.section("1. The levels, from the pilot").text(
        f"Pilot: `{path.name}` (runs made at `{made}`), {len(used)} runs of "
        f"{', '.join(sorted(sync_names | set(names)))}; T = {fmt(budget)} s. Levels every one "
        f"of them held: {', '.join(w.show(x) for x in levels)}."
    )  # fmt: skip

    arms = [w.arm(n, data, 8.0 if args.quick else budget) for n in ("sync", *names)]
    root = prov.runs_dir(name)
    runs = harness.interleave(arms, seeds, control="sync", prov=prov,
                              run=lambda a, s: w.run(a, s, root / harness.slug(a.name) /
                                                     f"seed{s}"))  # fmt: skip
    g = harness.by_arm(runs)
    copy, bound = harness.aa_name("sync"), harness.budget_of(runs)
    level_claims(rep, w, g, names, levels, len(seeds))
    rep.section(f"2. Confirmation (seeds {seeds[0]}–{seeds[-1]})").table(
        w.headers.replace("A*", w.show(levels[0])).replace("L*", w.show(levels[0])),
        [w.row(n, g[n], levels[0], bound) for n in ("sync", copy, *names)],
    )  # fmt: skip
    rep.data.update(budget_s=budget, chosen=names, levels=levels,
                    pilot=str(path.relative_to(harness.REPO)))  # fmt: skip
    rep.write(runs)


if __name__ == "__main__":
    main()
