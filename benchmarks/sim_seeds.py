"""The three seed papers' experiments at their own scale, on the virtual cluster (issue 14).

    .venv/bin/python benchmarks/sim_seeds.py jin        # sync/asgd/easgd/gossip, W = 2..128
    .venv/bin/python benchmarks/sim_seeds.py coquelin   # DASO/sync/post-local SGD, 4-16 nodes x 4
    .venv/bin/python benchmarks/sim_seeds.py paine      # GPU A-SGD: 1-8 clients, warm/cold, n_sync
    .venv/bin/python benchmarks/sim_seeds.py report     # rebuild results/sim_seeds.md

Every run is ``cloudburst.sim.run.simulate`` (one process, virtual seconds, deterministic: the
same seed gives the same run whatever the machine's load), three seeds per point. The MNIST-1D
CNN's real training drives the maths; the clock charges a published large model's bytes and
step time (the stand-in). Each experiment writes ``results/sim_seeds_<name>.json`` (every run:
settings, summary, evaluations) and ``.png``, and the command rebuilds ``results/sim_seeds.md``
from all the JSON files there; text below a ``<!-- hand-written -->`` line in that file is kept.
Runs that never reach the target are censored: counted and shown as "not reached", never
averaged in. ``--jobs 2`` runs two simulations side by side (their results do not depend on it).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402

RUNS = benchutil.REPO / "runs" / "sim_seeds"
MD = benchutil.RESULTS / "sim_seeds.md"
KEEP_MARK = "<!-- hand-written: kept when the report is rebuilt -->"
SEEDS = (0, 1, 2)
THRESHOLDS = (0.8, 0.85, 0.9)

# The stand-ins' figures (cloudburst/config/simulation.py has the profiles' sources).
RESNET50_PARAMS = 25_557_032
# Krizhevsky et al. 2012's network (the GPU A-SGD seed's model): ~60 M parameters; one K20X
# trains it in ~10.7 days (the seed, section 3) = 90 epochs x 1.28 M images / 10.7 d
# = 125 images/s, ~1.03 s per batch of 128.
ALEXNET_PARAMS = 60_000_000
K20X_STEP_S = 128 * 10.7 * 86400 / (90 * 1_281_167)


@dataclass
class Point:
    """One simulated run: ``cfg``/``sim`` are keyword arguments of RunConfig/SimulationConfig."""

    label: str
    group: dict[str, Any]  # what the report groups by (e.g. {"W": 8, "strategy": "sync"})
    cfg: dict[str, Any]
    sim: dict[str, Any]
    seed: int
    cost: float = 0.0  # worker-steps, to start the longest runs first
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- running
def _run_one(point: Point, reuse: bool) -> dict[str, Any]:
    """Simulate one point (in a pool process); returns its record."""
    from cloudburst.config import RunConfig
    from cloudburst.config.simulation import SimulationConfig
    from cloudburst.sim.run import simulate

    out = RUNS / point.label
    cfg_kw = {
        **point.cfg,
        "seed": point.seed,
        "out": str(out),
        "overwrite": True,
        "checkpoint_every": 0,
        "progress": False,
    }
    summary_path = out / "summary.json"
    summary = None
    if reuse and summary_path.exists():
        old = json.loads(summary_path.read_text())
        same_clock = old.get("clock_model", {}).get("settings") == (
            SimulationConfig(**point.sim).to_dict()
        )
        wanted = {**point.cfg, "seed": point.seed}
        same_run = all(old.get("config", {}).get(k) == v for k, v in wanted.items())
        if old.get("simulated") and same_clock and same_run:
            summary = old
    if summary is None:
        summary = simulate(RunConfig(**cfg_kw), SimulationConfig(**point.sim))
    evals = []
    for path in sorted((out / "metrics").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "eval":
                evals.append([rec["time_s"], rec["test_accuracy"]])
    evals.sort()
    keep = (
        "final_test_accuracy",
        "wall_time_s",
        "time_to_target_s",
        "steps_per_worker",
        "samples",
        "sent_bytes",
        "inter_node_bytes",
        "mean_staleness_versions",
        "simulator",
    )
    return {
        "label": point.label,
        "group": point.group,
        "seed": point.seed,
        "cfg": point.cfg,
        "sim": point.sim,
        "extra": point.extra,
        "summary": {k: summary.get(k) for k in keep},
        "evals": evals,
    }


def run_points(points: list[Point], jobs: int, reuse: bool) -> list[dict[str, Any]]:
    order = sorted(points, key=lambda p: -p.cost)
    records: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(_run_one, p, reuse): p for p in order}
        for n, fut in enumerate(as_completed(futures), 1):
            rec = fut.result()
            records[rec["label"]] = rec
            s = rec["summary"]
            print(
                f"[{time.perf_counter() - started:7.1f} s] {n}/{len(points)} {rec['label']}: "
                f"acc {s['final_test_accuracy']:.3f}, {s['wall_time_s']:.1f} virtual s, "
                f"sim {s['simulator']['wall_s']:.1f} s",
                flush=True,
            )
    return [records[p.label] for p in points]


# ---------------------------------------------------------------------------- measures
def start_time(rec: dict[str, Any]) -> float:
    """When training proper began: the first evaluation (after a warm start, its end)."""
    return rec["evals"][0][0] if rec["evals"] else 0.0


def time_to(rec: dict[str, Any], target: float) -> float | None:
    """Virtual seconds from :func:`start_time` to the first evaluation >= target (None:
    censored, never reached)."""
    t0 = start_time(rec)
    for t, acc in rec["evals"]:
        if acc >= target:
            return t - t0
    return None


def acc_at(rec: dict[str, Any], t: float) -> float:
    """Test accuracy of the last evaluation at or before ``t`` (from the start)."""
    t0 = start_time(rec)
    acc = rec["evals"][0][1]
    for when, a in rec["evals"]:
        if when - t0 <= t + 1e-9:
            acc = a
    return acc


def end_time(rec: dict[str, Any]) -> float:
    return rec["summary"]["wall_time_s"] - start_time(rec)


def censored_median(values: list[float | None]) -> float:
    """The median with censored runs (None) as +inf: defined while most runs reached it."""
    return statistics.median([math.inf if v is None else v for v in values])


def fmt_tt(values: list[float | None], ends: list[float]) -> str:
    """'12.3 ± 0.4 (3/3)', '15.1 (2/3; not reached by 40.2)', 'not reached (0/3; ends 40–41)'."""
    got = [v for v in values if v is not None]
    n = len(values)
    if not got:
        return f"not reached (0/{n}; runs end at {min(ends):.0f}–{max(ends):.0f})"
    text = f"{statistics.mean(got):.1f}"
    if len(got) > 1:
        text += f" ± {statistics.stdev(got):.1f}"
    missed = [e for v, e in zip(values, ends, strict=True) if v is None]
    if missed:
        return text + f" ({len(got)}/{n}; not reached by {', '.join(f'{e:.0f}' for e in missed)})"
    return text + f" ({len(got)}/{n})"


def fmt_mean_sd(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    vals = [v * scale for v in values]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{statistics.mean(vals):.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def groups_of(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        out.setdefault(tuple(r["group"][k] for k in keys), []).append(r)
    return out


def summary_rows(
    records: list[dict[str, Any]], keys: tuple[str, ...], target: float
) -> tuple[list[str], list[list[Any]]]:
    header = [
        *keys,
        f"time to {target:.0%} (virtual s, mean ± sd of reached)",
        "time to 90 %",
        "final acc (%)",
        "virtual s per step",
        "run ends (virtual s)",
    ]
    rows = []
    for key, recs in groups_of(records, keys).items():
        ends = [end_time(r) for r in recs]
        rows.append(
            [
                *key,
                fmt_tt([time_to(r, target) for r in recs], ends),
                fmt_tt([time_to(r, 0.9) for r in recs], ends),
                fmt_mean_sd([r["summary"]["final_test_accuracy"] for r in recs], 100),
                fmt_mean_sd(
                    [e / r["summary"]["steps_per_worker"] for e, r in zip(ends, recs, strict=True)],
                    1,
                    3,
                ),
                fmt_mean_sd(ends, 1, 0),
            ]
        )
    return header, rows


# ---------------------------------------------------------------------------- experiments
@dataclass
class Experiment:
    name: str
    title: str
    points: Callable[[argparse.Namespace], list[Point]]
    report: Callable[[list[dict[str, Any]], dict[str, Any]], tuple[list[str], str]]
    plot: Callable[[list[dict[str, Any]], dict[str, Any], Path], None]


def _eval_every(steps: int, step_s: float, evals: int = 50) -> float:
    return max(1e-3, steps * step_s / evals)


# ---- Jin et al. 2016 ---------------------------------------------------------------------
JIN_WORKERS = (2, 4, 8, 16, 32, 64, 128)
JIN_STRATEGIES = ("sync", "asgd", "easgd", "gossip")


def jin_points(args: argparse.Namespace) -> list[Point]:
    batch = 64
    step_s = batch / 367.0  # resnet50-v100-fp32: 367 images/s
    points = []
    for w in args.workers or JIN_WORKERS:
        steps = max(args.min_steps, math.ceil(args.samples / (w * batch)))
        for strategy in args.strategies or JIN_STRATEGIES:
            servers = 1 if strategy in ("asgd", "easgd") else 0
            cfg = {
                "strategy": strategy,
                "workers": w,
                "servers": servers,
                "nodes": w + servers,  # one GPU per node; a server on a node of its own
                "inter_node_link": args.link,
                "steps": steps,
                "batch_size": batch,
                "train_size": args.train_size,
                "test_size": 1000,
                "lr": 0.1,
                "target_accuracy": args.target,
                "eval_every_s": _eval_every(steps, step_s),
                "log_every_steps": 10_000,
                "comm_timeout_s": 3600.0,
            }
            if strategy == "asgd":
                cfg["n_sync"] = 10
            sim = {"profile": "resnet50-v100-fp32", "step_time_jitter": args.jitter}
            for seed in args.seeds:
                points.append(
                    Point(
                        f"jin/{strategy}-W{w}-seed{seed}",
                        {"W": w, "strategy": strategy},
                        cfg,
                        sim,
                        seed,
                        cost=w * steps * (1.3 if strategy == "gossip" else 1.0),
                    )
                )
    return points


def extend_censored(
    records: list[dict[str, Any]], points: list[Point], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Equal time, not equal steps: a run of an asynchronous strategy that ended without
    reaching the target *before* sync's runs at the same W ended is run again with its steps
    scaled up (× sync's end ÷ its end, + 5 %), so that no strategy is censored earlier in
    virtual time than sync is; the longer run replaces it in the report."""
    sync_end = {}
    for r in records:
        if r["group"]["strategy"] == "sync":
            w = r["group"]["W"]
            sync_end[w] = max(sync_end.get(w, 0.0), end_time(r))
    by_label = {p.label: p for p in points}
    longer: list[Point] = []
    for r in records:
        w = r["group"]["W"]
        if r["group"]["strategy"] == "sync" or w not in sync_end:
            continue
        if time_to(r, args.target) is None and end_time(r) < sync_end[w]:
            p = by_label[r["label"]]
            steps = math.ceil(p.cfg["steps"] * sync_end[w] / end_time(r) * 1.05)
            cfg = {**p.cfg, "steps": steps}
            cfg["eval_every_s"] = p.cfg["eval_every_s"] * steps / p.cfg["steps"]
            longer.append(
                Point(
                    p.label + "-longer",
                    p.group,
                    cfg,
                    p.sim,
                    p.seed,
                    cost=p.cost * steps / p.cfg["steps"],
                    extra={"extended_from_steps": p.cfg["steps"], "sync_end_s": sync_end[w]},
                )
            )
    if not longer:
        return records
    print(f"jin: {len(longer)} censored runs ended before sync's; running them longer", flush=True)
    done = {
        r["label"].removesuffix("-longer"): r for r in run_points(longer, args.jobs, args.reuse)
    }
    return [done.get(r["label"], r) for r in records]


def jin_report(records, meta) -> tuple[list[str], str]:
    target = meta["target"]
    header, rows = summary_rows(records, ("W", "strategy"), target)
    by = groups_of(records, ("W", "strategy"))
    ws = sorted({r["group"]["W"] for r in records})
    ratio_rows, ratios = [], {}
    for w in ws:
        sync = censored_median([time_to(r, target) for r in by.get((w, "sync"), [])])
        best, best_name = math.inf, "-"
        for s in ("asgd", "easgd", "gossip"):
            m = censored_median([time_to(r, target) for r in by.get((w, s), [])] or [None])
            if m < best:
                best, best_name = m, s
        ratio = best / sync if math.isfinite(sync) and math.isfinite(best) else None
        if math.isfinite(sync) and not math.isfinite(best):
            ratio = math.inf
        if not math.isfinite(sync) and math.isfinite(best):
            ratio = 0.0
        ratios[w] = ratio
        ratio_rows.append(
            [
                w,
                "not reached" if not math.isfinite(sync) else f"{sync:.1f}",
                best_name if math.isfinite(best) else "none reached",
                "-" if not math.isfinite(best) else f"{best:.1f}",
                "-"
                if ratio is None
                else ("∞ (async never)" if ratio == math.inf else f"{ratio:.2f}"),
            ]
        )
    small = [w for w in ws if w <= 8 and ratios[w] is not None]
    large = [w for w in ws if w >= 64 and ratios[w] is not None]
    async_few = bool(small) and all(ratios[w] < 1 for w in small)
    sync_many = bool(large) and all(ratios[w] > 1 for w in large)
    cross = None
    for w in ws:
        if all(ratios[v] is not None and ratios[v] > 1 for v in ws if v >= w):
            cross = w
            break
    verdict = (
        "reproduced"
        if async_few and sync_many
        else ("partly reproduced" if async_few or sync_many else "not reproduced")
    )
    lines = [
        *benchutil.table(header, rows),
        "",
        "The paper's comparison: the fastest asynchronous method's median time to "
        f"{target:.0%} ÷ sync's (censored runs count as never; < 1: asynchronous faster).",
        "",
        *benchutil.table(
            ["W", "sync median (virtual s)", "fastest async", "its median", "async ÷ sync"],
            ratio_rows,
        ),
        "",
        f"Rule: *asynchronous faster at few nodes* = async ÷ sync < 1 at every W ≤ 8 "
        f"({'yes' if async_few else 'no'}); *synchronous better at many* = > 1 at every W ≥ 64 "
        f"({'yes' if sync_many else 'no'}); both → reproduced, one → partly. Crossover "
        f"(smallest W from which sync is faster at every larger W): "
        f"{'none' if cross is None else f'W = {cross}'}.",
    ]
    meta["crossover_W"] = cross
    meta["async_over_sync"] = {str(k): v for k, v in ratios.items()}
    return lines, verdict


def _tt_plot(ax, records, xkey, series_key, target, xlabel):
    import matplotlib.ticker as mt

    by = groups_of(records, (series_key, xkey))
    names = list(dict.fromkeys(r["group"][series_key] for r in records))
    for name in names:
        xs, ys, es, cx, cy = [], [], [], [], []
        for (s, x), recs in sorted(by.items(), key=lambda kv: kv[0][1]):
            if s != name:
                continue
            got = [time_to(r, target) for r in recs]
            reached = [v for v in got if v is not None]
            xs.append(x)  # NaN where no seed reached it: the line breaks, never bridges a gap
            ys.append(statistics.mean(reached) if reached else math.nan)
            es.append(statistics.stdev(reached) if len(reached) > 1 else 0)
            if len(reached) < len(got):
                cx.append(x)
                cy.append(max(end_time(r) for r in recs))
        line = ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=name)
        if cx:
            ax.scatter(cx, cy, marker="^", facecolors="none", edgecolors=line[0].get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(mt.ScalarFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"virtual s to {target:.0%} test accuracy")
    ax.set_title("time to target (mean of reached; △ = a seed not reached by then)", fontsize=9)
    ax.legend(fontsize=8)


def _acc_plot(ax, records, xkey, series_key, xlabel):
    import matplotlib.ticker as mt

    by = groups_of(records, (series_key, xkey))
    names = list(dict.fromkeys(r["group"][series_key] for r in records))
    for name in names:
        pts = sorted((x, recs) for (s, x), recs in by.items() if s == name)
        xs = [x for x, _ in pts]
        accs = [[r["summary"]["final_test_accuracy"] * 100 for r in recs] for _, recs in pts]
        ax.errorbar(
            xs,
            [statistics.mean(a) for a in accs],
            yerr=[statistics.stdev(a) if len(a) > 1 else 0 for a in accs],
            marker="o",
            capsize=3,
            label=name,
        )
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(mt.ScalarFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("final accuracy (mean ± sd, 3 seeds)", fontsize=9)
    ax.legend(fontsize=8)


def jin_plot(records, meta, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    _tt_plot(axes[0], records, "W", "strategy", meta["target"], "workers W (1 GPU per node)")
    _acc_plot(axes[1], records, "W", "strategy", "workers W (1 GPU per node)")
    fig.suptitle(
        f"Jin et al.: ResNet-50-sized gradient (V100 fp32, batch 64), "
        f"{meta['link'].replace(',', ' Gbit/s, ')} ms between nodes; MNIST-1D CNN maths",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- Coquelin et al. 2021 (DASO) ---------------------------------------------------------
COQ_NODES = (4, 8, 16)
COQ_STRATEGIES = ("sync", "daso", "local_sgd")
GPUS_PER_NODE = 4


def coquelin_points(args: argparse.Namespace) -> list[Point]:
    batch = 64
    step_s = batch / 2470.0  # resnet50-a100: 2470 images/s (mixed precision)
    spe = args.steps_per_epoch
    points = []
    for link in args.links:
        for p in args.nodes or COQ_NODES:
            w = p * GPUS_PER_NODE
            steps = spe * args.epochs
            for strategy in args.strategies or COQ_STRATEGIES:
                cfg = {
                    "strategy": strategy,
                    "workers": w,
                    "nodes": p,
                    "inter_node_link": link,
                    "epochs": args.epochs,
                    "batch_size": batch,
                    # Every worker's shard is spe batches, so DASO's epoch-counted phases
                    # (4 warm-up, 4 cool-down epochs) are the same steps at every node count.
                    "train_size": w * batch * spe,
                    "test_size": 1000,
                    "lr": 0.1,
                    "target_accuracy": args.target,
                    "eval_every_s": _eval_every(steps, step_s),
                    "log_every_steps": 10_000,
                    "comm_timeout_s": 3600.0,
                }
                if strategy == "local_sgd":
                    cfg["period"] = args.period
                    cfg["local_sgd_warmup_steps"] = 4 * spe  # DASO's 4 warm-up epochs
                sim = {
                    "profile": "resnet50-a100",
                    "intra_node_link": args.intra_link,
                    "step_time_jitter": args.jitter,
                }
                for seed in args.seeds:
                    points.append(
                        Point(
                            f"coquelin/{strategy}-P{p}-link{link}-seed{seed}".replace(",", "_"),
                            {"link": link, "P": p, "strategy": strategy},
                            cfg,
                            sim,
                            seed,
                            cost=w * steps,
                        )
                    )
    return points


def coquelin_report(records, meta) -> tuple[list[str], str]:
    target = meta["target"]
    header, rows = summary_rows(records, ("link", "P", "strategy"), target)
    by = groups_of(records, ("link", "P", "strategy"))
    cmp_rows, faster, acc_ok = [], [], []
    for link in dict.fromkeys(r["group"]["link"] for r in records):
        for p in sorted({r["group"]["P"] for r in records}):
            med = {
                s: censored_median([time_to(r, target) for r in by.get((link, p, s), [])] or [None])
                for s in COQ_STRATEGIES
            }
            acc = {
                s: statistics.mean(
                    [r["summary"]["final_test_accuracy"] * 100 for r in by.get((link, p, s), [])]
                    or [math.nan]
                )
                for s in COQ_STRATEGIES
            }

            def ratio(a: str, b: str, med=med) -> str:
                if not math.isfinite(med[b]):
                    return "- (" + b + " never)"
                return "∞ (never)" if not math.isfinite(med[a]) else f"{med[a] / med[b]:.2f}"

            r_sync = med["daso"] / med["sync"] if math.isfinite(med["sync"]) else math.nan
            faster.append(r_sync < 0.9)
            acc_ok.append(acc["daso"] - acc["sync"] >= -1.0)
            cmp_rows.append(
                [
                    link,
                    p,
                    p * GPUS_PER_NODE,
                    ratio("daso", "sync"),
                    ratio("daso", "local_sgd"),
                    ratio("local_sgd", "sync"),
                    f"{acc['daso'] - acc['sync']:+.1f}",
                    f"{acc['local_sgd'] - acc['sync']:+.1f}",
                ]
            )
    if all(faster) and all(acc_ok):
        verdict = "reproduced"
    elif any(faster):
        verdict = "partly reproduced"
    else:
        verdict = "not reproduced"
    lines = [
        *benchutil.table(header, rows),
        "",
        f"Medians over seeds of the time to {target:.0%} (censored = never), and the mean final "
        "accuracy difference:",
        "",
        *benchutil.table(
            [
                "inter-node link (Gbit/s, ms)",
                "nodes P",
                "GPUs",
                "daso ÷ sync",
                "daso ÷ post-local SGD",
                "post-local SGD ÷ sync",
                "daso − sync acc (points)",
                "post-local − sync acc",
            ],
            cmp_rows,
        ),
        "",
        "Rule: reproduced when DASO reaches the target in < 0.9× sync's time at every node "
        "count and link and ends within 1 point of sync's accuracy; partly when it is faster at "
        "some; not when it is faster nowhere.",
    ]
    return lines, verdict


def coquelin_plot(records, meta, path: Path) -> None:
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["group"]["link"] for r in records))
    fig, axes = plt.subplots(len(links), 2, figsize=(11, 4.0 * len(links)), squeeze=False)
    for i, link in enumerate(links):
        recs = [r for r in records if r["group"]["link"] == link]
        _tt_plot(axes[i][0], recs, "P", "strategy", meta["target"], "nodes (4 GPUs each)")
        _acc_plot(axes[i][1], recs, "P", "strategy", "nodes (4 GPUs each)")
        axes[i][0].set_title(
            f"inter-node {link} Gbit/s: time to target (△ = a seed not reached)", fontsize=9
        )
    fig.suptitle(
        "Coquelin et al. (DASO): ResNet-50 on A100s (batch 64), "
        f"{meta['intra_link']} Gbit/s within a node; MNIST-1D CNN maths",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- Paine et al. 2013 (GPU A-SGD) -------------------------------------------------------
PAINE_WORKERS = (1, 2, 4, 8)


def paine_points(args: argparse.Namespace) -> list[Point]:
    points = []
    cases = [("warm", n) for n in args.n_sync] + [("cold", args.cold_n_sync)]
    for start, n_sync in cases:
        for w in args.workers or PAINE_WORKERS:
            cfg = {
                "strategy": "asgd",
                "workers": w,
                "servers": 1,
                "nodes": w + 1,  # every client and the server on a node of its own
                "inter_node_link": args.link,
                "n_sync": n_sync,
                "steps": args.steps,
                "batch_size": 64,
                "train_size": args.train_size,
                "test_size": 1000,
                "lr": 0.1,
                "warm_start_steps": args.warm_steps if start == "warm" else 0,
                "target_accuracy": args.target,
                "eval_every_s": _eval_every(args.steps, K20X_STEP_S, 60),
                "log_every_steps": 10_000,
                "comm_timeout_s": 3600.0,
            }
            sim = {
                "modelled_params": ALEXNET_PARAMS,
                "step_time_s": round(K20X_STEP_S, 4),
                "step_time_jitter": args.jitter,
            }
            for seed in args.seeds:
                points.append(
                    Point(
                        f"paine/{start}-nsync{n_sync}-W{w}-seed{seed}",
                        {"start": start, "n_sync": n_sync, "W": w},
                        cfg,
                        sim,
                        seed,
                        cost=w * args.steps,
                    )
                )
    return points


def paine_report(records, meta) -> tuple[list[str], str]:
    target = meta["target"]
    header, rows = summary_rows(records, ("start", "n_sync", "W"), target)
    by = groups_of(records, ("start", "n_sync", "W"))
    horizon = min(end_time(r) for r in records)
    early = horizon / 10
    # Speed-up against one client (medians of the time to target, censored = never).
    sp_rows, speedups = [], {}
    for start, n_sync in dict.fromkeys(
        (r["group"]["start"], r["group"]["n_sync"]) for r in records
    ):
        base = censored_median(
            [time_to(r, target) for r in by.get((start, n_sync, 1), [])] or [None]
        )
        cells = []
        for w in PAINE_WORKERS:
            m = censored_median(
                [time_to(r, target) for r in by.get((start, n_sync, w), [])] or [None]
            )
            sp = base / m if math.isfinite(base) and math.isfinite(m) else None
            speedups[(start, n_sync, w)] = sp
            cells.append("-" if sp is None else f"{sp:.2f}")
        err_early = [
            fmt_mean_sd([100 * (1 - acc_at(r, early)) for r in by.get((start, n_sync, w), [])])
            for w in PAINE_WORKERS
        ]
        err_end = [
            fmt_mean_sd([100 * (1 - acc_at(r, horizon)) for r in by.get((start, n_sync, w), [])])
            for w in PAINE_WORKERS
        ]
        sp_rows.append([start, n_sync, *cells, *err_early, *err_end])
    # Verdicts.
    warm_n = [
        n
        for (s, n) in dict.fromkeys((r["group"]["start"], r["group"]["n_sync"]) for r in records)
        if s == "warm"
    ]
    mid = sorted(warm_n)[len(warm_n) // 2] if warm_n else None
    sp = [speedups.get(("warm", mid, w)) for w in PAINE_WORKERS]
    more_faster = all(v is not None for v in sp) and all(
        a < b for a, b in zip(sp, sp[1:], strict=False)
    )
    more_faster_some = sp[-1] is not None and sp[-1] > 1
    cold_n = meta["cold_n_sync"]

    def mean_err(start, n, w, t):
        recs = by.get((start, n, w), [])
        return statistics.mean([100 * (1 - acc_at(r, t)) for r in recs]) if recs else math.nan

    cold_slow_early = mean_err("cold", cold_n, 8, early) > mean_err("cold", cold_n, 1, early) + 1
    cold_fast_late = mean_err("cold", cold_n, 8, horizon) < mean_err("cold", cold_n, 1, horizon) - 1
    lo, hi = (min(warm_n), max(warm_n)) if warm_n else (None, None)
    gap = (
        mean_err("warm", hi, 8, horizon) - mean_err("warm", lo, 8, horizon) if warm_n else math.nan
    )
    findings = {
        f"warm start, n_sync {mid}: more clients faster (speed-up rises with W)": (
            "reproduced" if more_faster else ("partly" if more_faster_some else "not")
        ),
        f"cold start, n_sync {cold_n}: 8 clients slower early "
        f"(error at {early:.0f} s > 1 point above 1 client's)": (
            "reproduced" if cold_slow_early else "not"
        ),
        f"cold start: 8 clients faster later "
        f"(error at {horizon:.0f} s > 1 point below 1 client's)": (
            "reproduced" if cold_fast_late else "not"
        ),
        f"warm, 8 clients: smaller n_sync lower error (n_sync {hi} − n_sync {lo} "
        f"at {horizon:.0f} s: {gap:+.1f} points; paper ~4)": (
            "reproduced" if gap > 1 else ("partly" if gap > 0 else "not")
        ),
    }
    meta["findings"] = findings
    n_rep = sum(v == "reproduced" for v in findings.values())
    verdict = (
        "reproduced"
        if n_rep == len(findings)
        else ("partly reproduced" if n_rep or "partly" in findings.values() else "not reproduced")
    )
    w_head = [f"W={w}" for w in PAINE_WORKERS]
    lines = [
        *benchutil.table(header, rows),
        "",
        f"Speed-up against one client = median time to {target:.0%} at W=1 ÷ at W (censored = "
        f"never: '-'); test error (%) at {early:.0f} s (early) and at {horizon:.0f} s (the "
        "shortest run's end), mean ± sd:",
        "",
        *benchutil.table(
            [
                "start",
                "n_sync",
                *[f"speed-up {h}" for h in w_head],
                *[f"error early {h}" for h in w_head],
                *[f"error end {h}" for h in w_head],
            ],
            sp_rows,
        ),
        "",
        *benchutil.table(["finding (the paper's)", "here"], [[k, v] for k, v in findings.items()]),
    ]
    return lines, verdict


def paine_plot(records, meta, path: Path) -> None:
    import matplotlib.pyplot as plt

    target = meta["target"]
    by = groups_of(records, ("start", "n_sync", "W"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    cases = list(dict.fromkeys((r["group"]["start"], r["group"]["n_sync"]) for r in records))
    for start, n in cases:
        base = censored_median([time_to(r, target) for r in by.get((start, n, 1), [])] or [None])
        xs, ys = [], []
        for w in PAINE_WORKERS:
            m = censored_median([time_to(r, target) for r in by.get((start, n, w), [])] or [None])
            if math.isfinite(base) and math.isfinite(m):
                xs.append(w)
                ys.append(base / m)
        axes[0].plot(
            xs, ys, marker="o", ls="-" if start == "warm" else "--", label=f"{start}, n_sync {n}"
        )
    axes[0].plot(PAINE_WORKERS, PAINE_WORKERS, color="grey", lw=0.8, ls=":", label="linear")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("clients W")
    axes[0].set_ylabel(f"speed-up to {target:.0%} vs 1 client")
    axes[0].set_title("speed-up (medians of 3 seeds)", fontsize=9)
    axes[0].legend(fontsize=8)
    for ax, (start, n) in ((axes[1], ("cold", meta["cold_n_sync"])), (axes[2], ("warm", None))):
        if start == "cold":
            for w in PAINE_WORKERS:
                for i, r in enumerate(by.get((start, n, w), [])):
                    t0 = start_time(r)
                    ax.plot(
                        [t - t0 for t, _ in r["evals"]],
                        [100 * (1 - a) for _, a in r["evals"]],
                        color=f"C{PAINE_WORKERS.index(w)}",
                        lw=0.9,
                        label=f"W={w}" if i == 0 else None,
                    )
            ax.set_title(f"cold start, n_sync {n}: test error (3 seeds each)", fontsize=9)
        else:
            for j, (s, nn) in enumerate(c for c in cases if c[0] == "warm"):
                for i, r in enumerate(by.get((s, nn, 8), [])):
                    t0 = start_time(r)
                    ax.plot(
                        [t - t0 for t, _ in r["evals"]],
                        [100 * (1 - a) for _, a in r["evals"]],
                        color=f"C{j}",
                        lw=0.9,
                        label=f"n_sync {nn}" if i == 0 else None,
                    )
            ax.set_title("warm start, 8 clients: test error by n_sync", fontsize=9)
        ax.set_xlabel("virtual s since the start (after the warm start)")
        ax.set_ylabel("test error (%)")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8)
    fig.suptitle(
        "Paine et al. (GPU A-SGD): a 60 M-parameter net on K20X-class steps "
        f"({K20X_STEP_S:.2f} s), {meta['link'].replace(',', ' Gbit/s, ')} ms; MNIST-1D CNN maths",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


EXPERIMENTS = {
    "jin": Experiment(
        "jin",
        "Jin et al. 2016 (gossiping SGD): sync / asgd / easgd / gossip at W = 2…128",
        jin_points,
        jin_report,
        jin_plot,
    ),
    "coquelin": Experiment(
        "coquelin",
        "Coquelin et al. 2021 (DASO): DASO vs sync vs post-local SGD, 4/8/16 nodes × 4 GPUs",
        coquelin_points,
        coquelin_report,
        coquelin_plot,
    ),
    "paine": Experiment(
        "paine",
        "Paine et al. 2013 (GPU A-SGD): 1/2/4/8 clients, warm and cold start, n_sync",
        paine_points,
        paine_report,
        paine_plot,
    ),
}


# ---------------------------------------------------------------------------- the report
def write_experiment(exp: Experiment, records, meta, wall_s: float) -> None:
    sims = [r["summary"]["simulator"] for r in records]
    meta = {
        **meta,
        "command": benchutil.command_line(),
        "git_commit": benchutil.git_revision(),
        "provenance": benchutil.provenance_lines(),
        "runs": len(records),
        "script_wall_s": round(wall_s, 1),
        "simulator_wall_s_sum": round(sum(s["wall_s"] for s in sims), 1),
        "max_rss_bytes": max(s["max_rss_bytes"] for s in sims),
    }
    lines, verdict = exp.report(records, meta)
    meta["verdict"] = verdict
    meta["report_lines"] = lines
    png = benchutil.RESULTS / f"sim_seeds_{exp.name}.png"
    exp.plot(records, meta, png)
    data = {"experiment": exp.name, "title": exp.title, "meta": meta, "records": records}
    path = benchutil.RESULTS / f"sim_seeds_{exp.name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def rebuild_experiment(exp: Experiment, path: Path) -> None:
    """Tables, verdict and plot again from the runs stored in ``path`` (no run is repeated);
    the runs' own provenance stays, the rebuild's is added."""
    data = json.loads(path.read_text())
    meta, records = data["meta"], data["records"]
    lines, verdict = exp.report(records, meta)
    meta["verdict"], meta["report_lines"] = verdict, lines
    meta["rebuilt"] = (
        f"tables, verdict and plot rebuilt from these runs (none re-run) by "
        f"`{benchutil.command_line()}` at commit `{benchutil.git_revision()}`"
    )
    if not any(ln.startswith("- tables, verdict and plot rebuilt") for ln in meta["provenance"]):
        meta["provenance"].append("- " + meta["rebuilt"])
    else:
        meta["provenance"] = [
            ("- " + meta["rebuilt"]) if ln.startswith("- tables, verdict and plot rebuilt") else ln
            for ln in meta["provenance"]
        ]
    exp.plot(records, meta, path.with_suffix(".png"))
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def rebuild_markdown() -> Path:
    kept = ""
    if MD.exists() and KEEP_MARK in MD.read_text():
        kept = MD.read_text().split(KEEP_MARK, 1)[1]
    lines = [
        "# The seed papers at their own scale, on the virtual cluster",
        "",
        "Each section is one command of `benchmarks/sim_seeds.py` (its provenance is in the "
        "section: command, clean commit, machine). Every run is `cloudburst.sim.run.simulate`: "
        "one process, times in **virtual seconds** from the clock model, deterministic per seed "
        "(so the machine's load changes the simulator's wall time only). The MNIST-1D CNN's "
        "real training is the maths; the clock charges the named large model's bytes and step "
        "time (the stand-in). Times to target start at the first evaluation (after a warm "
        "start: its end); a run that never reaches the target is censored — counted as not "
        "reached, never averaged in. Mean ± sd over 3 seeds (0, 1, 2).",
        "",
    ]
    for name, exp in EXPERIMENTS.items():
        path = benchutil.RESULTS / f"sim_seeds_{name}.json"
        if not path.exists():
            lines += [
                f"## {exp.title}",
                "",
                f"Not run yet: `python benchmarks/sim_seeds.py {name}`.",
                "",
            ]
            continue
        data = json.loads(path.read_text())
        meta = data["meta"]
        lines += [
            f"## {exp.title}",
            "",
            *meta["provenance"],
            f"- {meta['runs']} simulated runs in {meta['script_wall_s'] / 60:.1f} min of wall "
            f"time ({meta['jobs']} at a time; simulator time summed "
            f"{meta['simulator_wall_s_sum'] / 60:.1f} min); peak RSS of one simulation "
            f"{meta['max_rss_bytes'] / 2**30:.2f} GiB",
            f"- setup: {meta['setup']}",
            "",
            f"**Verdict (by the rule below the tables): {meta['verdict']}.**",
            "",
            *meta["report_lines"],
            "",
            f"![{name}](sim_seeds_{name}.png)",
            "",
        ]
    text = "\n".join(lines).rstrip() + "\n\n" + KEEP_MARK + (kept if kept else "\n")
    MD.write_text(text)
    return MD


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("experiment", choices=[*EXPERIMENTS, "report"])
    ap.add_argument("--jobs", type=int, default=2, help="simulations side by side")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=list(SEEDS))
    ap.add_argument("--reuse", action="store_true", help="keep runs whose summary matches")
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--jitter", default="lognormal:0.1")
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--strategies", type=lambda s: s.split(","), default=None)
    # jin
    ap.add_argument("--samples", type=int, default=160_000, help="jin: samples per run at least")
    ap.add_argument("--min-steps", type=int, default=250, help="jin: steps per worker at least")
    ap.add_argument("--train-size", type=int, default=40_000)
    ap.add_argument("--link", default=None, help="inter-node link GBIT[,MS]")
    # coquelin
    ap.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--links", type=lambda s: s.split(";"), default=["100,0.005"])
    ap.add_argument("--intra-link", default="600,0.002")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--steps-per-epoch", type=int, default=10)
    ap.add_argument("--period", type=int, default=4)
    # paine
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--n-sync", type=lambda s: [int(x) for x in s.split(",")], default=[1, 10, 60])
    ap.add_argument("--cold-n-sync", type=int, default=10)
    ap.add_argument("--warm-steps", type=int, default=150)
    args = ap.parse_args(argv)
    if args.experiment == "report":
        for name, exp in EXPERIMENTS.items():
            path = benchutil.RESULTS / f"sim_seeds_{name}.json"
            if path.exists():
                rebuild_experiment(exp, path)
        print(rebuild_markdown())
        return 0
    exp = EXPERIMENTS[args.experiment]
    if args.link is None:
        args.link = {"jin": "10,0.05", "paine": "40,0.002"}.get(exp.name, "10,0.05")
    meta: dict[str, Any] = {"target": args.target, "jobs": args.jobs, "seeds": args.seeds}
    if exp.name == "jin":
        meta.update(link=args.link)
        meta["setup"] = (
            f"stand-in ResNet-50 ({RESNET50_PARAMS:,} parameters, 102 MB fp32 gradient) on V100s "
            f"in fp32 (`--profile resnet50-v100-fp32`: 367 images/s → {64 / 367 * 1e3:.0f} ms per "
            f"batch of 64), one GPU per node, {args.link.replace(',', ' Gbit/s, ')} ms between "
            f"nodes (the parameter server on a node of its own), step-time jitter {args.jitter}; "
            f"batch 64 per worker, lr 0.1, momentum 0.9, MNIST-1D {args.train_size} train / 1000 "
            f"test; steps per worker max({args.min_steps}, ⌈{args.samples:,} / (64 W)⌉); asgd: "
            "1 shard, n_sync 10, λ = 1/W; easgd: 1 shard, τ = 10, α = 0.9/W; gossip: pull, "
            "exponential peers, every step; evaluation ~50 times per run (free in virtual time); "
            "equal time, not equal steps: an asynchronous run that ended without reaching the "
            "target before sync's runs at the same W ended was run again with proportionally "
            "more steps (label suffix `-longer`), so that none is censored earlier than sync"
        )
    elif exp.name == "coquelin":
        meta.update(intra_link=args.intra_link, links=args.links)
        meta["setup"] = (
            f"stand-in ResNet-50 on A100s (`--profile resnet50-a100`: 2470 images/s → "
            f"{64 / 2470 * 1e3:.1f} ms per batch of 64), 4 GPUs per node, intra-node "
            f"{args.intra_link.replace(',', ' Gbit/s, ')} ms (NVLink-class), inter-node "
            f"{' and '.join(link.replace(',', ' Gbit/s, ') + ' ms' for link in args.links)}, "
            f"jitter {args.jitter}; batch 64 per GPU, lr 0.1, momentum 0.9; each worker's shard is "
            f"{args.steps_per_epoch} batches (train size = 64 × {args.steps_per_epoch} × W), "
            f"{args.epochs} epochs = {args.epochs * args.steps_per_epoch} steps per worker; daso: "
            "the defaults (B = 4, S = 1 when cycling starts, 4 warm-up and 4 cool-down epochs of "
            "blocking global averages, plateau rule); post-local SGD: cloudburst's `local_sgd` "
            f"with {4 * args.steps_per_epoch} synchronous warm-up steps (DASO's 4 epochs) then "
            f"a model average every H = {args.period} steps — the algorithm of PyTorch's "
            "PostLocalSGDState + PeriodicModelAverager, standing in for PyTorch's own (which "
            "needs torch.distributed); unlike PyTorch's post_localSGD_hook, which keeps "
            "all-reducing gradients inside each node's subgroup after the warm-up, it trains "
            "every replica alone between averages"
        )
    else:
        meta.update(link=args.link, cold_n_sync=args.cold_n_sync)
        meta["setup"] = (
            f"asgd (GPU A-SGD: n_fetch = n_push = n_sync), 1 server shard, λ = 1/W (Downpour's "
            f"λ = 1 diverges for this CNN, results/seed_findings.md); stand-in: Krizhevsky et "
            f"al.'s net ({ALEXNET_PARAMS / 1e6:.0f} M parameters) on a K20X, "
            f"{K20X_STEP_S:.2f} s per step (the seed: 10.7 days for ~90 epochs of ImageNet at "
            f"batch 128), every client and the server on its own node, "
            f"{args.link.replace(',', ' Gbit/s, ')} ms (Gemini-class), server apply 10 GB/s, "
            f"jitter {args.jitter}; CNN batch 64, lr 0.1, momentum 0.9, MNIST-1D "
            f"{args.train_size} train; {args.steps} steps per client in every run (the paper: "
            f"24 h per run, ~84,000 steps of {K20X_STEP_S:.2f} s); warm start: worker 0 alone "
            f"for {args.warm_steps} steps (`--warm-start-steps`), times counted from its end; "
            f"n_sync scaled to the run's length: the paper's 100–900 are 0.12–1.1 % of a "
            f"24-h run, i.e. 2–16 of {args.steps} steps; here n_sync {args.n_sync} "
            "(1: DistBelief's; "
            f"{max(args.n_sync)}: 4 % of the run, beyond the paper's range, to make staleness "
            f"visible); cold start at n_sync {args.cold_n_sync}"
        )
    points = exp.points(args)
    if not points:
        print("nothing to run", file=sys.stderr)
        return 2
    print(
        f"{exp.name}: {len(points)} runs, {sum(p.cost for p in points):,.0f} worker-steps",
        flush=True,
    )
    started = time.perf_counter()
    records = run_points(points, args.jobs, args.reuse)
    if exp.name == "jin":
        records = extend_censored(records, points, args)
    write_experiment(exp, records, meta, time.perf_counter() - started)
    print(rebuild_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
