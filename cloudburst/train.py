"""A real rank's process: what every process of a job runs (under ``cloudburst train`` or a
user's ``torchrun``).

:func:`run_rank` joins the job (:func:`cloudburst.runtime.init_distributed`), starts the
watchdog that stops it when a rank it depends on goes silent, turns SIGTERM into Ctrl-C, and
runs its part of the job: :func:`cloudburst.loop.role.run_role`, the same rank main a virtual
rank runs (:mod:`cloudburst.sim.run`). A user's own loop takes the same components through
:class:`cloudburst.api.Job`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

from cloudburst.comm.liveness import EXIT_PEER_LOST, Watchdog, mark_done, watched_peers
from cloudburst.config import RunConfig
from cloudburst.data import load_run_dataset
from cloudburst.forkserver import die_with_parent, raise_open_files_limit
from cloudburst.loop.role import run_role
from cloudburst.loop.summary import failed_message, interrupted_message, write_partial_summary
from cloudburst.records.metrics import MetricsWriter, write_json_atomic
from cloudburst.runtime import init_distributed, shutdown
from cloudburst.runtime.context import Context

log = logging.getLogger(__name__)


def run_rank(cfg_dict: dict[str, Any]) -> None:
    """Entry point of one rank. ``cfg_dict`` is a :meth:`RunConfig.to_dict`."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        # Started by torch's agent (or, in a local job, by the forkserver the launcher
        # started): end with that process, however it ends, instead of training on
        # unsupervised. A rank started by hand (no agent) is left to its own parent.
        die_with_parent()
    raise_open_files_limit()  # gloo and the store cost a descriptor per connection
    cfg = RunConfig.from_dict(cfg_dict)
    ctx = init_distributed(cfg, cfg.strategy_spec)
    if ctx.rank == 0:  # what --resume reads back (the local launcher also writes it)
        write_json_atomic(f"{cfg.output.out}/config.json", cfg.to_dict())
    metrics = MetricsWriter(cfg.output.out, ctx.rank, ctx.role, tensorboard=cfg.metrics.tensorboard)
    metrics.log(
        "start",
        wall=time.time(),
        pid=os.getpid(),
        world_size=ctx.world_size,
        device=str(ctx.device),
        backend=ctx.backend,
    )
    # SIGTERM (torchrun's agent stopping its ranks, or a scheduler) stops a rank as Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    watchdog = start_watchdog(ctx, metrics)
    try:
        run_role(ctx, load_run_dataset(cfg), metrics)
        watchdog.stop()
        mark_done(ctx.liveness_store, ctx.rank)
    except KeyboardInterrupt:
        _interrupted(ctx, metrics, watchdog)
    except Exception:
        # A peer's death reaches this rank first as a failed send or receive: let the
        # watchdog name it (it exits with that reason) before reporting an error of our own.
        # The peer may have been stopped by Ctrl-C like this rank, whose signal then arrives
        # while it waits.
        try:
            watchdog.settle()
        except KeyboardInterrupt:
            _interrupted(ctx, metrics, watchdog)
        raise
    finally:
        metrics.close()
        shutdown(ctx)


def _interrupted(ctx: Context, metrics: MetricsWriter, watchdog: Watchdog) -> None:
    """Ctrl-C or SIGTERM: record it; under a user's torchrun rank 0 writes the summary and the
    resume command (a local job's launcher does it itself); exit 130."""
    watchdog.stop()  # the others are stopping too: their silence is no failure
    metrics.log("interrupted", time_s=ctx.elapsed_s())
    if ctx.rank == 0 and not os.environ.get("CLOUDBURST_LOCAL_JOB"):
        summary = write_partial_summary(ctx.cfg, interrupted=True)
        print(interrupted_message(summary), file=sys.stderr, flush=True)
    raise SystemExit(130) from None


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def start_watchdog(ctx: Context, metrics: MetricsWriter) -> Watchdog:
    """Stop this rank within ``heartbeat_timeout_s`` of a rank it depends on going silent
    (see :mod:`cloudburst.comm.liveness`): record why, and under a user's torchrun write the
    run's summary (a local job's launcher writes it), then exit."""
    cfg = ctx.cfg
    watched = watched_peers(
        ctx.rank, ctx.world_size, cfg.job.servers, cfg.strategy_spec.survives_worker_loss
    )

    def on_lost(rank: int | None, role: str) -> None:
        time_s = ctx.elapsed_s()
        reason = f"{role} lost at {time_s:.1f} s"
        log.error(
            "%s (no heartbeat for %g s): stopping this rank", reason, cfg.faults.heartbeat_timeout_s
        )
        try:
            metrics.log("peer_lost", lost_rank=rank, reason=reason, time_s=time_s)
            if not os.environ.get("CLOUDBURST_LOCAL_JOB"):
                summary = write_partial_summary(cfg, failed=reason)
                print(failed_message(summary), file=sys.stderr, flush=True)
        finally:
            os._exit(EXIT_PEER_LOST)

    return Watchdog(ctx.liveness_store, watched, cfg.faults.heartbeat_timeout_s, on_lost).start()
