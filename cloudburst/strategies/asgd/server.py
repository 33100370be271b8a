"""Parameter-server shards for asynchronous SGD (DistBelief Downpour, GPU A-SGD); async_diloco
and easgd serve on them too.

:class:`ServerLoop` is what a server rank runs for its shard k of θ: receive a request header
from *any* worker, check it, act, reply. Workers never wait for each other, only for a shard's
reply. How requests arrive (one serving task per group, rejoins, reconnects, which workers are
finished or lost) is its :class:`~cloudburst.strategies.asgd.serving.RequestServing`; the maths
of a push is :class:`~cloudburst.strategies.asgd.shard.ShardState`. Contract:

- Requests are applied one at a time, under the serving's lock, in arrival order.
- Nothing is applied before :func:`request_problem` and the finiteness checks pass, nor a push
  whose update is not finite or too large (``--max-push-ratio``: REFUSED, not held against its
  sender, who continues from θ_k: a diverging honest replica pushes the same); a refused
  payload is read and discarded (its size checked first), so the stream stays in step; each
  refusal is its sender's fault, and after ``MAX_PEER_FAULTS`` the sender is dropped (lost).
- A reply with no θ leaves once the push is admitted, before θ moves; under ``--shard-standby``
  every applied push reaches the standby (:class:`~cloudburst.strategies.asgd.serve.Standby`)
  before its worker's reply.
- A push received whole is applied and recorded even when its reply cannot be sent.
- Shards checkpoint every ``checkpoint_every`` applied pushes; one ``push`` record every
  ``push_log_every`` (and one per push not applied).

The protocol, step by step: docs/algorithms.md#asgd; rejoins, restarted shards, standbys and
lost workers: docs/failures.md; what is validated and why: docs/security.md.
"""

from __future__ import annotations

import logging
import math
from dataclasses import fields
from typing import Any

import torch

from cloudburst.comm.flat import shard_bounds
from cloudburst.comm.liveness import shard_restarted
from cloudburst.comm.messages import Header, Kind, PeerFaults, Status, worth_logging
from cloudburst.comm.stats import CommStats
from cloudburst.config import RunConfig
from cloudburst.records.checkpoint import save_checkpoint
from cloudburst.records.resilience import identity, shard_checkpoint_path
from cloudburst.runtime.groups import standby_of
from cloudburst.strategies.asgd.serving import RequestServing, first_line
from cloudburst.strategies.asgd.shard import (
    PushResult,
    all_finite,
    make_shard,
    overlapped_push_fetch,
)

log = logging.getLogger(__name__)

# A push's ``samples`` above this is refused: no real push carries 4 billion samples, and the
# shard's count (an int64 in every reply header) stays far from overflowing.
MAX_PUSH_SAMPLES = 2**32


PAYLOAD_KINDS = (Kind.PUSH, Kind.PUSH_FETCH, Kind.INIT)
REQUEST_KINDS = (Kind.FETCH, *PAYLOAD_KINDS, Kind.DONE, Kind.PING)


def request_problem(
    h: Header,
    src: int,
    *,
    shard: int,
    numel: int,
    version: int,
    awaiting_init: bool,
    warm_start_rank: int | None,
) -> str | None:
    """Why shard ``shard`` (``numel`` elements, at ``version``) refuses request ``h`` from
    rank ``src``, or None when it may be served. ``warm_start_rank``: the worker whose INIT
    seeds θ while ``awaiting_init``."""
    if h.kind not in REQUEST_KINDS:
        return f"{h.kind.name} is not a request"
    if h.shard != shard:
        return f"{h.kind.name} addressed to shard {h.shard}"
    if h.status != Status.OK:
        return f"{h.kind.name} with status {h.status}"
    expected = numel if h.kind in PAYLOAD_KINDS else 0
    if h.numel != expected:
        return f"{h.kind.name} with {h.numel} elements, expected {expected}"
    if not 0 <= h.samples <= MAX_PUSH_SAMPLES:
        return f"{h.kind.name} with samples {h.samples}, outside 0..{MAX_PUSH_SAMPLES}"
    if h.kind in (Kind.PUSH, Kind.PUSH_FETCH):
        if awaiting_init:
            return f"{h.kind.name} before the warm-start θ (INIT) arrived"
        if h.version > version:
            return f"{h.kind.name} against version {h.version}, the shard is at {version}"
    if h.kind == Kind.INIT:
        if not awaiting_init:
            return "INIT while no warm start is awaited (θ is seeded once)"
        if src != warm_start_rank:
            return f"INIT from rank {src}, not from the warm-start worker (rank {warm_start_rank})"
    return None


class ServerLoop:
    """The request protocol of server shard k. See the module docstring.

    How requests reach it is its :class:`~cloudburst.strategies.asgd.serving.RequestServing`
    (``self.serving``): one task per group that requests arrive on, each handing a request to
    :meth:`_serve_one` under one lock, so that requests are applied one at a time whatever
    group they came on; the serving also keeps how each worker stands (``lost``,
    ``finished``), which the protocol adds to under that lock.
    """

    def __init__(self, ctx, full_theta: torch.Tensor, metrics, liveness):
        cfg: RunConfig = ctx.cfg
        self.ctx, self.cfg, self.metrics = ctx, cfg, metrics
        self.bounds = shard_bounds(full_theta.numel(), cfg.job.servers)
        a, b = self.bounds[ctx.server_index]
        self.shard = make_shard(cfg, full_theta[a:b])
        # On the world group; a restarted shard has none: each worker reconnects to it on a
        # pair group of their own (reconnect_workers).
        self.incarnation = getattr(ctx, "shard_incarnation", 0)
        transport = None if self.incarnation else ctx.transport()
        self.restored_version: int | None = None  # a restarted shard's, from its checkpoint
        self.failed_over = False  # served by its standby after its own server died
        self.theta0 = full_theta
        # --shard-standby: the exact link to this shard's standby (None: none, or it is lost),
        # and the standby copy this server keeps of the shard before it.
        self.standby_link = None
        # --shard-standby: the copy this server keeps of the shard before (serve.Standby)
        self.standby: Any = None
        self.acked_before_restart = 0  # the highest version workers saw acknowledged before
        # PUSH_FETCH replies overlap with the push when the worker can rebuild θ_after from
        # θ_before (the add rule); an optimizer rule's state lives only here.
        self.overlap_replies = overlapped_push_fetch(cfg)
        # One receive buffer, reused: requests are handled one at a time.
        self._recv_buf = torch.empty(self.shard.theta.numel())
        self.awaiting_init = cfg.training.warm_start_steps > 0
        # Worker 0 trains alone, then seeds every shard with INIT (loop.role.warm_start).
        self.warm_start_rank = ctx.replica_ranks[0] if ctx.replica_ranks else None
        # Guarded by the serving's lock once serving tasks run, as the workers' standing is.
        self.deferred_fetches: list[int] = []
        self.done: set[int] = set()  # workers that sent DONE
        self.faults = PeerFaults(log, f"server {ctx.server_index}")
        self._standby_stats = CommStats()  # of the standby links
        self.error: BaseException | None = None  # a taken-over shard's serving failed
        self.serving = RequestServing(
            ctx,
            metrics,
            liveness,
            transport,
            self.incarnation,
            handle=self._serve_one,
            on_lost=self._forget,
            on_admit=self._admitted,
            on_reconnect=self._reconnected,
            version=lambda: self.shard.version,
        )

    @property
    def numel(self) -> int:
        return self.shard.theta.numel()

    @property
    def transport(self):
        """The world group's transport (None for a restarted shard): the serving's."""
        return self.serving.transport

    @property
    def lost(self) -> set[int]:
        """Workers lost (dropped ones too): the serving's set, added to under its lock."""
        return self.serving.lost

    @property
    def finished(self) -> set[int]:
        """Workers told FINISHED (they exit): the serving's set."""
        return self.serving.finished

    def run(self) -> None:
        self.serving.run()
        self._forward(Kind.DONE)  # the standby's copy is final: it stops listening
        self._checkpoint()
        log.info(
            "server %d finished: version %d, %d lost workers %s, %d rejoins",
            self.ctx.server_index,
            self.shard.version,
            len(self.lost),
            sorted(self.lost),
            self.serving.rejoins,
        )

    # ---------------------------------------------------------------- the serving's callbacks
    def _forget(self, ranks: set[int]) -> None:
        """(Under the lock) ``ranks`` are lost: no deferred fetch is answered to them."""
        self.deferred_fetches = [r for r in self.deferred_fetches if r not in ranks]

    def _admitted(self, rank: int) -> None:
        """(Under the lock) a restarted worker is admitted on a new group: a new process,
        whose stream starts in step whatever the old one sent, and which has not sent DONE."""
        self.faults.forgive(rank)
        self.done.discard(rank)
        self.deferred_fetches = [r for r in self.deferred_fetches if r != rank]

    def _reconnected(self, rank: int, acked: int | None) -> None:
        """(Under the lock) a worker reconnected to this restarted shard, having seen
        ``acked`` acknowledged before the restart (None: nothing)."""
        if acked is not None:
            self.acked_before_restart = max(self.acked_before_restart, acked)
        self.metrics.log(
            "reconnect",
            time_s=self.ctx.elapsed_s(),
            worker=rank,
            acked_version=acked,
            pushes_lost=self.pushes_lost,
        )

    # ---------------------------------------------------------------- the protocol
    def _serve_one(self, transport, src: int, header: Header | None) -> None:
        """Handle one request (under the lock): check it, then serve or reject it."""
        if self.faults.is_dropped(src):
            self.faults.ignore(src)  # its payloads stay unread: none is ever applied
            return
        if src not in self.serving.workers:
            # Not a worker: whether a payload follows is unknown, so nothing more is read.
            self.faults.reject(src, "a request from a rank that is not a worker", in_step=False)
            return
        if self.serving.peer(src) is not transport:
            # Sent by a previous incarnation of a worker that has since rejoined.
            log.warning("ignored a request from rank %d before its restart", src)
            return
        if src in self.lost:
            log.warning("rank %d was declared lost but is talking again; serving it", src)
            self.lost.discard(src)
        try:
            if header is None:
                problem = "malformed header (bad magic, unknown kind or a negative field)"
            else:
                problem = request_problem(
                    header,
                    src,
                    shard=self.ctx.server_index,
                    numel=self.numel,
                    version=self.shard.version,
                    awaiting_init=self.awaiting_init,
                    warm_start_rank=self.warm_start_rank,
                )
            if problem is not None:
                self._reject(src, header, problem)
                return
            self._handle(src, header)
        except RuntimeError as e:
            # The conversation with this one worker broke (it died mid-request: gloo raises
            # at once; or it hung: the group's timeout). The others are still served.
            log.error("lost worker rank %d during a request: %s", src, first_line(e))
            self.lost.add(src)
            self.deferred_fetches = [r for r in self.deferred_fetches if r != src]

    def _reject(self, src: int, h: Header | None, problem: str) -> None:
        """Refuse a request: its payload (announced by ``h.numel``) is read into the receive
        buffer and discarded, so the stream stays in step and it is never applied; then the
        worker gets a REJECTED reply. A payload of unknown size, or larger than the buffer,
        cannot be read safely: the sender is dropped instead."""
        if h is None or h.numel > self.numel:
            if h is not None:
                problem = f"{problem}; a payload of {h.numel} elements cannot be read"
            self.faults.reject(src, problem, in_step=False)
            self._drop(src)
            return
        if self.faults.reject(src, problem):
            self._drop(src)  # too many: its payload stays unread
            return
        if h.numel:
            self.serving.peer(src).recv_payload(src, h.numel, out=self._recv_buf[: h.numel])
        self._reply(src, Status.REJECTED)

    def _drop(self, src: int) -> None:
        """``src`` was dropped (see PeerFaults): lost, never served again, no reply."""
        self.lost.add(src)
        self.deferred_fetches = [r for r in self.deferred_fetches if r != src]
        self.metrics.log(
            "peer_dropped",
            time_s=self.ctx.elapsed_s(),
            worker=src,
            reason=self.faults.dropped[src],
        )

    def _handle(self, src: int, h: Header) -> None:
        transport = self.serving.peer(src)
        if h.kind in (Kind.PUSH, Kind.PUSH_FETCH):
            overlapped = h.kind == Kind.PUSH_FETCH and self.overlap_replies
            if overlapped:
                # θ before this push goes back while Δ comes in (both directions at once); the
                # worker adds its own Δ exactly as add_push will, unless the reply rejects it.
                send_theta = transport.isend_payload(src, self.shard.theta, reply=True)
            # Each chunk of Δ is checked as it arrives, while the next one is on the wire: its
            # norm (for --max-push-ratio) is finite only if every element is, else exactly.
            buf, finite, norms = self._recv_buf, [], []

            def on_chunk(a: int, b: int) -> None:
                n = float(buf[a:b].norm())
                norms.append(n)
                finite.append(math.isfinite(n) or all_finite(buf[a:b]))

            delta = transport.recv_payload(src, self.numel, out=buf, on_chunk=on_chunk)
            if overlapped:
                transport.wait_all([send_theta])  # θ must not change while it is sent
            norm_ok = norms and all(math.isfinite(n) for n in norms)
            result = self.shard.admit_push(
                delta,
                h.version,
                h.samples,
                finite=all(finite) if finite else None,  # (None: checked in admit_push)
                delta_norm=math.sqrt(sum(n * n for n in norms)) if norm_ok else None,
            )
            # A reply that carries no θ depends on the decision only: it leaves before θ
            # moves, so that the worker's own θ + αΔ runs while this server adds the same Δ
            # (both are off the wire, one after the other otherwise). Requests are still
            # applied one at a time: the next one is handled after the add, under the lock.
            with_theta = h.kind == Kind.PUSH_FETCH and not overlapped
            if with_theta and result.status == Status.OK:
                self.shard.add_push(delta, result.staleness)
            self.ctx.comm.apply_done(delta.numel() * delta.element_size())
            # The standby applies the same push before the worker learns of it: no push that
            # a worker saw acknowledged is missing from the standby's copy.
            self._forward(Kind.PUSH, delta, h.version, h.samples, status=result.status)
            try:
                self._reply(src, result.status, staleness=result.staleness, with_theta=with_theta)
            except RuntimeError:
                # Received whole and admitted (the version counts it, the standby has it):
                # applied and recorded, though its worker never learns so.
                if not with_theta and result.status == Status.OK:
                    self.shard.add_push(delta, result.staleness)
                self._record_push(src, result)
                raise
            if not with_theta and result.status == Status.OK:
                self.shard.add_push(delta, result.staleness)
            if result.status == Status.REJECTED and worth_logging(self.shard.rejected_nonfinite):
                # Not a fault: an honest worker's diverged replica pushes the same.
                log.warning(
                    "rejected a non-finite push from rank %d (%d in all)",
                    src,
                    self.shard.rejected_nonfinite,
                )
            if result.status == Status.REFUSED and worth_logging(self.shard.refused):
                # Not a fault either (a diverging replica's push): its worker is told, and
                # continues from θ_k; θ_k is unchanged.
                log.warning(
                    "refused a push from rank %d: %s (%d refused in all)",
                    src,
                    self.shard.last_refusal,
                    self.shard.refused,
                )
            self._record_push(src, result)
        elif h.kind == Kind.FETCH:
            if self.awaiting_init:
                self.deferred_fetches.append(src)
            else:
                self._reply(src, Status.OK, with_theta=True)
        elif h.kind == Kind.INIT:
            theta = transport.recv_payload(src, self.numel, out=self._recv_buf)
            if not all_finite(theta):
                if self.faults.reject(src, "warm-start θ (INIT) is not finite"):
                    self._drop(src)
                else:
                    self._reply(src, Status.REJECTED)  # the shard still awaits its θ
                return
            self.shard.set_theta(theta)
            self._forward(Kind.INIT, theta)
            self.awaiting_init = False
            self._reply(src, Status.OK)
            for waiting in self.deferred_fetches:
                self._reply(waiting, Status.OK, with_theta=True)
            self.deferred_fetches.clear()
        elif h.kind in (Kind.DONE, Kind.PING):
            self.done.add(src)
            training = set(self.ctx.replica_ranks) - self.done - self.lost
            if training:
                newly_lost = self.serving.liveness.dead(training)
                for r in sorted(newly_lost):
                    log.warning("worker rank %d stopped sending heartbeats: declared lost", r)
                self.lost.update(newly_lost)
                training -= newly_lost
            if training:
                self._reply(src, Status.WAIT)
            else:
                self._reply(src, Status.FINISHED)
                self.finished.add(src)

    def _record_push(self, src: int, result: PushResult) -> None:
        """After a push was decided (and, if OK, applied): its record and the checkpoint."""
        if result.status != Status.OK or self.shard.version % self.cfg.metrics.push_log_every == 0:
            self.metrics.log(
                "push",
                time_s=self.ctx.elapsed_s(),
                worker=src,
                status=result.status.name,
                staleness_versions=result.staleness,
                # the factor it was applied with (|Δ̃|/|Δ| under dc, dc-adaptive, gap)
                scale=self.shard.last_scale if result.status == Status.OK else 0.0,
                version=self.shard.version,
                samples=self.shard.samples,
            )
        if (
            self.cfg.faults.checkpoint_every
            and result.status == Status.OK
            and self.shard.version % self.cfg.faults.checkpoint_every == 0
        ):
            self._checkpoint()

    def _reply(
        self, dst: int, status: Status, staleness: int = 0, with_theta: bool = False
    ) -> None:
        header = Header(
            Kind.REPLY,
            shard=self.ctx.server_index,
            version=self.shard.version,
            numel=self.numel if with_theta else 0,
            samples=self.shard.samples,
            status=status,
            aux=staleness,
        )
        self.serving.reply(dst, header, self.shard.theta if with_theta else None)

    def _forward(
        self,
        kind: Kind,
        payload: torch.Tensor | None = None,
        version: int = 0,
        samples: int = 0,
        status: Status = Status.OK,
    ) -> None:
        """Send one applied request to this shard's standby and wait for its reply (it has
        applied it too). A standby that cannot be reached is lost: the shard goes on alone.
        ``status``: this shard's verdict on a push; the standby follows a REFUSED one rather
        than measure the push again (a norm summed in another order could decide otherwise
        on the bound, and the copy would no longer be this shard's)."""
        if self.standby_link is None:
            return
        k = self.ctx.server_index
        peer = standby_of(k, self.cfg.job.servers)
        # REPLY-tagged, so that the standby receives from this server only (a receive from
        # any source is not woken when its peer dies); the request's kind travels in aux.
        header = Header(
            Kind.REPLY,
            shard=k,
            version=version,
            numel=0 if payload is None else payload.numel(),
            samples=samples,
            status=status,
            aux=int(kind),
        )
        try:
            self.standby_link.send(peer, header, payload)
            self.standby_link.recv_reply(peer)
        except RuntimeError as e:
            log.error("lost the standby of shard %d (rank %d): %s", k, peer, first_line(e))
            self.standby_link = None
            self.metrics.log("standby_lost", time_s=self.ctx.elapsed_s(), standby=peer)

    def _checkpoint(self) -> None:
        save_checkpoint(
            shard_checkpoint_path(self.cfg.output.out, self.ctx.server_index),
            "server-shard",
            {
                "identity": identity(self.cfg),  # refused by another run (resilience)
                "shard": self.ctx.server_index,
                "bounds": self.bounds,
                "elapsed_s": self.ctx.elapsed_s(),
                **self.shard.state_dict(),
            },
        )

    def stats(self) -> dict[str, Any]:
        s = self.shard.stats()
        own = [] if self.transport is None else [self.transport.stats]
        s.update(_sum_stats([*own, *self.serving.rejoin_stats, self._standby_stats]).as_dict())
        # Every refused request once (the transports count only the unreadable headers, which
        # the faults count too), and those of dropped senders, which are not read.
        s["messages_rejected"] = self.faults.rejected + self.faults.ignored
        s["dropped_peers"] = self.faults.dropped_peers()
        s["lost_workers"] = sorted(self.lost)
        s["rejoined_workers"] = sorted(self.serving.rejoined)
        s["rejoins"] = self.serving.rejoins
        s["shard"] = self.ctx.server_index
        s["shard_restarts"] = 0 if self.failed_over else self.incarnation
        s["shard_failovers"] = int(self.failed_over)
        s["pushes_lost"] = self.pushes_lost
        return s

    @property
    def pushes_lost(self) -> int:
        """Pushes this shard had applied (and acknowledged) after its last checkpoint when it
        died: the highest version any reconnected worker saw acknowledged, minus the version
        restored. Pushes in flight at the death, never acknowledged, are not counted (their
        workers never learned that they were applied)."""
        if self.restored_version is None:
            return 0
        return max(0, self.acked_before_restart - self.restored_version)

    # ---------------------------------------------------------------- end of run
    def gather_final_theta(self) -> torch.Tensor | None:
        """Servers k > 0 send their shard to server 0, which returns the whole θ.

        On the servers' own group: the world group may have been left with a receive that
        timed out (every worker served on it gone), which breaks its connections.
        """
        if self.cfg.job.servers > 1 and shard_restarted(self.ctx.store):
            # A restarted shard is not in the servers' group: a pair group per shard k > 0.
            return self._gather_on_pairs()
        group = getattr(self.ctx, "servers_group", None)
        transport = (
            self.transport
            if group is None
            else self.ctx.transport(self.transport.stats, group=group)
        )
        if self.ctx.server_index != 0:
            h = Header(
                Kind.FINAL,
                shard=self.ctx.server_index,
                version=self.shard.version,
                numel=self.numel,
                samples=self.shard.samples,
            )
            transport.send(0, h, self.shard.theta, final=True)
            return None
        parts = [self.shard.theta]
        for k in range(1, self.cfg.job.servers):
            a, b = self.bounds[k]
            _, theta = transport.recv_final(k, b - a)
            parts.append(theta)
        return torch.cat(parts)

    def _gather_on_pairs(self) -> torch.Tensor | None:
        """:meth:`gather_final_theta` on one pair group per shard k > 0 (k and server 0)."""
        held = {self.ctx.server_index: self}  # the shards this server serves at the end
        if self.standby is not None and self.standby.promoted is not None:
            held[self.standby.primary] = self.standby.promoted
        if self.ctx.server_index != 0:
            for _, loop in sorted(held.items()):
                k = loop.ctx.server_index
                h = Header(
                    Kind.FINAL,
                    shard=k,
                    version=loop.shard.version,
                    numel=loop.numel,
                    samples=loop.shard.samples,
                )
                loop.ctx.shard_link(k, FINAL_PAIR, 0).send(0, h, loop.shard.theta, final=True)
            return None
        parts = [self.shard.theta]
        for j in range(1, self.cfg.job.servers):
            if j in held:
                parts.append(held[j].shard.theta)
                continue
            a, b = self.bounds[j]
            _, theta = self.ctx.shard_link(j, FINAL_PAIR, 0).recv_final(j, b - a)
            parts.append(theta)
        return torch.cat(parts)


FINAL_PAIR = 0  # the pair groups of the final gather use restart number 0 (no restart has it)


def _sum_stats(parts: list[CommStats]) -> CommStats:
    """The counters of several transports added up."""
    total = CommStats()
    for part in parts:
        for f in fields(CommStats):
            value = getattr(part, f.name)
            if isinstance(value, dict):
                for key, v in value.items():
                    total.extra[key] = total.extra.get(key, 0.0) + v
            else:
                setattr(total, f.name, getattr(total, f.name) + value)
    return total
