"""Point-to-point messages between workers and parameter-server shards, on a gloo group.

Every message is a fixed-size int64 *header* followed, for some kinds, by an fp32 *payload*.
The header carries a magic number, the message kind, the shard index, a version, the payload
length and two counters; :meth:`Header.from_tensor` validates it so that a malformed or
mismatched message is rejected (and counted) rather than applied.

Hostile or broken peers (what a receiver can and cannot do about them)
    A receiver never allocates from a length a peer sent: it compares it with the size it
    knows first. gloo accepts a message *shorter* than the receive buffer silently (the rest
    keeps what it held), so receives poison what a short message would leave: the header
    buffer with -1s (a negative field fails validation; only a request's ``aux``, which a
    server does not use, takes any value), a payload's last element with NaN (the receivers'
    finiteness checks reject it). A message *longer* than the buffer aborts the receiving
    process inside gloo (an enforce in its I/O thread, not an exception), so a payload of
    unknown size is never read: its sender is dropped instead (:class:`PeerFaults`). A sender
    that announces a payload and never sends it, or never reads its reply, holds the receiver
    for up to the group's timeout. Neither can be helped above gloo: torch.distributed is for
    networks you trust only (docs/security.md).

Compressed payloads (``compress``: bf16, int8, fp8; docs/algorithms.md#compression)
    A transport made with a compression method sends request and reply payloads as the bytes
    of :func:`~cloudburst.comm.quantise.encode` (uint8): the header's ``numel`` stays the number
    of values, and the receiver derives the byte size from the size it knows and the method
    (:func:`~cloudburst.comm.quantise.payload_bytes`), never from the header. A payload given
    as fp32 is encoded here (no error feedback: a fetched θ); one given as uint8 was encoded by
    the caller, which kept the error feedback (a worker's Δ). A short message leaves the last
    four bytes 0xFF: a NaN scale (or bf16 NaNs), so the decoded payload fails the receivers'
    finiteness checks, as does a block whose scale is not finite and positive. FINAL payloads
    (one server's θ to another at the end) are always exact fp32.

Chunked payloads (the real wire)
    An fp32 payload of more than ``chunk_numel`` values (:data:`CHUNK_NUMEL`, 4 MiB) travels
    as consecutive messages of at most that many values on the payload's tag (gloo keeps the
    messages of one tag between two peers in order). Both ends derive the chunks from the size
    they know (never from a peer's header), and every chunk's last element is poisoned with NaN
    before its receive, so a short chunk fails the receivers' finiteness checks as a short
    message did. Chunks let each side work on one part of a payload while the next is on the
    wire: :meth:`PeerTransport.isend_payload`'s ``prepare`` fills chunk i just before it is
    sent (a worker computes Δ while earlier chunks travel), :meth:`~PeerTransport.recv_payload`
    and :meth:`~PeerTransport.recv_reply` call ``on_chunk`` as each chunk arrives (a server
    checks Δ while the rest arrives), and :meth:`~PeerTransport.irecv_payload` returns a
    :class:`PayloadReceive` whose :meth:`~PayloadReceive.arrived` yields the chunks in order.
    Compressed payloads and the simulator's wire (whose link model prices each message) travel
    in one message.

Tags keep the streams apart, so a server can receive headers from *any* source (gloo's
``recv`` without ``src`` returns the sender) while payloads and replies are matched to one peer.
Every blocking call runs under the process group's timeout (set at ``init_process_group``);
the time spent blocked and the bytes moved are counted in :class:`CommStats`.

Peers are named by their global rank, also on a group built outside torch.distributed's
registry (a restarted worker's rejoin group, :func:`cloudburst.runtime.rejoin.rejoin_group`): the
transport then calls the group's own send/recv and maps ranks through ``members``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cloudburst.comm.messages import (
    HEADER_BYTES,
    HEADER_LEN,
    TAG_FINAL,
    TAG_FINAL_PAYLOAD,
    TAG_REPLY,
    TAG_REPLY_PAYLOAD,
    TAG_REQUEST,
    TAG_REQUEST_PAYLOAD,
    Header,
    Kind,
    MessageError,
)
from cloudburst.comm.quantise import decode, encode, payload_bytes
from cloudburst.comm.stats import CommStats
from cloudburst.comm.transport import REAL, TorchTransport, Transport, Work, member_group

#: fp32 payloads on the real wire travel in messages of at most this many values (4 MiB): big
#: enough that gloo's per-message cost is small, small enough that the work on one chunk (a
#: subtraction, a finiteness check, an add) overlaps with the next one on the wire.
CHUNK_NUMEL = 1 << 20

#: Called with a chunk's ``[start, stop)`` range of a payload (see the module docstring).
ChunkFn = Callable[[int, int], None]


def chunk_bounds(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges a payload of ``numel`` values travels in: one range when
    ``chunk_numel`` is 0 or not smaller than ``numel``; the last chunk may be shorter."""
    if numel < 0 or chunk_numel < 0:
        raise ValueError(f"numel and chunk_numel must be >= 0, got {numel} and {chunk_numel}")
    if chunk_numel == 0 or numel <= chunk_numel:
        return [(0, numel)]
    return [(a, min(a + chunk_numel, numel)) for a in range(0, numel, chunk_numel)]


class PayloadReceive:
    """A started receive of one payload, possibly in chunks: :meth:`arrived` yields each
    chunk's range as it arrives (in order), :meth:`wait` waits for all of it."""

    def __init__(self, parts: list[tuple[int, int, Work]]):
        self._parts = parts
        self._next = 0  # chunks before this one have arrived (and were yielded)

    def arrived(self) -> Iterator[tuple[int, int]]:
        """Wait for the chunks one by one, yielding each ``(start, stop)`` once it is in."""
        while self._next < len(self._parts):
            a, b, work = self._parts[self._next]
            work.wait()
            self._next += 1
            yield a, b

    def wait(self) -> None:
        for _ in self.arrived():
            pass

    def is_completed(self) -> bool:
        return all(work.is_completed() for _, _, work in self._parts[self._next :])


class _Sends:
    """Started sends of one payload's chunks, waited for together."""

    def __init__(self, works: list[Work]):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class PeerTransport:
    """Header + payload messages over point-to-point gloo send/recv, counted and timed.

    ``group`` is the process group (None: the default group, whose timeout bounds every call).
    ``members``: for a gloo group made outside torch.distributed's registry, the global rank of
    each of its ranks (rank i of the group is ``members[i]``); None for registered groups.
    """

    def __init__(
        self,
        group: Any = None,
        stats: CommStats | None = None,
        link=None,
        crosses=None,
        members: list[int] | None = None,
        wire: Transport = REAL,
        compress: str = "none",
        chunk_numel: int | None = None,
    ):
        """``link`` (a :class:`~cloudburst.comm.link.LinkEmulator`) and ``crosses(peer)``
        (True when ``peer`` is on another node) emulate a slow link between nodes: a message
        to another node leaves only once the emulated link has carried the one before it and
        itself (held back on the sender until it arrives; where the node's NIC is shared,
        behind the node's egress and the receiving node's ingress:
        ``LinkEmulator.book_send``).
        ``wire`` moves the tensors (:mod:`cloudburst.comm.transport`; the simulator's in a
        virtual cluster). ``compress``: how request and reply payloads travel (module
        docstring; ``none``: fp32). ``chunk_numel``: the most values of an fp32 payload in
        one message (0: whole payloads; None: :data:`CHUNK_NUMEL` on the real wire, whole
        payloads on the simulator's); both ends of a conversation must use the same."""
        if compress not in ("none", "bf16", "int8", "fp8"):
            raise ValueError(f"point-to-point payloads cannot be sent as {compress!r}")
        self.compress = compress
        if members is not None and group is None:
            raise ValueError("members names the ranks of a group; no group was given")
        self.wire = wire
        self.members = list(members) if members is not None else None
        self.group = member_group(group, members) if members is not None else group
        self.stats = stats or CommStats()
        self.link = link if link is not None and link.active else None
        self.crosses = crosses or (lambda peer: False)
        self._header_buf = torch.empty(HEADER_LEN, dtype=torch.int64)
        if chunk_numel is None:
            chunk_numel = CHUNK_NUMEL if isinstance(wire, TorchTransport) else 0
        if chunk_numel < 0:
            raise ValueError(f"chunk_numel must be >= 0 (0: whole payloads), got {chunk_numel}")
        self.chunk_numel = chunk_numel

    def _leave(self, dst: int, nbytes: int) -> None:
        """Count ``nbytes`` to ``dst`` as intra/inter-node; hold them back on a slow link."""
        if not self.crosses(dst):
            self.stats.intra_node_bytes += nbytes
            return
        self.stats.inter_node_bytes += nbytes
        if self.link is not None:
            cost = self.link.p2p_s(nbytes)
            self.stats.emulated_link_s += cost
            self.link.wait_until(self.link.book_send(nbytes, dst))

    # --------------------------------------------------------------- the wire
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return self.wire.isend(tensor, dst, tag, self.group)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        return self.wire.irecv(tensor, src, tag, self.group)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.wire.send(tensor, dst, tag, self.group)

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int:
        """Receive from ``src`` (None: from any peer); returns the sender's global rank."""
        return self.wire.recv(tensor, src, tag, self.group)

    def _isend_chunks(
        self, wire: torch.Tensor, dst: int, tag: int, prepare: ChunkFn | None = None
    ) -> _Sends:
        """Send ``wire`` (1-D) in chunks (fp32) or whole (compressed bytes); ``prepare(a, b)``
        fills ``wire[a:b]`` just before that chunk leaves."""
        chunk = self.chunk_numel if wire.dtype == torch.float32 else 0
        works = []
        for a, b in chunk_bounds(wire.numel(), chunk):
            if prepare is not None:
                prepare(a, b)
            works.append(self._isend(wire[a:b], dst, tag))
        return _Sends(works)

    def _irecv_chunks(self, buf: torch.Tensor, src: int, tag: int) -> list[tuple[int, int, Work]]:
        """Start receiving ``buf`` (1-D fp32) in the chunks its sender sends, each chunk's last
        element NaN until its message arrives (a short message leaves it so)."""
        parts = []
        for a, b in chunk_bounds(buf.numel(), self.chunk_numel):
            if b > a:
                buf[b - 1] = math.nan
            parts.append((a, b, self._irecv(buf[a:b], src, tag)))
        return parts

    def _recv_chunks(
        self, buf: torch.Tensor, src: int, tag: int, on_chunk: ChunkFn | None = None
    ) -> None:
        """Receive ``buf`` (1-D fp32) in chunks, calling ``on_chunk(a, b)`` as each arrives
        (all receives are posted first: the wire never waits for ``on_chunk``)."""
        bounds = chunk_bounds(buf.numel(), self.chunk_numel)
        if len(bounds) == 1:  # one message: a blocking receive
            if buf.numel():
                buf[-1] = math.nan
            self._recv(buf, src, tag)
            if on_chunk is not None:
                on_chunk(0, buf.numel())
            return
        parts = self._irecv_chunks(buf, src, tag)
        for a, b in PayloadReceive(parts).arrived():
            if on_chunk is not None:
                on_chunk(a, b)

    # --------------------------------------------------------------- sending
    def send(
        self, dst: int, header: Header, payload: torch.Tensor | None = None, final: bool = False
    ) -> None:
        tag, payload_tag = (TAG_FINAL, TAG_FINAL_PAYLOAD) if final else self._send_tags(header)
        # A header may announce a payload that follows separately (isend_payload).
        wire = None if payload is None else self._outgoing(payload, header.numel, exact=final)
        nbytes = 0 if wire is None else wire.numel() * wire.element_size()
        t0 = self.wire.now()
        self._leave(dst, HEADER_BYTES + nbytes)
        self._send(header.to_tensor(), dst, tag)
        self.stats.sent_bytes += HEADER_BYTES
        if wire is not None and header.numel:
            self._isend_chunks(wire.view(-1), dst, payload_tag).wait()
            self.stats.sent_bytes += nbytes
        self.stats.wait_s += self.wire.now() - t0

    def _outgoing(self, payload: torch.Tensor, numel: int | None, exact: bool) -> torch.Tensor:
        """What goes on the wire for ``payload`` of ``numel`` values (None: its own size):
        fp32, or the compressed bytes (encoded here unless the caller did, as uint8)."""
        if self.compress != "none" and not exact and payload.dtype == torch.uint8:
            if numel is not None and payload.numel() != payload_bytes(numel, self.compress):
                raise ValueError(
                    f"header says {numel} elements: {payload_bytes(numel, self.compress)} "
                    f"{self.compress} bytes, payload has {payload.numel()}"
                )
            return payload.detach().contiguous()
        if numel is not None and payload.numel() != numel:
            raise ValueError(f"header says {numel} elements, payload has {payload.numel()}")
        if self.compress != "none" and not exact:
            return encode(payload.detach().to(torch.float32), self.compress)
        return payload.detach().to(torch.float32).contiguous()

    def _packed_buffer(self, numel: int) -> torch.Tensor:
        """A receive buffer for a compressed payload of ``numel`` values, its last bytes 0xFF
        (a short message then decodes to NaN)."""
        packed = torch.empty(payload_bytes(numel, self.compress), dtype=torch.uint8)
        packed[-4:].fill_(0xFF)
        return packed

    @staticmethod
    def _send_tags(header: Header) -> tuple[int, int]:
        if header.kind == Kind.REPLY:
            return TAG_REPLY, TAG_REPLY_PAYLOAD
        return TAG_REQUEST, TAG_REQUEST_PAYLOAD

    # --------------------------------------------------------------- receiving
    def recv_request_any(self, src: int | None = None) -> tuple[int, Header | None]:
        """Block until any peer (or ``src``) sends a request header. Returns (sender, header
        or None).

        A header that fails validation is counted and returned as None; its sender is known,
        but not whether a payload follows (nor its size): the caller drops that sender.

        On the real wire, a peer that dies after announcing a request (its send posted, the
        receive not yet) makes every later receive from any source on the group fail: gloo
        keeps the dead sender's announcement and finds it first each time
        (tests/dist/test_request_poison.py). A receive from a named live peer still works.
        """
        # A short message (gloo accepts one) leaves -1s: a negative field, or bad magic.
        self._header_buf.fill_(-1)
        t0 = self.wire.now()
        src = self._recv(self._header_buf, src, TAG_REQUEST)
        self.stats.wait_s += self.wire.now() - t0
        self.stats.received_bytes += HEADER_BYTES
        try:
            return src, Header.from_tensor(self._header_buf)
        except MessageError:
            self.stats.messages_rejected += 1
            return src, None

    def recv_payload(
        self,
        src: int,
        numel: int,
        final: bool = False,
        out: torch.Tensor | None = None,
        on_chunk: ChunkFn | None = None,
    ) -> torch.Tensor:
        """Receive ``numel`` fp32 values from ``src`` (into ``out`` when given: no allocation).

        ``numel`` must be a size the caller knows (never one read from a peer's header alone).
        A shorter message leaves the last element of its chunk NaN: callers check the payload
        is finite. ``on_chunk(a, b)`` is called as each chunk ``out[a:b]`` arrives, while the
        next ones are on the wire (once, for the whole payload, when it travels in one message).
        """
        buf = torch.empty(numel, dtype=torch.float32) if out is None else out
        if buf.numel() != numel:
            raise ValueError(f"receive buffer has {buf.numel()} elements, expected {numel}")
        tag = TAG_FINAL_PAYLOAD if final else TAG_REQUEST_PAYLOAD
        t0 = self.wire.now()
        if self.compress != "none" and not final and numel:
            packed = self._packed_buffer(numel)
            self._recv(packed, src, tag)
            self.stats.received_bytes += packed.numel()
            buf.copy_(decode(packed, numel, self.compress))
            if on_chunk is not None:
                on_chunk(0, numel)
        elif numel:
            self._recv_chunks(buf.view(-1), src, tag, on_chunk)
            self.stats.received_bytes += numel * 4
        self.stats.wait_s += self.wire.now() - t0
        return buf

    # --------------------------------------------------------------- overlapped payloads
    def isend_payload(
        self, dst: int, payload: torch.Tensor, reply: bool, prepare: ChunkFn | None = None
    ) -> Work:
        """Start sending a payload without blocking (request or reply stream).

        ``prepare(a, b)``, when given, fills ``payload[a:b]`` just before that chunk is sent
        (``payload`` must then be a contiguous fp32 tensor, sent as is; compressed: the whole
        payload is prepared, then encoded), so that computing it overlaps with sending it.
        """
        tag = TAG_REPLY_PAYLOAD if reply else TAG_REQUEST_PAYLOAD
        if prepare is not None:
            if payload.dtype != torch.float32 or not payload.is_contiguous():
                raise ValueError("a payload prepared chunk by chunk must be contiguous fp32")
            if self.compress != "none":
                prepare(0, payload.numel())
                prepare = None
        wire = payload.detach().view(-1) if prepare is not None else None
        if wire is None:
            wire = self._outgoing(payload, None, exact=False).view(-1)
        nbytes = wire.numel() * wire.element_size()
        self._leave(dst, nbytes)
        work = self._isend_chunks(wire, dst, tag, prepare)
        self.stats.sent_bytes += nbytes
        return work

    def irecv_payload(self, src: int, out: torch.Tensor, reply: bool) -> PayloadReceive:
        """Start receiving a payload into ``out`` without blocking (compressed: decoded into
        ``out`` once it is in); the result's ``arrived()`` yields each chunk as it arrives."""
        tag = TAG_REPLY_PAYLOAD if reply else TAG_REQUEST_PAYLOAD
        if self.compress != "none" and out.numel():
            packed = self._packed_buffer(out.numel())
            work = self._irecv(packed, src, tag)
            self.stats.received_bytes += packed.numel()
            decoding = _Decoding(work, packed, out, self.compress)
            return PayloadReceive([(0, out.numel(), decoding)])
        parts = self._irecv_chunks(out.view(-1), src, tag) if out.numel() else []
        self.stats.received_bytes += out.numel() * out.element_size()
        return PayloadReceive(parts)

    def wait_all(self, works: list[Work]) -> None:
        """Wait for started sends/receives (each under the group's timeout), timing the wait."""
        t0 = self.wire.now()
        for work in works:
            work.wait()
        self.stats.wait_s += self.wire.now() - t0

    def recv_reply(
        self, src: int, out: torch.Tensor | None = None, on_chunk: ChunkFn | None = None
    ) -> Header:
        """Receive the reply header from ``src`` and, if it has a payload, copy it into ``out``
        (``on_chunk(a, b)`` is called as each chunk ``out[a:b]`` arrives).

        Raises :class:`MessageError` for a malformed header, another kind, or a payload of
        another size than ``out`` (then not read: ``src``'s reply stream is out of step). A
        shorter payload leaves the last element of its chunk of ``out`` NaN.
        """
        self._header_buf.fill_(-1)
        t0 = self.wire.now()
        self._recv(self._header_buf, src, TAG_REPLY)
        self.stats.received_bytes += HEADER_BYTES
        header = Header.from_tensor(self._header_buf)
        if header.kind != Kind.REPLY:
            raise MessageError(f"expected a reply from rank {src}, got {header.kind.name}")
        if header.numel:
            if out is None or out.numel() != header.numel:
                raise MessageError(
                    f"reply from rank {src} carries {header.numel} elements, "
                    f"expected {0 if out is None else out.numel()}"
                )
            if self.compress != "none":
                packed = self._packed_buffer(header.numel)
                self._recv(packed, src, TAG_REPLY_PAYLOAD)
                self.stats.received_bytes += packed.numel()
                out.copy_(decode(packed, header.numel, self.compress))
                if on_chunk is not None:
                    on_chunk(0, header.numel)
            else:
                self._recv_chunks(out.view(-1), src, TAG_REPLY_PAYLOAD, on_chunk)
                self.stats.received_bytes += header.numel * 4
        self.stats.wait_s += self.wire.now() - t0
        return header

    def recv_final(self, src: int, numel: int) -> tuple[Header, torch.Tensor]:
        """Server 0 receives another server's final shard."""
        self._header_buf.fill_(-1)
        t0 = self.wire.now()
        self._recv(self._header_buf, src, TAG_FINAL)
        self.stats.wait_s += self.wire.now() - t0
        self.stats.received_bytes += HEADER_BYTES
        header = Header.from_tensor(self._header_buf)
        if header.kind != Kind.FINAL or header.numel != numel:
            raise MessageError(
                f"expected FINAL with {numel} elements from rank {src}, got "
                f"{header.kind.name} with {header.numel}"
            )
        return header, self.recv_payload(src, numel, final=True)


class _Decoding:
    """A started receive of a compressed payload: ``wait`` decodes it into ``out``."""

    def __init__(self, work: Work, packed: torch.Tensor, out: torch.Tensor, method: str):
        self._work, self._packed, self._out, self._method = work, packed, out, method
        self._decoded = False

    def wait(self) -> None:
        self._work.wait()
        if not self._decoded:
            self._out.copy_(decode(self._packed, self._out.numel(), self._method))
            self._decoded = True

    def is_completed(self) -> bool:
        return self._work.is_completed()
