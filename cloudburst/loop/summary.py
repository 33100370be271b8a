"""A run's ``summary.json`` and the table the CLI prints of it.

A finished run's summary is written by rank 0 (:func:`finalize_run`): it evaluates the final
global θ, gathers every rank's report (:func:`hand_in`) and writes the file. A run that did not
finish (interrupted, or failed) gets :func:`partial_summary` instead — what was done so far,
read from its metrics files and checkpoints, and the command that continues it — written by
whoever stops the run (the local launcher, or rank 0 under a user's torchrun) from the files
alone, so it needs no live rank. A run that finished with a final test loss that is not
finite (θ diverged) failed too: its summary's ``failed`` says so (:func:`diverged`), and the
CLI exits non-zero with that line.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cloudburst.comm.flat import assign_flat
from cloudburst.config import RunConfig
from cloudburst.data import Dataset, evaluate_dataset, in_memory
from cloudburst.records.checkpoint import load_model_buffers, save_model
from cloudburst.records.metrics import MetricsWriter, iter_jsonl, time_to_target, write_json_atomic
from cloudburst.runtime.context import Context
from cloudburst.strategies import REGISTRY

log = logging.getLogger(__name__)


def resume_command(out: str | Path) -> str:
    """The command that continues the run in ``out`` from its checkpoints."""
    return f"cloudburst train --resume {shlex.quote(str(out))}"


def partial_summary(cfg: RunConfig, **status: Any) -> dict[str, Any]:
    """What the run in ``cfg.output.out`` did so far (``status``: e.g. ``interrupted=True`` or
    ``failed="..."``), from its metrics: each worker's last logged step and samples, the last
    evaluation of the global model, the checkpoints a resume would start from."""
    out = Path(cfg.output.out)
    last_step: dict[int, dict[str, Any]] = {}
    last_eval: dict[str, Any] | None = None
    wall_time_s = 0.0
    for path in sorted((out / "metrics").glob("rank*.jsonl")):
        for record in iter_jsonl(path):
            time_s = record.get("time_s")
            if isinstance(time_s, int | float):
                wall_time_s = max(wall_time_s, float(time_s))
            event = record.get("event")
            if event == "step" and isinstance(record.get("rank"), int):
                last_step[record["rank"]] = record
            elif event == "eval" and isinstance(record.get("test_accuracy"), int | float):
                if last_eval is None or record.get("time_s", 0) >= last_eval.get("time_s", 0):
                    last_eval = record
    checkpoints = sorted(
        str(p.relative_to(out)) for p in (out / "checkpoints").glob("*.pt") if p.is_file()
    )
    return {
        "strategy": cfg.job.strategy,
        "workers": cfg.job.workers,
        "servers": cfg.job.servers,
        **status,
        "final_test_accuracy": None if last_eval is None else last_eval["test_accuracy"],
        "accuracy_is_last_evaluation": True,
        "wall_time_s": wall_time_s,
        "time_to_target_s": None,
        "samples": sum(int(r.get("samples", 0)) for r in last_step.values()),
        "steps_done": {str(rank): int(r.get("step", 0)) for rank, r in sorted(last_step.items())},
        "sent_bytes": sum(int(r.get("sent_bytes", 0)) for r in last_step.values()),
        "lost_workers": [],
        "checkpoints": checkpoints,
        "resume_command": resume_command(out) if checkpoints else None,
        "config": cfg.to_dict(),
    }


def write_partial_summary(cfg: RunConfig, **status: Any) -> dict[str, Any]:
    summary = partial_summary(cfg, **status)
    write_json_atomic(Path(cfg.output.out) / "summary.json", summary)
    return summary


def interrupted_message(summary: dict[str, Any]) -> str:
    """One line for the user: where the run stopped and how to continue it."""
    steps = summary.get("steps_done") or {}
    done = f"{max(steps.values())} steps" if steps else "no step logged yet"
    if summary.get("resume_command"):
        return (
            f"cloudburst: interrupted after {done}; the last checkpoints are kept, continue with: "
            f"{summary['resume_command']}"
        )
    return f"cloudburst: interrupted after {done}; no checkpoint was written yet"


def format_summary(summaries: list[dict[str, Any]], labels: list[str] | None = None) -> str:
    """The comparison table the CLI prints: one row per run (``labels``: a first column).
    Simulated runs' times are virtual seconds, and their columns say so. Language models show
    their test loss (nats per token) and bits per byte, and the time to ``--target-loss``,
    where classifiers show the test accuracy and the time to ``--target-accuracy``."""
    virtual = bool(summaries) and all(s.get("simulated") for s in summaries)
    text = bool(summaries) and all("final_bits_per_byte" in s for s in summaries)
    quality = (
        [("test loss", "final_test_loss", "{:.4f}"), ("bits/byte", "final_bits_per_byte", "{:.4f}")]
        if text
        else [("test acc", "final_test_accuracy", "{:.4f}")]
    )
    to_target = "time_to_target_loss_s" if text else "time_to_target_s"
    cols = [
        ("strategy", "strategy", "{}"),
        ("W", "workers", "{}"),
        ("S", "servers", "{}"),
        *quality,
        ("virtual s" if virtual else "wall s", "wall_time_s", "{:.1f}"),
        ("to target virtual s" if virtual else "to target s", to_target, "{:.1f}"),
        ("samples", "samples", "{}"),
        ("MB sent", "sent_bytes", "{:.1f}"),
        *strategy_columns(s.get("strategy") for s in summaries),
        ("lost", "lost_workers", "{}"),
    ]
    if labels is not None:
        cols.insert(0, ("run", "_label", "{}"))
        summaries = [{**s, "_label": label} for s, label in zip(summaries, labels, strict=True)]
    rows = [[name for name, _, _ in cols]]
    for s in summaries:
        row = []
        for _, key, fmt in cols:
            v = s.get(key)
            if key == "sent_bytes" and v is not None:
                v = v / 1e6
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def strategy_columns(names: Iterable[Any]) -> list[tuple[str, str, str]]:
    """The columns the runs' strategies add to the table (``report_columns``), each once."""
    cols: list[tuple[str, str, str]] = []
    for name in names:
        if name in REGISTRY:
            cols += [c for c in REGISTRY[name].report_columns if c not in cols]
    return cols


def failed_message(summary: dict[str, Any]) -> str:
    """One line for the user: why the run stopped and how to continue it."""
    steps = [n for n in (summary.get("steps_done") or {}).values() if isinstance(n, int)]
    done = f"after {max(steps)} steps" if steps else "before any step was logged"
    line = f"cloudburst: the run failed {done}: {summary.get('failed')}"
    if "final_test_loss" in summary:  # it finished: what diverged is its final θ
        return line
    if summary.get("resume_command"):
        return f"{line}; the last checkpoints are kept, continue with: {summary['resume_command']}"
    return f"{line}; no checkpoint was written yet"


def finished_exit_code(out: str | Path) -> int:
    """Rank 0 of a user's torchrun, its run over: 1, with the one line, when the summary it
    wrote says the run failed (θ diverged: :func:`diverged`), else 0."""
    try:
        summary = json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(summary, dict) or not summary.get("failed"):
        return 0
    print(failed_message(summary), file=sys.stderr, flush=True)
    return 1


# ---------------------------------------------------------------------------- a finished run
def diverged(test_loss: float) -> str | None:
    """Why a finished run failed, or None: its final model's test loss is NaN or infinite
    (θ diverged: its accuracy is chance, whatever the run's other numbers say)."""
    if math.isfinite(test_loss):
        return None
    return (
        f"the final model's test loss is {test_loss} (θ diverged); lower --lr (or the "
        "strategy's server or outer lr), or clip with --clip-grad-norm"
    )


def hand_in(ctx: Context, metrics: MetricsWriter, report: dict[str, Any], time_s: float) -> None:
    """Log this rank's final report; ranks other than 0 also leave it in the store for rank 0."""
    metrics.log("final", time_s=time_s, **{k: v for k, v in report.items() if k != "evals"})
    if ctx.rank != 0:
        ctx.store.set(f"stats/{ctx.rank}", json.dumps(report))


def finalize_run(
    ctx: Context,
    model: nn.Module,
    theta: torch.Tensor,
    data: Dataset,
    metrics: MetricsWriter,
    own_report: dict[str, Any],
    lost: list[int],
    wall_time_s: float,
    global_samples: int,
) -> dict[str, Any]:
    """Rank 0: evaluate the final global θ, gather every rank's report, write the summary."""
    cfg = ctx.cfg
    assign_flat(model, theta)
    if ctx.is_server and any(True for _ in model.buffers()) and cfg.job.servers not in lost:
        try:
            ctx.store.wait(["buffers"], _seconds(cfg.faults.comm_timeout_s))
            load_model_buffers(model, ctx.store.get("buffers"))
        except Exception as e:  # noqa: BLE001 - worker 0 was lost: keep the initial buffers
            log.warning("no model buffers from worker 0 (%s); evaluating with initial ones", e)
    t_start = ctx.comm.now()
    acc, test_loss = evaluate_dataset(
        model,
        in_memory(data.test),
        data.preprocess(augment=False),
        ctx.device,
        autocast=cfg.model.autocast == "bf16",
    )
    eval_s = ctx.comm.now() - t_start
    reports = {0: own_report}
    for r in range(1, ctx.world_size):
        if r in lost:
            continue
        key = f"stats/{r}"
        try:
            ctx.store.wait([key], _seconds(cfg.faults.comm_timeout_s))
            reports[r] = json.loads(ctx.store.get(key))
        except Exception as e:  # noqa: BLE001 - a rank that died after training
            log.warning("no report from rank %d (%s); it is counted as lost", r, e)
            if r >= cfg.job.servers:
                lost.append(r)
    # As every evaluation record (cloudburst.loop.evaluator.Evaluator): the clock, and the
    # clock less the time the evaluating worker spent on every earlier evaluation.
    metrics.log(
        "eval",
        time_s=wall_time_s,
        train_time_s=wall_time_s - evaluation_time_s(reports.values()),
        eval_s=eval_s,
        samples=global_samples,
        test_accuracy=acc,
        test_loss=test_loss,
        final=True,
    )
    save_model(f"{cfg.output.out}/model.pt", model, {"config": cfg.to_dict(), "test_accuracy": acc})
    lost_set = set(lost) | {r for rep in reports.values() for r in rep.get("lost_workers", [])}
    evals = [e for rep in reports.values() for e in rep.get("evals", [])]
    evals.append([wall_time_s, global_samples, acc])
    workers = [rep for r, rep in reports.items() if rep.get("role") == "worker"]
    servers = [rep for rep in reports.values() if rep.get("role") == "server"]
    failed = diverged(test_loss)
    if failed is not None:
        log.error("the run failed: %s", failed)
    summary = {
        "strategy": cfg.job.strategy,
        "workers": cfg.job.workers,
        "servers": cfg.job.servers,
        **({"failed": failed} if failed else {}),  # (a run that did not fail has no key)
        "final_test_accuracy": acc,
        "final_test_loss": test_loss,
        **_loss_target(cfg, reports.values(), wall_time_s, test_loss),
        "wall_time_s": wall_time_s,
        "target_accuracy": cfg.metrics.target_accuracy,
        "time_to_target_s": time_to_target(
            [{"time_s": t, "test_accuracy": a} for t, _, a in evals], cfg.metrics.target_accuracy
        ),
        "samples": sum(w["samples"] for w in workers),
        "samples_applied": global_samples,
        "steps_per_worker": cfg.steps_per_worker(len(data.train)),
        # Each worker's steps (fewer than steps_per_worker when the time budget ended it).
        "steps_done": {
            str(r): rep.get("steps") for r, rep in reports.items() if rep.get("role") == "worker"
        },
        "train_time_s": wall_time_s - evaluation_time_s(reports.values()),
        "max_train_time_s": cfg.training.max_train_time_s,
        "stopped_by": stopped_by(workers),
        "device": str(ctx.device if not ctx.is_server else _worker_device(reports)),
        "backend": ctx.backend,
        "nodes": ctx.num_nodes,
        "replica": cfg.cluster.replica,
        "replicas": cfg.replicas,
        "ranks_per_replica": cfg.ranks_per_replica,
        **_placement_summary(ctx, reports),
        "inter_node_bytes": sum(rep.get("inter_node_bytes", 0) for rep in reports.values()),
        "intra_node_bytes": sum(rep.get("intra_node_bytes", 0) for rep in reports.values()),
        "sent_bytes": sum(rep["sent_bytes"] for rep in reports.values()),
        "received_bytes": sum(rep["received_bytes"] for rep in reports.values()),
        "comm_wait_s": sum(rep["comm_wait_s"] for rep in reports.values()),
        "messages_rejected": sum(rep.get("messages_rejected", 0) for rep in reports.values()),
        "dropped_peers": sorted(
            {r for rep in reports.values() for r in rep.get("dropped_peers", [])}
        ),
        "lost_workers": sorted(lost_set),
        # the shards' own fields (staleness, refused pushes, restarts), from the strategy
        **(cfg.strategy_spec.summary_fields(servers) if servers else {}),
        "steps_skipped_nonfinite": sum(w.get("steps_skipped_nonfinite", 0) for w in workers),
        **_replica_summary(workers),
        "config": cfg.to_dict(),
    }
    write_json_atomic(f"{cfg.output.out}/summary.json", summary)
    log.info("summary written: accuracy %.4f in %.1f s", acc, wall_time_s)
    return summary


def _placement_summary(ctx: Context, reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Where the shards are (``shard_nodes``: shard k's node) and the bytes each node's ranks
    put on the inter-node link (``node_nic_bytes``: the sum of their ``inter_node_bytes``).

    ``inter_node_bytes`` is counted where the bytes leave: a message to a rank on another node
    by its sender alone (its receiver counts it in ``received_bytes`` only), a collective whose
    group spans nodes by every member, as the share a ring all-reduce sends from it (hops
    inside a node included). So a node's number is what its ranks sent towards other nodes
    (its NIC's egress, collectives counted at their ring share); a lost rank's bytes are
    missing. The simulated NIC (``simulated_node_nic_bytes``) counts egress and ingress."""
    node_of = ctx.topology.node_of if ctx.topology is not None else (0,) * ctx.world_size
    nic = [0] * ctx.num_nodes
    for rank, rep in reports.items():
        nic[node_of[rank]] += int(rep.get("inter_node_bytes", 0))
    return {"shard_nodes": list(node_of[: ctx.cfg.job.servers]), "node_nic_bytes": nic}


def _loss_target(cfg, reports, wall_time_s: float, test_loss: float) -> dict[str, Any]:
    """Language models (docs/lm.md): bits per byte, and the time to ``target_loss`` held for
    ``TARGET_HELD_EVALS`` evaluations (the final one included)."""
    if cfg.dataset_kind_path()[0] != "text":
        return {}
    from cloudburst.records.metrics import time_to_target_loss

    evals = [e for rep in reports for e in rep.get("loss_evals", [])]
    return {
        "final_bits_per_byte": test_loss / math.log(2),
        "target_loss": cfg.metrics.target_loss,
        "time_to_target_loss_s": time_to_target_loss(
            [*evals, [wall_time_s, test_loss]], cfg.metrics.target_loss
        ),
    }


def stopped_by(workers: list[dict[str, Any]]) -> str:
    """``time_budget`` when --max-train-time-s ended a worker's training, else ``steps`` (its
    --steps or --epochs ran out)."""
    budget = any(w.get("stopped_by") == "time_budget" for w in workers)
    return "time_budget" if budget else "steps"


def evaluation_time_s(reports) -> float:
    """Seconds the evaluating worker spent on its evaluations during training (its report's
    ``eval_time_s``; 0 when no report has one, e.g. its worker was lost)."""
    return sum(float(rep.get("eval_time_s", 0.0)) for rep in reports)


def _replica_summary(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Decentralised strategies: each replica's accuracy and the worst one (the final model
    is the replicas' average)."""
    accs = [w["replica_accuracy"] for w in workers if "replica_accuracy" in w]
    if not accs:
        return {}
    return {"replica_accuracies": accs, "worst_replica_accuracy": min(accs)}


def _worker_device(reports: dict[int, dict[str, Any]]) -> str:
    for rep in reports.values():
        if rep.get("role") == "worker" and "device" in rep:
            return rep["device"]
    return "cpu"


def _seconds(s: float):
    import datetime

    return datetime.timedelta(seconds=s)
