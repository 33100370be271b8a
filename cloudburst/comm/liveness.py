"""Liveness for every role: a rank stops within seconds when a rank it cannot work without
goes silent, instead of waiting out a collective's timeout.

Every rank bumps a heartbeat counter in the job store (:class:`~cloudburst.comm.liveness.Heartbeat`,
on a store connection of its own, so that a long ``store.wait`` of the training thread never
delays it). A :class:`Watchdog` thread reads the counters of the ranks this one depends on —
every other worker for the lockstep strategies, the parameter-server shards for asgd/easgd
(whose servers handle a lost worker themselves) — and when one has not moved for
``heartbeat_timeout_s`` (and the rank has not said it finished) it calls ``on_lost``, which
records why and ends the process. A SIGKILLed, crashed or SIGSTOPped peer is found the same
way, independently of ``comm_timeout_s``.

The store is open to anyone who reaches it, so a heartbeat's value is read, never parsed by
the store: ``store.add`` on a key holding a non-integer makes torch's server drop that client's
connection (and with it the heartbeats and watchdog of the rank that asked). A beat *sets* the
counter; a watcher reads it with a non-mutating ``compare_set`` that never blocks on a missing
key. A malformed value is one unreadable beat (counted in ``LivenessMonitor.unreadable`` and
logged): the rank's clock is not reset by it, and its next beat overwrites it.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from cloudburst.comm.auth import ENV_SECRET_FILE, run_identity, sign, verify

log = logging.getLogger(__name__)

DONE_KEY = "done/{rank}"  # set by a rank that finished normally: silence is then expected
HEARTBEAT_KEY = "hb/{rank}"  # a rank's heartbeat counter, decimal
_ABSENT = "\x00absent"  # compare_set's answer for a missing heartbeat key (never a counter)
_MAX_COUNTER_BYTES = 20  # a counter's decimal digits: anything longer is not one of ours
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
                watching -= {
                    r for r in watching if any(self._store.check([k]) for k in _settled_keys(r))
                }
                dead = monitor.dead(watching)
            except Exception as e:  # noqa: BLE001 - the store's host is gone: the job is over
                if not self._stop.is_set():
                    self._on_lost(None, f"the job's store ({type(e).__name__})")
                return
            if dead and not self._stop.is_set():
                rank = min(dead)
                self._on_lost(rank, self._watched[rank])
                return


def _settled_keys(rank: int) -> list[str]:
    """Keys whose presence says that ``rank``'s silence is no loss: it finished, or (a server
    shard) its standby took it over."""
    return [DONE_KEY.format(rank=rank), FAILOVER_KEY.format(shard=rank)]


def heartbeat_interval_s(heartbeat_timeout_s: float) -> float:
    """How often a worker bumps its heartbeat: five times per ``heartbeat_timeout_s``."""
    return max(0.05, heartbeat_timeout_s / 5)


class Heartbeat:
    """A worker's liveness signal: a counter in the job store, bumped from a daemon thread.
    It counts from a random start, so that a restarted rank's first beat is not its
    predecessor's last value (which its watchers would take for no beat)."""

    def __init__(self, store: dist.Store, rank: int, interval_s: float):
        self._store, self._key = store, HEARTBEAT_KEY.format(rank=rank)
        self._interval_s = interval_s
        self._count = secrets.randbelow(1 << 48)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cloudburst-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def _beat(self) -> None:
        # Set, not added: whatever someone else wrote under the key is overwritten.
        self._count += 1
        self._store.set(self._key, str(self._count))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s * 2)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._beat()
            except Exception as e:  # the store's host went away: the job is over
                log.warning("heartbeat stopped: %s", e)
                return


class LivenessMonitor:
    """Decides which workers are dead: their heartbeat counter stopped moving for too long.
    A missing or malformed counter is no beat; malformed reads are counted in ``unreadable``."""

    def __init__(self, store: dist.Store, ranks: list[int], timeout_s: float):
        self._store, self._timeout_s = store, timeout_s
        now = time.monotonic()
        self._last: dict[int, tuple[int | None, float]] = {r: (None, now) for r in ranks}
        self._malformed: set[int] = set()  # ranks whose last read was malformed
        self.unreadable = 0

    def dead(self, ranks: set[int] | list[int]) -> set[int]:
        now = time.monotonic()
        dead = set()
        for r in ranks:
            value = self._read(r)
            last_value, since = self._last[r]
            if value is not None and value != last_value:
                self._last[r] = (value, now)
            elif now - since > self._timeout_s:
                dead.add(r)
        return dead

    def revive(self, rank: int) -> None:
        """Give ``rank`` (a restarted worker rejoining) a full timeout from now."""
        self._last[rank] = (self._read(rank), time.monotonic())

    def _read(self, rank: int) -> int | None:
        """``rank``'s counter; None when it has not beaten yet or its value is malformed."""
        raw = self._store.compare_set(HEARTBEAT_KEY.format(rank=rank), _ABSENT, _ABSENT)
        if raw == _ABSENT.encode():
            return None
        if len(raw) <= _MAX_COUNTER_BYTES and raw.isdigit():
            self._malformed.discard(rank)
            return int(raw)
        self.unreadable += 1
        if rank not in self._malformed:  # once per run of bad reads, not at every poll
            self._malformed.add(rank)
            log.warning(
                "malformed heartbeat of rank %d (%d bytes, not a counter): no beat, ignored "
                "(%d malformed reads so far)",
                rank,
                len(raw),
                self.unreadable,
            )
        return None


class RejoinRefused(RuntimeError):
    """A restarted worker came back after the servers had finished, or cannot prove it is of
    this job (no job secret)."""


class RejoinBoard:
    """Announcements, in the job store, of restarted workers rejoining an asgd/easgd job.

    A restarted worker takes the next number of a counter and writes (rank, incarnation)
    under it. Every server reads the announcements in that order, so all of them build the
    rejoin groups in the same order. A server that has finished serving *closes* the board by
    adding ``CLOSED`` to the counter, in the same atomic operation that tells it which
    announcements came before: a number handed out after that comes back ``>= CLOSED``, and
    both sides treat that announcement as late (refused). So a worker is either admitted by
    every server or refused by every one.

    Each record is signed: an HMAC under the job secret (:mod:`cloudburst.comm.auth`) of the run's
    identity, the announcement's number, rank, restart and lateness. The store is open to
    anyone who reaches it; an announcement without a valid signature (forged, or one copied
    to another number or from another run) is refused and logged, and never admitted. Without
    a secret (``secret`` None: torchrun with none given) every announcement is refused.
    """

    COUNT = "rejoin/count"
    CLOSED = 1 << 40
    MAX_PER_READ = 1024  # announcements read at once (a job restarts a few ranks at a time)
    MAX_RECORD_BYTES = 256
    LOG_FIRST = 5  # refused announcements logged one by one, then every LOG_EVERY-th
    LOG_EVERY = 100

    def __init__(
        self, store: dist.Store, timeout_s: float, *, secret: bytes | None, run: str | None = None
    ):
        self._store, self._timeout_s, self._secret = store, timeout_s, secret
        self._run = run_identity() if run is None else run
        self._seen = 0
        self._closed = False
        self.refused = 0  # announcements refused: unreadable, or not signed with the secret

    def announce(self, rank: int, incarnation: int) -> None:
        """Worker side; raises :class:`RejoinRefused` when the servers have finished, or when
        there is no job secret to sign with."""
        if self._secret is None:
            raise RejoinRefused(
                f"rank {rank} was restarted, and a restarted rank rejoins only "
                f"with the job secret: none was given (set {ENV_SECRET_FILE} on every "
                "machine; see docs/security.md)"
            )
        value = self._store.add(self.COUNT, 1)
        late = value >= self.CLOSED
        number = value % self.CLOSED
        record = {
            "rank": rank,
            "incarnation": incarnation,
            "late": late,
            "mac": self._sign(number, rank, incarnation, late),
        }
        self._store.set(f"rejoin/{number}", json.dumps(record))
        if late:
            raise RejoinRefused(
                f"rank {rank} was restarted after the parameter servers had finished: "
                "there is no running job to rejoin"
            )

    def skip(self) -> None:
        """Server side: take every announcement made so far as read (a restarted shard: the
        workers restarted before it do not rejoin it through the board)."""
        self._seen = self._store.add(self.COUNT, 0) % self.CLOSED

    def poll(self) -> list[tuple[int, int]]:
        """Server side: (rank, incarnation) of the announcements since the last call."""
        return self._read(self._store.add(self.COUNT, 0) % self.CLOSED)

    def close(self) -> list[tuple[int, int]]:
        """Server side: refuse announcements from now on; returns those not read yet."""
        if self._closed:
            return self.poll()
        self._closed = True
        return self._read(self._store.add(self.COUNT, self.CLOSED) % self.CLOSED)

    def _sign(self, number: int, rank: int, incarnation: int, late: bool) -> str:
        assert self._secret is not None
        return sign(self._secret, "rejoin", self._run, number, rank, incarnation, late)

    def _read(self, count: int) -> list[tuple[int, int]]:
        if count - self._seen > self.MAX_PER_READ:
            # Never this many restarts at once: a counter moved by someone else than a worker.
            log.warning(
                "rejoin counter jumped from %d to %d; reading %d announcements only",
                self._seen,
                count,
                self.MAX_PER_READ,
            )
            count = self._seen + self.MAX_PER_READ
        arrivals = []
        timeout = datetime.timedelta(seconds=self._timeout_s)
        for number in range(self._seen + 1, count + 1):
            key = f"rejoin/{number}"
            try:
                # written right after the number was taken (unless that worker died there)
                self._store.wait([key], timeout)
                raw = self._store.get(key)
                if len(raw) > self.MAX_RECORD_BYTES:
                    raise ValueError(f"{len(raw)} bytes")
                record = json.loads(raw)
                rank, incarnation = _announcement(record)
            except (RuntimeError, ValueError, TypeError) as e:  # timed out, or not ours
                self._refuse(number, f"unreadable ({e})")
                continue
            problem = self._unsigned(number, record, rank, incarnation)
            if problem is not None:
                self._refuse(number, f"rank {rank}, restart {incarnation}: {problem}")
            elif not record["late"]:
                arrivals.append((rank, incarnation))
        self._seen = max(self._seen, count)
        return arrivals

    def _unsigned(self, number: int, record: dict, rank: int, incarnation: int) -> str | None:
        """Why ``record`` is not a signed announcement of this job, or None."""
        if self._secret is None:
            return "this job has no secret, so no announcement can be verified"
        fields = ("rejoin", self._run, number, rank, incarnation, record["late"])
        if not verify(self._secret, record.get("mac"), *fields):
            return "not signed with the job secret (forged, replayed or of another run)"
        return None

    def _refuse(self, number: int, why: str) -> None:
        self.refused += 1
        n = self.refused
        if n <= self.LOG_FIRST or n % self.LOG_EVERY == 0:
            note = "" if n <= self.LOG_FIRST else f" ({n} refused so far)"
            log.warning("refused rejoin announcement %d: %s%s", number, why, note)


def _announcement(record: object) -> tuple[int, int]:
    """(rank, incarnation) of a well-formed announcement; ``ValueError`` otherwise."""
    if not isinstance(record, dict) or not isinstance(record.get("late"), bool):
        raise ValueError("not an announcement")
    rank, incarnation = record.get("rank"), record.get("incarnation")
    if not all(type(v) is int and 0 <= v < 1 << 31 for v in (rank, incarnation)):
        raise ValueError(f"bad rank/incarnation {rank!r}/{incarnation!r}")
    return rank, incarnation


# ---------------------------------------------------------------------------- restarted shards
SHARD_BACK_KEY = "shard/{shard}/back/{incarnation}"  # the version a restarted shard restored
SHARD_ACKED_KEY = "shard/{shard}/back/{incarnation}/acked/{rank}"  # a worker's last ack
SHARD_RESTARTS_KEY = "shard/restarts"  # how many shard restarts the job has seen
FAILOVER_KEY = "shard/{shard}/failover"  # the server rank whose standby took shard over


def announce_shard(store: dist.Store, shard: int, incarnation: int, version: int) -> None:
    """A restarted shard says it is serving again, at the ``version`` it restored."""
    store.add(SHARD_RESTARTS_KEY, 1)
    store.set(SHARD_BACK_KEY.format(shard=shard, incarnation=incarnation), str(version))


def shard_restarted(store: dist.Store) -> bool:
    """Whether any shard of the job was restarted (the servers' own group lacks it then)."""
    return store.add(SHARD_RESTARTS_KEY, 0) > 0


def await_shard(store: dist.Store, shard: int, incarnation: int, timeout_s: float) -> int:
    """Worker side: wait until shard ``shard`` announces restart ``incarnation``; returns the
    version it restored. Raises RuntimeError after ``timeout_s`` (the watchdog usually ends
    the rank before: a shard that is not restarted stops beating)."""
    key = SHARD_BACK_KEY.format(shard=shard, incarnation=incarnation)
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return int(store.get(key))


def report_acked(store: dist.Store, shard: int, incarnation: int, rank: int, version: int) -> None:
    """Worker side: the last version of ``shard`` this worker saw acknowledged before the
    shard's restart ``incarnation`` (the shard counts the pushes it lost from these)."""
    key = SHARD_ACKED_KEY.format(shard=shard, incarnation=incarnation, rank=rank)
    store.set(key, str(version))


def acked_version(store: dist.Store, shard: int, incarnation: int, rank: int) -> int | None:
    """Shard side: what :func:`report_acked` left for ``rank``, or None."""
    key = SHARD_ACKED_KEY.format(shard=shard, incarnation=incarnation, rank=rank)
    if not store.check([key]):
        return None
    return int(store.get(key))
