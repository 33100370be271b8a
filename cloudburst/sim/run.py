"""Run a job on the virtual cluster: every rank of ``cfg`` as a task of one process.

The ranks run cloudburst's own code — :func:`cloudburst.loop.role.run_worker` with the configured
strategy, :func:`cloudburst.loop.role.run_server` for the parameter-server shards — on a
:class:`~cloudburst.sim.transport.SimTransport` instead of torch.distributed. The run writes
what a real run writes (``config.json``, ``metrics/rank*.jsonl``, ``summary.json``,
``model.pt``), with times in virtual seconds; ``summary.json`` adds ``"simulated": true``, the
clock model, and what the simulation itself cost.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cloudburst.comm.flat import flatten_params
from cloudburst.config import RunConfig
from cloudburst.config.faults import FaultInjector, parse_faults
from cloudburst.config.simulation import SimulationConfig
from cloudburst.data import load_run_dataset
from cloudburst.loop.role import run_role
from cloudburst.loop.train_step import calibrate_step_time
from cloudburst.models import build_run_model
from cloudburst.records.metrics import MetricsWriter, write_json_atomic
from cloudburst.runtime import build_context
from cloudburst.runtime.context import Context
from cloudburst.sim.clock import ClockModel, resolve_step_time
from cloudburst.sim.network import SimNetwork
from cloudburst.sim.scheduler import Scheduler
from cloudburst.sim.transport import NullHeartbeat, SimStore, SimTransport

log = logging.getLogger(__name__)


class SimulationFailed(RuntimeError):
    """The simulated job failed as the real one would have (a rank raised)."""


class VirtualCluster:
    """The ranks of one job on one simulated network: the scheduler, the network and its
    groups, the store, and each rank's :class:`~cloudburst.runtime.Context` (whose ``comm``
    is a :class:`~cloudburst.sim.transport.SimTransport`)."""

    def __init__(self, cfg: RunConfig, clock):
        from cloudburst.comm.link import Topology

        self.cfg, self.clock = cfg, clock
        self.world = cfg.world_size
        # Shards where --shard-placement puts them, workers in blocks (as a real run).
        self.topology = Topology.place(
            cfg.job.workers, cfg.job.servers, cfg.cluster.nodes or 1, cfg.cluster.shard_placement
        )
        self.sched = Scheduler()
        self.net = SimNetwork(self.sched, clock, self.topology, cfg.faults.comm_timeout_s)
        self.store = SimStore(self.net)
        self._faults = parse_faults(cfg.faults.inject_fault, cfg.job.servers, self.world)

    def describe(self) -> str:
        """One line for the run's start: its nodes, where its shards are, its network model
        and why (``"4 node(s); shards on nodes 0,1,2,3 (spread); network model nccl (the run
        models GPUs: --device cuda)"``)."""
        from cloudburst.runtime.placement import shards_line

        cfg, clock = self.cfg, self.clock
        line = f"{self.topology.num_nodes} node(s)"
        line += shards_line(self.topology, cfg.job.servers, cfg.cluster.shard_placement)
        model = getattr(getattr(clock, "sim", None), "network_model", None)
        if model is not None:
            line += f"; network model {model} ({getattr(clock, 'network_model_reason', '')})"
        return line

    def context(self, rank: int) -> Context:
        """Rank ``rank``'s Context, its groups made as a real rank makes them (through its
        transport): called on the rank's own task."""
        cfg = self.cfg
        worker = rank >= cfg.job.servers
        index = rank - cfg.job.servers if worker else None
        slow = FaultInjector(self._faults, rank, active=False).slow_factor
        factor = cfg.straggler_factor(index) * slow if worker else 1.0
        return build_context(
            cfg,
            rank,
            SimTransport(self.net, rank, index, factor),
            store=self.store,
            t0=0.0,
            device=torch.device("cpu"),
            backend="sim",
            topology=self.topology,
            link=None,  # the clock model is the link
            heartbeat=NullHeartbeat(),
        )

    def run(self, rank_main: Callable[[int], Any]) -> list[Any]:
        """``rank_main(rank)`` on every rank, each a task; their results by rank."""
        results: list[Any] = [None] * self.world
        cfg = self.cfg

        def body(rank: int) -> None:
            results[rank] = rank_main(rank)

        for rank in range(self.world):
            role = f"server{rank}" if rank < cfg.job.servers else f"worker{rank - cfg.job.servers}"
            self.sched.spawn(lambda rank=rank: body(rank), role, rank)
        self.sched.run()
        return results


def run_ranks(
    cfg: RunConfig,
    fn: Callable[..., Any],
    *args: Any,
    sim: SimulationConfig | None = None,
    actual_params: int = 1,
) -> list[Any]:
    """``fn(ctx, *args)`` on every rank of ``cfg``'s job on the virtual cluster (one process);
    the results by rank. For scripted scenarios (tests, experiments) that drive a strategy
    or the server loop by hand rather than through the training loop."""
    sim = sim or SimulationConfig(step_time_s=0.01)
    step_time_s, source = resolve_step_time(sim, cfg, calibrate_step_time)
    cluster = VirtualCluster(cfg, ClockModel(sim, cfg, actual_params, step_time_s, source))
    return cluster.run(lambda rank: fn(cluster.context(rank), *args))


def simulate(cfg: RunConfig, sim: SimulationConfig) -> dict[str, Any]:
    """Run ``cfg`` on the virtual cluster ``sim``; returns the summary (also in
    ``cfg.output.out/summary.json``). Raises :class:`SimulationFailed` with the first rank's error
    when the job fails (a partial summary is written first)."""
    from cloudburst.loop.summary import write_partial_summary

    started = time.perf_counter()
    # One process computes for every rank: no DataLoader processes, no TensorBoard writers.
    cfg = cfg.replace(data_workers=0, tensorboard=False, progress=False)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(cfg.output.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "config.json", cfg.to_dict())
    data = load_run_dataset(cfg)
    probe = build_run_model(cfg, data)
    actual_params = flatten_params(probe).numel()
    step_time_s, source = resolve_step_time(sim, cfg, calibrate_step_time)
    clock = ClockModel(sim, cfg, actual_params, step_time_s, source)
    cluster = VirtualCluster(cfg, clock)
    log.info("virtual cluster: %s", cluster.describe())

    def rank_main(rank: int) -> None:
        ctx = cluster.context(rank)
        metrics = MetricsWriter(cfg.output.out, rank, ctx.role)
        metrics.log("start", wall=time.time(), world_size=ctx.world_size, device="cpu")
        try:
            run_role(ctx, data, metrics)
        finally:
            metrics.close()

    try:
        cluster.run(rank_main)
    except BaseException as e:
        reason = _first_line(e)
        write_partial_summary(cfg, failed=reason)
        raise SimulationFailed(f"the simulated job failed: {reason}") from e
    wall_s = time.perf_counter() - started
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text())
    worker_steps = sum(n or 0 for n in summary.get("steps_done", {}).values()) or (
        cfg.job.workers * cfg.steps_per_worker(len(data.train))
    )
    sched, net = cluster.sched, cluster.net
    summary["simulated"] = True
    summary["time_unit"] = "virtual seconds"
    summary["clock_model"] = clock.describe()
    # Each node NIC's bytes, egress + ingress, on the modelled wire (SimNetwork.node_nic_bytes).
    summary["simulated_node_nic_bytes"] = [round(b) for b in net.node_nic_bytes]
    summary["simulator"] = {
        "wall_s": round(wall_s, 3),
        "tasks": len(sched.tasks),
        "task_switches": sched.switches,
        "messages": net.messages,
        "collectives": net.collectives,
        "worker_steps": worker_steps,
        "wall_s_per_worker_step": round(wall_s / max(1, worker_steps), 6),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    write_json_atomic(summary_path, summary)
    return summary


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]
