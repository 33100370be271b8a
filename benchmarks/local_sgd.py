"""``local_sgd`` and ``diloco`` against ``sync`` and their peers, side by side (issue 4).

    .venv/bin/python benchmarks/local_sgd.py            # the result: results/local_sgd.{md,json}
    .venv/bin/python benchmarks/local_sgd.py --quick    # smoke test, output under runs/bench/
    .venv/bin/python benchmarks/local_sgd.py --reuse    # rebuild the report from the last runs

MNIST-1D, the MNIST-1D paper's CNN (``model=cnn``), 4 workers × batch 64, worker SGD lr 0.1,
momentum 0.9 (the setting of ``results/accuracy.md``), 64 epochs of each worker's shard = 960
steps per worker, seeds 0, 1, 2. Per seed (odd seeds in the reverse order; each cloudburst
variant next to its peers, so that a pair sees the same load of the shared machine):

- ``sync`` — DDP, the gradient (|θ| fp32 values) all-reduced every step;
- ``local_sgd`` H = 8 and ``diloco`` H = 8 — cloudburst's strategies: |θ| fp32 parameters
  all-reduced every H steps (plus one final average when H does not divide the step count);
  ``diloco`` with the outer settings found below (outer SGD lr 0.1, Nesterov momentum 0.9);
- ``torch_periodic_averager`` H = 8 — ``PeriodicModelAverager`` through cloudburst's loop
  (``benchmarks/peers_averaging.py``; the same averaging schedule as ``local_sgd``);
- ``torchft_localsgd`` / ``torchft_diloco`` H = 8 — torchft 0.2.0's ``LocalSGD`` and
  ``DiLoCo``: a lighthouse and 4 replica groups of one process each on 127.0.0.1, run by the
  peer virtual environment's python (``--peer-python``), training the same model on the same
  shards and batches (cloudburst's data and model code) with the same optimizer and seed;
- ``local_sgd`` and ``diloco`` with H = 16.

Seed 0 also runs the search for DiLoCo's outer optimizer (the paper's lr 0.7 + Nesterov 0.9
diverges with this inner optimizer: cloudburst's and torchft's alike) and ``local_sgd`` with
H = 7, which does not divide 960 and so exercises the final average of the byte formula.

Measured: bytes per sample (summary ``sent_bytes`` ÷ ``samples``) of each variant ÷ sync's,
against the prediction (number of parameter averages) ÷ (number of steps) — sync moves one
|θ|-sized all-reduce per step, local SGD one per average, and both are counted as a ring
all-reduce moves them, 2(W−1)/W · |θ| · 4 bytes sent per rank — target within 2 %; final test
accuracy, mean over the seeds, target within 1 point of sync's; time per step, the same way
for every variant: the median, over all workers' logged windows of ``log_every_steps`` = 16
steps (a multiple of H = 8 and 16, so every window holds whole periods, averages included),
of (Δ wall time ÷ Δ steps) — cloudburst's step records and the torchft script's alike —
target cloudburst not slower than the peer (ratio ≤ 1). Whole runs of the same work differ by
~±10 % on this shared machine, so the one step where ``local_sgd`` and the torch averager
differ — a parameter average — is also timed alone (:func:`average_call_bench`), with an
A/A control that shows the noise floor. Evaluation during training runs every
5 s (cloudburst, worker 0; the torchft script evaluates only at the end) and the median leaves
those windows out.

Peer environment (never the project's dependencies)::

    python3.11 -m venv /tmp/cloudburst-peers-venv
    /tmp/cloudburst-peers-venv/bin/pip install torch==2.13.0
    /tmp/cloudburst-peers-venv/bin/pip install torchft==0.2.0 mnist1d

Without it the torchft rows say why they are missing; the rest runs. About 13-15 minutes on
this 2-core machine when nothing else runs (jobs one after another; each uses both cores);
longer when other jobs share the cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402
from experiments import Bench, Run, fmt, pct  # noqa: E402

# Importing peers_averaging registers torch_periodic_averager.
from peers_averaging import TorchftFailed, median_step_s, run_torchft  # noqa: E402

from cloudburst.config import RunConfig  # noqa: E402
from cloudburst.metrics import read_run  # noqa: E402

REPO = benchutil.REPO
PEER_PYTHON = os.environ.get("CLOUDBURST_PEER_PYTHON", "/tmp/cloudburst-peers-venv/bin/python")
H = 8
H2 = 16
H_ODD = 7  # does not divide 960: the final average shows in the byte count
COMMON = dict(
    dataset="mnist1d",
    model="cnn",
    workers=4,
    batch_size=64,
    lr=0.1,
    momentum=0.9,
    eval_every_s=5.0,
    log_every_steps=16,  # a multiple of H and H2: every logged window holds whole periods
)
FULL = dict(epochs=64)  # 960 steps per worker, as results/accuracy.md
QUICK = dict(steps=48)  # a multiple of H and H2 (torchft ends on one model only after a sync)
# DiLoCo's outer optimizer: the paper's (lr 0.7, Nesterov 0.9) and what was tried instead.
DILOCO_PAPER = dict(diloco_outer_lr=0.7, diloco_outer_momentum=0.9)
DILOCO_CHOSEN = dict(diloco_outer_lr=0.1, diloco_outer_momentum=0.9)
DILOCO_TRIED = (
    DILOCO_PAPER,
    dict(diloco_outer_lr=0.3, diloco_outer_momentum=0.9),
    DILOCO_CHOSEN,
    dict(diloco_outer_lr=0.7, diloco_outer_momentum=0.0),
    dict(diloco_outer_lr=1.0, diloco_outer_momentum=0.5),
)
TARGET_BYTES_REL = 0.02
TARGET_ACC_POINTS = 1.0
TARGET_STEP_RATIO = 1.0


# ---------------------------------------------------------------------------- variants
def variant_values(strategy: str, period: int | None, outer: dict[str, Any] | None = None):
    values: dict[str, Any] = {"strategy": strategy}
    if period is not None:
        values["period"] = period
    if strategy == "diloco" or outer:
        values.update(outer or DILOCO_CHOSEN)
    return values


def outer_text(values: dict[str, Any]) -> str:
    lr, mom = values["diloco_outer_lr"], values["diloco_outer_momentum"]
    return f"outer lr {lr:g}, " + (f"Nesterov {mom:g}" if mom else "no momentum")


class Peer:
    """A torchft run: its summary (like cloudburst's ``summary.json``) or why it is missing."""

    def __init__(self, name: str, algorithm: str, cfg: RunConfig, summary, error, outer_s):
        self.name, self.algorithm, self.cfg = name, algorithm, cfg
        self.summary: dict[str, Any] | None = summary
        self.error: str | None = error
        self.outer_s = outer_s

    def get(self, key: str) -> Any:
        return None if self.summary is None else self.summary.get(key)

    @property
    def final_acc(self) -> float | None:
        return self.get("final_test_accuracy")

    def step_s(self) -> float | None:
        return None if self.summary is None else median_step_s(self.summary["step_times"])

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "algorithm": self.algorithm,
            "dir": os.path.relpath(self.cfg.out, REPO),
            "error": self.error,
            "outer_s": round(self.outer_s, 2),
            "summary": self.summary,
        }


class LocalSgdBench:
    def __init__(self, bench: Bench, peer_python: str):
        self.bench = bench
        self.peer_python = peer_python
        self.peers: list[Peer] = []
        self.peer_env = peer_environment(peer_python)

    def run(self, name: str, **values: Any) -> Run:
        return self.bench.run(name, **values)

    def torchft(self, name: str, algorithm: str, **values: Any) -> Peer:
        cfg = RunConfig(**values, out=str(self.bench.run_root / name), progress=False)
        print(f"== local_sgd/{name}: torchft {algorithm} W={cfg.workers}", flush=True)
        summary, error = None, None
        t0 = time.monotonic()
        if self.bench.reuse:
            path = Path(cfg.out) / "summary.json"
            stored = Path(cfg.out) / "config.json"
            if stored.is_file() and json.loads(stored.read_text()) != cfg.to_dict():
                raise SystemExit(f"--reuse: {cfg.out} was not made with these settings")
            if path.is_file():
                summary = json.loads(path.read_text())
            else:
                error = (
                    (Path(cfg.out) / "error.txt").read_text()
                    if (Path(cfg.out) / "error.txt").is_file()
                    else "no summary.json in the run directory"
                )
            outer_s = self.bench.saved.get("outer_s", {}).get(name, math.nan)
        else:
            if self.peer_env.get("error"):
                error = self.peer_env["error"]
            else:
                try:
                    summary = run_torchft(cfg, algorithm, cfg.out, self.peer_python)
                except (TorchftFailed, OSError, ValueError) as e:
                    error = str(e)
            if error:
                Path(cfg.out).mkdir(parents=True, exist_ok=True)
                (Path(cfg.out) / "error.txt").write_text(error + "\n")
            outer_s = time.monotonic() - t0
        peer = Peer(name, algorithm, cfg, summary, error, outer_s)
        self.peers.append(peer)
        print(
            f"   final acc {fmt(peer.final_acc, 4)}, step {fmt(ms(peer.step_s()), 2)} ms, "
            f"launch-to-summary {outer_s:.1f} s" + (f", FAILED: {error}" if error else ""),
            flush=True,
        )
        return peer


def peer_environment(python: str) -> dict[str, Any]:
    """torch and torchft versions of the peer interpreter, or why it cannot run torchft."""
    if not Path(python).exists():
        return {
            "error": f"peer python {python} not found (install the peer venv: see "
            "benchmarks/local_sgd.py's docstring, or pass --peer-python)"
        }
    probe = subprocess.run(
        [
            python,
            "-c",
            "import torch, importlib.metadata as m; "
            "print(torch.__version__, m.version('torchft'), m.version('mnist1d'))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        return {"error": f"{python} cannot import torch/torchft: {probe.stderr.strip()[-500:]}"}
    torch_v, torchft_v, mnist1d_v = probe.stdout.split()
    return {"python": python, "torch": torch_v, "torchft": torchft_v, "mnist1d": mnist1d_v}


# ---------------------------------------------------------------------------- per-run facts
def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def cloudburst_step_s(run: Run) -> float | None:
    """The same measure as :func:`peers_averaging.median_step_s`, from the step records."""
    times = {
        rank: [[r["step"], r["time_s"]] for r in records if r["event"] == "step"]
        for rank, records in read_run(run.dir).items()
    }
    return median_step_s(times)


def averages_done(run: Run) -> int | None:
    """Parameter averages worker 0 did (its final record)."""
    for records in read_run(run.dir).values():
        for r in records:
            if r["event"] == "final" and r.get("role") == "worker" and r.get("rank") == 0:
                return r.get("averages")
    return None


def predicted_averages(steps: int, period: int) -> int:
    """Averages after steps H, 2H, … plus one final average when H does not divide the steps."""
    return math.ceil(steps / period)


def bytes_per_sample(x: Run | Peer) -> float | None:
    b, s = x.get("sent_bytes"), x.get("samples")
    return b / s if b is not None and s else None


def mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


# ---------------------------------------------------------------------------- the average alone
AVERAGE_CALLS = 600  # per variant and rank, interleaved


def average_call_bench(workers: int, calls: int, out_dir: Path) -> dict[str, Any]:
    """The one thing ``local_sgd`` and ``torch_periodic_averager`` do differently, alone:
    one parameter average of the CNN over ``workers`` gloo ranks (fresh processes), by each
    strategy's own ``after_step`` with H = 1. Three slots — ``local_sgd``, the torch averager,
    and a second ``local_sgd`` as an A/A control (the noise floor) — called in turn behind a
    barrier, the order rotating every round. Returns the median seconds per call of each,
    pooled over the ranks, and the ratios."""
    import socket

    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_average_call_rank, args=(workers, port, calls, str(out_dir)), nprocs=workers)
    times: dict[str, list[float]] = {}
    for r in range(workers):
        for slot, values in json.loads((out_dir / f"rank{r}.json").read_text()).items():
            times.setdefault(slot, []).extend(values)
    med = {slot: statistics.median(v) for slot, v in times.items()}
    return {
        "calls_per_rank": calls,
        "workers": workers,
        "median_s": med,
        "ratio": med[AVG_SLOTS[0]] / med[AVG_SLOTS[1]],
        "control_ratio": med[AVG_SLOTS[0]] / med[AVG_SLOTS[2]],
    }


AVG_SLOTS = ("local_sgd", "torch_periodic_averager", "local_sgd (A/A control)")


def _average_call_rank(rank: int, workers: int, port: int, calls: int, out_dir: str) -> None:
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from cloudburst.models import build_model
    from cloudburst.runtime import Context
    from cloudburst.strategies import STRATEGY_CLASSES

    # torch warns that H = 1 is better done by DDP: true, and beside the point here.
    warnings.filterwarnings("ignore", message="When period is 1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, workers, is_master=rank == 0)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=workers, timeout=timedelta(seconds=120)
    )
    strategies = {}
    for slot in AVG_SLOTS:
        name = slot.split()[0]
        cfg = RunConfig(strategy=name, workers=workers, period=1, steps=1, progress=False)
        ctx = Context(
            cfg=cfg,
            rank=rank,
            world_size=workers,
            num_servers=0,
            num_workers=workers,
            workers_group=None,
            store=store,
            t0=0.0,
        )
        model = build_model("cnn", (40,), 10, seed=0)
        model(torch.zeros(2, 40)).sum().backward()  # torch averages parameters with a grad
        strategy = STRATEGY_CLASSES[name](ctx)
        strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        strategies[slot] = strategy
    times: dict[str, list[float]] = {slot: [] for slot in strategies}
    warmup = 20
    for i in range(calls + warmup):
        k = i % len(AVG_SLOTS)
        for slot in AVG_SLOTS[k:] + AVG_SLOTS[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            strategies[slot].after_step(64)
            if i >= warmup:
                times[slot].append(time.perf_counter() - t0)
    for slot, strategy in strategies.items():
        if strategy.report().get("averages") != calls + warmup:
            raise RuntimeError(f"{slot}: {strategy.report()}, expected {calls + warmup} averages")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def average_cpu_bench(calls: int, out_dir: Path) -> dict[str, Any]:
    """The same average with the communication taken out: one process, a gloo group of one
    rank (the all-reduce moves nothing, the division is by 1, so θ never changes), calling
    ``local_sgd``'s ``_synchronise`` and the torch averager's ``average_parameters`` in turn
    (order alternating). What is left is each mechanism's own CPU work: flatten, all-reduce
    call, divide, write back. Returns the median seconds per call of each and the ratio."""
    import socket

    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_average_cpu_rank, args=(port, calls, str(out_dir)), nprocs=1)
    times = json.loads((out_dir / "cpu.json").read_text())
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"calls": calls, "median_s": med, "ratio": med["local_sgd"] / med["torch"]}


def _average_cpu_rank(rank: int, port: int, calls: int, out_dir: str) -> None:
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from cloudburst.models import build_model
    from cloudburst.runtime import Context
    from cloudburst.strategies import STRATEGY_CLASSES

    warnings.filterwarnings("ignore", message="When period is 1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(60))
    calls_of = {}
    for name in ("local_sgd", "torch_periodic_averager"):
        cfg = RunConfig(strategy=name, workers=1, period=1, steps=1, progress=False)
        ctx = Context(
            cfg=cfg,
            rank=0,
            world_size=1,
            num_servers=0,
            num_workers=1,
            workers_group=None,
            store=store,
            t0=0.0,
        )
        model = build_model("cnn", (40,), 10, seed=0)
        model(torch.zeros(2, 40)).sum().backward()  # torch averages parameters with a grad
        strategy = STRATEGY_CLASSES[name](ctx)
        strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        if name == "local_sgd":
            calls_of["local_sgd"] = strategy._synchronise
        else:
            calls_of["torch"] = lambda s=strategy: s.averager.average_parameters(
                s.model.parameters()
            )
    times: dict[str, list[float]] = {name: [] for name in calls_of}
    names = list(calls_of)
    for i in range(calls + 100):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            calls_of[name]()
            if i >= 100:
                times[name].append(time.perf_counter() - t0)
    Path(out_dir, "cpu.json").write_text(json.dumps(times))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the experiment
def experiment(lb: LocalSgdBench) -> None:
    bench = lb.bench
    quick = bench.quick
    length = QUICK if quick else FULL
    seeds = (0,) if quick else (0, 1, 2)
    base = dict(COMMON, **length)
    steps = RunConfig(**base, progress=False).steps_per_worker(4000)

    # (name, kind, strategy or torchft algorithm, H). Each cloudburst variant runs right next
    # to its peers, so that a pair sees the same load of the shared machine; odd seeds run the
    # list backwards (A B … B A across seeds).
    main_variants: list[tuple[str, str, str, int | None]] = [
        ("sync", "cb", "sync", None),
        (f"torch_periodic_averager-H{H}", "cb", "torch_periodic_averager", H),
        (f"local_sgd-H{H}", "cb", "local_sgd", H),
        (f"torchft_localsgd-H{H}", "tft", "localsgd", H),
        (f"diloco-H{H}", "cb", "diloco", H),
        (f"torchft_diloco-H{H}", "tft", "diloco", H),
        (f"local_sgd-H{H2}", "cb", "local_sgd", H2),
        (f"diloco-H{H2}", "cb", "diloco", H2),
    ]
    results: dict[str, dict[int, Run | Peer]] = {name: {} for name, *_ in main_variants}
    for i, seed in enumerate(seeds):
        order = main_variants if i % 2 == 0 else main_variants[::-1]
        for name, kind, what, period in order:
            values = dict(base, seed=seed)
            if kind == "cb":
                results[name][seed] = lb.run(
                    f"{name}-seed{seed}", **values, **variant_values(what, period)
                )
            else:
                outer = DILOCO_CHOSEN if what == "diloco" else {}
                results[name][seed] = lb.torchft(
                    f"{name}-seed{seed}", what, **values, period=period, **outer
                )

    # Seed 0: DiLoCo's outer optimizer (cloudburst, and torchft with the paper's), and H = 7.
    tuning: list[tuple[dict[str, Any], Run]] = []
    for outer in [] if quick else DILOCO_TRIED:
        tag = f"lr{outer['diloco_outer_lr']:g}-m{outer['diloco_outer_momentum']:g}"
        run = lb.run(
            f"diloco-H{H}-{tag}-seed0",
            **dict(base, seed=0),
            **variant_values("diloco", H, outer),
        )
        tuning.append((outer, run))
    paper_peer = (
        None
        if quick
        else lb.torchft(
            f"torchft_diloco-H{H}-paper-seed0",
            "diloco",
            **dict(base, seed=0, period=H),
            **DILOCO_PAPER,
        )
    )
    odd = (
        None
        if quick
        else lb.run(
            f"local_sgd-H{H_ODD}-seed0",
            **dict(base, seed=0),
            **variant_values("local_sgd", H_ODD),
        )
    )
    if bench.reuse:
        average_call = json.loads((bench.run_root / "average_call" / "result.json").read_text())
    else:
        print("== local_sgd/average_call: one average, local_sgd vs torch's averager", flush=True)
        calls = 100 if quick else AVERAGE_CALLS
        average_call = average_call_bench(4, calls, bench.run_root / "average_call")
        average_call["cpu"] = average_cpu_bench(5 * calls, bench.run_root / "average_call")
        (bench.run_root / "average_call" / "result.json").write_text(json.dumps(average_call))
        print(f"   ratio {average_call['ratio']:.3f}", flush=True)
    report(lb, results, seeds, steps, tuning, paper_peer, odd, average_call)


def report(
    lb: LocalSgdBench,
    results: dict[str, dict[int, Run | Peer]],
    seeds: tuple[int, ...],
    steps: int,
    tuning: list[tuple[dict[str, Any], Run]],
    paper_peer: Peer | None,
    odd: Run | None,
    average_call: dict[str, Any],
) -> None:
    bench = lb.bench
    sync = results["sync"]
    derived: dict[str, Any] = {"steps_per_worker": steps, "seeds": list(seeds)}

    # ---- bytes per sample relative to sync, measured ÷ predicted
    byte_rows = []
    byte_checks: dict[str, Any] = {}
    byte_cases: list[tuple[str, int, dict[int, Run | Peer]]] = [
        (name, period, results[name])
        for name, period in (
            (f"local_sgd-H{H}", H),
            (f"diloco-H{H}", H),
            (f"local_sgd-H{H2}", H2),
            (f"diloco-H{H2}", H2),
            (f"torch_periodic_averager-H{H}", H),
        )
    ]
    if odd is not None:
        byte_cases.append((f"local_sgd-H{H_ODD}", H_ODD, {0: odd}))
    for name, period, by_seed in byte_cases:
        predicted_n = predicted_averages(steps, period)
        predicted = predicted_n / steps
        for seed, run in sorted(by_seed.items()):
            ref = bytes_per_sample(sync[seed]) if seed in sync else None
            own = bytes_per_sample(run)
            measured = own / ref if own is not None and ref else None
            rel = measured / predicted if measured is not None else None
            done = averages_done(run) if isinstance(run, Run) else None
            ok = rel is not None and abs(rel - 1) <= TARGET_BYTES_REL
            byte_checks.setdefault(name, []).append(
                {"seed": seed, "measured": measured, "predicted": predicted, "ratio": rel}
            )
            byte_rows.append(
                [
                    f"`{name}`",
                    seed,
                    fmt(ref, 2),
                    fmt(own, 3),
                    fmt(measured, 5),
                    f"{predicted_n}/{steps} = {predicted:.5f}",
                    "-" if done is None else done,
                    fmt(rel, 4),
                    "PASS" if ok else "MISS",
                ]
            )
    derived["bytes"] = byte_checks

    # ---- accuracy
    acc_order = [
        "sync",
        f"local_sgd-H{H}",
        f"diloco-H{H}",
        f"torch_periodic_averager-H{H}",
        f"torchft_localsgd-H{H}",
        f"torchft_diloco-H{H}",
        f"local_sgd-H{H2}",
        f"diloco-H{H2}",
    ]
    sync_mean = mean([r.final_acc for r in sync.values()])
    acc_rows = []
    derived["accuracy"] = {}
    for name in acc_order:
        accs = {seed: results[name][seed].final_acc for seed in seeds if seed in results[name]}
        m = mean(list(accs.values()))
        diff = None if m is None or sync_mean is None else 100 * (m - sync_mean)
        derived["accuracy"][name] = {"per_seed": accs, "mean": m, "minus_sync_points": diff}
        verdict = (
            "-"
            if name == "sync" or diff is None
            else ("PASS" if diff >= -TARGET_ACC_POINTS else "MISS")
            + (" (> 1 point above)" if diff > TARGET_ACC_POINTS else "")
        )
        acc_rows.append(
            [
                f"`{name}`",
                " / ".join(pct(accs.get(s)) for s in seeds),
                pct(m),
                "-" if diff is None or name == "sync" else f"{diff:+.1f}",
                verdict,
            ]
        )

    # ---- step time: cloudburst ÷ peer, per seed
    def step_s(x: Run | Peer) -> float | None:
        return x.step_s() if isinstance(x, Peer) else cloudburst_step_s(x)

    pairs = [
        (f"local_sgd-H{H}", f"torch_periodic_averager-H{H}"),
        (f"local_sgd-H{H}", f"torchft_localsgd-H{H}"),
        (f"diloco-H{H}", f"torchft_diloco-H{H}"),
        ("sync", f"local_sgd-H{H}"),  # context: what averaging every H steps saves
    ]
    time_rows = []
    derived["step_time"] = {}
    for ours, peer in pairs:
        ratios = []
        for seed in seeds:
            a, b = results[ours].get(seed), results[peer].get(seed)
            sa = step_s(a) if a is not None else None
            sb = step_s(b) if b is not None else None
            ratios.append(sa / sb if sa and sb else None)
        valid = [r for r in ratios if r is not None]
        med = statistics.median(valid) if valid else None
        context = ours == "sync"
        derived["step_time"][f"{ours} / {peer}"] = {"ratios": ratios, "median": med}
        time_rows.append(
            [
                f"`{ours}` ÷ `{peer}`",
                ", ".join(fmt(r, 3) for r in ratios),
                fmt(med, 3),
                "(context)"
                if context
                else (
                    "MISS (no ratio)"
                    if med is None
                    else benchutil.verdict(med, TARGET_STEP_RATIO, False)
                ),
            ]
        )

    med = average_call["median_s"]
    derived["average_call"] = average_call
    time_rows.append(
        [
            "one average alone: `local_sgd` ÷ `torch_periodic_averager`",
            f"{1e6 * med[AVG_SLOTS[0]]:.0f} µs ÷ {1e6 * med[AVG_SLOTS[1]]:.0f} µs "
            f"({average_call['calls_per_rank']} rounds × 4 ranks)",
            fmt(average_call["ratio"], 4),
            benchutil.verdict(average_call["ratio"], TARGET_STEP_RATIO, False),
        ]
    )
    time_rows.append(
        [
            "one average alone, A/A control: `local_sgd` ÷ a second `local_sgd`",
            f"{1e6 * med[AVG_SLOTS[0]]:.0f} µs ÷ {1e6 * med[AVG_SLOTS[2]]:.0f} µs",
            fmt(average_call["control_ratio"], 4),
            "(noise floor)",
        ]
    )
    cpu = average_call["cpu"]
    time_rows.append(
        [
            "one average, communication taken out (1 rank): `local_sgd` ÷ torch's averager",
            f"{1e6 * cpu['median_s']['local_sgd']:.0f} µs ÷ "
            f"{1e6 * cpu['median_s']['torch']:.0f} µs ({cpu['calls']} calls each)",
            fmt(cpu["ratio"], 3),
            benchutil.verdict(cpu["ratio"], TARGET_STEP_RATIO, False),
        ]
    )

    # ---- every run
    run_rows = []
    for name in acc_order:
        for seed in seeds:
            x = results[name].get(seed)
            if x is None:
                continue
            st = step_s(x)
            wall = x.get("wall_time_s")
            kind = "torchft (peer venv)" if isinstance(x, Peer) else "cloudburst loop"
            averages = x.get("syncs") if isinstance(x, Peer) else averages_done(x)
            run_rows.append(
                [
                    f"`{name}`",
                    seed,
                    kind,
                    pct(x.final_acc),
                    fmt(bytes_per_sample(x), 2),
                    "-" if averages is None else averages,
                    fmt(ms(st), 2),
                    fmt(wall),
                    fmt(ms(wall / steps) if wall else None, 2),
                    fmt(x.outer_s),
                    (x.error or "")[:300],
                ]
            )

    # ---- DiLoCo's outer optimizer (seed 0)
    tuning_rows = []
    sync0 = sync.get(0)
    for outer, run in tuning:
        lr, mom = outer["diloco_outer_lr"], outer["diloco_outer_momentum"]
        tuning_rows.append(
            [
                "cloudburst `diloco`",
                f"{lr:g}",
                f"{mom:g}" + (" (Nesterov)" if mom else ""),
                f"{lr / (1 - mom):.2g}",
                pct(run.final_acc),
                "-"
                if run.final_acc is None or sync0 is None or sync0.final_acc is None
                else f"{100 * (run.final_acc - sync0.final_acc):+.1f}",
                "chosen" if outer == DILOCO_CHOSEN else "",
            ]
        )
    if paper_peer is not None:
        paper_lr, paper_mom = DILOCO_PAPER["diloco_outer_lr"], DILOCO_PAPER["diloco_outer_momentum"]
        tuning_rows.append(
            [
                "torchft `DiLoCo`",
                f"{DILOCO_PAPER['diloco_outer_lr']:g}",
                f"{DILOCO_PAPER['diloco_outer_momentum']:g} (Nesterov)",
                f"{paper_lr / (1 - paper_mom):.2g}",
                pct(paper_peer.final_acc),
                "-"
                if paper_peer.final_acc is None or sync0 is None
                else f"{100 * (paper_peer.final_acc - sync0.final_acc):+.1f}",
                paper_peer.error or "",
            ]
        )
    derived["diloco_outer_search"] = [
        {**outer, "final_test_accuracy": run.final_acc} for outer, run in tuning
    ]
    if paper_peer is not None:
        derived["torchft_diloco_paper_outer"] = paper_peer.final_acc

    # ---- write
    env = lb.peer_env
    lines = bench.header(
        "`local_sgd` and `diloco`: bytes, accuracy and step time vs sync and peers"
    )
    lines += [
        (
            f"- peer venv: `{env['python']}`: torch {env['torch']}, torchft {env['torchft']}, "
            f"mnist1d {env['mnist1d']}"
        )
        if not env.get("error")
        else f"- peer venv: **not usable**: {env['error']}",
        "",
        "MNIST-1D, CNN, 4 workers × batch 64, worker SGD lr 0.1 momentum 0.9, "
        f"{steps} steps per worker, seeds {', '.join(map(str, seeds))}; H = {H} (and {H2}). "
        "The variants of one seed run one after another, each cloudburst variant next to its "
        "peers (odd seeds in the reverse order), so that a pair sees the same machine load. "
        "No device emulation: 4 CPU-bound workers share the 2 cores, and so do torchft's 4 "
        "replica processes and its lighthouse.",
        "",
        "## Verdict",
        "",
        "### 1. Bytes per sample relative to `sync`, measured ÷ predicted (target within 2 %)",
        "",
        "Measured = (`sent_bytes` / `samples`) of the variant ÷ that of `sync` of the same seed "
        "(summary.json; cloudburst counts every all-reduce as a ring moves it, "
        "2(W−1)/W · numel · 4 bytes sent per rank). Predicted = (parameter averages) ÷ "
        "(steps per worker), with averages = ⌈T/H⌉: after steps H, 2H, … and one final "
        "average when H does not divide T. Sync all-reduces the |θ| gradient values every "
        "step; an average all-reduces the |θ| parameter values, so the |θ|, W and ring factors "
        "cancel and the ratio is 1/H when H divides T. `averages done` is worker 0's count.",
        "",
        *benchutil.table(
            [
                "variant",
                "seed",
                "sync B/sample",
                "variant B/sample",
                "measured ratio",
                "predicted ratio",
                "averages done",
                "measured ÷ predicted",
                "verdict",
            ],
            byte_rows,
        ),
        "",
        "### 2. Final test accuracy (target: within 1 point of `sync`, mean over seeds)",
        "",
        "Final = the model every replica ends on, on the 1000 test samples. The verdict asks "
        "for the mean to be no more than 1 point below sync's; a variant more than 1 point "
        "*above* sync is marked so.",
        "",
        *benchutil.table(
            ["variant", "per seed (%)", "mean (%)", "mean − sync (points)", "verdict"], acc_rows
        ),
        "",
        "### 3. Time per step, cloudburst ÷ peer (target ≤ 1: not slower)",
        "",
        "Time per step = median over all workers' logged 16-step windows of Δ wall time ÷ "
        "Δ steps (step records every `log_every_steps` = 16 steps: cloudburst's metrics, and "
        "the same records in the torchft script; 16 is a multiple of H, so every window holds "
        "whole periods, their averages included). One ratio per seed, both runs of a pair in "
        "the same invocation. The machine is shared and noisy: whole runs of the same work "
        "differ by ~±10 % here. `local_sgd` and `torch_periodic_averager` run the same loop and "
        "differ only in how one average is done, so the last row times that alone: one "
        "parameter average of the CNN over 4 gloo ranks, by each strategy's own `after_step` "
        "with H = 1, in rounds of one call each behind a barrier (order rotating), median over "
        "all calls of all ranks, with a second `local_sgd` in the same rounds as an A/A "
        "control: its ratio is what this machine cannot resolve "
        f"(`{os.path.relpath(bench.run_root / 'average_call', REPO)}/`). The last row takes "
        "the communication out (one process, a gloo group of one rank, so the all-reduce "
        "moves nothing and θ stays the same): `LocalSgdStrategy._synchronise` against the "
        "torch averager's `average_parameters`, each mechanism's own CPU work per average.",
        "",
        *benchutil.table(["pair", "ratio per seed", "median", "verdict"], time_rows),
        "",
        "Where the last row's difference comes from: per parameter tensor, cloudburst's "
        "`flatten_params` does `detach().reshape(-1).to(float32)` before one `torch.cat(out=)` "
        "and `assign_flat` slices the flat vector and `copy_`s into the parameter, where "
        "torch's `average_parameters` does `p.data.reshape(-1)` + `torch.cat` and re-points "
        "`p.data` at views of the new flat vector (no copy back). In a run that cost is paid "
        "once per H steps.",
        "",
        "## DiLoCo's outer optimizer (seed 0, H = 8)",
        "",
        "The paper's outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9) was tuned for an "
        "AdamW inner optimizer with a small lr over H = 500 steps. Here the inner optimizer "
        "is SGD lr 0.1 with momentum 0.9 and H = 8; the outer momentum sums pseudo-gradients "
        "into an effective outer step of about lr/(1−μ) = 7× the replicas' average move, and "
        "training diverges — in cloudburst and in torchft alike. Tried, with "
        "`effective` = lr/(1−μ):",
        "",
        *benchutil.table(
            [
                "implementation",
                "outer lr",
                "outer momentum",
                "effective",
                "final acc (%)",
                "− sync seed 0 (points)",
                "note",
            ],
            tuning_rows,
        ),
        "",
        "Chosen for the tables above: outer lr 0.1 with Nesterov momentum 0.9 (effective "
        "step 1: on average the plain replica average, with the paper's momentum smoothing "
        "it). `local_sgd` needed nothing: it is above sync without a post-local-SGD warm-up, "
        "so `local_sgd_warmup_steps` stays 0. (`diloco` has no warm-up: its schedule ignores "
        "`local_sgd_warmup_steps`.)",
        "",
        "## Every run",
        "",
        "`averages`: parameter averages done (cloudburst: worker 0's count; torchft: the "
        "manager's committed steps). `wall / step`: wall time ÷ steps (cloudburst: "
        "`wall_time_s`, evaluations and the final average included; torchft: the training "
        "loop of the slowest replica, no evaluation), context only. `launch → summary`: this "
        "script's clock around the whole job, start-up included (torchft: 5 processes each "
        "importing torch and torchft).",
        "",
        *benchutil.table(
            [
                "variant",
                "seed",
                "runs in",
                "final acc (%)",
                "B/sample",
                "averages",
                "step (ms, median)",
                "wall (s)",
                "wall / step (ms)",
                "launch → summary (s)",
                "error",
            ],
            run_rows,
        ),
        "",
        *bench.settings_lines(),
        "torchft runs use the same `RunConfig` values as the cloudburst run of the same name "
        "(their `config.json` is in the run directory); `diloco` rows use outer lr 0.1, "
        "Nesterov 0.9 unless named otherwise.",
        "",
        "## How the peers run",
        "",
        "- `torch_periodic_averager`: `PeriodicModelAverager(period=H, warmup_steps=H−1, "
        "process_group=<workers>)`, `average_parameters(model.parameters())` after every "
        "optimizer step, inside cloudburst's loop (`benchmarks/peers_averaging.py`). Its "
        "call c averages when c ≥ warmup_steps and (c − warmup_steps) mod H = 0, so "
        "warmup_steps = H−1 puts the averages after steps H, 2H, …, cloudburst's schedule.",
        "- torchft: `torchft._torchft.LighthouseServer(bind='127.0.0.1:0', min_replicas=4)` in "
        "its own process; per replica group one process with its own `TCPStore`, "
        "`Manager(pg=ProcessGroupGloo, min_replica_size=4, use_async_quorum=False, rank=0, "
        "world_size=1, replica_id='rg<i>', init_sync=False)` and `LocalSGD(manager, model, "
        "inner_opt, sync_every=H)` or `DiLoCo(manager, [model], inner_opt, outer_opt, "
        "sync_every=H, pin_memory=False)` around a plain loop over cloudburst's batch stream "
        "of worker i's shard. torchft's bytes are not counted by a counter: they are the "
        "committed syncs × the same ring formula.",
    ]
    bench.write(lines, derived)
    # The torchft runs are not Bench runs: keep their records next to the cloudburst ones.
    json_path = bench.results / f"{bench.md_stem}.json"
    data = json.loads(json_path.read_text())
    data["peer_environment"] = env
    data["torchft_runs"] = [p.record() for p in lb.peers]
    json_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    if not bench.reuse:
        inv = bench.run_root / "invocation.json"
        saved = json.loads(inv.read_text())
        saved["outer_s"].update({p.name: p.outer_s for p in lb.peers})
        inv.write_text(json.dumps(saved, indent=1) + "\n")


def average_only() -> None:
    """Re-time the one step where ``local_sgd`` and PyTorch's averager differ (after a change
    to the flatten/assign code), without re-running the training comparison."""
    root = REPO / "runs" / "bench" / "local_sgd_average"
    call = average_call_bench(4, 600, root / "average_call")
    cpu = average_cpu_bench(3000, root / "average_cpu")
    us = {k: 1e6 * v for k, v in call["median_s"].items()}
    cpu_us = {k: 1e6 * v for k, v in cpu["median_s"].items()}
    lines = [
        "# One parameter average: local_sgd ÷ PyTorch's PeriodicModelAverager",
        "",
        *benchutil.provenance_lines(),
        "",
        "The two rows of `local_sgd.md` §3 that time one average alone (see that file for the "
        "method), re-measured after `flatten_params` (plain views under `no_grad`) and "
        "`assign_flat` (`split` + `copy_`) were made about 2× faster. Target ≤ 1.",
        "",
        *benchutil.table(
            ["pair", "median per call", "ratio", "verdict"],
            [
                [
                    "one average, 4 gloo ranks: `local_sgd` ÷ `torch_periodic_averager`",
                    f"{us[AVG_SLOTS[0]]:.0f} µs ÷ {us[AVG_SLOTS[1]]:.0f} µs",
                    f"{call['ratio']:.4f}",
                    benchutil.verdict(call["ratio"], 1.0, higher_is_better=False),
                ],
                [
                    "A/A control: `local_sgd` ÷ a second `local_sgd`",
                    f"{us[AVG_SLOTS[0]]:.0f} µs ÷ {us[AVG_SLOTS[2]]:.0f} µs",
                    f"{call['control_ratio']:.4f}",
                    "(noise floor)",
                ],
                [
                    "communication taken out (1 rank): `local_sgd` ÷ torch's averager",
                    f"{cpu_us['local_sgd']:.0f} µs ÷ {cpu_us['torch']:.0f} µs",
                    f"{cpu['ratio']:.3f}",
                    benchutil.verdict(cpu["ratio"], 1.0, higher_is_better=False),
                ],
            ],
        ),
    ]
    dest = REPO / "benchmarks" / "results"
    benchutil.write_markdown(dest / "local_sgd_average.md", lines)
    (dest / "local_sgd_average.json").write_text(json.dumps({"call": call, "cpu": cpu}, indent=1))
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: 48 steps, one seed")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="run no job: rebuild the report from the last invocation's run directories",
    )
    p.add_argument(
        "--peer-python",
        default=PEER_PYTHON,
        help="python of the peer venv with torch 2.13.0 + torchft 0.2.0 + mnist1d "
        f"(default: $CLOUDBURST_PEER_PYTHON or {PEER_PYTHON})",
    )
    p.add_argument(
        "--average-only",
        action="store_true",
        help="time one parameter average alone (4 ranks, and with the communication taken "
        "out), local_sgd against PyTorch's averager: results/local_sgd_average.md",
    )
    args = p.parse_args()
    os.chdir(REPO)
    if args.average_only:
        average_only()
        return
    bench = Bench("local_sgd", args.quick, args.reuse)
    experiment(LocalSgdBench(bench, args.peer_python))


if __name__ == "__main__":
    main()
