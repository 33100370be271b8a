"""Peers of ``local_sgd`` and ``diloco``: PyTorch's model averager and torchft (issue 4).

Two peers, each trained on the same MNIST-1D shards, model, seed, batch size, optimizer and
number of steps as cloudburst's own strategies (``benchmarks/local_sgd.py`` runs them side by
side):

``torch_periodic_averager`` — ``torch.distributed.algorithms.model_averaging.averagers.
PeriodicModelAverager`` as a registered cloudburst :class:`Strategy`, so it runs through
cloudburst's own loop (same data stream, evaluation and summary). Each replica trains with its
local optimizer; after every optimizer step ``averager.average_parameters(model.parameters())``
is called, and torch averages θ over the workers' group (one blocking fp32 all-reduce) on the
calls it chooses: call c (0-based) averages when ``c >= warmup_steps`` and
``(c - warmup_steps) % period == 0``. With ``warmup_steps = H - 1`` these are the calls after
steps H, 2H, … — exactly cloudburst's ``local_sgd`` schedule (without post-local warm-up), so
the two differ only in the averaging mechanism. ``finish`` averages once more when the step
count is not a multiple of H (as ``local_sgd`` does), with torch's ``average_parameters``.
Bytes are counted as cloudburst counts its own all-reduces (a ring: 2(W−1)/W · |θ| · 4 bytes
sent and received per rank per average), so the summaries compare. Synchronous every H steps;
a dead worker makes the next average raise and the job stops.

torchft 0.2.0 ``LocalSGD`` / ``DiLoCo`` — they need torchft's lighthouse and one ``Manager``
per replica group, so they cannot run inside cloudburst's loop. :func:`run_torchft` starts a
lighthouse and W replica groups of one process each on 127.0.0.1 with the *peer* virtual
environment's python (torchft is never a dependency of the project); each process runs
:func:`torchft_replica`: cloudburst's own data and model code (``cloudburst.data``,
``cloudburst.models``, imported from this repository) with the run's ``RunConfig``, a plain
training loop, and torchft's algorithm as a context manager around it (its optimizer hooks do
the synchronisation), then the test accuracy of the final model. Step times are recorded
every ``log_every_steps`` steps, as cloudburst's loop records them.

    python benchmarks/peers_averaging.py lighthouse --min-replicas 4      # (peer venv)
    python benchmarks/peers_averaging.py torchft-replica --algorithm localsgd ...

Importing this module registers ``torch_periodic_averager`` (``RunConfig(strategy=...)``).
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

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script by the peer venv's python
    sys.path.insert(0, str(REPO))

from torch.distributed.algorithms.model_averaging import utils as averaging_utils  # noqa: E402
from torch.distributed.algorithms.model_averaging.averagers import (  # noqa: E402
    PeriodicModelAverager,
)

from cloudburst.comm.allreduce import count_collective, ring_bytes  # noqa: E402
from cloudburst.comm.flat import flatten_params  # noqa: E402
from cloudburst.config import RunConfig  # noqa: E402
from cloudburst.strategies import STRATEGY_CLASSES, Strategy, register_strategy  # noqa: E402

TORCHFT_ALGORITHMS = ("localsgd", "diloco")


# ---------------------------------------------------------------------------- torch's averager
def averaging_due(averager: PeriodicModelAverager) -> bool:
    """Whether the next ``average_parameters`` call all-reduces (torch's own rule)."""
    step, warmup = averager.step, averager.warmup_steps
    return step >= warmup and (step - warmup) % averager.period == 0


class TorchPeriodicAveragerStrategy(Strategy):
    """Local SGD by ``PeriodicModelAverager(period=H, warmup_steps=H - 1)`` (module doc)."""

    name = "torch_periodic_averager"

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        if self.cfg.local_sgd_warmup_steps:
            raise ValueError(
                "torch_periodic_averager: local_sgd_warmup_steps must be 0, got "
                f"{self.cfg.local_sgd_warmup_steps} (torch's warm-up is DDP's post-local SGD hook, "
                "not this averager; see benchmarks/peers.py)"
            )
        self.model = model
        self.period = self.cfg.period
        self.averager = PeriodicModelAverager(
            period=self.period, warmup_steps=self.period - 1, process_group=self.ctx.workers_group
        )
        self.numel = sum(p.numel() for p in model.parameters())
        topo = self.ctx.topology
        self.spans_nodes = topo is not None and topo.spans_nodes(self.ctx.worker_ranks)
        self.averages = 0
        return model

    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        if self.cfg.workers == 1:
            return
        if averaging_due(self.averager):
            self._counted(lambda: self.averager.average_parameters(self.model.parameters()))
        else:
            self.averager.average_parameters(self.model.parameters())  # only advances its step

    def _counted(self, average) -> None:
        """Run ``average`` (torch's blocking fp32 all-reduce of θ), counted and timed."""
        count_collective(self.stats, ring_bytes(self.numel, 4, self.cfg.workers), self.spans_nodes)
        t0 = time.perf_counter()
        average()
        link = self.ctx.link
        if link is not None and link.active and self.spans_nodes:
            cost = link.allreduce_s(self.numel * 4, self.cfg.workers)
            self.stats.emulated_link_s += cost
            link.wait_until(link.reserve(cost, start=t0))
        self.stats.wait_s += time.perf_counter() - t0
        self.averages += 1

    def finish(self) -> None:
        # End on one model, as local_sgd does: average what was trained since the last average.
        if self.cfg.workers > 1 and self.local_steps % self.period != 0:
            group = self.ctx.workers_group
            self._counted(
                lambda: averaging_utils.average_parameters(iter(self.model.parameters()), group)
            )

    def global_params(self) -> tuple[torch.Tensor, int]:
        samples = self.local_steps * self.cfg.batch_size * self.cfg.workers
        return flatten_params(self.model), samples

    def report(self) -> dict[str, Any]:
        r = super().report()
        r["averages"] = self.averages
        return r


if TorchPeriodicAveragerStrategy.name not in STRATEGY_CLASSES:
    register_strategy(TorchPeriodicAveragerStrategy)


# ---------------------------------------------------------------------------- torchft: launcher
class TorchftFailed(RuntimeError):
    """A torchft run did not finish; the message carries the failing process's last output."""


def run_torchft(
    cfg: RunConfig,
    algorithm: str,
    out_dir: str | Path,
    python: str,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Train ``cfg`` with torchft's ``algorithm`` (``localsgd`` or ``diloco``): a lighthouse
    and ``cfg.workers`` replica groups of one process each, run by ``python`` (the peer venv's
    interpreter). Returns a summary with the keys cloudburst's ``summary.json`` uses for the same
    numbers (``final_test_accuracy``, ``sent_bytes``, ``samples``, ``wall_time_s``) plus every
    replica's step times. Raises :class:`TorchftFailed` with the failing process's output."""
    if algorithm not in TORCHFT_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {TORCHFT_ALGORITHMS}, got {algorithm!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        if stale.is_file():
            stale.unlink()
    script = str(Path(__file__).resolve())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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
            replicas.append(
                subprocess.Popen(
                    [
                        python,
                        script,
                        "torchft-replica",
                        "--algorithm",
                        algorithm,
                        "--replica",
                        str(i),
                        "--lighthouse",
                        address,
                        "--config",
                        str(out / "config.json"),
                        "--out",
                        str(out),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=REPO,
                )
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
        "step_times": {str(i): r["step_times"] for i, r in enumerate(reports)},
        "launch_to_summary_s": time.monotonic() - t0,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text().strip().splitlines()
    except OSError as e:
        return f"(no output: {e})"
    return " | ".join(text[-lines:]) or "(no output)"


# ---------------------------------------------------------------------------- torchft: processes
def lighthouse_main(min_replicas: int) -> None:
    """Serve a torchft lighthouse on 127.0.0.1 (a free port); print its address; exit when
    stdin closes (the launcher's signal)."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas)
    print(server.address(), flush=True)
    sys.stdin.read()
    server.shutdown()


def torchft_replica(algorithm: str, replica: int, lighthouse: str, cfg: RunConfig, out: Path):
    """One replica group (one process): train ``cfg`` with torchft's ``algorithm``."""
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
    shard = worker_source(data, replica, cfg.workers)
    # Exactly the batches cloudburst's worker ``replica`` draws (train.run_worker).
    stream = batch_stream(
        shard,
        cfg.batch_size,
        seed=cfg.seed * 1000 + replica,
        preprocess=data.preprocess(augment=cfg.augment),
    )
    total = cfg.steps_per_worker(len(data.train))
    if total % cfg.period:
        raise ValueError(
            f"torchft runs need steps ({total}) to be a multiple of period ({cfg.period}): "
            "torchft's algorithms end on one model only after a sync"
        )
    loss_fn = nn.CrossEntropyLoss()

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
    if algorithm == "localsgd":
        algo = LocalSGD(manager, model, optimizer, sync_every=cfg.period)
    else:
        outer = torch.optim.SGD(
            model.parameters(),
            lr=cfg.diloco_outer_lr,
            momentum=cfg.diloco_outer_momentum,
            nesterov=cfg.diloco_nesterov and cfg.diloco_outer_momentum > 0,
        )
        algo = DiLoCo(manager, [model], optimizer, outer, sync_every=cfg.period, pin_memory=False)
    _file_barrier(out, replica, cfg.workers, timeout_s=120.0)

    step_times: list[list[float]] = []
    t0 = time.perf_counter()
    loss = float("nan")
    with algo:
        for step in range(1, total + 1):
            xb, yb = next(stream)
            loss_t = loss_fn(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss_t.backward()
            optimizer.step()  # torchft's post-step hook syncs every H steps
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


def median_step_s(step_times: dict[str, list[list[float]]]) -> float | None:
    """Median over every replica's logged windows of (Δtime / Δsteps) between consecutive
    step records — the measure ``benchmarks/local_sgd.py`` uses for every variant."""
    per_step = [
        (b[1] - a[1]) / (b[0] - a[0])
        for times in step_times.values()
        for a, b in zip(times, times[1:], strict=False)
        if b[0] > a[0]
    ]
    return statistics.median(per_step) if per_step else None


def main() -> None:
    p = argparse.ArgumentParser(description="torchft peer processes (run by the peer venv)")
    sub = p.add_subparsers(dest="command", required=True)
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--min-replicas", type=int, required=True)
    rp = sub.add_parser("torchft-replica")
    rp.add_argument("--algorithm", choices=TORCHFT_ALGORITHMS, required=True)
    rp.add_argument("--replica", type=int, required=True)
    rp.add_argument("--lighthouse", required=True)
    rp.add_argument("--config", required=True)
    rp.add_argument("--out", required=True)
    args = p.parse_args()
    if args.command == "lighthouse":
        lighthouse_main(args.min_replicas)
        return
    cfg = RunConfig.from_dict(json.loads(Path(args.config).read_text()))
    torchft_replica(args.algorithm, args.replica, args.lighthouse, cfg, Path(args.out))


if __name__ == "__main__":
    main()
