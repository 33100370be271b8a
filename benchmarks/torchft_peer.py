"""torchft 0.2.0 as a peer: ``LocalSGD`` and ``DiLoCo`` (streaming with fragments too), trained
on cloudburst's own data, model and batches, one replica group per process.

torchft needs a lighthouse and one ``Manager`` per replica group, so it cannot run inside
cloudburst's loop. :func:`run_torchft` starts a lighthouse and ``cfg.workers`` replica groups
of one process each on 127.0.0.1 with the *peer* virtual environment's python (torchft is never
a dependency of the project; ``../shared/PEERS.md``). Each process runs
:func:`torchft_replica`: cloudburst's data and model code with the run's ``RunConfig`` (shard,
batch stream and seed of cloudburst's worker ``replica``), a plain training loop, torchft's
algorithm as a context manager around it (its optimizer hooks synchronise), each step padded
to ``cfg.min_step_time_s`` as cloudburst's loop pads it, then the final model's test accuracy.
Step times are recorded every ``cfg.log_every_steps`` steps.

Used by ``benchmarks/compress.py`` (time per step against cloudburst's DiLoCo) and
``benchmarks/local_sgd.py`` (``local_sgd`` / ``diloco`` against torchft's)::

    python benchmarks/torchft_peer.py lighthouse --min-replicas 4         # (peer venv)
    python benchmarks/torchft_peer.py replica --algorithm diloco ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script by the peer venv's python
    sys.path.insert(0, str(REPO))

from cloudburst.comm.stats import ring_bytes  # noqa: E402
from cloudburst.config import RunConfig  # noqa: E402

PEER_PYTHON = os.environ.get("CLOUDBURST_PEER_PYTHON", "/work/peers-venv/bin/python")
ALGORITHMS = ("localsgd", "diloco")


class TorchftFailed(RuntimeError):
    """A torchft run did not finish; the message carries the failing process's last output."""


# ---------------------------------------------------------------------------- the launcher
def run_torchft(
    cfg: RunConfig,
    algorithm: str,
    out_dir: str | Path,
    python: str = PEER_PYTHON,
    steps: int | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Train ``cfg`` with torchft's ``algorithm`` (``diloco`` streams when ``cfg.fragments``
    > 1): a lighthouse and ``cfg.workers`` replica groups run by ``python``, ``steps`` per
    replica (default: ``cfg``'s). Returns a summary with the keys of cloudburst's
    ``summary.json`` for the same numbers (``final_test_accuracy``, ``sent_bytes``,
    ``samples``, ``wall_time_s``) plus every replica's step times and ``step_s`` (their
    median, :func:`median_step_s`). Raises :class:`TorchftFailed` with the failing output."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        if stale.is_file():
            stale.unlink()
    script = str(Path(__file__).resolve())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    (out / "config.json").write_text(cfg.to_json() + "\n")
    lh_log = open(out / "lighthouse.log", "w")  # noqa: SIM115 - closed in finally
    lighthouse = subprocess.Popen(
        [python, script, "lighthouse", "--min-replicas", str(cfg.workers)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=lh_log,
        text=True,
        env=env,
        cwd=REPO,
    )
    replicas: list[subprocess.Popen] = []
    logs = []
    t0 = time.monotonic()
    try:
        address = lighthouse.stdout.readline().strip()
        if not address.startswith("http"):
            raise TorchftFailed(
                f"torchft lighthouse did not start: {_tail(out / 'lighthouse.log')}"
            )
        for i in range(cfg.workers):
            log = open(out / f"replica{i}.log", "w")  # noqa: SIM115 - closed in finally
            logs.append(log)
            argv = [python, script, "replica", "--algorithm", algorithm, "--replica", str(i)]
            argv += ["--lighthouse", address, "--config", str(out / "config.json")]
            argv += ["--out", str(out)] + (["--steps", str(steps)] if steps else [])
            replicas.append(
                subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            )
        deadline = time.monotonic() + timeout_s
        for i, p in enumerate(replicas):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TorchftFailed(
                    f"torchft {algorithm} replica {i} still running after {timeout_s:.0f} s: "
                    f"{_tail(out / f'replica{i}.log')}"
                ) from None
            if rc != 0:
                raise TorchftFailed(
                    f"torchft {algorithm} replica {i} exited with {rc}: "
                    f"{_tail(out / f'replica{i}.log')}"
                )
    finally:
        for p in replicas:
            if p.poll() is None:
                p.kill()
                p.wait()
        if lighthouse.poll() is None:
            lighthouse.stdin.close()  # the lighthouse exits when its stdin closes
            try:
                lighthouse.wait(timeout=10)
            except subprocess.TimeoutExpired:
                lighthouse.kill()
                lighthouse.wait()
        lh_log.close()
        for log in logs:
            log.close()
    reports = [json.loads((out / f"replica{i}.json").read_text()) for i in range(cfg.workers)]
    accs = [r["final_test_accuracy"] for r in reports]
    step_times = {str(i): r["step_times"] for i, r in enumerate(reports)}
    summary = {
        "strategy": f"torchft_{algorithm}",
        "workers": cfg.workers,
        "final_test_accuracy": accs[0],
        "replica_accuracies": accs,
        "wall_time_s": max(r["wall_time_s"] for r in reports),
        "samples": sum(r["samples"] for r in reports),
        "sent_bytes": sum(r["sent_bytes"] for r in reports),
        "syncs": reports[0]["syncs"],
        "commit_failures": sum(r["commit_failures"] for r in reports),
        "steps_per_worker": reports[0]["steps"],
        "step_times": step_times,
        "step_s": median_step_s(step_times),
        "launch_to_summary_s": time.monotonic() - t0,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def peer_versions(python: str = PEER_PYTHON) -> dict[str, str]:
    """The peer venv's torch and torchft versions, or ``{"error": ...}``."""
    if not Path(python).exists():
        return {"error": f"peer python {python} not found (see ../shared/PEERS.md)"}
    probe = subprocess.run(
        [python, "-c", "import torch, importlib.metadata as m; "
         "print(torch.__version__, m.version('torchft'))"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if probe.returncode:
        return {"error": probe.stderr.strip()[-400:]}
    torch_v, torchft_v = probe.stdout.split()
    return {"python": python, "torch": torch_v, "torchft": torchft_v}


def median_step_s(step_times: dict[str, list[list[float]]], skip_steps: int = 0) -> float | None:
    """Median over every replica's logged windows of Δtime ÷ Δsteps between consecutive step
    records, windows starting before ``skip_steps`` left out (the measure cloudburst's runs
    get from their step records)."""
    per_step = [
        (b[1] - a[1]) / (b[0] - a[0])
        for times in step_times.values()
        for a, b in zip(times, times[1:], strict=False)
        if b[0] > a[0] and a[0] >= skip_steps
    ]
    return statistics.median(per_step) if per_step else None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text().strip().splitlines()
    except OSError as e:
        return f"(no output: {e})"
    return " | ".join(text[-lines:]) or "(no output)"


# ---------------------------------------------------------------------------- the processes
def lighthouse_main(min_replicas: int) -> None:
    """Serve a torchft lighthouse on 127.0.0.1 (a free port); print its address; exit when
    stdin closes (the launcher's signal)."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas)
    print(server.address(), flush=True)
    sys.stdin.read()
    server.shutdown()


def fragments_of(model, fragments: int) -> list:
    """cloudburst's split (whole tensors, module order, balanced by element count) as the
    ``nn.Module`` fragments torchft's ``DiLoCo`` takes: each holds the model's own tensors."""
    from torch import nn

    from cloudburst.strategies.local_sgd import split_fragments

    if fragments == 1:
        return [model]
    named = list(model.named_parameters())
    out, i = [], 0
    for group in split_fragments([p for _, p in named], fragments):
        holder = nn.Module()
        for p in group:
            holder.register_parameter(named[i][0].replace(".", "_"), p)
            i += 1
        out.append(holder)
    return out


def torchft_replica(
    algorithm: str, replica: int, lighthouse: str, cfg: RunConfig, out: Path, steps: int | None
) -> None:
    """One replica group (one process): train ``cfg`` with torchft's ``algorithm``."""
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo, LocalSGD

    from cloudburst.data import (
        batch_stream,
        evaluate_dataset,
        in_memory,
        load_dataset,
        worker_source,
    )
    from cloudburst.models import build_model
    from cloudburst.train import make_optimizer

    torch.set_num_threads(1)
    data = load_dataset(cfg.dataset, cfg.train_size, cfg.test_size, cfg.image_size)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    optimizer = make_optimizer(cfg, model.parameters())
    # Exactly the batches cloudburst's worker ``replica`` draws (train.run_worker).
    stream = batch_stream(
        worker_source(data, replica, cfg.workers),
        cfg.batch_size,
        seed=cfg.seed * 1000 + replica,
        preprocess=data.preprocess(augment=cfg.augment),
    )
    total = steps or cfg.steps_per_worker(len(data.train))
    if total % cfg.period:
        raise ValueError(
            f"torchft runs need steps ({total}) to be a multiple of period ({cfg.period}): "
            "torchft's algorithms end on one model only after a sync"
        )

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=cfg.comm_timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=cfg.workers,
        use_async_quorum=False,  # DiLoCo requires it; LocalSGD syncs right after its quorum
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
        init_sync=False,  # every replica starts from the same seeded θ, as in cloudburst
    )
    # Padding as cloudburst's loop pads (the step's compute — forward, backward and the inner
    # optimizer's step — takes at least min_step_time_s; the sync comes after it): a
    # post-hook registered before the algorithm's runs before its sync.
    started = [0.0]

    def pad(*_: Any) -> None:
        left = cfg.min_step_time_s - (time.perf_counter() - started[0])
        if left > 0:
            time.sleep(left)

    optimizer.register_step_post_hook(pad)
    if algorithm == "localsgd":
        algo = LocalSGD(manager, model, optimizer, sync_every=cfg.period)
    else:
        fragments = fragments_of(model, cfg.fragments)
        outers = [
            torch.optim.SGD(
                f.parameters(),
                lr=cfg.diloco_outer_lr,
                momentum=cfg.diloco_outer_momentum,
                nesterov=cfg.diloco_nesterov and cfg.diloco_outer_momentum > 0,
            )
            for f in fragments
        ]
        algo = DiLoCo(
            manager,
            fragments,
            optimizer,
            outers if len(outers) > 1 else outers[0],
            sync_every=cfg.period,
            pin_memory=False,
            fragment_sync_delay=cfg.fragment_delay,
            fragment_update_alpha=cfg.fragment_alpha,
        )
    _file_barrier(out, replica, cfg.workers, timeout_s=120.0)

    loss_fn = nn.CrossEntropyLoss()
    step_times: list[list[float]] = []
    t0 = time.perf_counter()
    loss = float("nan")
    with algo:
        for step in range(1, total + 1):
            started[0] = time.perf_counter()
            xb, yb = next(stream)
            loss_t = loss_fn(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss_t.backward()
            optimizer.step()  # pad, then torchft's post-step hook (the syncs every H steps)
            loss = loss_t.item()
            if step % cfg.log_every_steps == 0 or step == total:
                step_times.append([step, time.perf_counter() - t0])
    wall_s = time.perf_counter() - t0
    acc, test_loss = evaluate_dataset(
        model, in_memory(data.test), data.preprocess(augment=False), "cpu"
    )
    syncs = manager.current_step()  # committed syncs
    numel = sum(p.numel() for p in model.parameters())
    report = {
        "replica": replica,
        "algorithm": algorithm,
        "steps": total,
        "samples": total * cfg.batch_size,
        "final_loss": loss,
        "final_test_accuracy": acc,
        "final_test_loss": test_loss,
        "wall_time_s": wall_s,
        "syncs": syncs,
        "commit_failures": total // cfg.period - syncs,
        # Counted as cloudburst counts an all-reduce of |θ| fp32 values (a ring).
        "sent_bytes": syncs * ring_bytes(numel, 4, cfg.workers),
        "step_times": step_times,
    }
    (out / f"replica{replica}.json").write_text(json.dumps(report) + "\n")
    manager.shutdown(wait=False)


def _file_barrier(out: Path, replica: int, n: int, timeout_s: float) -> None:
    """Start training together (set-up differs per process): wait for every ``ready<i>``."""
    (out / f"ready{replica}").touch()
    deadline = time.monotonic() + timeout_s
    while not all((out / f"ready{i}").exists() for i in range(n)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {replica}: not all {n} replicas ready in {timeout_s} s")
        time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser(description="torchft peer processes (run by the peer venv)")
    sub = p.add_subparsers(dest="command", required=True)
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--min-replicas", type=int, required=True)
    rp = sub.add_parser("replica")
    rp.add_argument("--algorithm", choices=ALGORITHMS, required=True)
    rp.add_argument("--replica", type=int, required=True)
    rp.add_argument("--lighthouse", required=True)
    rp.add_argument("--config", required=True)
    rp.add_argument("--out", required=True)
    rp.add_argument("--steps", type=int, default=None)
    args = p.parse_args()
    if args.command == "lighthouse":
        lighthouse_main(args.min_replicas)
        return
    cfg = RunConfig.from_dict(json.loads(Path(args.config).read_text()))
    torchft_replica(args.algorithm, args.replica, args.lighthouse, cfg, Path(args.out), args.steps)


if __name__ == "__main__":
    main()
