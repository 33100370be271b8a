"""Gossip transport: pull a peer's θ or push ours to it while both keep training.

Mechanism only: the gossip strategy (:mod:`cloudburst.strategies.gossip`) decides when, with
whom and with which weights; this module moves θ between workers, counts the bytes, and
times out.

Threads and groups
    Every worker runs a *serving thread* next to its training (main) thread. Two gloo groups
    of the workers, created once for the job by :func:`cloudburst.runtime.init_distributed`
    (which checks that every member proves the job secret before θ moves: no peer joins them
    later), keep their traffic apart so that two threads never receive on the same group:

    - the *request* group: main threads send FETCH / PUSH (+ θ) / PING / DONE to a peer's
      serving thread; only serving threads receive on it (from any peer);
    - the *reply* group: serving threads send the θ a FETCH asked for; only main threads
      receive on it (from the one peer they asked).

    A FETCH is answered from a :class:`Snapshot`: a copy of this worker's θ taken by the main
    thread at its last step boundary, under a lock, never a half-updated model; so a peer's
    pull waits for the serving thread's reply, not for this worker's step. A PUSH is received
    into a :class:`Mailbox` that the main thread drains at its next step boundary.

Messages
    :class:`~cloudburst.comm.messages.Header` + fp32 payload, as in :mod:`cloudburst.comm.p2p`
    (magic, kind and length validated there). Kinds reused from :class:`~cloudburst.comm.messages.
    Kind`: FETCH (no payload; the reply carries θ), PUSH (payload θ, or SGP's numerator
    θ·w/2; ``aux`` carries the push-sum weight as the bits of a float64), PING (keep-alive,
    below), DONE (the sender will send nothing more), REPLY. ``shard`` carries the sender's
    worker index and ``version`` the step of the θ it sends.

Compression (``--compress bf16|fp8|int8``: docs/algorithms.md#compression)
    Pulled θ, pushed θ and push-sum numerators travel compressed (:mod:`cloudburst.comm.p2p`
    encodes and decodes them; the byte size follows from θ's size and the method), with no
    error feedback: each message is a θ (not an increment whose sum matters) sent to a
    different peer, and a rounding of θ is not carried into the next one. Push-sum weights
    stay exact in the header (float64 bits), so Σ_i w_i stays exactly W; the numerators'
    sum Σ_i x_i does not (each message rounds its own by at most one rounding, relative to
    |θ|), so the consensus is lossy: the replicas still contract towards each other, up to
    the rounding floor.

Checks (peers are not trusted to be well-behaved)
    :func:`check_request` validates a request's kind, worker index and length (against the
    known size: nothing is allocated from a header) and a push's weight, in (0, W];
    :func:`check_push` the pushed θ (finite, and finite once de-biased by its weight);
    :func:`check_reply` a pulled θ (status, worker, finite). A bad request is rejected: its
    payload is read into the receive buffer and discarded (never deposited), a FETCH is
    answered with ``Status.REJECTED``. A header that cannot be read, or that announces a
    payload larger than θ, leaves the rest of that peer's stream unreadable: the peer is
    dropped at once (:class:`~cloudburst.comm.messages.PeerFaults`; nothing more from it is read,
    its DONE is not awaited); any peer is dropped after ``MAX_PEER_FAULTS`` bad requests. A
    bad reply to a pull is not averaged in; the puller counts it against that peer and stops
    pulling from it after ``MAX_PEER_FAULTS`` (at once if its reply stream is out of step).
    Every rejection is counted in ``messages_rejected`` and logged at a bounded rate; none
    stops either thread. A rejected push-sum message takes its weight with it: Σ_i w_i is
    then short of W by that much (a correct peer never sends one).

Shutdown
    A worker that has finished training sends DONE to every peer, then keeps serving until it
    has received DONE from every peer; then its serving thread exits. A peer's requests and its
    DONE travel the same ordered channel (same pair, group and tag), so by the time a serving
    thread has every DONE no request to it can still be on its way: pulls to a finished peer
    are answered (with its final θ), pushes to it land in its mailbox and are folded in its
    ``finish``. No global barrier during training: only the finish waits, for the slowest peer.

Timeouts
    Every blocking call runs under the group's timeout (``comm_timeout_s``). A serving thread
    waiting for requests would hit that timeout when no peer contacts it for that long (a
    worker that finished early, waiting for a straggler that never picks it): each main thread
    therefore sends a PING to every peer it has not contacted for ``keepalive_s`` (a quarter
    of the timeout) at its step boundaries. A serving thread that still hears nothing for
    ``comm_timeout_s`` (a peer died or hung, or one step took longer than the timeout) fails;
    the main thread raises at its next step boundary or in ``finish``. (gloo cannot wait
    for a message with a shorter timeout and try again: a timed-out receive breaks the
    group's connections, so the serving thread never polls.)

Accounting
    Bytes go to the caller's :class:`CommStats`: inter- or intra-node by the peer's node, and
    messages to another node are held back by the emulated link (``PeerTransport._leave``) —
    replies from the serving thread too, since they share this rank's node NIC. The serving
    thread counts into its own stats (one writer per counter, no lost updates) and settles
    them after each whole message; :meth:`GossipTransport.merge_serving_stats` adds what was
    settled since the last merge into the caller's stats at a step boundary. The serving
    thread's idle wait is not this worker's comm wait and is not added.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from cloudburst.comm.messages import Header, Kind, MessageError, PeerFaults, Status
from cloudburst.comm.p2p import PeerTransport
from cloudburst.comm.stats import CommStats
from cloudburst.comm.transport import REAL, Transport

log = logging.getLogger(__name__)

#: The request kinds a serving thread accepts.
REQUEST_KINDS = (Kind.FETCH, Kind.PUSH, Kind.PING, Kind.DONE)
#: Keep-alive period as a fraction of the groups' timeout.
KEEPALIVE_FRACTION = 0.25
FP32_MAX = torch.finfo(torch.float32).max
#: The serving thread's counters that are added to the caller's stats.
MERGED_STATS = (
    "sent_bytes",
    "received_bytes",
    "inter_node_bytes",
    "intra_node_bytes",
    "emulated_link_s",
    "messages_rejected",
)


def encode_weight(weight: float) -> int:
    """A float64 as the int64 with the same bits (travels in ``Header.aux`` exactly)."""
    return struct.unpack("<q", struct.pack("<d", weight))[0]


def decode_weight(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def check_request(
    header: Header, sender_worker: int, numel: int, max_weight: float = math.inf
) -> str | None:
    """Why a request from worker ``sender_worker`` is malformed, or None when it is fine.

    ``max_weight``: the largest push-sum weight a message may carry, W (the weights of all
    workers, messages in flight included, sum to W; a sender sends half of its own).
    """
    if header.kind not in REQUEST_KINDS:
        return f"unexpected message kind {header.kind.name}"
    if header.shard != sender_worker:
        return f"header names worker {header.shard}, sent by worker {sender_worker}"
    expected = numel if header.kind == Kind.PUSH else 0
    if header.numel != expected:
        return f"{header.kind.name} with {header.numel} elements, expected {expected}"
    if header.kind == Kind.PUSH:
        weight = decode_weight(header.aux)
        if not (math.isfinite(weight) and 0 < weight <= max_weight):
            return f"PUSH with weight {weight}, outside (0, {max_weight}]"
    return None


def check_push(payload: torch.Tensor, weight: float) -> str | None:
    """Why a pushed payload (θ, or a push-sum numerator θ·w with weight w) is refused, or
    None: it must be finite, and so must the θ it stands for (payload / w, in fp32)."""
    largest = float(torch.linalg.vector_norm(payload, ord=math.inf))  # NaN if any is NaN
    if not math.isfinite(largest):
        return "PUSH of a non-finite θ"
    if largest / weight > FP32_MAX:
        return f"PUSH whose θ overflows once divided by its weight {weight}"
    return None


def check_reply(reply: Header, peer_worker: int, numel: int, theta: torch.Tensor) -> str | None:
    """Why a reply to a pull (its header, and θ received into ``theta``) is refused, or None."""
    if reply.status != Status.OK:
        return f"FETCH answered with status {reply.status}"
    if reply.shard != peer_worker or reply.numel != numel:
        return (
            f"reply names worker {reply.shard} with {reply.numel} elements, "
            f"expected worker {peer_worker} with {numel}"
        )
    if not math.isfinite(float(torch.linalg.vector_norm(theta, ord=math.inf))):
        return "pulled θ is not finite"
    return None


class Snapshot:
    """θ as of the last step boundary, which the serving thread sends while training goes on.

    Three host buffers: the published one, the one the serving thread may still be sending
    (at most one: there is one serving thread), and one to write the next snapshot into. So
    :meth:`publish` never waits for a send and a send never sees a half-written θ.
    """

    def __init__(self, numel: int):
        self._buffers = [torch.empty(numel, dtype=torch.float32) for _ in range(3)]
        self._front = 0
        self._in_use: int | None = None
        self._version = 0
        self._lock = threading.Lock()

    @property
    def numel(self) -> int:
        return self._buffers[0].numel()

    def publish(self, flat: torch.Tensor, version: int) -> None:
        """Main thread: make a copy of ``flat`` (any device) the θ that peers get."""
        with self._lock:
            back = next(i for i in range(3) if i not in (self._front, self._in_use))
        self._buffers[back].copy_(flat)  # neither published nor being sent: no lock needed
        with self._lock:
            self._front, self._version = back, version

    @contextmanager
    def acquire(self) -> Iterator[tuple[torch.Tensor, int]]:
        """Serving thread: (θ, its step), not overwritten until the block ends."""
        with self._lock:
            index, version = self._front, self._version
            self._in_use = index
        try:
            yield self._buffers[index], version
        finally:
            with self._lock:
                self._in_use = None


class Mailbox:
    """What peers pushed since the main thread last looked: Σθ (or Σ numerators), n, Σw."""

    def __init__(self, numel: int):
        self._acc = torch.zeros(numel, dtype=torch.float32)
        self._spare = torch.zeros(numel, dtype=torch.float32)
        self._count = 0
        self._weight = 0.0
        self._lock = threading.Lock()

    def deposit(self, payload: torch.Tensor, weight: float) -> None:
        """Serving thread: add one received message."""
        with self._lock:
            self._acc.add_(payload)
            self._count += 1
            self._weight += weight

    def take(self) -> tuple[torch.Tensor, int, float]:
        """Main thread: (Σ payloads, n, Σ weights) since the last take. The tensor stays
        valid until the next call (two buffers swap; deposits go to the other one)."""
        with self._lock:
            self._spare.zero_()
            taken, self._acc, self._spare = self._acc, self._spare, self._acc
            count, weight = self._count, self._weight
            self._count, self._weight = 0, 0.0
        return taken, count, weight


@dataclass
class ServingCounters:
    fetches_served: int = 0
    pushes_received: int = 0
    pings_received: int = 0
    requests_rejected: int = 0  # bad requests, and those of dropped peers (not read)
    replies_rejected: int = 0  # bad replies to this worker's pulls (main thread)


class GossipTransport:
    """One worker's end of gossip: the main thread's requests and the serving thread.

    ``rank`` and peers are global ranks; ``worker_of(rank)`` gives a rank's worker index (for
    the headers). ``crosses(peer)`` is True when ``peer`` is on another node.
    """

    def __init__(
        self,
        request_group: Any,
        reply_group: Any,
        rank: int,
        peers: list[int],
        numel: int,
        stats: CommStats,
        worker_of: Callable[[int], int],
        timeout_s: float,
        link=None,
        crosses: Callable[[int], bool] | None = None,
        wire: Transport = REAL,
        compress: str = "none",
    ):
        self.rank, self.peers, self.numel = rank, list(peers), numel
        self.wire = wire
        self.worker_of = worker_of
        self.stats = stats
        self.serve_stats = CommStats()
        self.counters = ServingCounters()
        self.keepalive_s = timeout_s * KEEPALIVE_FRACTION
        # Main thread: sends on the request group, receives replies on the reply group.
        # Payloads (θ, push-sum numerators) travel as ``compress`` says; weights stay exact.
        kw = dict(wire=wire, compress=compress)
        self._requests = PeerTransport(request_group, stats, link=link, crosses=crosses, **kw)
        self._replies = PeerTransport(reply_group, stats, **kw)
        # Serving thread: receives on the request group, sends replies on the reply group.
        self._serve_in = PeerTransport(request_group, self.serve_stats, **kw)
        self._serve_out = PeerTransport(
            reply_group, self.serve_stats, link=link, crosses=crosses, **kw
        )
        self._recv_buf = torch.empty(numel, dtype=torch.float32)
        self.max_weight = float(len(self.peers) + 1)  # W
        # Who sent this worker bad requests (serving thread), bad replies (main thread); each
        # thread keeps its own, so a peer dropped by one is still heard by the other.
        self.request_faults = PeerFaults(log, f"gossip worker {worker_of(rank)} serving")
        self.reply_faults = PeerFaults(log, f"gossip worker {worker_of(rank)} pulling")
        self._last_sent = dict.fromkeys(self.peers, self.wire.now())
        # The serving thread's counters as of its last whole message, and as last merged.
        self._serve_totals = (0,) * len(MERGED_STATS)
        self._merged_totals = self._serve_totals
        self._stats_lock = threading.Lock()
        self._thread = None  # the serving task
        self._error: BaseException | None = None
        self._done_sent = False
        self._me = worker_of(rank)

    # ------------------------------------------------------------------ main thread
    def start(self, snapshot: Snapshot, mailbox: Mailbox | None) -> None:
        """Start serving ``snapshot`` to pullers and filling ``mailbox`` from pushers."""
        if snapshot.numel != self.numel:
            raise ValueError(f"snapshot has {snapshot.numel} elements, expected {self.numel}")
        self._snapshot, self._mailbox = snapshot, mailbox
        self._thread = self.wire.spawn(self._serve, f"cloudburst-gossip-serve{self._me}")

    def pull(self, peer: int, out: torch.Tensor, step: int) -> int | None:
        """Fetch ``peer``'s θ (its last published snapshot) into ``out``; return its step.

        None when the reply is refused (see :func:`check_reply`; ``out`` must not be used),
        and, without asking, once ``peer`` is dropped for bad replies.
        """
        if self.reply_faults.is_dropped(peer):
            return None
        self._send(peer, Header(Kind.FETCH, shard=self._me, version=step))
        try:
            reply = self._replies.recv_reply(peer, out)
        except MessageError as e:  # θ, if any, was not read: its replies are out of step
            self._refuse_reply(peer, str(e), in_step=False)
            return None
        problem = check_reply(reply, self.worker_of(peer), self.numel, out)
        if problem is not None:
            self._refuse_reply(peer, problem)
            return None
        return reply.version

    def dropped_peers(self) -> list[int]:
        """Peers dropped for bad requests or bad replies."""
        return sorted({*self.request_faults.dropped_peers(), *self.reply_faults.dropped_peers()})

    def _refuse_reply(self, peer: int, problem: str, in_step: bool = True) -> None:
        self.reply_faults.reject(peer, problem, in_step=in_step)
        self.counters.replies_rejected += 1
        self.stats.messages_rejected += 1

    def push(self, peer: int, payload: torch.Tensor, weight: float, step: int) -> None:
        """Send ``payload`` (θ, or a push-sum numerator) and ``weight`` to ``peer``'s mailbox."""
        header = Header(
            Kind.PUSH, shard=self._me, version=step, numel=self.numel, aux=encode_weight(weight)
        )
        self._send(peer, header, payload)

    def keepalive(self) -> None:
        """PING every peer not contacted for ``keepalive_s`` (keeps its serving thread's wait
        for requests inside the timeout)."""
        now = self.wire.now()
        for peer in self.peers:
            if now - self._last_sent[peer] > self.keepalive_s:
                self._send(peer, Header(Kind.PING, shard=self._me))

    def check(self) -> None:
        """Raise if the serving thread has failed."""
        if self._error is not None:
            raise RuntimeError(
                f"gossip serving thread of rank {self.rank} failed: {self._error} (a peer "
                "died, or sent nothing for comm_timeout_s; peers send keep-alives at their "
                "step boundaries, so --comm-timeout-s must exceed one step's time by far)"
            ) from self._error

    def finish(self) -> None:
        """Send DONE to every peer, then wait until every peer has sent its DONE (this
        worker serves them until then) and the serving thread has exited."""
        self.check()
        if not self._done_sent:
            for peer in self.peers:
                self._send(peer, Header(Kind.DONE, shard=self._me))
            self._done_sent = True
        if self._thread is not None:
            self._thread.join()
        self.merge_serving_stats()
        self.check()

    def merge_serving_stats(self) -> None:
        """Add what the serving thread moved since the last call to the caller's stats
        (whole messages only, so that bytes and their inter/intra-node split agree)."""
        with self._stats_lock:
            totals = self._serve_totals
        for name, now, before in zip(MERGED_STATS, totals, self._merged_totals, strict=True):
            setattr(self.stats, name, getattr(self.stats, name) + now - before)
        self._merged_totals = totals

    def _settle_serving_stats(self) -> None:
        totals = tuple(getattr(self.serve_stats, name) for name in MERGED_STATS)
        with self._stats_lock:
            self._serve_totals = totals

    def _send(self, peer: int, header: Header, payload: torch.Tensor | None = None) -> None:
        if self._done_sent:
            raise RuntimeError("gossip: nothing may be sent after DONE")
        self._requests.send(peer, header, payload)
        self._last_sent[peer] = self.wire.now()

    # ------------------------------------------------------------------ serving thread
    def _serve(self) -> None:
        # Peers whose DONE is awaited; a dropped peer's is not (it may never come).
        pending = set(self.peers)
        try:
            while pending:
                src, header = self._serve_in.recv_request_any()
                if self.request_faults.is_dropped(src):
                    self.request_faults.ignore(src)  # its payloads stay unread
                    self._count_rejected(header)
                elif src not in self.peers:
                    self._drop(src, header, "a request from a rank that is not a gossip peer")
                elif header is None:
                    self._drop(src, header, "malformed header (bad magic, unknown kind, ...)")
                elif self._serve_request(src, header):
                    pending.discard(src)  # its DONE
                pending.difference_update(self.request_faults.dropped_peers())
                self._settle_serving_stats()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by check()
            self._error = e
            log.error("gossip serving thread stops: %s", e)
        finally:
            self._settle_serving_stats()

    def _serve_request(self, src: int, header: Header) -> bool:
        """Check and serve one request of peer ``src``; True when it is a valid DONE."""
        problem = check_request(header, self.worker_of(src), self.numel, self.max_weight)
        if problem is None and header.kind == Kind.PUSH and self._mailbox is None:
            problem = "PUSH to a worker that pulls"
        if problem is not None:
            self._refuse(src, header, problem)
        elif header.kind == Kind.FETCH:
            self._serve_fetch(src)
        elif header.kind == Kind.PUSH:
            payload = self._serve_in.recv_payload(src, self.numel, out=self._recv_buf)
            weight = decode_weight(header.aux)
            problem = check_push(payload, weight)  # a short payload ends in NaN: refused too
            if problem is not None:
                self._count_rejected(header)
                self.request_faults.reject(src, problem)
            else:
                self._mailbox.deposit(payload, weight)
                self.counters.pushes_received += 1
        elif header.kind == Kind.PING:
            self.counters.pings_received += 1
        return problem is None and header.kind == Kind.DONE

    def _serve_fetch(self, src: int) -> None:
        with self._snapshot.acquire() as (theta, version):
            reply = Header(Kind.REPLY, shard=self._me, version=version, numel=self.numel)
            self._serve_out.send(src, reply, theta)
        self.counters.fetches_served += 1

    def _refuse(self, src: int, header: Header, problem: str) -> None:
        """Reject a request: the payload it announces is read into the receive buffer and
        discarded (the stream stays in step; nothing is deposited); a FETCH gets
        ``Status.REJECTED``. A payload larger than θ cannot be read safely: ``src`` is dropped."""
        if header.numel > self.numel:
            self._drop(src, header, f"{problem}; a payload of {header.numel} elements")
            return
        self._count_rejected(header)
        if self.request_faults.reject(src, problem):
            return  # dropped now: its payload stays unread, and it gets no reply
        if header.numel:
            self._serve_in.recv_payload(src, header.numel, out=self._recv_buf[: header.numel])
        if header.kind == Kind.FETCH:
            self._serve_out.send(src, Header(Kind.REPLY, shard=self._me, status=Status.REJECTED))

    def _drop(self, src: int, header: Header | None, problem: str) -> None:
        """Reject a request whose payload (if any) cannot be read in step: drop ``src``."""
        self._count_rejected(header)
        self.request_faults.reject(src, problem, in_step=False)

    def _count_rejected(self, header: Header | None) -> None:
        self.counters.requests_rejected += 1
        if header is not None:  # an unreadable header was counted by the transport
            self.serve_stats.messages_rejected += 1
