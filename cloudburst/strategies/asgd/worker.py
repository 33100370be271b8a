"""``asgd``: asynchronous SGD with a sharded parameter server (Downpour; GPU A-SGD).

Algorithm (docs/algorithms.md#asgd; Dean et al. 2012, Paine et al. 2013): each worker trains
its own replica; every ``n_push`` local steps it pushes Δ = θ_local − θ_reference to the S
shards, every ``n_fetch`` steps it fetches θ (``n_sync`` sets both: GPU A-SGD's n_sync local
steps, then push and fetch in one round trip). Shards apply pushes one at a time in arrival
order (:mod:`cloudburst.strategies.asgd.server`).

Synchronous: nothing between workers; a worker waits only for its own round trip to the
shards. Staleness: the pushes (from any worker) a shard applied between this worker's fetch
and its push; unbounded unless ``max_staleness`` drops older ones. A dead worker: the shards
serve the others, its unpushed steps are lost (``lost_workers``); restarted by its agent
(``--max-restarts``) it rejoins on a gloo group with the shards, resumes from its checkpoint and
starts again from their θ. A dead shard stops the job unless it is restarted in place or its
standby takes it over (``--shard-standby``); then each worker reconnects and takes its θ_k.

Contract with the shards: an overlapped PUSH_FETCH (a stateless rule such as add, scalar
compensators) returns θ_k *before* the push, and the worker adds its own Δ with the shard's α
(its rule's ``alpha`` of the staleness factor, the shard's own arithmetic), bit for bit —
"apply, then fetch"; rules with state only the shard has reply after the apply. Warm start:
worker 0 trains alone, then seeds every shard with INIT. Under ``--compress`` a push sends
C(Δ + e) with error feedback and the worker adds the same decoded Δ. A push a shard rejects (not
finite) or refuses (too large, ``--max-push-ratio``) is counted, logged (the first few) and
dropped: the worker continues from the shards' θ (after a refusal, with its optimizer's state
reset: the momentum that made the push would make the next ones too). On a GPU, Δ and θ cross
to and from pinned host buffers. Details and where this departs from the papers:
docs/algorithms.md#asgd and #compression."""

from __future__ import annotations

import logging

import torch
from torch import nn

from cloudburst.comm.compress import ErrorFeedback, decode, encode
from cloudburst.comm.flat import adopt_flat, assign_flat, flatten_params, is_flat_view, shard_bounds
from cloudburst.comm.liveness import Heartbeat, await_shard, heartbeat_interval_s, report_acked
from cloudburst.comm.messages import Header, Kind, Status, worth_logging
from cloudburst.strategies.asgd import Asgd
from cloudburst.strategies.asgd.compensation import staleness_factor
from cloudburst.strategies.asgd.shard import overlapped_push_fetch
from cloudburst.strategies.base import Strategy

log = logging.getLogger(__name__)

FINISH_POLL_S = 0.2
SEEDED_KEY = "warm_start/seeded"  # in the job store once the warm-start worker seeded θ
# θ + αΔ, then into the parameters, 1 MiB at a time: the copy reads what the add has just
# written from the core's L2 cache. Smaller chunks cost more in per-op overhead than they save
# (10M values: 6.6 ms at 256 KiB, 5.2 ms at 1 MiB, 5.8 ms in two whole passes; one core).
ADD_CHUNK_NUMEL = 1 << 18


class AsgdStrategy(Asgd, Strategy):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.transport = ctx.transport(self.stats)
        self.overlap = overlapped_push_fetch(ctx.cfg)
        # The shards' rule (a stateless one when replies overlap): its α rebuilds θ_k + αΔ.
        self.overlap_rule = ctx.cfg.strategy_spec.server_rule(ctx.cfg) if self.overlap else None
        self.num_servers = ctx.num_servers
        self.staleness_sum = 0
        self.staleness_max = 0
        self.pushes = 0
        self.pushes_rejected = 0
        self.pushes_refused = 0  # finite, but too large for the shards (--max-push-ratio)
        self.pushes_dropped = 0
        self.last_staleness = 0
        self.global_samples = 0
        self._fresh: torch.Tensor | None = None
        self._peek: torch.Tensor | None = None  # read-only fetches for evaluation
        self._heartbeat: Heartbeat | None = None
        self._samples_since_push = 0
        self.compress = self.message_method(ctx.cfg.cluster.compress)
        self.feedback = ErrorFeedback()  # residuals of compressed pushes, by shard
        # Restarted shards: each one's restart number and transport (a pair group), the last
        # version each shard acknowledged to this worker, and the reconnections to report.
        self._links: dict[int, object] = {}
        self._shard_incarnation = [0] * self.num_servers
        self._acked = [0] * self.num_servers
        self.shard_reconnects = 0
        self.pushes_acked = [0] * self.num_servers  # pushes each shard applied and said so
        self._reconnected: list[dict] = []

    # ------------------------------------------------------------------ set-up
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.model = model
        self.optimizer = optimizer  # its state is reset when a push is refused
        self.numel = sum(p.numel() for p in model.parameters())
        self.bounds = shard_bounds(self.numel, self.num_servers)
        self.versions = [0] * self.num_servers
        self.reference = flatten_params(model)
        self._flat = self.reference.clone()
        # The parameters become views of one flat buffer (as PyTorch's model averager makes
        # them): a round reads and writes them with no flatten/assign copies.
        adopt_flat(model, self._flat)
        self._delta = torch.empty_like(self.reference)
        self._spare = torch.empty_like(self.reference)
        self.on_gpu = self.reference.device.type == "cuda"
        if self.on_gpu:
            # Staging buffers in page-locked host memory: the copies run at PCIe/NVLink speed
            # and without an extra bounce through pageable memory.
            self._delta_host = torch.empty(self.numel, pin_memory=True)
            self._fetch_host = torch.empty(self.numel, pin_memory=True)
        return model

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (Δ) in host memory for gloo: the tensor itself on a CPU replica."""
        if not self.on_gpu:
            return t
        return self._staged_copy(self._delta_host, t)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """The fetched θ on the replica's device (no copy on a CPU replica)."""
        if not self.on_gpu:
            return host
        return self._staged_copy(self._spare, host)

    def _staged_copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """One non-blocking copy between the GPU and pinned memory, waited for.

        Its duration is read from CUDA events around the copy, so the counters measure the
        transfer itself, not the kernels still queued before it (the wait for those is
        compute, and shows in the round's wall time).
        """
        if not hasattr(self, "_events"):
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        start, end = self._events
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        self.stats.staging_s += start.elapsed_time(end) / 1e3
        self.stats.staging_bytes += src.numel() * src.element_size()
        return dst

    def _compress_push(self, delta: torch.Tensor) -> list[torch.Tensor]:
        """Each shard's slice of ``delta`` (host) as the bytes to send, with error feedback;
        ``delta`` becomes what the servers will apply (the decompressed values)."""
        packets = []
        for k, (a, b) in enumerate(self.bounds):
            key = f"shard{k}"
            intended = self.feedback.compensate(key, delta[a:b])
            packet = encode(intended, self.compress)
            delta[a:b].copy_(decode(packet, b - a, self.compress))
            self.feedback.remember(key, intended, delta[a:b])
            packets.append(packet)
        return packets

    def start(self) -> None:
        # A worker that rejoined after a restart has beaten since before it rejoined.
        self._heartbeat = getattr(self.ctx, "heartbeat", None) or self.ctx.comm.heartbeat(
            self.ctx.store, self.ctx.rank, heartbeat_interval_s(self.cfg.faults.heartbeat_timeout_s)
        )
        if (
            self.cfg.training.warm_start_steps
            and self.ctx.replica_index == 0
            and not self._seeded()
        ):
            # The warm-start worker trained alone; its θ becomes every shard's starting point.
            flat = flatten_params(self.model).cpu()
            if not bool(torch.isfinite(flat).all()):
                raise RuntimeError(
                    "warm start: θ is not finite after the warm-up steps; the servers refuse "
                    "it (lower --lr or --warm-start-steps)"
                )
            for k, (a, b) in enumerate(self.bounds):
                self.transport.send(k, Header(Kind.INIT, shard=k, numel=b - a), flat[a:b])
            for k in range(self.num_servers):
                reply = self.transport.recv_reply(k)
                self._check(reply, k)
                if reply.status != Status.OK:
                    # A shard takes INIT once, while it awaits it: one resumed from its
                    # checkpoint (--resume) holds θ already and keeps it.
                    log.info("shard %d holds θ already (resumed): it keeps it", k)
            self.ctx.store.add(SEEDED_KEY, 1)
        # Start from the servers' θ, whatever the replica holds: nothing is pending at the start
        # (a warm-start worker's progress went to the servers with INIT), and a worker resumed
        # from its checkpoint after a restart continues from the θ the others have made since.
        self._round(push=False, fetch=True, keep_local=False)

    def _seeded(self) -> bool:
        """Whether the servers already hold the warm-start θ (a restarted worker 0 that had
        seeded them must not again: they have moved on since)."""
        return getattr(self.ctx, "rejoined", False) and self.ctx.store.add(SEEDED_KEY, 0) > 0

    # ------------------------------------------------------------------ training
    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        self._samples_since_push += samples
        self._fresh = None
        push = self.local_steps % self.cfg.asgd.n_push == 0
        fetch = self.local_steps % self.cfg.asgd.n_fetch == 0
        if push or fetch:
            self._round(push=push, fetch=fetch)

    def _round(self, push: bool, fetch: bool, keep_local: bool = True) -> None:
        """One round trip to every shard: send all requests first, then read all replies.

        ``keep_local=False`` makes a fetch replace the replica outright, discarding local
        progress not yet pushed (after the servers rejected it).
        """
        # Persistent buffers: on large models fresh 4·|θ|-byte tensors per round cost more in
        # page faults than the copies themselves (benchmarks/results/transport.md).
        flat = self._params_flat()
        kind = Kind.PUSH_FETCH if push and fetch else Kind.PUSH if push else Kind.FETCH
        # With the add rule a PUSH_FETCH reply carries θ before our push, sent while our push
        # travels the other way; we then add our own Δ exactly as the server does.
        overlapped = kind == Kind.PUSH_FETCH and self.overlap
        # Plain fp32 on the CPU: Δ is computed chunk by chunk just before each chunk is sent
        # (PeerTransport.isend_payload's prepare), so the subtraction overlaps the wire.
        lazy_delta = overlapped and not self.on_gpu and self.compress == "none"
        if push and not lazy_delta:
            delta = self._to_host(torch.sub(flat, self.reference, out=self._delta))
        else:
            delta = self._delta if push else None
        # Compressed: the bytes per shard, and delta becomes what the servers will apply.
        packets = self._compress_push(delta) if push and self.compress != "none" else None
        fetched = (self._fetch_host if self.on_gpu else self._spare) if fetch else None
        started: dict[int, list] = {}
        broken: set[int] = set()  # shards that died during this round (restarted: reconnect)
        for k, (a, b) in enumerate(self.bounds):
            header = Header(
                kind,
                shard=k,
                version=self.versions[k],
                numel=(b - a) if push else 0,
                samples=self._samples_since_push if push else 0,
                aux=self.local_steps,
            )
            payload = (packets[k] if packets is not None else delta[a:b]) if push else None
            link = self._link(k)
            try:
                if overlapped:
                    link.send(k, header)
                    prepare = self._delta_chunk(flat, a) if lazy_delta else None
                    started[k] = [
                        link.irecv_payload(k, fetched[a:b], reply=True),  # θ flows meanwhile
                        link.isend_payload(k, payload, reply=False, prepare=prepare),
                    ]
                else:
                    link.send(k, header, payload)
            except RuntimeError as e:
                self._shard_failed(k, e, broken)
        for k, works in started.items():
            try:
                self._link(k).wait_all(works)
            except RuntimeError as e:
                self._shard_failed(k, e, broken)
        rejected = False
        copied: set[int] = set()  # shards whose θ + αΔ is in the parameters already
        for k, (a, b) in enumerate(self.bounds):
            if k in broken:
                continue
            try:
                reply = self._link(k).recv_reply(
                    k, fetched[a:b] if fetch and not overlapped else None
                )
            except RuntimeError as e:
                self._shard_failed(k, e, broken)
                continue
            self._check(reply, k)
            if push:
                self._account_push(reply)
                self.pushes_acked[k] += reply.status == Status.OK
                rejected |= reply.status in (Status.REJECTED, Status.REFUSED)
            if overlapped and reply.status == Status.OK:
                alpha = self.overlap_rule.alpha(
                    staleness_factor(
                        self.cfg.asgd.staleness_compensation,
                        reply.aux,
                        self.cfg.asgd.delay_threshold_value(self.cfg),
                    )
                )
                # θ + αΔ and, on a CPU replica, straight into the parameters, one cache-sized
                # chunk at a time (the copy reads what the add has just written)
                for i in range(a, b, ADD_CHUNK_NUMEL):
                    j = min(b, i + ADD_CHUNK_NUMEL)
                    fetched[i:j].add_(delta[i:j], alpha=alpha)
                    if not self.on_gpu:
                        flat[i:j].copy_(fetched[i:j])
                copied.add(k)
            if fetch:
                self.versions[k] = reply.version
            self._acked[k] = max(self._acked[k], reply.version)
            if k == 0:
                self.global_samples = reply.samples
        if push:
            self._samples_since_push = 0
        if rejected:
            self.feedback = ErrorFeedback()  # what was left out of a non-finite Δ is no use
        if rejected and not fetch:
            # The servers refused our update (non-finite, or too large): start again from
            # their θ.
            log.warning("the servers rejected this worker's push; re-fetching θ")
            self._recover(broken)
            self._round(push=False, fetch=True, keep_local=False)
            return
        if fetch:
            fetched = self._to_device(fetched)
            pending = (flat - self.reference) if keep_local and not push else None
            new_local = fetched if pending is None or rejected else fetched + pending
            if new_local is not fetched or self.on_gpu:
                assign_flat(self.model, new_local)
            else:  # the parameters are `flat`: copy the shards not written above
                for k, (a, b) in enumerate(self.bounds):
                    if k not in copied or rejected:
                        flat[a:b].copy_(fetched[a:b])
            # The fetched θ becomes the reference; the old reference buffer receives next time.
            self._spare, self.reference = self.reference, fetched
            self._fresh = fetched
        else:
            self.reference.copy_(flat)
        self._recover(broken)

    def _params_flat(self) -> torch.Tensor:
        """The parameters as one flat vector: the buffer they are views of (no copy), or a
        copy into it when something replaced a parameter's storage (a loaded checkpoint)."""
        if not is_flat_view(self.model, self._flat):
            # (a fresh copy first: some parameters may still be views of the buffer)
            self._flat.copy_(flatten_params(self.model))
            adopt_flat(self.model, self._flat)  # views again from now on
        return self._flat

    def _delta_chunk(self, flat: torch.Tensor, start: int):
        """``prepare`` of shard payload ``[start, …)``: Δ of its chunk [i, j) just before it
        leaves."""
        delta, reference = self._delta, self.reference

        def prepare(i: int, j: int) -> None:
            a, b = start + i, start + j
            torch.sub(flat[a:b], reference[a:b], out=delta[a:b])

        return prepare

    # ------------------------------------------------------------------ restarted shards
    def _link(self, k: int):
        """The transport to shard ``k``: a pair group once it was restarted."""
        return self._links.get(k, self.transport)

    def _shard_failed(self, k: int, e: RuntimeError, broken: set[int]) -> None:
        """Talking to shard ``k`` failed: with restarts (--max-restarts) or a standby
        (--shard-standby), it is reconnected after the round; without, the error stands (the
        watchdog names the silent shard)."""
        if not (self.cfg.faults.max_restarts or self.cfg.asgd.shard_standby):
            raise e
        if k not in broken:
            log.warning("lost the connection to shard %d: %s", k, str(e).splitlines()[0][:200])
        broken.add(k)

    def _recover(self, broken: set[int]) -> None:
        """Reconnect to each restarted shard in ``broken`` and take its θ_k as this worker's
        (replica and reference, so the fetched θ too): what this round pushed to it,
        unacknowledged, is gone with everything it applied after its checkpoint."""
        if not broken:
            return
        flat = self._params_flat()
        for k in sorted(broken):
            a, b = self.bounds[k]
            theta_k = self._reconnect_shard(k).to(flat.device)
            flat[a:b].copy_(theta_k)
            self.reference[a:b].copy_(theta_k)
        if self.on_gpu:
            assign_flat(self.model, flat)  # (on the CPU the parameters are views of flat)

    def _reconnect_shard(self, k: int) -> torch.Tensor:
        """Wait for shard ``k``'s next restart to announce itself (RuntimeError after
        ``comm_timeout_s``; the watchdog ends this rank sooner if the shard stops beating),
        tell it the last version it acknowledged here, build the pair group, fetch θ_k."""
        incarnation = self._shard_incarnation[k] + 1
        store, rank = self.ctx.store, self.ctx.rank
        report_acked(store, k, incarnation, rank, self._acked[k])
        restored = await_shard(store, k, incarnation, self.cfg.faults.comm_timeout_s)
        link = self.ctx.shard_link(k, incarnation, rank, self.stats)
        self._links[k], self._shard_incarnation[k] = link, incarnation
        a, b = self.bounds[k]
        theta_k = torch.empty(b - a)
        link.send(k, Header(Kind.FETCH, shard=k))
        reply = link.recv_reply(k, theta_k)
        self._check(reply, k)
        log.warning(
            "shard %d restarted (restart %d) at version %d; this worker had seen version %d",
            k,
            incarnation,
            restored,
            self._acked[k],
        )
        self._reconnected.append(
            {"shard": k, "restart": incarnation, "version": restored, "acked": self._acked[k]}
        )
        self.versions[k] = self._acked[k] = reply.version
        self.shard_reconnects += 1
        return theta_k

    def step_info(self) -> dict:
        # the staleness of this worker's last applied push, in shard versions
        info = {**super().step_info(), "staleness_versions": self.last_staleness}
        if self._reconnected:
            info["shard_reconnected"], self._reconnected = self._reconnected, []
        return info

    def _account_push(self, reply: Header) -> None:
        self.pushes += 1
        self.last_staleness = reply.aux
        if reply.status == Status.OK:
            self.staleness_sum += reply.aux
            self.staleness_max = max(self.staleness_max, reply.aux)
        elif reply.status == Status.REJECTED:
            self.pushes_rejected += 1
        elif reply.status == Status.REFUSED:
            self.pushes_refused += 1
            # The local optimizer's state (momentum, Adam's moments) carries the steps that
            # made the refused push: kept, it would make the next ones as large.
            if self.optimizer is not None:
                self.optimizer.state.clear()
            if worth_logging(self.pushes_refused):
                log.warning(
                    "shard %d refused this worker's push: its update is too large "
                    "(--max-push-ratio) or would make θ not finite; continuing from the "
                    "servers' θ with a fresh optimizer state (%d refused so far)",
                    reply.shard,
                    self.pushes_refused,
                )
        elif reply.status == Status.STALE_DROPPED:
            self.pushes_dropped += 1

    @staticmethod
    def _check(reply: Header, shard: int) -> None:
        if reply.shard != shard:
            raise RuntimeError(f"reply from shard {reply.shard} where shard {shard} was expected")

    def global_params(self) -> tuple[torch.Tensor, int] | None:
        if self._fresh is None:
            return None
        return self._fresh, self.global_samples

    def fetch_global_params(self) -> tuple[torch.Tensor, int]:
        """The servers' θ now: the one fetched this step (handed out once), else a read-only
        fetch — so the evaluator, scoring θ after its own last step while others still push,
        fetches again each time instead of re-reading the θ of its last step.

        The read-only fetch leaves the replica, its reference and its versions alone, so
        evaluating between two rounds (n_sync can be hundreds of steps) does not change what
        this worker trains or pushes.
        """
        if self._fresh is not None:
            fresh, self._fresh = self._fresh, None
            return fresh, self.global_samples
        if self._peek is None:
            self._peek = torch.empty(self.numel)
        broken: set[int] = set()
        for k in range(self.num_servers):
            try:
                self._link(k).send(k, Header(Kind.FETCH, shard=k))
            except RuntimeError as e:
                self._shard_failed(k, e, broken)
        for k, (a, b) in enumerate(self.bounds):
            if k in broken:
                continue
            try:
                reply = self._link(k).recv_reply(k, self._peek[a:b])
            except RuntimeError as e:
                self._shard_failed(k, e, broken)
                continue
            self._check(reply, k)
            self._acked[k] = max(self._acked[k], reply.version)
            if k == 0:
                self.global_samples = reply.samples
        self._recover(broken)  # the replica takes a restarted shard's θ_k
        for k in broken:
            a, b = self.bounds[k]
            self._peek[a:b].copy_(self.reference[a:b])
        return self._peek, self.global_samples

    # ------------------------------------------------------------------ the end
    def _flush(self) -> None:
        """Push the local progress not pushed yet."""
        if self.local_steps % self.cfg.asgd.n_push != 0:
            self._round(push=True, fetch=False)

    def finish(self) -> None:
        """Push what is left, then tell every shard we are done and wait for it to finish."""
        self._flush()
        pending = set(range(self.num_servers))
        told: set[int] = set()  # shards that have our DONE (a restarted one has not)
        while pending:
            broken: set[int] = set()
            for k in sorted(pending):
                try:
                    self._link(k).send(k, Header(Kind.PING if k in told else Kind.DONE, shard=k))
                except RuntimeError as e:
                    self._shard_failed(k, e, broken)
            for k in sorted(pending - broken):
                try:
                    reply = self._link(k).recv_reply(k)
                except RuntimeError as e:
                    self._shard_failed(k, e, broken)
                    continue
                told.add(k)
                if reply.status == Status.FINISHED:
                    pending.discard(k)
            self._recover(broken)
            told -= broken
            if pending and not broken:
                self.ctx.comm.sleep(FINISH_POLL_S)
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(
            pushes=self.pushes,
            pushes_rejected=self.pushes_rejected,
            pushes_refused=self.pushes_refused,
            pushes_dropped=self.pushes_dropped,
            staleness_sum=self.staleness_sum,
            staleness_max=self.staleness_max,
        )
        if self.compress != "none":
            state["compress_feedback"] = self.feedback.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for key in ("pushes", "pushes_rejected", "pushes_refused", "pushes_dropped"):
            setattr(self, key, int(state.get(key, 0)))
        self.staleness_sum = int(state.get("staleness_sum", 0))
        self.staleness_max = int(state.get("staleness_max", 0))
        if "compress_feedback" in state:
            self.feedback.load_state_dict(state["compress_feedback"])

    def report(self) -> dict:
        r = super().report()
        r.update(
            pushes=self.pushes,
            pushes_rejected=self.pushes_rejected,
            pushes_refused=self.pushes_refused,
            pushes_dropped_stale=self.pushes_dropped,
            staleness_sum_versions=self.staleness_sum,
            staleness_max_versions=self.staleness_max,
            shard_reconnects=self.shard_reconnects,
            pushes_acked_by_shard=list(self.pushes_acked),
        )
        return r
