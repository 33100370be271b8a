"""torchft 0.2.0 as a peer: ``LocalSGD`` and ``DiLoCo`` (streaming with fragments too) on
cloudburst's own data, model and batches, one replica group per process.

torchft needs a lighthouse and one ``Manager`` per replica group, so :func:`run_torchft` starts
them on 127.0.0.1 with the peer venv's python (torchft is never a dependency;
``../shared/PEERS.md``); each replica trains on the batches of cloudburst's worker ``replica``,
steps padded to ``cfg.cluster.min_step_time_s`` as cloudburst pads. Used by ``compress.py`` and
``local_sgd.py``::

    python benchmarks/torchft_peer.py lighthouse --min-replicas 4         # (peer venv)
    python benchmarks/torchft_peer.py replica --algorithm diloco ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

SCRIPT = str(Path(__file__).resolve())
REPO = Path(SCRIPT).parent.parent
if str(REPO) not in sys.path:  # run as a script by the peer venv's python
    sys.path.insert(0, str(REPO))

import harness  # noqa: E402 (benchmarks/ is on the path: this folder, or the importer's)

from cloudburst.comm.stats import ring_bytes  # noqa: E402
from cloudburst.config import RunConfig  # noqa: E402

PEER_PYTHON = os.environ.get("CLOUDBURST_PEER_PYTHON", "/work/peers-venv/bin/python")
ALGORITHMS = ("localsgd", "diloco")
TIMEOUT_S, READY_S = 600.0, 120.0  # for every replica to finish; to start together


class TorchftFailed(RuntimeError):
    """A torchft run did not finish; the message carries the failing process's last output."""


# ---------------------------------------------------------------------------- the launcher
def run_torchft(cfg: RunConfig, algorithm: str, out_dir: str | Path, steps: int | None = None):
    """Train ``cfg`` with torchft's ``algorithm`` (``diloco`` streams when
    ``cfg.diloco.fragments`` > 1),
    ``steps`` per replica (default: ``cfg``'s). Returns a summary with the keys of cloudburst's
    ``summary.json`` for the same numbers plus every replica's step times and ``step_s``, their
    median (:func:`harness.step_s`). Raises :class:`TorchftFailed` with the failing output."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (p for p in out.glob("*") if p.is_file()):
        stale.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    (out / "config.json").write_text(cfg.to_json() + "\n")
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:  # on the way out: replicas killed, then the lighthouse

        def start(name: str, *argv: str, **kw: Any) -> subprocess.Popen:
            log = stack.enter_context(open(out / f"{name}.log", "w"))  # noqa: SIM115
            kw = {"stdout": log, "stderr": log if "stdout" in kw else subprocess.STDOUT, **kw}
            proc = subprocess.Popen([PEER_PYTHON, SCRIPT, *argv], env=env, cwd=REPO, **kw)
            stack.callback(_stop, proc)
            return proc

        def failed(what: str, name: str) -> TorchftFailed:
            try:
                tail = " | ".join((out / f"{name}.log").read_text().strip().splitlines()[-15:])
            except OSError as e:
                tail = f"(no output: {e})"
            return TorchftFailed(f"torchft {what}: {tail or '(no output)'}")

        lh = start("lighthouse", "lighthouse", "--min-replicas", str(cfg.job.workers),
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        address = lh.stdout.readline().strip()
        if not address.startswith("http"):
            raise failed("lighthouse did not start", "lighthouse")
        argv = ["--algorithm", algorithm, "--lighthouse", address, "--out", str(out),
                "--config", str(out / "config.json")]  # fmt: skip
        argv += ["--steps", str(steps)] if steps else []
        replicas = [start(f"replica{i}", "replica", "--replica", str(i), *argv)
                    for i in range(cfg.job.workers)]  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        for i, p in enumerate(replicas):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise failed(f"{algorithm} replica {i} still running after {TIMEOUT_S:.0f} s",
                             f"replica{i}") from None  # fmt: skip
            if rc != 0:
                raise failed(f"{algorithm} replica {i} exited with {rc}", f"replica{i}")
    reports = [json.loads((out / f"replica{i}.json").read_text()) for i in range(cfg.job.workers)]
    step_times = {str(i): r["step_times"] for i, r in enumerate(reports)}
    summary = {
        "strategy": f"torchft_{algorithm}", "workers": cfg.job.workers,
        "final_test_accuracy": reports[0]["final_test_accuracy"],
        "replica_accuracies": [r["final_test_accuracy"] for r in reports],
        "wall_time_s": max(r["wall_time_s"] for r in reports),
        **{k: sum(r[k] for r in reports) for k in ("samples", "sent_bytes", "commit_failures")},
        "syncs": reports[0]["syncs"], "steps_per_worker": reports[0]["steps"],
        "step_times": step_times, "step_s": harness.step_s(step_times),
        "launch_to_summary_s": time.monotonic() - t0,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _stop(proc: subprocess.Popen) -> None:
    """A replica killed; the lighthouse given 10 s to exit once its stdin closes, then killed."""
    if proc.stdin is not None and proc.poll() is None:
        proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    proc.kill()  # nothing if it has exited
    proc.wait()


def run_arm(name, seed: int, cfg: RunConfig, algorithm: str, out: Path, steps: int, error=None):
    """One torchft run as a harness Run, ``values["step_s"]`` its step time (the first 32 steps
    left out); a failure (or a peer venv ``error``) is kept in ``failed``, never raised."""
    summary, failed = {}, error
    if not error:
        try:
            summary = run_torchft(cfg, algorithm, out, steps=steps)
        except (TorchftFailed, OSError, ValueError) as e:
            failed = str(e)[-300:]
    wall = summary.get("launch_to_summary_s", 0.0)  # the command, as a cloudburst run's wall_s
    run = harness.Run(name, seed, wall, summary, failed=failed, out_dir=str(out))
    if summary:
        run.values["step_s"] = harness.step_s(summary["step_times"], skip_steps=32)
    return run


def peer_versions() -> dict[str, str]:
    """The peer venv's torch and torchft versions, or ``{"error": ...}``."""
    if not Path(PEER_PYTHON).exists():
        return {"error": f"peer python {PEER_PYTHON} not found (see ../shared/PEERS.md)"}
    code = "import torch, importlib.metadata as m; print(torch.__version__, m.version('torchft'))"
    probe = subprocess.run([PEER_PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    if probe.returncode:
        return {"error": probe.stderr.strip()[-400:]}
    torch_v, torchft_v = probe.stdout.split()
    return {"python": PEER_PYTHON, "torch": torch_v, "torchft": torchft_v}


# ---------------------------------------------------------------------------- the processes
def fragments_of(model, fragments: int) -> list:
    """cloudburst's split (whole tensors, module order, balanced by element count) as the
    ``nn.Module`` fragments torchft's ``DiLoCo`` takes: each holds the model's own tensors."""
    from torch import nn

    from cloudburst.strategies.local_sgd import split_fragments

    if fragments == 1:
        return [model]
    names = {id(p): name.replace(".", "_") for name, p in model.named_parameters()}
    groups = split_fragments(list(model.parameters()), fragments)
    return [nn.ParameterDict([(names[id(p)], p) for p in group]) for group in groups]


def torchft_replica(
    algorithm: str, replica: int, lighthouse: str, cfg: RunConfig, out: Path, steps: int | None
) -> None:
    """One replica group (one process): train ``cfg`` with torchft's ``algorithm``."""
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo, LocalSGD

    from cloudburst import data as cb
    from cloudburst.loop.train_step import make_optimizer
    from cloudburst.models import build_run_model

    torch.set_num_threads(1)
    data = cb.load_run_dataset(cfg)
    model = build_run_model(cfg, data)
    optimizer = make_optimizer(cfg, model.parameters())
    # Exactly the batches cloudburst's worker ``replica`` draws (train.run_worker).
    source = cb.worker_source(data, replica, cfg.job.workers)
    stream = cb.batch_stream(source, cfg.training.batch_size,
                             seed=cfg.training.seed * 1000 + replica,
                             preprocess=data.preprocess(augment=cfg.data.augment))  # fmt: skip
    total = steps or cfg.steps_per_worker(len(data.train))
    if total % cfg.local_sgd.period:
        raise ValueError(
            f"torchft runs need steps ({total}) to be a multiple of period "
            f"({cfg.local_sgd.period}): torchft's algorithms end on one model only after a sync"
        )

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=cfg.faults.comm_timeout_s)
    # use_async_quorum=False: DiLoCo requires it (LocalSGD syncs right after its quorum);
    # init_sync=False: every replica starts from the same seeded θ, as in cloudburst.
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        min_replica_size=cfg.job.workers, use_async_quorum=False,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
        replica_id=f"rg{replica}", hostname="127.0.0.1", init_sync=False,
    )  # fmt: skip
    # Padding as cloudburst's loop pads (the step's compute — forward, backward and the inner
    # optimizer's step — takes at least min_step_time_s; the sync comes after it): a
    # post-hook registered before the algorithm's runs before its sync.
    started = [0.0]

    def pad(*_: Any) -> None:
        left = cfg.cluster.min_step_time_s - (time.perf_counter() - started[0])
        if left > 0:
            time.sleep(left)

    optimizer.register_step_post_hook(pad)
    if algorithm == "localsgd":
        algo = LocalSGD(manager, model, optimizer, sync_every=cfg.local_sgd.period)
    else:
        fragments = fragments_of(model, cfg.diloco.fragments)
        nesterov = cfg.diloco.nesterov and cfg.diloco.outer_momentum > 0
        outers = [torch.optim.SGD(f.parameters(), lr=cfg.diloco.outer_lr,
                                  momentum=cfg.diloco.outer_momentum, nesterov=nesterov)
                  for f in fragments]  # fmt: skip
        algo = DiLoCo(manager, fragments, optimizer, outers if len(outers) > 1 else outers[0],
                      sync_every=cfg.local_sgd.period, pin_memory=False,
                      fragment_sync_delay=cfg.diloco.fragment_delay,
                      fragment_update_alpha=cfg.diloco.fragment_alpha)  # fmt: skip
    # Start training together (set-up differs per process): wait for every ``ready<i>``.
    (out / f"ready{replica}").touch()
    deadline, n = time.monotonic() + READY_S, cfg.job.workers
    while not all((out / f"ready{i}").exists() for i in range(n)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {replica}: not all {n} replicas ready in {READY_S} s")
        time.sleep(0.01)

    loss_fn = torch.nn.CrossEntropyLoss()
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
            if step % cfg.metrics.log_every_steps == 0 or step == total:
                step_times.append([step, time.perf_counter() - t0])
    wall_s = time.perf_counter() - t0
    test = cb.in_memory(data.test)
    acc, test_loss = cb.evaluate_dataset(model, test, data.preprocess(augment=False), "cpu")
    syncs = manager.current_step()  # committed syncs
    numel = sum(p.numel() for p in model.parameters())
    # sent_bytes: counted as cloudburst counts an all-reduce of |θ| fp32 values (a ring).
    report = {"replica": replica, "algorithm": algorithm, "steps": total,
              "samples": total * cfg.training.batch_size, "final_loss": loss,
              "final_test_accuracy": acc, "final_test_loss": test_loss, "wall_time_s": wall_s,
              "syncs": syncs, "commit_failures": total // cfg.local_sgd.period - syncs,
              "sent_bytes": syncs * ring_bytes(numel, 4, cfg.job.workers),
              "step_times": step_times}  # fmt: skip
    (out / f"replica{replica}.json").write_text(json.dumps(report) + "\n")
    manager.shutdown(wait=False)


def main() -> None:
    p = argparse.ArgumentParser(description="torchft peer processes (run by the peer venv)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("lighthouse").add_argument("--min-replicas", type=int, required=True)
    rp = sub.add_parser("replica")
    rp.add_argument("--algorithm", choices=ALGORITHMS, required=True)
    rp.add_argument("--replica", type=int, required=True)
    for flag in ("--lighthouse", "--config", "--out"):
        rp.add_argument(flag, required=True)
    rp.add_argument("--steps", type=int, default=None)
    args = p.parse_args()
    if args.command == "lighthouse":  # on a free port; print its address; exit when stdin closes
        from torchft._torchft import LighthouseServer

        server = LighthouseServer(bind="127.0.0.1:0", min_replicas=args.min_replicas)
        print(server.address(), flush=True)
        sys.stdin.read()
        return server.shutdown()
    cfg = RunConfig.from_dict(json.loads(Path(args.config).read_text()))
    torchft_replica(args.algorithm, args.replica, args.lighthouse, cfg, Path(args.out), args.steps)


if __name__ == "__main__":
    main()
