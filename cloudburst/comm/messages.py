"""The messages between workers and parameter-server shards, and what a receiver does about a
peer that sends bad ones: a fixed-size int64 :class:`Header` (magic number, kind, shard,
version, payload length, two counters) that :meth:`Header.from_tensor` validates, so that a
malformed or mismatched message is rejected and counted rather than applied; the tags that
keep the streams apart; and :class:`PeerFaults`, which drops a sender after a few bad
messages. How they travel: :mod:`cloudburst.comm.p2p`; why each check: docs/security.md.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from enum import IntEnum

import torch

from cloudburst.comm.stats import CommStats  # noqa: F401 - also importable from here

MAGIC = 0x0C10_0DB5
HEADER_LEN = 8
TAG_REQUEST = 11
TAG_REQUEST_PAYLOAD = 12
TAG_REPLY = 13
TAG_REPLY_PAYLOAD = 14
TAG_FINAL = 15
TAG_FINAL_PAYLOAD = 16

#: A sender whose messages fail validation this many times is dropped (nothing more from it is
#: read or answered). Honest peers send none; a few are tolerated as a peer's bug, not an attack.
MAX_PEER_FAULTS = 5
#: A receiver logs its rejections one by one up to this many, then every FAULT_LOG_EVERY-th.
FAULT_LOG_FIRST = 5
FAULT_LOG_EVERY = 100


class Kind(IntEnum):
    """Message kinds. Requests go worker → server; every request gets exactly one reply."""

    FETCH = 1  # request θ_k
    PUSH = 2  # payload Δ_k; reply is an ack
    PUSH_FETCH = 3  # payload Δ_k; reply carries θ_k (one round trip, GPU A-SGD's n_sync)
    INIT = 4  # payload θ_k from the warm-start worker
    DONE = 5  # worker finished training
    PING = 6  # a finished worker asks whether the server has finished
    REPLY = 7  # server → worker
    FINAL = 8  # server k → server 0: the final shard


class Status(IntEnum):
    OK = 0
    STALE_DROPPED = 1  # older than max_staleness
    REJECTED = 2  # non-finite payload or malformed header
    WAIT = 3  # reply to DONE/PING: other workers still training
    FINISHED = 4  # reply to DONE/PING: the server is done, the worker may exit
    REFUSED = 5  # a finite push whose update is too large (--max-push-ratio) or overflows θ


class MessageError(ValueError):
    """A header that fails validation (wrong magic, unknown kind, wrong shard or length)."""


@dataclass
class Header:
    kind: Kind
    shard: int = 0
    version: int = 0
    numel: int = 0  # payload length in values (0: no payload; compressed: see the docstring)
    samples: int = 0  # training samples the sender processed since its last push
    status: int = Status.OK
    aux: int = 0  # kind-specific: staleness in replies, worker step in pushes

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(
            [
                MAGIC,
                int(self.kind),
                self.shard,
                self.version,
                self.numel,
                self.samples,
                int(self.status),
                self.aux,
            ],
            dtype=torch.int64,
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Header:
        values = [int(v) for v in t.tolist()]
        if len(values) != HEADER_LEN or values[0] != MAGIC:
            raise MessageError(f"bad magic {values[0]:#x} (expected {MAGIC:#x})")
        try:
            kind = Kind(values[1])
        except ValueError:
            raise MessageError(f"unknown message kind {values[1]}") from None
        if values[4] < 0 or values[3] < 0 or values[2] < 0:
            raise MessageError(f"negative field in header {values}")
        return cls(kind, *values[2:])


HEADER_BYTES = HEADER_LEN * 8


class PeerFaults:
    """The bad messages one receiver got, by sender: each counted once, logged at a bounded
    rate (the first ``FAULT_LOG_FIRST``, then every ``FAULT_LOG_EVERY``-th), and the sender
    dropped after ``limit`` of them, or at once when its stream cannot be kept in step (a
    payload of unknown or too large size may follow its header: see the module docstring).

    A dropped sender is not read from again: its later messages are counted as ``ignored``
    and left unanswered, and a payload it sent stays unread on its channel, so none is ever
    applied. Safe to share between threads.
    """

    def __init__(self, logger: logging.Logger, receiver: str, limit: int = MAX_PEER_FAULTS):
        self._log, self._receiver, self.limit = logger, receiver, limit
        self.by_peer: dict[int, int] = {}  # rejected messages per sender
        self.dropped: dict[int, str] = {}  # dropped sender -> why
        self.rejected = 0  # messages rejected, each once (the one that dropped its sender too)
        self.ignored = 0  # messages from dropped senders, not read
        self._lock = threading.Lock()

    def reject(self, peer: int, reason: str, in_step: bool = True) -> bool:
        """Count one rejected message from ``peer``; True when ``peer`` is dropped (by now).

        ``in_step=False``: the rest of ``peer``'s stream cannot be read in step (a payload of
        unknown size may follow): it is dropped at once.
        """
        with self._lock:
            self.rejected += 1
            count = self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
            if peer in self.dropped:
                return True
            if not in_step or count >= self.limit:
                why = reason if not in_step else f"{count} bad messages, the last: {reason}"
                self.dropped[peer] = why
                self._log.error(
                    "%s: dropped rank %d (%s); nothing more from it is read",
                    self._receiver,
                    peer,
                    why,
                )
                return True
            if worth_logging(self.rejected):
                self._log.warning(
                    "%s: rejected a message from rank %d: %s (%d from it, %d in all)%s",
                    self._receiver,
                    peer,
                    reason,
                    count,
                    self.rejected,
                    _rate_note(self.rejected),
                )
            return False

    def ignore(self, peer: int) -> None:
        """Count a message from a dropped sender (not read, not answered)."""
        with self._lock:
            self.ignored += 1
            if worth_logging(self.ignored):
                self._log.warning(
                    "%s: ignored a message from dropped rank %d (%d ignored)%s",
                    self._receiver,
                    peer,
                    self.ignored,
                    _rate_note(self.ignored),
                )

    def is_dropped(self, peer: int) -> bool:
        with self._lock:
            return peer in self.dropped

    def dropped_peers(self) -> list[int]:
        with self._lock:
            return sorted(self.dropped)

    def forgive(self, peer: int) -> None:
        """Start ``peer`` afresh (a restarted process on a stream of its own)."""
        with self._lock:
            self.dropped.pop(peer, None)
            self.by_peer.pop(peer, None)


def worth_logging(count: int) -> bool:
    """Whether the ``count``-th of a repeated event is logged: the first ``FAULT_LOG_FIRST``,
    then every ``FAULT_LOG_EVERY``-th (a flood of bad messages cannot flood the log)."""
    return count <= FAULT_LOG_FIRST or count % FAULT_LOG_EVERY == 0


def _rate_note(count: int) -> str:
    return f"; from now on every {FAULT_LOG_EVERY}th is logged" if count == FAULT_LOG_FIRST else ""
