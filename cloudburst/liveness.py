"""Liveness for every role: a rank stops within seconds when a rank it cannot work without
goes silent, instead of waiting out a collective's timeout.

Every rank bumps a heartbeat counter in the job store (:class:`~cloudburst.runtime.Heartbeat`,
on a store connection of its own, so that a long ``store.wait`` of the training thread never
delays it). A :class:`Watchdog` thread reads the counters of the ranks this one depends on —
every other worker for the lockstep strategies, the parameter-server shards for asgd/easgd
(whose servers handle a lost worker themselves) — and when one has not moved for
``heartbeat_timeout_s`` (and the rank has not said it finished) it calls ``on_lost``, which
records why and ends the process. A SIGKILLed, crashed or SIGSTOPped peer is found the same
way, independently of ``comm_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from cloudburst.runtime import LivenessMonitor

log = logging.getLogger(__name__)

DONE_KEY = "done/{rank}"  # set by a rank that finished normally: silence is then expected
EXIT_PEER_LOST = 3  # the exit code of a rank that stopped because a peer was lost


def role_of(rank: int, num_servers: int) -> str:
    """A rank's role in words: ``server shard 1 (rank 1)`` or ``worker 2 (rank 3)``."""
    if rank < num_servers:
        return f"server shard {rank} (rank {rank})"
    return f"worker {rank - num_servers} (rank {rank})"


def watched_peers(
    rank: int, world_size: int, num_servers: int, survives_worker_loss: bool
) -> dict[int, str]:
    """The ranks that ``rank`` cannot work without, with their roles."""
    if survives_worker_loss:
        peers = range(num_servers)  # a lost worker is the servers' business
    else:
        peers = range(world_size)  # lockstep: every collective needs every rank
    return {r: role_of(r, num_servers) for r in peers if r != rank}


def mark_done(store: dist.Store, rank: int) -> None:
    """Tell the watchdogs that ``rank`` finished normally (its silence from now on is fine)."""
    store.set(DONE_KEY.format(rank=rank), "1")


class Watchdog:
    """Calls ``on_lost(rank, role)`` once, from its own thread, when a watched rank's heartbeat
    stops for ``timeout_s`` (ranks that marked themselves done are not watched any more)."""

    def __init__(
        self,
        store: dist.Store,
        watched: dict[int, str],
        timeout_s: float,
        on_lost: Callable[[int | None, str], None],
    ):
        self._store, self._watched, self._timeout_s = store, dict(watched), timeout_s
        self._on_lost = on_lost
        self._interval_s = max(0.05, timeout_s / 5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cloudburst-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self._watched:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval_s * 2)

    def settle(self) -> None:
        """Called by a rank whose communication just failed: give the watchdog one timeout to
        name the peer behind it (it then ends the process with that reason); returns when no
        watched peer went silent, so the rank reports its own failure."""
        if self._thread.is_alive():
            self._thread.join(timeout=self._timeout_s + 2 * self._interval_s)

    def _run(self) -> None:
        monitor = LivenessMonitor(self._store, list(self._watched), self._timeout_s)
        watching = set(self._watched)
        while not self._stop.wait(self._interval_s):
            try:
                watching -= {r for r in watching if self._store.check([DONE_KEY.format(rank=r)])}
                dead = monitor.dead(watching)
            except Exception as e:  # noqa: BLE001 - the store's host is gone: the job is over
                if not self._stop.is_set():
                    self._on_lost(None, f"the job's store ({type(e).__name__})")
                return
            if dead and not self._stop.is_set():
                rank = min(dead)
                self._on_lost(rank, self._watched[rank])
                return
