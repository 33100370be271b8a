"""Streaming DiLoCo and compressed communication on two emulated nodes: bytes across the slow
link, time to target, final accuracy, and time per step against torchft (issue 17).

    .venv/bin/python benchmarks/compress.py            # results/compress.{md,json,png}
    .venv/bin/python benchmarks/compress.py --quick    # smoke test, under runs/bench/ only
    .venv/bin/python benchmarks/compress.py --reuse    # rebuild the report from the JSON

Three parts, one invocation, one job at a time:

``link`` — ``cloudburst train``, 4 workers on 2 emulated nodes (``--nodes 2``) joined by an
emulated link (``--inter-node-link G,1``: G Gbit/s, 1 ms), every step padded to
``--min-step-time-s`` (an emulated device: 4 CPU-bound workers share 2 cores here). Two models:
the wide CNN of ``bench_models.py`` (528 k parameters, bytes matter) and the MNIST-1D paper's
CNN (5 k parameters, latency matters). Variants: sync (DDP), sync + bf16 / PowerSGD rank 1
(PyTorch's hooks), DiLoCo (H = 8), Streaming DiLoCo F = 2 and 4 with and without int8, and one
Streaming DiLoCo with H = 32 (the byte target needs H ≳ 25 at W = 4, see the report). Per seed
the variants run in a rotated order; an A/A control repeats one run, spread over the sequence.
Bytes per sample = summary ``inter_node_bytes`` ÷ ``samples``; time to target = summary
``time_to_target_s`` (worker 0 evaluates every ``eval_every_s``); a run that never reaches the
target is counted as censored (+∞ in the median), never dropped.

``torchft`` — time per step, cloudburst's ``diloco`` (and Streaming DiLoCo F = 2) against
torchft 0.2.0's ``DiLoCo`` (with two model fragments for the streaming one), with an A/A
control (cloudburst's ``diloco`` twice). torchft has no link emulator, so both run with no
emulated link, on the same real constraint: gloo over loopback on this machine, the same
padding, no evaluation during training. Time per step = the median over every worker's
16-step windows (a multiple of H, so windows hold whole periods) of Δ wall ÷ Δ steps, the
first 32 steps left out. torchft runs in the peer venv (``--peer-python``); each replica group
is one process running :func:`torchft_replica` (cloudburst's data and model code, a plain loop).

``sim`` — ``cloudburst simulate`` at several link speeds (few steps: virtual step times are
deterministic), the per-step time of each method; multiplied by the steps each method needed
to reach the target in the ``link`` part (link-independent: the emulation only adds sleep)
this answers "what link speed makes compression worth it for this model?".
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
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import benchutil  # noqa: E402

PEER_PYTHON = os.environ.get("CLOUDBURST_PEER_PYTHON", "/work/peers-venv/bin/python")
WIDE = "benchmarks.bench_models:mnist1d_wide_cnn"
MODELS = {"wide": WIDE, "cnn": "cnn"}
MODEL_TEXT = {"wide": "wide CNN (528 k parameters)", "cnn": "MNIST-1D CNN (5.2 k parameters)"}
NOTES_MARK = "<!-- notes: kept by --reuse and re-runs; written after the run -->"
INF = math.inf

# name -> cloudburst train flags beyond the common ones
VARIANTS: dict[str, list[str]] = {
    "sync": ["--strategy", "sync"],
    "sync_bf16": ["--strategy", "sync", "--compress", "bf16"],
    "sync_powersgd1": ["--strategy", "sync", "--compress", "powersgd:1"],
    "diloco": ["--strategy", "diloco"],
    "sdiloco_f2": ["--strategy", "diloco", "--fragments", "2", "--fragment-delay", "2"],
    "sdiloco_f4": ["--strategy", "diloco", "--fragments", "4", "--fragment-delay", "1"],
    "sdiloco_f2_int8": ["--strategy", "diloco", "--fragments", "2", "--fragment-delay", "2"],
    "sdiloco_f4_int8": ["--strategy", "diloco", "--fragments", "4", "--fragment-delay", "1"],
    "sdiloco_f4_int8_h32": [
        *("--strategy", "diloco", "--period", "32", "--fragments", "4"),
        *("--fragment-delay", "4"),
    ],
}
for _name, _flags in VARIANTS.items():
    if _name.startswith("sdiloco"):
        _flags += ["--fragment-alpha", "0.5"]  # the paper's best mixing with τ > 0
    if "int8" in _name:
        _flags += ["--compress", "int8"]
COMPRESSED = ("sync_bf16", "sync_powersgd1", "sdiloco_f2_int8", "sdiloco_f4_int8")


def settings(quick: bool) -> dict[str, Any]:
    """What runs. Budget: the whole invocation ≤ ~40 min on this 2-core machine, so the
    0.1 Gbit/s cells run one seed (bytes, accuracy and steps to target do not depend on the
    link: the emulation only adds sleep; seed 0 at both speeds checks that) and the small CNN
    runs the variants that bracket the question."""
    wide = [v for v in VARIANTS if v != "sdiloco_f2"]
    wide_slow = [
        "sync",
        "sync_bf16",
        "sync_powersgd1",
        "diloco",
        "sdiloco_f4_int8",
        "sdiloco_f4_int8_h32",
    ]
    cnn = ["sync", "sync_bf16", "diloco", "sdiloco_f4_int8"]
    seeds = [0] if quick else [0, 1, 2]
    return {
        "workers": 4,
        "nodes": 2,
        "batch_size": 64,
        "min_step_time_s": 0.03,
        "latency_ms": 1,
        "eval_every_s": 0.5,
        "target_accuracy": 0.8,
        "steps": {"wide": 48 if quick else 400, "cnn": 48 if quick else 400},
        # [model, link Gbit/s, variants, seeds]
        "cells": [
            ["wide", 1.0, ["sync", "sdiloco_f4_int8"] if quick else wide, seeds],
            ["wide", 0.1, ["sync"] if quick else wide_slow, [0]],
            ["cnn", 1.0, ["sync"] if quick else cnn, seeds],
            ["cnn", 0.1, [] if quick else ["sync", "sdiloco_f4_int8"], [0]],
        ],
        "aa": ["wide", 1.0, "sync", 0],
        "aa_repeats": 1,
        "torchft_steps": 48 if quick else 160,
        "torchft_seeds": seeds,
        "torchft_model": "wide",
        "sim_links": [0.1, 1.0] if quick else [0.01, 0.1, 1.0, 10.0],
        "sim_steps": 16,
        "sim_variants": ["sync", "sdiloco_f4_int8"]
        if quick
        else ["sync", "sync_bf16", "diloco", "sdiloco_f4_int8"],
    }


# ---------------------------------------------------------------------------- cloudburst runs
def train_flags(s: dict, model: str, link: float | None, variant: str, seed: int) -> list[str]:
    args = [*VARIANTS[variant], "--workers", str(s["workers"]), "--seed", str(seed)]
    args += ["--model", MODELS[model], "--batch-size", str(s["batch_size"])]
    args += ["--min-step-time-s", str(s["min_step_time_s"]), "--checkpoint-every", "0"]
    args += ["--log-every-steps", "16", "--no-progress"]
    if link is not None:
        args += ["--nodes", str(s["nodes"]), "--inter-node-link", f"{link:g},{s['latency_ms']:g}"]
    return args


def run_cloudburst(cmd: str, args: list[str], out: Path, timeout_s: float = 900) -> dict:
    """One ``cloudburst train|simulate``; the summary's numbers or the error."""
    full = [sys.executable, "-m", "cloudburst", cmd, *args, "--out", str(out), "--overwrite"]
    env = dict(os.environ, PYTHONPATH=str(REPO))  # the wide CNN lives in benchmarks/
    record: dict[str, Any] = {"out": str(out), "loadavg_1m_before": os.getloadavg()[0]}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            full, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        error = proc.stderr[-800:] if proc.returncode else None
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout_s:.0f} s"
    record["command_s"] = round(time.monotonic() - t0, 2)
    path = out / "summary.json"
    if error is None and not path.exists():
        error = "no summary.json"
    if error is not None:
        record["error"] = error
        return record
    summ = json.loads(path.read_text())
    for key in (
        "inter_node_bytes",
        "samples",
        "wall_time_s",
        "time_to_target_s",
        "final_test_accuracy",
        "steps_per_worker",
        "comm_wait_s",
    ):
        record[key] = summ.get(key)
    record["sent_bytes"] = summ.get("sent_bytes", summ.get("sent_bytes"))
    if cmd == "train":
        record.update(curve_and_steps(out, summ))
    return record


def curve_and_steps(out: Path, summ: dict) -> dict:
    """Worker 0's evaluations (time, samples, accuracy), the steps to the target (first eval at
    or above it; link-independent) and the median time per step (16-step windows, after 32)."""
    from cloudburst.metrics import read_run

    curve, windows = [], []
    target = summ.get("target_accuracy")
    for records in read_run(out).values():
        steps = [(r["step"], r["time_s"]) for r in records if r.get("event") == "step"]
        windows += [
            (b[1] - a[1]) / (b[0] - a[0])
            for a, b in zip(steps, steps[1:], strict=False)
            if b[0] > a[0] and a[0] >= 32
        ]
        curve += [
            [r["time_s"], r["samples"], r["test_accuracy"]]
            for r in records
            if r.get("event") == "eval"
        ]
    curve.sort()
    per_step = summ["config"]["workers"] * summ["config"]["batch_size"]
    reached = [c for c in curve if target is not None and c[2] >= target]
    return {
        "curve": curve,
        "steps_to_target": round(reached[0][1] / per_step) if reached else None,
        "step_s": statistics.median(windows) if windows else None,
    }


# ---------------------------------------------------------------------------- torchft
def torchft_fragments(model, fragments: int) -> list:
    """cloudburst's split (whole tensors, module order, balanced by element count) as the
    ``nn.Module`` fragments torchft's ``DiLoCo`` takes: each holds the model's own tensors."""
    from torch import nn

    from cloudburst.strategies.local_sgd import split_fragments

    if fragments == 1:
        return [model]
    named = list(model.named_parameters())
    groups = split_fragments([p for _, p in named], fragments)
    out, i = [], 0
    for group in groups:
        holder = nn.Module()
        for p in group:
            holder.register_parameter(named[i][0].replace(".", "_"), p)
            i += 1
        out.append(holder)
    return out


def torchft_replica(replica: int, lighthouse: str, spec: dict, out: Path) -> None:
    """One replica group (one process): torchft's DiLoCo around a plain loop over cloudburst's
    batch stream of worker ``replica``'s shard, each step padded as cloudburst pads it."""
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from cloudburst.config import RunConfig
    from cloudburst.data import batch_stream, load_dataset, worker_source
    from cloudburst.models import build_model
    from cloudburst.train import make_optimizer

    torch.set_num_threads(1)
    cfg = RunConfig.from_dict(spec["config"])
    data = load_dataset(cfg.dataset, cfg.train_size, cfg.test_size, cfg.image_size)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    inner = make_optimizer(cfg, model.parameters())
    stream = batch_stream(
        worker_source(data, replica, cfg.workers),
        cfg.batch_size,
        seed=cfg.seed * 1000 + replica,
        preprocess=data.preprocess(augment=cfg.augment),
    )
    fragments = torchft_fragments(model, cfg.fragments)
    outers = [
        torch.optim.SGD(
            f.parameters(),
            lr=cfg.diloco_outer_lr,
            momentum=cfg.diloco_outer_momentum,
            nesterov=cfg.diloco_nesterov and cfg.diloco_outer_momentum > 0,
        )
        for f in fragments
    ]
    loss_fn = nn.CrossEntropyLoss()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=120)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=cfg.workers,
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"rg{replica}",
        hostname="127.0.0.1",
        init_sync=False,
    )
    # Padding as cloudburst's loop pads (train.py: the step's compute — forward, backward and
    # the inner optimizer's step — takes at least min_step_time_s; the sync comes after it):
    # a post-hook registered before DiLoCo's runs before DiLoCo's sync.
    started = [0.0]

    def pad(*_: Any) -> None:
        left = cfg.min_step_time_s - (time.perf_counter() - started[0])
        if left > 0:
            time.sleep(left)

    inner.register_step_post_hook(pad)
    algo = DiLoCo(
        manager,
        fragments,
        inner,
        outers if len(outers) > 1 else outers[0],
        sync_every=cfg.period,
        pin_memory=False,
        fragment_sync_delay=cfg.fragment_delay,
        fragment_update_alpha=cfg.fragment_alpha,
    )
    (out / f"ready{replica}").touch()
    deadline = time.monotonic() + 120
    while not all((out / f"ready{i}").exists() for i in range(cfg.workers)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {replica}: not all replicas ready in 120 s")
        time.sleep(0.01)
    total, times = spec["steps"], []
    t0 = time.perf_counter()
    with algo:
        for step in range(1, total + 1):
            started[0] = time.perf_counter()
            xb, yb = next(stream)
            loss = loss_fn(model(xb), yb)
            inner.zero_grad(set_to_none=True)
            loss.backward()
            inner.step()  # pad, then torchft's post-step hook (the fragment syncs)
            if step % 16 == 0:
                times.append([step, time.perf_counter() - t0])
    report = {
        "replica": replica,
        "steps": total,
        "step_times": times,
        "wall_time_s": time.perf_counter() - t0,
        "syncs": manager.current_step(),
    }
    (out / f"replica{replica}.json").write_text(json.dumps(report) + "\n")
    manager.shutdown(wait=False)


def run_torchft(s: dict, variant: str, seed: int, out: Path, python: str) -> dict:
    """A lighthouse and W replica groups (peer venv); the median step time or the error."""
    from cloudburst.config import RunConfig

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        if stale.is_file():
            stale.unlink()
    frag = {"diloco": (1, 0), "sdiloco_f2": (2, 2)}[variant]
    cfg = RunConfig(
        strategy="diloco",
        workers=s["workers"],
        model=MODELS[s["torchft_model"]],
        seed=seed,
        batch_size=s["batch_size"],
        min_step_time_s=s["min_step_time_s"],
        fragments=frag[0],
        fragment_delay=frag[1],
        fragment_alpha=0.5 if frag[0] > 1 else 0.0,
        progress=False,
    )
    spec = {"config": cfg.to_dict(), "steps": s["torchft_steps"]}
    (out / "spec.json").write_text(json.dumps(spec) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    record: dict[str, Any] = {"out": str(out), "loadavg_1m_before": os.getloadavg()[0]}
    t0 = time.monotonic()
    lh_log = open(out / "lighthouse.log", "w")  # noqa: SIM115 - closed below
    lighthouse = subprocess.Popen(
        [
            python,
            str(REPO / "benchmarks" / "peers_averaging.py"),
            "lighthouse",
            "--min-replicas",
            str(s["workers"]),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=lh_log,
        text=True,
        env=env,
        cwd=REPO,
    )
    procs, logs = [], []
    try:
        address = lighthouse.stdout.readline().strip()
        if not address.startswith("http"):
            raise RuntimeError("lighthouse did not start: " + _tail(out / "lighthouse.log"))
        for i in range(s["workers"]):
            logs.append(open(out / f"replica{i}.log", "w"))  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [
                        python,
                        __file__,
                        "torchft-replica",
                        "--replica",
                        str(i),
                        "--lighthouse",
                        address,
                        "--spec",
                        str(out / "spec.json"),
                        "--out",
                        str(out),
                    ],
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=REPO,
                )
            )
        deadline = time.monotonic() + 600
        for i, p in enumerate(procs):
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise RuntimeError(f"replica {i} exited {rc}: " + _tail(out / f"replica{i}.log"))
        reports = [json.loads((out / f"replica{i}.json").read_text()) for i in range(s["workers"])]
        windows = [
            (b[1] - a[1]) / (b[0] - a[0])
            for r in reports
            for a, b in zip(r["step_times"], r["step_times"][1:], strict=False)
            if a[0] >= 32
        ]
        record.update(
            step_s=statistics.median(windows),
            syncs=reports[0]["syncs"],
            wall_time_s=max(r["wall_time_s"] for r in reports),
        )
    except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
        record["error"] = str(e)[-800:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if lighthouse.poll() is None:
            lighthouse.stdin.close()
            try:
                lighthouse.wait(timeout=10)
            except subprocess.TimeoutExpired:
                lighthouse.kill()
                lighthouse.wait()
        lh_log.close()
        for f in logs:
            f.close()
    record["command_s"] = round(time.monotonic() - t0, 2)
    return record


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return " | ".join(path.read_text().strip().splitlines()[-lines:])
    except OSError as e:
        return f"(no output: {e})"


def peer_versions(python: str) -> dict:
    if not Path(python).exists():
        return {"error": f"peer python {python} not found (see PEERS.md; --peer-python)"}
    probe = subprocess.run(
        [
            python,
            "-c",
            "import torch, importlib.metadata as m; print(torch.__version__, m.version('torchft'))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if probe.returncode:
        return {"error": probe.stderr.strip()[-400:]}
    torch_v, torchft_v = probe.stdout.split()
    return {"python": python, "torch": torch_v, "torchft": torchft_v}


# ---------------------------------------------------------------------------- the sequence
def jobs(s: dict) -> list[dict]:
    """Every job in order: per seed the link cells' variants in a rotated order, the torchft
    block of that seed after them, the A/A repeats spread over the sequence, the sim last."""
    seeds = sorted({seed for cell in s["cells"] for seed in cell[3]} | set(s["torchft_seeds"]))
    seq: list[dict] = []
    for k, seed in enumerate(seeds):
        for model, link, variants, cell_seeds in s["cells"]:
            if seed not in cell_seeds or not variants:
                continue
            r = k % len(variants)
            for v in variants[r:] + variants[:r]:
                seq.append(
                    {
                        "part": "link",
                        "model": model,
                        "link": link,
                        "variant": v,
                        "seed": seed,
                        "kind": "main",
                    }
                )
        if seed in s["torchft_seeds"]:
            block = [
                ("cloudburst", "diloco"),
                ("torchft", "diloco"),
                ("cloudburst", "sdiloco_f2"),
                ("torchft", "sdiloco_f2"),
                ("cloudburst", "diloco_aa"),
            ]
            r = k % len(block)
            for impl, v in block[r:] + block[:r]:
                seq.append(
                    {
                        "part": "torchft",
                        "impl": impl,
                        "variant": v,
                        "seed": seed,
                        "model": s["torchft_model"],
                    }
                )
    n = s["aa_repeats"]
    model, link, variant, seed = s["aa"]
    for i in reversed(range(n)):
        seq.insert(
            round(len(seq) * (2 * i + 1) / (2 * n)),
            {
                "part": "link",
                "model": model,
                "link": link,
                "variant": variant,
                "seed": seed,
                "kind": f"aa{i}",
            },
        )
    for link in s["sim_links"]:
        for v in s["sim_variants"]:
            seq.append({"part": "sim", "model": "wide", "link": link, "variant": v, "seed": 0})
    return seq


def job_name(j: dict) -> str:
    if j["part"] == "torchft":
        return f"tf-{j['impl']}-{j['variant']}-s{j['seed']}"
    extra = "" if j.get("kind", "main") == "main" else f"-{j['kind']}"
    return f"{j['part']}-{j['model']}-{j['link']:g}g-{j['variant']}-s{j['seed']}{extra}"


def run_job(s: dict, j: dict, workdir: Path, peer_python: str) -> dict:
    out = workdir / job_name(j)
    if j["part"] == "link":
        args = train_flags(s, j["model"], j["link"], j["variant"], j["seed"])
        args += ["--steps", str(s["steps"][j["model"]]), "--eval-every-s", str(s["eval_every_s"])]
        args += ["--target-accuracy", str(s["target_accuracy"])]
        return run_cloudburst("train", args, out)
    if j["part"] == "sim":
        args = train_flags(s, j["model"], j["link"], j["variant"], j["seed"])
        args += ["--steps", str(s["sim_steps"]), "--eval-every-s", "1e6"]
        return run_cloudburst("simulate", args, out)
    if j["impl"] == "torchft":
        return run_torchft(s, j["variant"], j["seed"], out, peer_python)
    variant = j["variant"].removesuffix("_aa")
    args = train_flags(s, j["model"], None, variant, j["seed"])
    args += ["--steps", str(s["torchft_steps"]), "--eval-every-s", "1e6"]
    return run_cloudburst("train", args, out)


def measure(
    s: dict, parts: set[str], workdir: Path, json_path: Path, meta: dict, peer_python: str
) -> list:
    """Run the jobs of ``parts`` in order, the JSON rewritten after each (a failed run is
    recorded with its error, never dropped)."""
    records = []
    seq = [j for j in jobs(s) if j["part"] in parts]
    for i, j in enumerate(seq):
        r = {**j, **run_job(s, j, workdir, peer_python), "position": i}
        records.append(r)
        brief = {k: v for k, v in r.items() if k != "curve"}
        print(f"[{i + 1}/{len(seq)}] {json.dumps(brief)}", flush=True)
        json_path.write_text(json.dumps({**meta, "runs": records}, indent=1) + "\n")
    return records


# ---------------------------------------------------------------------------- the report
def med_censored(values: list[float | None]) -> float | None:
    """Median with censored runs (None) as +∞; None if the median itself is censored."""
    if not values:
        return None
    m = statistics.median([INF if v is None else v for v in values])
    return None if m == INF else m


def fmt(x: float | None, nd: int = 1, none: str = "—") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def runs_of(records, part, model=None, link=None, variant=None, kind="main"):
    return [
        r
        for r in records
        if r["part"] == part
        and (model is None or r.get("model") == model)
        and (link is None or r.get("link") == link)
        and (variant is None or r.get("variant") == variant)
        and (kind is None or r.get("kind", "main") == kind)
    ]


def bps(r: dict) -> float | None:
    if r.get("inter_node_bytes") is None or not r.get("samples"):
        return None
    return r["inter_node_bytes"] / r["samples"]


def link_tables(data: dict) -> tuple[list[str], dict]:
    s, records = data["settings"], data["runs"]
    lines, derived = [], {}
    for model, link, variants, seeds in s["cells"]:
        if not variants:
            continue
        sync = {r["seed"]: r for r in runs_of(records, "link", model, link, "sync")}
        rows = []
        for v in variants:
            runs = sorted(runs_of(records, "link", model, link, v), key=lambda r: r["seed"])
            ok = [r for r in runs if "error" not in r]
            ratios = [
                bps(r) / bps(sync[r["seed"]])
                for r in ok
                if r["seed"] in sync and bps(r) and bps(sync[r["seed"]])
            ]
            accs = [100 * r["final_test_accuracy"] for r in ok]
            sync_accs = [
                100 * sync[r["seed"]]["final_test_accuracy"]
                for r in ok
                if r["seed"] in sync and "error" not in sync[r["seed"]]
            ]
            ttt = [r.get("time_to_target_s") for r in runs]  # failed runs count as censored
            reached = sum(t is not None for t in ttt)
            stt = [r.get("steps_to_target") for r in runs]
            d_acc = (
                statistics.fmean(accs) - statistics.fmean(sync_accs) if accs and sync_accs else None
            )
            row = {
                "bytes_per_sample": statistics.fmean([bps(r) for r in ok]) if ok else None,
                "ratio_vs_sync": statistics.fmean(ratios) if ratios else None,
                "acc_mean": statistics.fmean(accs) if accs else None,
                "acc_sd": statistics.stdev(accs) if len(accs) > 1 else None,
                "acc_minus_sync": d_acc,
                "time_to_target_median_s": med_censored(ttt),
                "reached": f"{reached}/{len(runs)}",
                "steps_to_target_median": med_censored(stt),
                "step_ms_median": 1e3
                * statistics.median([r["step_s"] for r in ok if r.get("step_s")])
                if ok
                else None,
            }
            derived[f"{model}/{link:g}/{v}"] = row
            ratio = row["ratio_vs_sync"]
            rows.append(
                [
                    f"`{v}`",
                    len(runs),
                    fmt(row["bytes_per_sample"], 0),
                    "1" if v == "sync" else (f"1/{1 / ratio:.1f}" if ratio else "—"),
                    f"{fmt(row['acc_mean'])} ± {fmt(row['acc_sd'])}",
                    "" if v == "sync" else (f"{d_acc:+.1f}" if d_acc is not None else "—"),
                    f"{fmt(row['time_to_target_median_s'])} ({row['reached']})",
                    fmt(row["steps_to_target_median"], 0),
                    fmt(row["step_ms_median"]),
                    ", ".join(fmt(t) if t is not None else "never" for t in ttt),
                ]
            )
        lines += [
            f"### {MODEL_TEXT[model]}, {link:g} Gbit/s + {s['latency_ms']} ms, "
            f"{s['steps'][model]} steps per worker, seeds {', '.join(map(str, seeds))}",
            "",
            *benchutil.table(
                [
                    "variant",
                    "runs",
                    "inter-node B/sample",
                    "÷ sync",
                    "final acc % (mean ± sd)",
                    "− sync (points)",
                    f"time to {100 * s['target_accuracy']:g} % s (median; reached)",
                    "steps to target (median)",
                    "step ms (median)",
                    "time to target per seed (s)",
                ],
                rows,
            ),
            "",
        ]
    return lines, derived


def torchft_table(data: dict) -> tuple[list[str], dict]:
    records = [r for r in data["runs"] if r["part"] == "torchft"]
    seeds = sorted({r["seed"] for r in records})

    def step(impl: str, variant: str, seed: int) -> float | None:
        for r in records:
            if (r["impl"], r["variant"], r["seed"]) == (impl, variant, seed):
                return r.get("step_s")
        return None

    pairs = [
        ("`diloco` ÷ torchft `DiLoCo`", ("cloudburst", "diloco"), ("torchft", "diloco")),
        (
            "Streaming DiLoCo F = 2, τ = 2, α = 0.5: cloudburst ÷ torchft",
            ("cloudburst", "sdiloco_f2"),
            ("torchft", "sdiloco_f2"),
        ),
        ("A/A: `diloco` ÷ `diloco`", ("cloudburst", "diloco"), ("cloudburst", "diloco_aa")),
    ]
    rows, derived = [], {}
    for label, a, b in pairs:
        ratios = []
        for seed in seeds:
            x, y = step(*a, seed), step(*b, seed)
            ratios.append(x / y if x and y else None)
        ok = [q for q in ratios if q is not None]
        m = statistics.median(ok) if ok else None
        derived[label] = {"per_seed": ratios, "median": m}
        verdict = (
            "(noise floor)"
            if label.startswith("A/A")
            else (benchutil.verdict(m, 1.0, higher_is_better=False) if m else "no data")
        )
        rows.append(
            [label, ", ".join(fmt(q, 3) if q else "failed" for q in ratios), fmt(m, 3), verdict]
        )
    detail = []
    for r in sorted(records, key=lambda r: (r["seed"], r["impl"], r["variant"])):
        detail.append(
            [
                r["impl"],
                f"`{r['variant']}`",
                r["seed"],
                fmt(1e3 * r["step_s"], 2) if r.get("step_s") else "—",
                fmt(r.get("wall_time_s")),
                (r.get("error") or "")[:160].replace("|", "/"),
            ]
        )
    lines = [
        *benchutil.table(["pair", "ratio per seed", "median", "verdict (≤ 1)"], rows),
        "",
        *benchutil.table(
            ["implementation", "variant", "seed", "step ms (median)", "wall s", "error"], detail
        ),
        "",
    ]
    return lines, derived


def sim_table(data: dict, derived_link: dict) -> tuple[list[str], dict]:
    s, records = data["settings"], data["runs"]
    sims = [r for r in records if r["part"] == "sim"]
    if not sims:
        return [], {}
    rows, derived = [], {}
    for link in s["sim_links"]:
        row = [f"{link:g}"]
        for v in s["sim_variants"]:
            r = next((x for x in sims if x["link"] == link and x["variant"] == v), None)
            if r is None or "error" in r or not r.get("wall_time_s"):
                row.append("failed")
                continue
            step_s = r["wall_time_s"] / r["steps_per_worker"]
            steps = derived_link.get(f"wide/1/{v}", {}).get("steps_to_target_median")
            t = step_s * steps if steps else None
            derived[f"{link:g}/{v}"] = {"virtual_step_s": step_s, "modelled_time_to_target_s": t}
            row.append(f"{1e3 * step_s:.1f} ms → {fmt(t)} s")
        rows.append(row)
    header = ["link Gbit/s", *[f"`{v}`" for v in s["sim_variants"]]]
    return [*benchutil.table(header, rows), ""], derived


def report(data: dict, quick: bool, png: Path | None) -> tuple[list[str], dict]:
    s = data["settings"]
    link_lines, d_link = link_tables(data)
    tf_lines, d_tf = torchft_table(data)
    sim_lines, d_sim = sim_table(data, d_link)
    aa = [r for r in data["runs"] if r["part"] == "link" and r.get("kind", "main") != "main"]
    m, ln, v, seed = s["aa"]
    aa_runs = runs_of(data["runs"], "link", m, ln, v) + aa
    aa_runs = [r for r in aa_runs if r["seed"] == seed and "error" not in r]
    aa_text = ", ".join(
        f"{r['wall_time_s']:.2f} s (to target {fmt(r.get('time_to_target_s'))} s, "
        f"acc {100 * r['final_test_accuracy']:.1f} %)"
        for r in aa_runs
    )
    loads = [r["loadavg_1m_before"] for r in data["runs"] if "loadavg_1m_before" in r]
    lines = [
        "# Streaming DiLoCo and compression: bytes across the slow link, time to target, "
        "accuracy, and time per step against torchft",
        "",
        *data["provenance"],
        f"- peer venv: {data['peer']}",
        f"- load average (1 min) before each run: {min(loads):.2f} – {max(loads):.2f} "
        f"(median {statistics.median(loads):.2f}; 2 cores)"
        if loads
        else "- no runs",
        f"- {len(data['runs'])} runs, one after another, {data['elapsed_min']:.1f} min in all; "
        f"run directories under `{data['workdir']}`"
        + (" — **a smoke test (`--quick`), not the result**" if quick else ""),
        "",
        "Issue 17's evidence. Set-up: MNIST-1D (4000 train / 1000 test), 4 workers × batch "
        f"{s['batch_size']}, worker SGD lr 0.1 momentum 0.9, on {s['nodes']} emulated nodes "
        f"of 2 ranks, every step padded to {1e3 * s['min_step_time_s']:g} ms "
        "(`--min-step-time-s`, an emulated device: 4 CPU-bound workers contend for the 2 cores "
        "here, and the padding keeps the contention from deciding the result), "
        f"`--checkpoint-every 0`, worker 0 evaluates every {s['eval_every_s']} s. DiLoCo: "
        "H = 8, outer Nesterov SGD lr 0.1 momentum 0.9 (the defaults over SGD); Streaming "
        "DiLoCo α = 0.5 (the paper's best with τ > 0), τ = 2 (F = 2) or 1 (F = 4); the H = 32 "
        "variant τ = 4. Every variant's flags: `VARIANTS` in the script.",
        "",
        "## 1. Bytes across the slow link, accuracy, time to target",
        "",
        "`÷ sync` = inter-node bytes per sample ÷ sync's of the same seed (deterministic: the "
        "same at both link speeds). Time to target: the run's own clock from its first step "
        "to the first evaluation at or above the target; `never` = censored, counted as +∞ in "
        "the median. Steps to target: from that evaluation's sample count (link-independent).",
        "",
        *link_lines,
        f"A/A control (`{v}`, {MODEL_TEXT[m]}, {ln:g} Gbit/s, seed {seed}, "
        f"the run in the table and {len(aa)} repeat(s) spread over the sequence): "
        f"{aa_text or 'none'}.",
        "",
        "## 2. Time per step against torchft 0.2.0 (no emulated link)",
        "",
        f"The {MODEL_TEXT[s['torchft_model']]}, {s['torchft_steps']} steps, seeds "
        f"{', '.join(map(str, s['torchft_seeds']))}, the same padding, no evaluation during "
        "training, no emulated link (torchft has no link emulator, so both run on the same "
        "real constraint: gloo over loopback on this machine). Ratio < 1: cloudburst faster.",
        "",
        *tf_lines,
    ]
    if sim_lines:
        lines += [
            "## 3. What link speed makes compression worth it (virtual cluster)",
            "",
            f"`cloudburst simulate`, the wide CNN, {s['sim_steps']} steps (virtual step time "
            "= wall ÷ steps, deterministic), at each link speed (1 ms latency); "
            "→ × the median steps to target of the 1 Gbit/s real runs = a modelled time to "
            "target. PowerSGD runs only inside real DDP, so it is not here.",
            "",
            *sim_lines,
        ]
    if png is not None:
        lines += [f"![bytes and time to target]({png.name})", ""]
    return lines, {"link": d_link, "torchft": d_tf, "sim": d_sim}


def plot(data: dict, derived: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["settings"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    ax = axes[0]
    names = [v for v in VARIANTS if f"wide/1/{v}" in derived["link"]]
    vals = [derived["link"][f"wide/1/{v}"]["bytes_per_sample"] or 0 for v in names]
    ax.barh(names, vals, color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("inter-node bytes per sample (wide CNN, log)")
    for link, axis in ((1.0, axes[1]), (0.1, axes[2])):
        for v in names:
            for r in runs_of(data["runs"], "link", "wide", link, v):
                if r.get("curve") and r["seed"] == 0:
                    c = r["curve"]
                    axis.plot([p[0] for p in c], [p[2] for p in c], label=v, lw=1)
        axis.axhline(s["target_accuracy"], color="0.5", lw=0.8, ls="--")
        axis.set_title(f"wide CNN, {link:g} Gbit/s, seed 0")
        axis.set_xlabel("training time (s)")
        axis.set_ylabel("test accuracy")
        axis.set_ylim(0.3, 1.0)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_md(path: Path, lines: list[str]) -> None:
    notes = ""
    if path.exists() and NOTES_MARK in path.read_text():
        notes = path.read_text().split(NOTES_MARK, 1)[1]
    benchutil.write_markdown(path, [*lines, NOTES_MARK + notes.rstrip("\n")])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command")
    rp = sub.add_parser("torchft-replica", help="(internal) one torchft replica group")
    rp.add_argument("--replica", type=int, required=True)
    rp.add_argument("--lighthouse", required=True)
    rp.add_argument("--spec", required=True)
    rp.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="smoke test, under runs/bench/ only")
    p.add_argument("--reuse", action="store_true", help="rebuild the report from the JSON")
    p.add_argument("--parts", default="link,torchft,sim", help="which parts to run")
    p.add_argument(
        "--peer-python",
        default=PEER_PYTHON,
        help=f"python with torch 2.13.0 + torchft 0.2.0 (default {PEER_PYTHON})",
    )
    args = p.parse_args()
    if args.command == "torchft-replica":
        spec = json.loads(Path(args.spec).read_text())
        torchft_replica(args.replica, args.lighthouse, spec, Path(args.out))
        return
    parts = set(args.parts.split(","))
    custom = args.quick or parts != {"link", "torchft", "sim"}
    name = "compress_quick" if custom else "compress"
    workdir = REPO / "runs" / "bench" / name
    target = workdir if custom else benchutil.RESULTS
    json_path = target / f"{name}.json"
    if args.reuse:
        data = json.loads(json_path.read_text())
    else:
        s = settings(args.quick)
        workdir.mkdir(parents=True, exist_ok=True)
        peer = peer_versions(args.peer_python)
        meta = {
            "settings": s,
            "workdir": str(workdir.relative_to(REPO)),
            "commit": benchutil.git_revision(),
            "peer": peer.get("error")
            or f"`{peer['python']}`: torch {peer['torch']}, torchft {peer['torchft']}",
        }
        started = time.monotonic()
        records = measure(s, parts, workdir, json_path, meta, args.peer_python)
        data = {
            **meta,
            "elapsed_min": (time.monotonic() - started) / 60,
            "provenance": benchutil.provenance_lines(),
            "runs": records,
        }
        json_path.write_text(json.dumps(data, indent=1) + "\n")
    png = target / f"{name}.png"
    lines, derived = report(data, custom, png)
    plot(data, derived, png)
    data["derived"] = derived
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    write_md(target / f"{name}.md", lines)


if __name__ == "__main__":
    main()
