"""The end of a rank's run, shared by the CLI's loop and :class:`cloudburst.api.Job`: the
strategy's finish and the worker's report, a server's shard served to the end; for the CLI
also the final model and the hand-in to rank 0, which writes the summary."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cloudburst.comm.collectives import all_reduce_sum
from cloudburst.comm.flat import flatten_params
from cloudburst.comm.stats import CommStats
from cloudburst.data import Dataset, evaluate_dataset, in_memory
from cloudburst.loop.summary import finalize_run, hand_in
from cloudburst.records.checkpoint import model_buffers_bytes
from cloudburst.records.metrics import MetricsWriter
from cloudburst.runtime.context import Context
from cloudburst.strategies.base import Strategy


def finish_strategy(strategy: Strategy, stream: Any = None, **fields: Any) -> dict[str, Any]:
    """Flush the strategy's pending updates and leave, close the batch stream; the worker's
    report: its role, ``fields``, then the strategy's communication report."""
    strategy.finish()
    if hasattr(stream, "close"):
        stream.close()
    return {"role": "worker", **fields, **strategy.report()}


def finish_worker(
    ctx: Context,
    model: nn.Module,
    data: Dataset,
    metrics: MetricsWriter,
    strategy: Strategy,
    report: dict[str, Any],
) -> None:
    """Hand this worker's report in; rank 0 (worker 0 when there are no servers) then writes
    the run's summary from the final global model."""
    wall_time_s = ctx.elapsed_s()
    averaged = None
    if strategy.decentralised and ctx.leads_replica:
        # Replicas differ at the end (gossip): report each one's accuracy, and make the final
        # model their average (a measurement collective, not counted as the strategy's traffic).
        report["replica_accuracy"], _ = evaluate_dataset(
            model, in_memory(data.test), data.preprocess(augment=False), ctx.device
        )
        # Push-sum replicas carry weights: the average that preserves the mass.
        weight = float(strategy.replica_weight())
        averaged = torch.cat([flatten_params(model) * weight, torch.tensor([weight])])
        all_reduce_sum(averaged, ctx.replica_group, CommStats(), comm=ctx.comm)
        averaged = averaged[:-1] / averaged[-1]
    if ctx.worker_index == 0 and ctx.num_servers and any(True for _ in model.buffers()):
        # The servers hold parameters only: the model's buffers (batch-norm statistics) that
        # the final evaluation needs come from worker 0's replica.
        ctx.store.set("buffers", model_buffers_bytes(model))
    hand_in(ctx, metrics, report, wall_time_s)
    if ctx.rank == 0:  # no servers: worker 0 is rank 0 and writes the summary
        flat, global_samples = strategy.global_params()
        if averaged is not None:
            flat = averaged
        finalize_run(ctx, model, flat, data, metrics, report, [], wall_time_s, global_samples)


def serve(
    ctx: Context, model: nn.Module, metrics: MetricsWriter
) -> tuple[Any, dict[str, Any], float]:
    """Serve θ's shard (``model`` gives the shapes and the starting θ) until every worker
    finished or was lost, as the strategy serves it (``StrategySpec.serve_shard``); (the
    server loop, the server's report, the job's clock at its end)."""
    loop = ctx.cfg.strategy_spec.serve_shard(ctx, flatten_params(model), metrics)
    wall_time_s = ctx.elapsed_s()
    return loop, {"role": "server", **loop.stats()}, wall_time_s
