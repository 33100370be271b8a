"""This worker's injected faults (``--inject-fault``): armed on a first attempt only."""

from __future__ import annotations

import time

from cloudburst.config.faults import FaultInjector, parse_faults
from cloudburst.records.metrics import MetricsWriter
from cloudburst.runtime import restart_count
from cloudburst.runtime.context import Context


def worker_faults(ctx: Context, metrics: MetricsWriter) -> FaultInjector:
    """The faults aimed at this rank; a restarted or resumed run fires none again."""
    cfg = ctx.cfg
    return FaultInjector(
        parse_faults(cfg.faults.inject_fault, cfg.job.servers, cfg.world_size),
        ctx.rank,
        active=restart_count() == 0 and not cfg.faults.resume,
        on_fire=lambda f, step: metrics.log("fault", step=step, kind=f.kind, wall=time.time()),
        stop=ctx.comm.stop_self,
    )
