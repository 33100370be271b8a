"""Staleness at scale on the virtual cluster: asynchronous methods ÷ sync and asynchronous
DiLoCo ÷ DiLoCo with heavy-tailed step times and one 4× straggler (issue 28 item 4).

Every arm gets the same virtual time from its first evaluation; per (W, jitter), paired by
seed: time to 80 % and samples to it ÷ sync's, async DiLoCo against DiLoCo. Targets fixed
before any run. Details: benchmarks/README.md.

    .venv/bin/python benchmarks/staleness.py [--quick] [--seeds N] [--workers 16,64]
        [--jitters lognormal:0.3,pareto:2] [--arms sync,asgd,...] [--jobs 2]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from statistics import NormalDist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from experiments import STRAGGLER_ARMS, cli_help, supported  # noqa: E402
from harness import Arm, fmt, pct  # noqa: E402

TARGET = 0.80  # below sync's plateau at these budgets (the jin runs: 85-86 % at W = 8, 32)
TGT = f"{100 * TARGET:.0f}"
STEP_S = 0.02
SLOW = 4.0  # worker 0's factor
BUDGET_S = 30.0  # virtual seconds from the first evaluation, every arm alike
EVALS = 40  # evaluations per budget (free in virtual time)
BEST_RATIO_TARGET, SAMPLES_TARGET, DILOCO_RATIO_TARGET, BAND = 0.70, 1.2, 0.75, 1.0
ARMS = ("sync", "asgd", "asgd dc-adaptive", "diloco", "async_diloco", "async_diloco dylu")


def slowest(n: int, jitter: str) -> float:
    """The expected largest of ``n`` draws of ``jitter`` (mean 1): a lockstep step waits for it.
    Pareto(α): x_m·Γ(n+1)Γ(1−1/α)/Γ(n+1−1/α), x_m = (α−1)/α; lognormal(CV): its quantile at
    n/(n+1), an approximation (both only size a run's steps, never a result)."""
    kind, _, value = jitter.partition(":")
    if n < 1:
        return 1.0
    if kind == "pareto":
        a = float(value)
        lg = math.lgamma(n + 1) + math.lgamma(1 - 1 / a) - math.lgamma(n + 1 - 1 / a)
        return (a - 1) / a * math.exp(lg)
    sigma = math.sqrt(math.log1p(float(value) ** 2))
    return math.exp(-sigma * sigma / 2 + sigma * NormalDist().inv_cdf(n / (n + 1)))


def argv(name: str, w: int, jitter: str, budget_s: float) -> list[str]:
    flags, kind = STRAGGLER_ARMS[name]
    # an asynchronous arm's fast worker steps about once per STEP_S (jitter mean 1: margin
    # 1.3), a lockstep arm at its slowest worker's pace at best (the 4× straggler, or the
    # largest of the others' W − 1 draws at W = 64); both then outlast the budget
    pace = STEP_S if kind == "async" else max(SLOW, slowest(w - 1, jitter)) * STEP_S * 0.8
    steps = math.ceil(1.3 * budget_s / pace)
    return [*flags, "--workers", str(w), "--steps", str(steps), "--train-size", "40000",
            "--straggler", f"0:{SLOW:g}", "--step-time-s", str(STEP_S),
            "--step-time-jitter", jitter, "--eval-every-s", f"{budget_s / EVALS:g}",
            "--log-every-steps", "1000", "--checkpoint-every", "0"]  # fmt: skip


def within(r: harness.Run, budget_s: float) -> list[tuple[float, int, float]]:
    """The run's evaluations within ``budget_s`` of its first, times from that first."""
    if r.failed or not r.evals:
        return []
    t0 = r.evals[0][0]
    return [(t - t0, s, a) for t, s, a in r.evals if t - t0 <= budget_s]


def time_to(r: harness.Run, level: float, budget_s: float) -> float | None:
    return harness.time_to_target(within(r, budget_s), level)


def samples_to(r: harness.Run, level: float, budget_s: float) -> int | None:
    ev = within(r, budget_s)
    t = harness.time_to_target(ev, level)
    return next((s for when, s, _ in ev if when == t), None)


def acc_at(r: harness.Run, budget_s: float) -> float | None:
    ev = within(r, budget_s)
    return ev[-1][2] if ev else None


def acc_at_samples(r: harness.Run, samples: int) -> float | None:
    """The last evaluated accuracy once the run had processed at most ``samples``."""
    before = [a for _, s, a in r.evals if s <= samples]
    return before[-1] if before and not r.failed else None


def main() -> None:
    def add(p) -> None:
        p.add_argument("--workers", default="16,64", help="W values, comma-separated")
        p.add_argument("--jitters", default="lognormal:0.3,pareto:2")
        p.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(STRAGGLER_ARMS)}")
        p.add_argument("--budget-s", type=float, default=BUDGET_S, help="virtual s per arm")
        p.add_argument("--jobs", type=int, default=2, help="simulations side by side")
        p.add_argument("--runs", help="re-derive the report from this result JSON's runs")
        p.add_argument("--timeout-s", type=float, default=3600.0, help="per simulation (wall)")

    args, prov = harness.start(__doc__, add)
    budget = 3.0 if args.quick else args.budget_s
    ws = [4] if args.quick else [int(w) for w in args.workers.split(",")]
    jitters = args.jitters.split(",")[:1] if args.quick else args.jitters.split(",")
    unknown = [a for a in args.arms.split(",") if a not in STRAGGLER_ARMS]
    if unknown or "sync" not in args.arms.split(","):
        sys.exit(f"staleness: --arms needs sync and known arms ({', '.join(STRAGGLER_ARMS)})")
    names, missing = supported(args.arms.split(","), cli_help())
    seeds = range(args.seeds or (1 if args.quick else 3))
    root = prov.runs_dir("staleness")
    jobs = [(Arm(f"W{w} {j} {n}", argv(n, w, j, budget)), s)
            for w in ws for j in jitters for s in seeds for n in names]  # fmt: skip
    stored = json.loads(Path(args.runs).read_text()) if args.runs else None
    if stored is None:
        outs = [(a, s, root / harness.slug(a.name) / f"seed{s}") for a, s in jobs]
        runs = harness.simulate_all(outs, prov, args.jobs, args.timeout_s)
    else:
        runs = [harness.Run(**r) for r in stored["runs"]]
        prov.sample_load()
    rep = harness.Report("staleness", "Staleness at scale on the virtual cluster", prov)
    groups = harness.by_arm(runs)
    rows, diloco_rows = [], []
    for w in ws:
        for j in jitters:
            g = {n: groups[f"W{w} {j} {n}"] for n in names}
            where = f"W = {w}, {j}, one worker {SLOW:g}× slower"
            t = {n: [time_to(r, TARGET, budget) for r in rs] for n, rs in g.items()}
            smp = {n: [samples_to(r, TARGET, budget) for r in rs] for n, rs in g.items()}
            floor = harness.censored_floor(
                (samples_to(r, TARGET, budget), ev[-1][1])
                for rs in g.values() for r in rs if (ev := within(r, budget))
            )  # fmt: skip
            for n in names:
                if STRAGGLER_ARMS[n][1] != "async":
                    continue
                harness.ratio_claim(
                    rep, f"time to {TGT} %, {n} ÷ sync, {where}", t[n], t["sync"],
                    None, f"≤ {BEST_RATIO_TARGET}", lambda r: r <= BEST_RATIO_TARGET, budget,
                )  # fmt: skip
                harness.ratio_claim(
                    rep, f"samples to {TGT} %, {n} ÷ sync, {where}", smp[n], smp["sync"], None,
                    f"≤ {SAMPLES_TARGET}", lambda r: r <= SAMPLES_TARGET, floor, samples=True,
                )  # fmt: skip
            for n in names:
                med, cens = harness.censored_median(t[n], budget)
                rows.append([w, j, n, " / ".join(fmt(x) for x in t[n]), fmt(med), cens,
                             fmt(harness.median(smp[n])),
                             " / ".join(pct(acc_at(r, budget)) for r in g[n])])  # fmt: skip
            if "diloco" in g:
                diloco_rows += compare_diloco(rep, g, names, where, budget)
    rep.settings(
        f"{len(runs)} simulations, {len(seeds)} seeds per point ({args.jobs} side by side), "
        f"a {budget:g}-virtual-second budget per arm, every arm at its defaults unless its "
        "name says otherwise"
        + ("; --quick: W = 4, a few virtual seconds, not a result" if args.quick else "")
        + (f". Not measured (this commit has no such flag): {', '.join(missing)}" if missing
           else "")
        + (f". **Re-derived** from the stored runs of `{args.runs}` (simulated at commit "
           f"`{stored['provenance'].get('commit', '?')}`, started "
           f"{stored['provenance'].get('started_utc', '?')}): the runs are that commit's, the "
           "claims this one's" if stored else "")
        + f".\n\n{harness.about(__doc__)}"
    )  # fmt: skip
    failed = [r for r in runs if r.failed]
    if failed:
        rep.text(f"{len(failed)} runs failed (counted as censored): {failed[0].failed}")
    rep.section(f"Every arm: time to {TGT} % (virtual s from the first evaluation)").table(
        ["W", "jitter", "arm", "per seed", "median", "censored", "samples to it (median)",
         "accuracy at the budget %"], rows)  # fmt: skip
    if diloco_rows:
        rep.section("Async DiLoCo ÷ DiLoCo").table(["W", "jitter", "arm",
            "acc at DiLoCo's samples − DiLoCo's (points)", "acc at the budget − DiLoCo's (points)",
            f"time to DiLoCo's − {BAND:g} point ÷ DiLoCo's"], diloco_rows)  # fmt: skip
    rep.data["argv"] = {a.name: list(a.argv) for a, _ in jobs}
    rep.data["not measured"] = missing
    rep.write(runs)


def compare_diloco(
    rep: harness.Report, g: dict[str, list[harness.Run]], names: list[str], where: str,
    budget: float,
) -> list[list]:  # fmt: skip
    """Async DiLoCo (± DyLU) against DiLoCo: claims, and rows for the table."""
    base = g["diloco"]
    finals = [acc_at(r, budget) for r in base]
    if any(a is None for a in finals):
        return []
    levels = [a - BAND / 100 for a in finals]  # type: ignore[operator]
    theirs = [time_to(r, lv, budget) for r, lv in zip(base, levels, strict=True)]
    rows = []
    for n in [n for n in names if n.startswith("async_diloco")]:
        rs = g[n]
        mine = [time_to(r, lv, budget) for r, lv in zip(rs, levels, strict=True)]
        c = harness.ratio_claim(
            rep, f"time to DiLoCo's accuracy − {BAND:g} point, {n} ÷ diloco, {where}", mine,
            theirs, None, f"≤ {DILOCO_RATIO_TARGET}", lambda r: r <= DILOCO_RATIO_TARGET,
            budget,
        )  # fmt: skip
        done = [within(b, budget)[-1][1] for b in base]  # DiLoCo's samples at the budget
        pushes = [acc_at_samples(r, s) for r, s in zip(rs, done, strict=True)]
        at_time = [acc_at(r, budget) for r in rs]
        diff = {}
        for label, accs in (("equal pushes", pushes), ("equal time", at_time)):
            if any(a is None for a in accs):
                continue
            d, lo, hi = harness.difference_interval(accs, finals, paired=True)
            diff[label] = 100 * d
            if n == "async_diloco" or label == "equal time":  # DyLU: pushes ≠ samples / H
                rep.claim(
                    f"accuracy at {label}, {n} − diloco (points), {where}", round(100 * d, 2),
                    f"≥ −{BAND:g}", 100 * d >= -BAND,
                    interval=(round(100 * lo, 2), round(100 * hi, 2)), seeds=len(accs),
                )  # fmt: skip
        rows.append([*where.split(", ")[:2], n, fmt(diff.get("equal pushes")),
                     fmt(diff.get("equal time")), fmt(c.value)])  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
