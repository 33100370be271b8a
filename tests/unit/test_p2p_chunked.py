"""Chunked payloads of PeerTransport (cloudburst.comm.p2p), against an in-memory wire: the
chunks on the wire, their order, ``prepare`` / ``on_chunk`` / ``arrived``, and the NaN a short
chunk leaves. No processes (tests/dist/test_p2p_chunked.py runs the same over gloo)."""

import math
from collections import defaultdict, deque

import pytest
import torch

from cloudburst.comm.messages import TAG_REPLY_PAYLOAD, TAG_REQUEST_PAYLOAD, Header, Kind, Status
from cloudburst.comm.p2p import CHUNK_NUMEL, PeerTransport, chunk_bounds
from cloudburst.comm.transport import REAL
from tests.support import Done


class FakeWire:
    """Messages in FIFO queues by (src, dst, tag), the sender's tensor cloned when sent; a
    receive copies the next message into the buffer's prefix (as gloo does a short one)."""

    def __init__(self):
        self.queues: dict[tuple[int, int, int], deque] = defaultdict(deque)
        self.sent: list[tuple[int, int, int, list[float]]] = []  # (src, dst, tag, values)
        self.me = 0

    def at(self, rank: int) -> "FakeWire":
        self.me = rank
        return self

    def now(self) -> float:
        return 0.0

    def isend(self, tensor, dst, tag, group=None):
        self.queues[(self.me, dst, tag)].append(tensor.clone())
        self.sent.append((self.me, dst, tag, tensor.tolist()))
        return Done()

    def send(self, tensor, dst, tag, group=None):
        self.isend(tensor, dst, tag, group)

    def irecv(self, tensor, src, tag, group=None):
        me = self.me
        return Done(lambda: self._take(me, tensor, src, tag))

    def recv(self, tensor, src, tag, group=None):
        return self._take(self.me, tensor, src, tag)

    def _take(self, me, tensor, src, tag):
        if src is None:  # from any sender
            src = next(s for (s, d, g), q in self.queues.items() if d == me and g == tag and q)
        msg = self.queues[(src, me, tag)].popleft()
        if msg.numel() > tensor.numel():
            raise AssertionError("message longer than the receive buffer (gloo would abort)")
        tensor[: msg.numel()].copy_(msg)
        return src


def _pair(chunk_numel: int, **kw):
    wire = FakeWire()
    return wire, PeerTransport(wire=wire, chunk_numel=chunk_numel, **kw)


def test_chunk_bounds():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(3, 4) == [(0, 3)]
    assert chunk_bounds(10, 0) == [(0, 10)]
    assert chunk_bounds(0, 4) == [(0, 0)]
    with pytest.raises(ValueError, match="must be >= 0"):
        chunk_bounds(10, -1)


def test_default_chunking_real_wire_only():
    assert PeerTransport(wire=REAL).chunk_numel == CHUNK_NUMEL
    assert PeerTransport(wire=FakeWire()).chunk_numel == 0  # the simulator's: whole payloads
    with pytest.raises(ValueError, match="chunk_numel must be >= 0"):
        PeerTransport(wire=FakeWire(), chunk_numel=-2)


@pytest.mark.parametrize(
    "kind, tag, chunk, numel, compress, chunks",
    [
        (Kind.PUSH, TAG_REQUEST_PAYLOAD, 4, 10, "none", [(0, 4), (4, 8), (8, 10)]),
        (Kind.REPLY, TAG_REPLY_PAYLOAD, 3, 8, "none", [(0, 3), (3, 6), (6, 8)]),
        (Kind.PUSH, TAG_REQUEST_PAYLOAD, 2, 6, "bf16", [(0, 6)]),  # compressed: whole
    ],
)
def test_a_payload_travels_in_chunks_and_each_is_whole_when_handed_on(
    kind, tag, chunk, numel, compress, chunks
):
    """The payload leaves in chunks of ``chunk`` values (compressed ones whole), counted once with
    the header, and arrives whole; ``on_chunk`` sees each chunk already received."""
    wire, t = _pair(chunk_numel=chunk, compress=compress)
    payload = torch.arange(numel, dtype=torch.float32)
    t.send(1, Header(kind, numel=numel, status=Status.OK), payload)
    assert len([m for m in wire.sent if m[2] == tag]) == len(chunks)
    if compress == "none":
        assert [len(m[3]) for m in wire.sent if m[2] == tag] == [b - a for a, b in chunks]
        assert t.stats.sent_bytes == 64 + 4 * numel
    out, seen = torch.zeros(numel), []

    def on_chunk(a: int, b: int) -> None:
        seen.append((a, b, out[a:b].tolist()))

    wire.at(1)  # rank 1 receives
    if kind == Kind.REPLY:
        assert t.recv_reply(0, out, on_chunk=on_chunk).numel == numel
    else:
        assert t.recv_request_any()[1].numel == numel
        t.recv_payload(0, numel, out=out, on_chunk=on_chunk)
    assert out.tolist() == payload.tolist()
    assert seen == [(a, b, payload[a:b].tolist()) for a, b in chunks]


def test_prepare_fills_each_chunk_before_it_is_sent():
    wire, t = _pair(chunk_numel=3)
    payload = torch.zeros(7)
    calls = []

    def prepare(a, b):
        calls.append((a, b, len(wire.sent)))  # how many chunks had left before this one
        payload[a:b] = torch.arange(a, b, dtype=torch.float32) * 10

    t.isend_payload(1, payload, reply=False, prepare=prepare).wait()
    assert calls == [(0, 3, 0), (3, 6, 1), (6, 7, 2)]
    assert [m[3] for m in wire.sent] == [[0, 10, 20], [30, 40, 50], [60]]
    with pytest.raises(ValueError, match="contiguous fp32"):
        t.isend_payload(1, torch.zeros(4, dtype=torch.float64), reply=False, prepare=prepare)


def test_irecv_payload_yields_chunks_in_order():
    wire, t = _pair(chunk_numel=2)
    t.isend_payload(1, torch.arange(5, dtype=torch.float32), reply=True)
    out = torch.zeros(5)
    receive = t.wire.at(1) and t.irecv_payload(0, out, reply=True)
    assert list(receive.arrived()) == [(0, 2), (2, 4), (4, 5)]
    assert out.tolist() == [0, 1, 2, 3, 4]
    receive.wait()  # nothing left to wait for
    assert receive.is_completed()


def test_short_chunk_leaves_nan_in_its_last_element():
    wire, t = _pair(chunk_numel=4)
    # A hostile sender: the second chunk's message is one value short.
    for part in (torch.ones(4), torch.ones(3), torch.ones(2)):
        wire.isend(part, 1, TAG_REQUEST_PAYLOAD)
    out = torch.zeros(10)
    wire.at(1)
    t.recv_payload(0, 10, out=out)
    assert math.isnan(out[7]) and bool(torch.isfinite(out[:7]).all())


def test_final_payload_in_chunks():
    wire, t = _pair(chunk_numel=4)
    t.send(1, Header(Kind.FINAL, numel=9), torch.full((9,), 2.5), final=True)
    assert [len(m[3]) for m in wire.sent[1:]] == [4, 4, 1]
    wire.at(1)
    _, theta = t.recv_final(0, 9)
    assert theta.tolist() == [2.5] * 9
