"""How requests reach a parameter shard (:class:`RequestServing`): its serving tasks, which
worker is served on which group, how each worker stands (finished, lost), and the admission of
workers that rejoin after a restart.

A :class:`~cloudburst.strategies.asgd.server.ServerLoop` owns one and hands it the protocol as
callbacks (``handle``: one request, under the lock; ``on_lost``, ``on_admit``,
``on_reconnect``, ``version``); nothing here reads a request's content. One task per group
that requests arrive on (the world group, and one group per worker that rejoined after a
restart) receives from any member and hands each request to ``handle`` under one lock, so that
requests are applied one at a time whatever group they came on. The calling task admits
rejoining workers (from the job store's :class:`~cloudburst.comm.liveness.RejoinBoard`) and waits
until every worker is finished or lost. Tasks are started through the transport
(``ctx.comm.spawn``); where it restarts no rank (``ctx.comm.restarts_ranks`` is False: the
virtual cluster) the shard serves on its one task, with no rejoin board.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from cloudburst.comm.auth import PeerRefused, job_secret
from cloudburst.comm.liveness import DONE_KEY, RejoinBoard, acked_version, announce_shard
from cloudburst.comm.messages import Header
from cloudburst.comm.stats import CommStats

log = logging.getLogger("cloudburst.strategies.asgd.server")  # the shard's one log

LIVENESS_POLL_S = 0.2  # how often a failed receive asks the liveness monitor who died
REJOIN_POLL_S = 0.5  # how often a server looks for restarted workers announcing themselves
_ADMITTING = object()  # a restarted shard's route to a worker not reconnected yet


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


class RequestServing:
    """A shard's serving tasks, its workers' standing and rejoin admission (module docstring).

    ``transport``: the world group's (None for a restarted shard: each worker reconnects on a
    pair group of its own); ``incarnation``: the shard's restart count. Everything below is
    guarded by one lock, whose condition is notified when a worker finishes or is lost, and when a
    serving task fails.
    """

    def __init__(
        self,
        ctx,
        metrics,
        liveness,
        transport,
        incarnation: int,
        *,
        handle: Callable[[Any, int, Header | None], None],
        on_lost: Callable[[set[int]], None],
        on_admit: Callable[[int], None],
        on_reconnect: Callable[[int, int | None], None],
        version: Callable[[], int],
    ):
        self.ctx, self.cfg, self.metrics, self.liveness = ctx, ctx.cfg, metrics, liveness
        self.transport, self.incarnation = transport, incarnation
        self._handle, self._on_lost, self._on_admit = handle, on_lost, on_admit
        self._on_reconnect, self._version = on_reconnect, version
        self.workers = set(ctx.replica_ranks)
        self.finished: set[int] = set()  # workers told FINISHED (they exit)
        self.lost: set[int] = set()  # dropped workers too
        self.rejoined: set[int] = set()  # workers that rejoined after a restart
        self.rejoins = 0
        self.rejoins_refused = 0  # rejoin groups where a member did not prove the job secret
        self._board_unreadable = False  # its counter in the store was overwritten: no rejoins
        self.rejoin_stats: list[CommStats] = []  # of the rejoin and reconnect groups
        self._incarnations: dict[int, int] = {}  # rank -> the last restart admitted
        # Where each rejoined worker is served now (the others: self.transport). A worker being
        # admitted maps to _ADMITTING: nothing from its previous incarnation is served.
        self._routes: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self._stopped = False
        # The one world worker still served, on receives from it alone, once the world group's
        # receive from any source broke (see _receive_failed); None: from any source.
        self._sole_sender: int | None = None
        # While a rejoin group's task handles a request: the rejoined worker, and its replies
        # (sent once the lock is released; see _serve).
        self._outbox_for: int | None = None
        self._outbox: list[tuple[int, Header, torch.Tensor | None]] = []

    def run(self) -> None:
        """Serve until every worker is finished or lost; raises what a serving task raised."""
        if self.ctx.comm.restarts_ranks:
            self._run_with_rejoins()
            return
        # Nothing is restarted: its one serving task, and no rejoin board.
        self._serve(self.transport, None)
        self._stopped = True
        self._raise_if_failed()

    def peer(self, src: int):
        """The transport that ``src`` is served on."""
        return self._routes.get(src, self.transport)

    def reply(self, dst: int, header: Header, payload: torch.Tensor | None) -> None:
        """Send a reply to ``dst`` (under the lock). A rejoined worker's, while its group's task
        handles its request, leaves after the lock is released (see :meth:`_serve`), with a
        copy of ``payload`` (θ, which other requests may change meanwhile)."""
        if dst == self._outbox_for:
            self._outbox.append((dst, header, None if payload is None else payload.clone()))
            return
        self.peer(dst).send(dst, header, payload)

    def _run_with_rejoins(self) -> None:
        """Serve the world group on a task, admit rejoining workers on this one, until
        every worker is finished or lost."""
        # The board waits in the store (for an announcement being written): a connection of
        # its own, so that the serving tasks' liveness checks never wait behind it.
        board = RejoinBoard(
            self.ctx.store.clone(), self.cfg.faults.comm_timeout_s, secret=job_secret()
        )
        if self.transport is None:
            # A restarted shard: workers restarted before it rejoined a group that held its
            # previous incarnation; they reconnect like the others (reconnect_workers).
            self._read_board(lambda: board.skip() or [])
            self._reconnect_workers()
        else:
            self._serve_in_thread(self.transport, None)
        try:
            while True:
                for rank, incarnation in self._read_board(board.poll):
                    self._admit(rank, incarnation)
                with self._changed:
                    self._raise_if_failed()
                    self._finished_elsewhere()
                    if self.finished | self.lost != self.workers:
                        self._changed.wait(REJOIN_POLL_S)
                        continue
                # Every worker is finished or lost: refuse later rejoins, but admit those
                # announced before (they will train, so the serving goes on).
                arrivals = self._read_board(board.close)
                if not arrivals:
                    break
                for rank, incarnation in arrivals:
                    self._admit(rank, incarnation)
        finally:
            with self._lock:
                self._stopped = True

    def _read_board(self, read: Callable[[], list[tuple[int, int]]]) -> list[tuple[int, int]]:
        """The announcements ``read`` returns; none from the first failure on. The board's
        counter is a store key that anyone who reaches the store can overwrite with a value
        that is no number (the store then drops the connection): that costs the job its
        rejoins (refused from then on, and logged), never the shard."""
        if self._board_unreadable:
            return []
        try:
            return read()
        except (RuntimeError, ValueError) as e:
            self._board_unreadable = True
            log.error(
                "the rejoin board cannot be read (%s): restarted workers are refused from now on",
                first_line(e),
            )
            return []

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # ---------------------------------------------------------------- serving tasks
    def _serve_in_thread(self, transport, rank: int | None) -> None:
        name = "world" if rank is None else f"rank{rank}"
        self.ctx.comm.spawn(lambda: self._serve(transport, rank), f"cloudburst-serve-{name}")

    def _expects_requests(self, transport, rank: int | None) -> bool:
        """Whether a worker served on ``transport`` may still send: one that is neither
        finished nor lost (``rank``: the rejoined worker whose group it is; None: the world).
        A thread receives only then, so that none waits on a group nobody will talk on."""
        if self._stopped:
            return False
        if rank is None:
            served = self.workers - self._routes.keys()
        else:
            served = {rank} if self._routes.get(rank) is transport else set()
        return any(r not in self.finished and r not in self.lost for r in served)

    def _serve(self, transport, rank: int | None) -> None:
        """One group's requests: receive a header from any member, handle it, and again.

        Each receive runs under the group's timeout. A thread can still be left waiting (a
        worker died or was moved to a rejoin group while it waited); it is a daemon, and
        nothing else receives on its group.

        Why a rejoined worker's replies leave after the lock is released: a worker sends its
        requests to every shard before it reads any reply, and a shard's blocking reply waits
        for the worker to read it, i.e. for the worker's exchanges with the *other* shards.
        With one receiving thread, a shard takes a request only when it is free, so workers
        reach the shards in the same order and no cycle of waits can form (this is how the
        world group is still served). A second group's thread takes requests while the lock is
        held; had it kept the lock while replying, server A could wait (in its reply) for a
        rejoined worker that waits for server B, which waits for a world worker that waits
        for server A's world thread, held up by the lock. So on a rejoin group, everything
        that needs only the worker's posted operations (receiving its payload, sending θ it
        has posted a receive for, applying the push) runs under the lock, and the replies
        (θ copied) are sent after it.
        """
        try:
            while True:
                with self._lock:
                    if not self._expects_requests(transport, rank):
                        return
                sole = self._sole_sender if rank is None else None
                try:
                    if sole is None:
                        src, header = transport.recv_request_any()
                    else:
                        src, header = transport.recv_request_any(sole)
                except RuntimeError as e:
                    if self._only_the_dead_failed(rank, e):
                        continue
                    if self._receive_failed(transport, rank, e):
                        continue
                    return
                with self._changed:
                    if self._stopped:  # run() has returned: θ is final, nothing is applied
                        log.warning("ignored a request from rank %d after the end", src)
                        return
                    ended = len(self.finished) + len(self.lost)
                    self._outbox_for, self._outbox = rank, []
                    try:
                        self._handle(transport, src, header)
                    finally:
                        outbox, self._outbox_for, self._outbox = self._outbox, None, []
                    if len(self.finished) + len(self.lost) != ended:
                        self._changed.notify_all()
                self._send_replies(outbox)
        except BaseException as e:  # noqa: BLE001 - handed to run(), or recorded as a loss
            with self._changed:
                if not self._expects_requests(transport, rank):
                    group = "the world" if rank is None else f"rank {rank}"
                    log.debug("the serving thread of %s's group ends: %s", group, e)
                elif rank is not None:
                    # The rejoined worker's group failed: that worker is lost, not the server.
                    log.error("lost rejoined worker rank %d: %s", rank, first_line(e))
                    self.lost.add(rank)
                else:
                    self._error = e
                self._changed.notify_all()

    def _only_the_dead_failed(self, rank: int | None, e: RuntimeError) -> bool:
        """A receive from any worker of the world group failed (gloo raises there when a
        worker dies in the middle of a message, not only on its timeout). Within one heartbeat
        timeout, the liveness monitor tells the dead workers from the others: those are lost
        and the others served on. False (every worker served on the group is lost, as on a
        timeout) when none is found dead, or the receive fails again without a new death."""
        comm = self.ctx.comm
        if rank is not None or self.liveness is None or not comm.breaks_on_peer_death:
            return False
        deadline = comm.now() + self.cfg.faults.heartbeat_timeout_s * 1.5 + 1.0
        while comm.now() < deadline:
            with self._changed:
                if self._stopped:
                    return False
                training = self._world_training()
                dead = self.liveness.dead(training) if training else set()
                if dead:
                    log.error(
                        "receiving a request failed (%s): workers %s stopped sending "
                        "heartbeats and are lost; serving the others",
                        first_line(e),
                        sorted(dead),
                    )
                    self._lose(dead)
                    return True
                if not training:
                    return False
            comm.sleep(LIVENESS_POLL_S)
        return False

    def _receive_failed(self, transport, rank: int | None, e: RuntimeError) -> bool:
        """A request receive failed (gloo: its timeout, or a broken connection). The sender is
        unknown: the workers served on the group are lost, not the server, which goes on
        serving the others until they finish. True: serve on (see below).

        The world group's receive from any source also fails, at once and for good, once a
        worker died with a request announced but not received (p2p.recv_request_any): after
        a lost world worker, a failure that is no timeout is that. One worker still training
        is then served with receives from it alone; several cannot be (a receive posted for
        one would hold the others, which can wait on each other through the other shards), so
        this shard stops: restarted in place under --max-restarts (the workers reconnect on
        groups of their own), else the job ends with its resume command.
        """
        with self._changed:
            if not self._expects_requests(transport, rank):
                group = "the world" if rank is None else f"rank {rank}"
                log.debug("the serving thread of %s's group ends: %s", group, first_line(e))
                return False
            silent = self._world_training() if rank is None else {rank}
            poisoned = (
                rank is None
                and self._sole_sender is None
                and "timed out" not in str(e).lower()
                and bool(self.lost & (self.workers - self._routes.keys()))
            )
            if poisoned and len(silent) == 1:
                [self._sole_sender] = silent
                log.warning(
                    "receiving from any worker fails since workers %s were lost (%s): serving "
                    "worker %d, the one still training, on receives from it alone",
                    sorted(self.lost),
                    first_line(e),
                    self._sole_sender,
                )
                return True
            if poisoned:
                self._error = RuntimeError(
                    f"receiving from any worker fails since workers {sorted(self.lost)} were "
                    f"lost ({first_line(e)}); workers {sorted(silent)} cannot be served apart: "
                    "this shard stops"
                )
                self._changed.notify_all()
                return False
            log.error(
                "receiving a request failed (%s): workers %s, served on that group, are lost",
                first_line(e),
                sorted(silent),
            )
            self._lose(silent)
            return False

    def _world_training(self) -> set[int]:
        """(Under the lock) the workers served on the world group, neither finished nor lost."""
        return self.workers - self._routes.keys() - self.finished - self.lost

    def _lose(self, ranks: set[int]) -> None:
        """(Under the lock) ``ranks`` are lost: no deferred fetch is answered to them."""
        self.lost |= ranks
        self._on_lost(ranks)
        self._changed.notify_all()

    def _send_replies(self, outbox: list[tuple[int, Header, torch.Tensor | None]]) -> None:
        """Send a rejoined worker's replies (outside the lock)."""
        for dst, header, payload in outbox:
            try:
                self.peer(dst).send(dst, header, payload)
            except RuntimeError as e:
                with self._changed:
                    log.error("lost worker rank %d during a reply: %s", dst, first_line(e))
                    self.lost.add(dst)
                    self._changed.notify_all()
                return

    # ---------------------------------------------------------------- a restarted shard
    def _reconnect_workers(self) -> None:
        """This shard was restarted and restored its checkpoint: announce it (the version it
        restored), then build a pair group with each worker as it reconnects, each on a thread
        of its own (one that never comes holds up no other), and serve it there."""
        k, incarnation, version = self.ctx.server_index, self.incarnation, self._version()
        with self._changed:
            for rank in self.workers:
                self._routes[rank] = _ADMITTING
        announce_shard(self.ctx.store, k, incarnation, version)
        self.metrics.log(
            "shard_restored",
            time_s=self.ctx.elapsed_s(),
            incarnation=incarnation,
            version=version,
        )
        log.info("shard %d serving again at version %d (restart %d)", k, version, incarnation)
        for rank in sorted(self.workers):
            self.ctx.comm.spawn(
                lambda rank=rank: self._reconnect(rank), f"cloudburst-reconnect-rank{rank}"
            )

    def _reconnect(self, rank: int) -> None:
        stats = CommStats()
        try:
            transport = self.ctx.shard_link(self.ctx.server_index, self.incarnation, rank, stats)
        except RuntimeError as e:  # it died, finished, or timed out: comm_timeout_s
            with self._changed:
                if rank not in self.finished:
                    log.error("worker rank %d did not reconnect: %s", rank, first_line(e))
                    self.lost.add(rank)
                self._changed.notify_all()
            return
        acked = acked_version(self.ctx.store, self.ctx.server_index, self.incarnation, rank)
        with self._changed:
            self._routes[rank] = transport
            self.rejoin_stats.append(stats)
            self.lost.discard(rank)
            self._on_reconnect(rank, acked)
        log.info("worker rank %d reconnected (it had seen version %s)", rank, acked)
        self._serve_in_thread(transport, rank)

    def _finished_elsewhere(self) -> None:
        """A restarted shard (under the lock): workers not reconnected yet that have ended
        their run (they finished with this shard before its death) are finished."""
        if self.transport is not None:
            return
        for rank in self.workers - self.finished - self.lost:
            if self._routes.get(rank) is _ADMITTING and self.ctx.store.check(
                [DONE_KEY.format(rank=rank)]
            ):
                self.finished.add(rank)

    # ---------------------------------------------------------------- rejoining workers
    def _admit(self, rank: int, incarnation: int) -> None:
        """Serve a restarted worker on a new group with it (built by it and every server).

        The announcement was signed with the job secret (the board refuses any other), and the
        group is authenticated before anything moves on it: until both hold, nothing about the
        worker changes here — its route, its restart count, its standing. A member that does
        not prove the secret (a process that raced the worker for its place in the group) is
        refused and logged, and the worker keeps its route. Once admitted it counts as
        training again (not lost, not done); if the group cannot be built it is lost.
        """
        if rank not in self.workers:
            log.warning("ignored a rejoin announcement from rank %d, not a worker", rank)
            return
        # A worker restarted by its agent announces its restart count: 1..max_restarts, each
        # once and in order. Anything else (a replay) would take a live worker's route away.
        last = self._incarnations.get(rank, 0)
        if not last < incarnation <= self.cfg.faults.max_restarts:
            log.warning(
                "ignored a rejoin announcement from rank %d with restart %d (last %d, at most %d)",
                rank,
                incarnation,
                last,
                self.cfg.faults.max_restarts,
            )
            return
        stats = CommStats()
        try:
            transport = self.ctx.rejoin_transport(rank, incarnation, stats)
        except PeerRefused as e:
            log.error(
                "refused the rejoin of worker rank %d (restart %d): %s; it keeps its route",
                rank,
                incarnation,
                first_line(e),
            )
            with self._changed:
                self.rejoins_refused += 1
            return
        except RuntimeError as e:  # it died again, or timed out: comm_timeout_s
            log.error("worker rank %d could not rejoin: %s", rank, first_line(e))
            with self._changed:
                self._incarnations[rank] = incarnation
                self.lost.add(rank)
                self._changed.notify_all()
            return
        with self._changed:
            self._incarnations[rank] = incarnation
            # A new process on a new group: its stream starts in step, whatever the old sent.
            self._on_admit(rank)
            self._routes[rank] = transport
            for ranks in (self.lost, self.finished):
                ranks.discard(rank)
            if self.liveness is not None:
                self.liveness.revive(rank)
            self.rejoin_stats.append(stats)
            self.rejoined.add(rank)
            self.rejoins += 1
            self.metrics.log(
                "rejoin", time_s=self.ctx.elapsed_s(), worker=rank, incarnation=incarnation
            )
        log.info("worker rank %d rejoined after restart %d", rank, incarnation)
        self._serve_in_thread(transport, rank)
