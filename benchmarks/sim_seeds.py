"""The three seed papers' findings on the virtual cluster, scaled to fit the benchmark budget.

Every run is ``cloudburst.sim.run.simulate`` (deterministic per seed), a published large
model's bytes and step time charged; time to 80 % held for 3 evaluations, censored runs
counted. ``jin`` (Jin et al. 2016), ``coquelin`` (DASO, Coquelin et al. 2021) and ``paine``
(Paine et al. 2013), each finding judged by the paper's own criterion. Details:
benchmarks/README.md.

    .venv/bin/python benchmarks/sim_seeds.py [jin|coquelin|paine ...] [--quick] [--force]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

TARGET = 0.8
JIN_BUDGET_S = 100.0  # virtual seconds from the first evaluation, the same for every method
JIN_SENSITIVITY = (0.85, 0.9)  # further targets, named before the run
RESNET50_V100_STEP_S = 64 / 367.0  # resnet50-v100-fp32: 367 images/s, batch 64
ALEXNET_PARAMS = 60_000_000  # Krizhevsky et al. 2012, the GPU A-SGD seed's model
K20X_STEP_S = 128 * 10.7 * 86400 / (90 * 1_281_167)  # ~1.03 s per batch of 128 (the seed, §3)


def _base(steps: int, step_s: float, train_size: int) -> dict[str, Any]:
    # ~40 evaluations (free in virtual time)
    return dict(steps=steps, batch_size=64, train_size=train_size, test_size=1000, lr=0.1,
                target_accuracy=TARGET, log_every_steps=10_000, comm_timeout_s=3600.0,
                checkpoint_every=0, progress=False,
                eval_every_s=max(1e-3, steps * step_s / 40))  # fmt: skip


def jin(q: bool) -> list[tuple[dict, dict, dict]]:
    """(group, RunConfig kwargs, SimulationConfig kwargs) of every point, seeds apart."""
    points = []
    # a worker steps at most once per step time, so this many steps outlast the budget
    steps = 30 if q else math.ceil(1.05 * JIN_BUDGET_S / RESNET50_V100_STEP_S)
    for w in (2, 4) if q else (2, 8, 32, 128):
        for s in ("sync", "asgd") if q else ("sync", "asgd", "easgd", "gossip"):
            servers = 1 if s in ("asgd", "easgd") else 0
            cfg = {**_base(steps, RESNET50_V100_STEP_S, 40_000), "strategy": s, "workers": w}
            cfg.update(servers=servers, nodes=w + servers, inter_node_link="10,0.05")
            cfg.update({"shard_placement": "own"} if servers else {})  # a node of its own
            cfg.update({"n_sync": 10} if s == "asgd" else {})
            sim = {"profile": "resnet50-v100-fp32", "step_time_jitter": "lognormal:0.1",
                   "network_model": "nccl"}  # fmt: skip
            points.append(({"W": w, "strategy": s}, cfg, sim))
    return points


def coquelin(q: bool) -> list[tuple[dict, dict, dict]]:
    points, spe, epochs = [], 3 if q else 10, 6 if q else 30
    for gbit in (10,) if q else (10, 100):
        for p in (2,) if q else (4, 8, 16):
            w = 4 * p
            for s in ("sync", "daso") if q else ("sync", "daso", "local_sgd"):
                cfg = {**_base(spe * epochs, 64 / 2470.0, w * 64 * spe), "strategy": s}
                cfg.update(workers=w, nodes=p, inter_node_link=f"{gbit},0.05", epochs=epochs)
                del cfg["steps"]  # DASO's phases count epochs: each worker's shard is spe batches
                if s == "local_sgd":
                    cfg.update(period=4, local_sgd_warmup_steps=4 * spe)
                sim = {"profile": "resnet50-a100", "intra_node_link": "600,0.002",
                       "step_time_jitter": "lognormal:0.1", "network_model": "nccl"}  # fmt: skip
                points.append(({"Gbit": gbit, "P": p, "strategy": s}, cfg, sim))
    return points


def paine(q: bool) -> list[tuple[dict, dict, dict]]:
    points, steps = [], 60 if q else 600
    for start, n_sync in [("warm", 10), ("cold", 10)] + ([] if q else [("warm", 1)]):
        for w in (1, 2) if q else (1, 2, 8):
            cfg = {**_base(steps, K20X_STEP_S, 40_000), "strategy": "asgd", "workers": w}
            cfg.update(servers=1, nodes=w + 1, n_sync=n_sync, shard_placement="own")
            cfg["warm_start_steps"] = (10 if q else 50) if start == "warm" else 0
            sim = {"modelled_params": ALEXNET_PARAMS, "step_time_s": round(K20X_STEP_S, 4),
                   "step_time_jitter": "lognormal:0.1"}  # fmt: skip
            points.append(({"start": start, "n_sync": n_sync, "W": w}, cfg, sim))
    return points


EXPERIMENTS = {"jin": jin, "coquelin": coquelin, "paine": paine}


def simulate_point(name: str, group: dict, cfg: dict, sim: dict, seed: int, out: str) -> dict:
    """One simulation (in a pool process): the group, its summary and its evaluations."""
    from cloudburst.config import RunConfig
    from cloudburst.config.simulation import SimulationConfig
    from cloudburst.sim.run import simulate

    try:
        summary, failed = simulate(RunConfig(**cfg, seed=seed, out=out, overwrite=True),
                                   SimulationConfig(**sim)), None  # fmt: skip
    except Exception as e:  # kept and counted as censored, never dropped
        summary, failed = {}, f"{type(e).__name__}: {e}"[:300]
    keep = ("final_test_accuracy", "wall_time_s", "steps_per_worker", "simulator")
    return {"experiment": name, "group": group, "seed": seed, "failed": failed,
            "summary": {k: summary.get(k) for k in keep},
            "evals": harness.read_evals(out) if not failed else []}  # fmt: skip


def tt(rec: dict, target: float = TARGET, budget_s: float | None = None) -> float | None:
    """Time to target from the first evaluation, only those within ``budget_s`` of it counted."""
    if rec["failed"] or not rec["evals"]:
        return None
    t0 = rec["evals"][0][0]
    evals = [e for e in rec["evals"] if budget_s is None or e[0] - t0 <= budget_s]
    t = harness.time_to_target(evals, target)
    return None if t is None else t - t0


def end(rec: dict) -> float:
    return rec["evals"][-1][0] - rec["evals"][0][0] if rec["evals"] else 0.0


def acc_at(rec: dict, t: float) -> float:
    """The last evaluated accuracy at or before ``t`` (from the first evaluation)."""
    t0 = rec["evals"][0][0] if rec["evals"] else 0.0
    before = [a for ts, _, a in rec["evals"] if ts - t0 <= t]
    return before[-1] if before else 0.0


def med(recs: list[dict], target: float = TARGET, budget_s: float | None = None):
    """Censored median time to target over ``recs`` (and how many were censored)."""
    times = [tt(r, target, budget_s) for r in recs]
    return harness.censored_median(times, budget_s or max(map(end, recs), default=0.0))


def finite(x: float | str) -> float:
    return x if isinstance(x, float | int) else math.inf


def finding(rep: harness.Report, name: str, ok: bool | str, seeds: int, note: str = "") -> None:
    """A claim that a paper's finding is ``ok`` (or a verdict such as "partly reproduced")."""
    verdict = ok if isinstance(ok, str) else "reproduced" if ok else "not reproduced"
    rep.claim(name, verdict, "reproduced", verdict == "reproduced", seeds=seeds, note=note)


def report_jin(rep: harness.Report, recs: dict[tuple, list[dict]], n_seeds: int) -> None:
    ws, budget = sorted({k[0] for k in recs}), JIN_BUDGET_S
    rows, ratio = [], {}
    for w in ws:
        m = {s: med(r, TARGET, budget) for (ww, s), r in recs.items() if ww == w}
        best = min((s for s in m if s != "sync"), key=lambda s: finite(m[s][0]))
        a, b = finite(m[best][0]), finite(m["sync"][0])
        ratio[w] = a / b if math.isfinite(b) else (0.0 if math.isfinite(a) else None)
        rows += [[w, s, v, c, *(med(recs[w, s], t, budget)[0] for t in JIN_SENSITIVITY),
                  100 * statistics.median(acc_at(r, budget) for r in recs[w, s])]
                 for s, (v, c) in m.items()]  # fmt: skip
    few = [ratio[w] for w in ws if w <= 8 and ratio[w] is not None]
    many = [ratio[ws[-1]]] if ratio[ws[-1]] is not None else []
    async_few, sync_many = bool(few) and max(few) < 1, bool(many) and many[0] > 1
    verdict = {2: "reproduced", 1: "partly reproduced", 0: "not reproduced"}[async_few + sync_many]
    per_w = ", ".join(f"W={w}: {harness.fmt(ratio[w])}" for w in ws)
    note = f"equal time, {budget:g} virtual s; fastest async ÷ sync per W: {per_w}"
    finding(rep, "Jin et al.: async faster at few workers (W ≤ 8), sync at many (largest W)",
            verdict, n_seeds, note)  # fmt: skip
    rep.section(f"Jin et al. 2016: time to target within {budget:g} virtual s (every method)")
    rep.table(["W", "strategy", f"median to {100 * TARGET:g} %", "censored",
               *(f"median to {100 * t:g} %" for t in JIN_SENSITIVITY),
               f"accuracy at {budget:g} s (%, median)"], rows)  # fmt: skip


def report_coquelin(rep: harness.Report, recs: dict[tuple, list[dict]], n_seeds: int) -> None:
    """One claim per link speed: DASO's finding at every P, at some, or at none."""
    rows, ok = [], {}
    for gbit, p in sorted({k[:2] for k in recs}):
        mine = {s: r for (g, pp, s), r in recs.items() if (g, pp) == (gbit, p)}
        m = {s: med(r) for s, r in mine.items()}
        acc = {s: statistics.fmean(x["summary"]["final_test_accuracy"] or 0 for x in r)
               for s, r in mine.items()}  # fmt: skip
        sync = finite(m["sync"][0])
        ratio = finite(m["daso"][0]) / sync if math.isfinite(sync) else None
        hit = ratio is not None and ratio < 0.9 and acc["daso"] - acc["sync"] >= -0.01
        ok.setdefault(gbit, []).append(hit)
        rows.append([gbit, p, 4 * p, *(m[s][0] for s in m), ratio,
                     100 * (acc["daso"] - acc["sync"])])  # fmt: skip
        strategies = list(m)
    for gbit, hits in ok.items():
        verdict = "reproduced" if all(hits) else "partly reproduced" if any(hits) else False
        finding(rep, f"Coquelin et al.: DASO ≤ 0.9 × sync's time to 80 %, accuracy within 1 "
                f"point, {gbit} Gbit/s (every P)", verdict, n_seeds)  # fmt: skip
    rep.section("Coquelin et al. 2021: median time to 80 % (virtual s)")
    rep.table(["Gbit/s", "P", "GPUs", *strategies, "daso ÷ sync", "daso − sync acc (points)"],
              rows)  # fmt: skip


def report_paine(rep: harness.Report, recs: dict[tuple, list[dict]], n_seeds: int) -> None:
    rows, speedup = [], {}
    horizon = min(end(r) for rs in recs.values() for r in rs if r["evals"])
    early = horizon / 4
    for (start, n_sync, w), rs in sorted(recs.items()):
        one = finite(med(recs[(start, n_sync, 1)])[0])
        mine = finite(med(rs)[0])
        speedup[(start, n_sync, w)] = one / mine if math.isfinite(mine) else None
        err = [100 * (1 - statistics.fmean(acc_at(r, t) for r in rs)) for t in (early, horizon)]
        rows.append([start, n_sync, w, med(rs)[0], speedup[(start, n_sync, w)], *err])
    ws = sorted({k[2] for k in recs})
    warm = [speedup.get(("warm", 10, w)) for w in ws]
    more_faster = None not in warm and all(a < b for a, b in zip(warm, warm[1:], strict=False))
    err_early = {w: next(r[5] for r in rows if r[:3] == ["cold", 10, w]) for w in ws}
    cold_slow = err_early[ws[-1]] > err_early[1] + 1
    finding(
        rep,
        f"Paine et al.: warm start, n_sync 10, speed-up rises with W ({ws})",
        more_faster,
        n_seeds,
    )
    finding(
        rep,
        f"Paine et al.: cold start, W = {ws[-1]} slower early (error > 1 point above W = 1)",
        cold_slow,
        n_seeds,
    )
    rep.section("Paine et al. 2013: GPU A-SGD, time to 80 % and test error (virtual s, %)")
    rep.table(f"start | n_sync | W | median tt | speed-up vs W=1 | error at {early:.0f} s | "
              f"error at {horizon:.0f} s", rows)  # fmt: skip


REPORTS = {"jin": report_jin, "coquelin": report_coquelin, "paine": report_paine}


def main() -> None:
    def add(p):
        p.add_argument("experiments", nargs="*", choices=[*EXPERIMENTS, []], default=[])
        p.add_argument("--jobs", type=int, default=2, help="simulations side by side")

    args, prov = harness.start(__doc__, add)
    names = args.experiments or list(EXPERIMENTS)
    seeds = list(range(args.seeds or (1 if args.quick else 3)))  # deterministic per seed
    root = prov.runs_dir("sim_seeds")
    jobs = [(name, group, cfg, sim, seed,
             str(root / name / f"{'-'.join(f'{k}{v}' for k, v in group.items())}-s{seed}"))
            for name in names for group, cfg, sim in EXPERIMENTS[name](args.quick)
            for seed in seeds]  # fmt: skip
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("forkserver")) as pool:
        records = list(pool.map(simulate_point, *zip(*jobs, strict=True)))
    prov.sample_load()
    rep = harness.Report("sim_seeds", "The seed papers' findings on the virtual cluster", prov)
    rep.settings(
        f"{len(records)} simulations ({len(seeds)} seeds per point, {args.jobs} side by side)"
        + ("; --quick: a few short runs, not a result" if args.quick else "")
        + f".\n\n{harness.about(__doc__)}"
    )
    failed = [r for r in records if r["failed"]]
    if failed:
        rep.text(f"{len(failed)} runs failed (counted as censored): " + failed[0]["failed"])
    for name in names:
        recs: dict[tuple, list[dict]] = {}
        for r in (r for r in records if r["experiment"] == name):
            recs.setdefault(tuple(r["group"].values()), []).append(r)
        REPORTS[name](rep, recs, len(seeds))
    rep.data = {"records": records}
    rep.write()
    print(json.dumps([c.name for c in rep.claims]))


if __name__ == "__main__":
    main()
