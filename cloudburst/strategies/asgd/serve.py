"""How a server rank serves its shard (:func:`serve_shard`, the strategy spec's ``server`` for
asgd, easgd and async_diloco): restored from its checkpoint on a resume or a restart, with the
hot standby copy of the shard before it (``--shard-standby``: :class:`Standby`, which takes
that shard over when its server dies), then :class:`~cloudburst.strategies.asgd.server.
ServerLoop` until every worker finished or was lost. docs/failures.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import torch

from cloudburst.comm.liveness import FAILOVER_KEY
from cloudburst.comm.messages import Header, Kind, Status
from cloudburst.comm.transport import Task
from cloudburst.records.resilience import shard_checkpoint_path
from cloudburst.strategies.asgd.server import ServerLoop
from cloudburst.strategies.asgd.serving import first_line
from cloudburst.strategies.asgd.shard import make_shard

log = logging.getLogger("cloudburst.strategies.asgd.server")  # the shard's one log


_FORWARDED = {int(Kind.PUSH), int(Kind.INIT), int(Kind.DONE)}


class Standby:
    """Server s's hot copy of shard p = s − 1 (mod S), kept by applying every request that
    p's server forwards (PUSH with the push's base version and samples, INIT), in p's order,
    before p replies to the worker; each forward is answered once applied.

    When p's server dies (the link breaks), this server takes shard p over: it marks p as
    failed over in the job store (the watchdogs stop watching p), and serves the copy as a
    restarted shard would (:meth:`RequestServing._reconnect_workers`): the workers reconnect, and
    since the copy holds every push a worker saw acknowledged, none is lost. Shard 0 is not
    taken over: its server (rank 0) writes the run's summary, and its death stops the job.
    """

    def __init__(self, loop: ServerLoop, primary: int, link):
        self.loop, self.primary, self.link = loop, primary, link
        a, b = loop.bounds[primary]
        self.replica = make_shard(loop.cfg, loop.theta0[a:b])
        self._buf = torch.empty(b - a)
        self.promoted: ServerLoop | None = None
        self._task: Task | None = None
        self._promoted_task: Task | None = None

    def start(self) -> Standby:
        self._task = self.loop.ctx.comm.spawn(self._run, f"cloudburst-standby-{self.primary}")
        return self

    def join(self) -> None:
        """Until the primary said it is done, or (taken over) the promoted shard finished."""
        self._task.join()
        if self._promoted_task is not None:
            self._promoted_task.join()
            if self.promoted is not None and self.promoted.error is not None:
                raise self.promoted.error

    def _run(self) -> None:
        p = self.primary
        while True:
            try:
                h = self.link.recv_reply(p, self._buf)
                kind = Kind(h.aux) if h.aux in _FORWARDED else None
                if h.shard != p or kind is None or h.numel not in (0, self._buf.numel()):
                    raise RuntimeError(f"not a forwarded request from shard {p}'s server: {h}")
                if kind == Kind.INIT:
                    self.replica.set_theta(self._buf)
                elif kind == Kind.PUSH:
                    refused = h.status == Status.REFUSED
                    self.replica.apply_push(self._buf, h.version, h.samples, refused=refused)
                self.link.send(p, Header(Kind.REPLY, shard=p, version=self.replica.version))
                if kind == Kind.DONE:
                    return
            except (RuntimeError, ValueError) as e:
                log.error("shard %d's server is lost (%s)", p, first_line(e))
                self._take_over()
                return

    def _take_over(self) -> None:
        p, loop = self.primary, self.loop
        if p == 0:
            log.error("shard 0 is not taken over (its server writes the summary)")
            return
        ctx = dataclasses.replace(loop.ctx, rank=p, shard_incarnation=1)
        liveness = ctx.comm.liveness_monitor(
            ctx.store, ctx.replica_ranks, loop.cfg.faults.heartbeat_timeout_s
        )
        promoted = ServerLoop(ctx, loop.theta0, loop.metrics, liveness)
        promoted.shard, promoted.awaiting_init = self.replica, False
        promoted.restored_version, promoted.failed_over = self.replica.version, True
        ctx.store.set(FAILOVER_KEY.format(shard=p), str(loop.ctx.rank))
        loop.metrics.log("failover", time_s=ctx.elapsed_s(), shard=p, version=self.replica.version)
        log.warning("took shard %d over at version %d", p, self.replica.version)
        self.promoted = promoted

        def serve() -> None:
            try:
                promoted.run()
                ctx.store.set(f"stats/{p}", json.dumps({"role": "server", **promoted.stats()}))
            except BaseException as e:  # noqa: BLE001 - raised again by join()
                promoted.error = e

        # Not a daemon: the process serves the taken-over shard's workers to their end.
        self._promoted_task = ctx.comm.spawn(serve, f"cloudburst-shard{p}", daemon=False)


def start_standby(loop: ServerLoop) -> None:
    """--shard-standby: this server's link to its own shard's standby, and its standby copy
    of the shard before it, both built now (in the order of the shard they serve, so that
    every server builds its two pair groups in an order that never waits in a cycle)."""
    from cloudburst.records.resilience import load_shard_state
    from cloudburst.runtime.groups import standby_link

    cfg, ctx = loop.cfg, loop.ctx
    own, before = ctx.server_index, (ctx.server_index - 1) % cfg.job.servers
    for p in sorted({own, before}):
        link = standby_link(ctx, p, loop._standby_stats)
        if p == own:
            loop.standby_link = link
        else:
            loop.standby = Standby(loop, p, link)
    path = shard_checkpoint_path(cfg.output.out, before)
    if cfg.faults.resume and path.is_file():
        loop.standby.replica.load_state_dict(load_shard_state(path, cfg))
    loop.standby.start()


def serve_shard(ctx, theta0: torch.Tensor, metrics) -> ServerLoop:
    """Serve this server rank's shard of θ (starting from ``theta0``, the full flat θ) until
    every worker finished or was lost; returns the loop (its stats, the final θ).

    The one way a shard is served, by the CLI's ranks and by ``Job.serve`` alike: a resumed
    run (``--resume``, or a restart) continues from the shard's checkpoint when there is one
    (refused when it belongs to another run or to other shard bounds); a new run removes an
    earlier run's shard file first.
    """
    from cloudburst.records.checkpoint import CheckpointError
    from cloudburst.records.resilience import load_shard_state
    from cloudburst.runtime import restart_count

    cfg = ctx.cfg
    liveness = ctx.comm.liveness_monitor(
        ctx.store, ctx.replica_ranks, cfg.faults.heartbeat_timeout_s
    )
    loop = ServerLoop(ctx, theta0, metrics, liveness)
    elapsed_s = 0.0
    path = shard_checkpoint_path(cfg.output.out, ctx.server_index)
    if not (cfg.faults.resume or restart_count() > 0):
        path.unlink(missing_ok=True)  # an earlier run's shard in a used directory
    elif path.is_file():
        state = load_shard_state(path, cfg)
        if list(map(list, state["bounds"])) != [list(b) for b in loop.bounds]:
            raise CheckpointError(f"checkpoint {str(path)!r} was written for other shard bounds")
        loop.shard.load_state_dict(state)
        loop.awaiting_init = False
        loop.restored_version = loop.shard.version
        elapsed_s = float(state.get("elapsed_s", 0.0))
        metrics.log("resume", version=loop.shard.version, attempt=restart_count(), wall=time.time())
        log.info("shard %d resumed at version %d", ctx.server_index, loop.shard.version)
    if cfg.asgd.shard_standby and ctx.comm.restarts_ranks and not loop.incarnation:
        start_standby(loop)
    if loop.incarnation:
        # Died before its first checkpoint: θ0 at version 0 (a warm start's θ is lost too).
        loop.awaiting_init = False
        if loop.restored_version is None:
            loop.restored_version = 0
            metrics.log("resume", version=0, attempt=restart_count(), wall=time.time())
    ctx.start_clock(elapsed_s)
    loop.run()
    if loop.standby is not None:
        loop.standby.join()
    return loop
