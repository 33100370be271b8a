"""What receivers check before anything is applied: the header, the fault ledger, the server's
and gossip's checks, and their serving loops driven by scripted messages through fake transports
(which fail the test if a payload of a size the receiver should not trust is ever read)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from cloudburst.comm.gossip import (
    GossipTransport,
    Mailbox,
    Snapshot,
    check_push,
    check_reply,
    check_request,
    encode_weight,
)
from cloudburst.comm.messages import (
    FAULT_LOG_EVERY,
    FAULT_LOG_FIRST,
    MAGIC,
    MAX_PEER_FAULTS,
    Header,
    Kind,
    MessageError,
    PeerFaults,
    Status,
)
from cloudburst.comm.p2p import PeerTransport
from cloudburst.comm.stats import CommStats
from cloudburst.comm.transport import REAL
from cloudburst.config import RunConfig
from cloudburst.strategies.asgd.server import MAX_PUSH_SAMPLES, ServerLoop, request_problem
from tests.support import FakeNamespace, RecordingMetrics

NUMEL = 6


# ---------------------------------------------------------------------------- the header
def test_header_round_trip():
    h = Header(Kind.PUSH_FETCH, shard=2, version=17, numel=1000, samples=64, aux=5)
    assert Header.from_tensor(h.to_tensor()) == h


@pytest.mark.parametrize(
    "values, why",
    [
        ([0, 1, 0, 0, 0, 0, 0, 0], f"bad magic 0x0 (expected {MAGIC:#x})"),
        ([MAGIC, 99, 0, 0, 0, 0, 0, 0], "unknown message kind 99"),
        ([MAGIC, 2, 0, -1, 10, 0, 0, 0], "negative field in header"),  # version
        ([MAGIC, 2, 0, 0, -5, 0, 0, 0], "negative field in header"),  # length
        ([MAGIC, 2, -1, 0, 5, 0, 0, 0], "negative field in header"),  # shard
    ],
)
def test_malformed_headers_are_rejected(values, why):
    with pytest.raises(MessageError) as err:
        Header.from_tensor(torch.tensor(values, dtype=torch.int64))
    assert str(err.value).startswith(why), err.value


# ---------------------------------------------------------------------------- the ledger
def test_a_peer_is_dropped_after_max_faults_or_at_once_when_out_of_step():
    faults = PeerFaults(logging.getLogger("test"), "receiver")
    for _ in range(MAX_PEER_FAULTS - 1):
        assert not faults.reject(1, "bad")
    assert not faults.is_dropped(1)
    assert faults.reject(1, "bad")  # the MAX_PEER_FAULTS-th
    assert faults.dropped_peers() == [1] and "bad" in faults.dropped[1]
    assert faults.reject(2, "unreadable header", in_step=False)  # the first is enough
    faults.ignore(2)
    faults.ignore(2)
    assert faults.dropped_peers() == [1, 2]
    assert faults.rejected == MAX_PEER_FAULTS + 1 and faults.ignored == 2
    assert faults.by_peer == {1: MAX_PEER_FAULTS, 2: 1}
    faults.forgive(2)  # a restarted process: a fresh stream
    assert faults.dropped_peers() == [1] and 2 not in faults.by_peer


def test_rejections_are_logged_at_a_bounded_rate(caplog):
    faults = PeerFaults(logging.getLogger("test.faults"), "receiver", limit=10**9)
    with caplog.at_level(logging.WARNING, logger="test.faults"):
        for i in range(2 * FAULT_LOG_EVERY + 7):
            faults.reject(i % 3, "bad")
    logged = [r for r in caplog.records if "rejected a message" in r.getMessage()]
    assert len(logged) == FAULT_LOG_FIRST + 2  # the first few, then the 100th and 200th
    assert "every 100th" in logged[FAULT_LOG_FIRST - 1].getMessage()
    assert faults.rejected == 2 * FAULT_LOG_EVERY + 7  # all counted


# ---------------------------------------------------------------------------- server checks
def _problem(h: Header, src: int = 1, awaiting_init: bool = False) -> str | None:
    return request_problem(
        h, src, shard=0, numel=NUMEL, version=3, awaiting_init=awaiting_init, warm_start_rank=1
    )


def _push(**kw) -> Header:
    return Header(Kind.PUSH, **{"shard": 0, "version": 3, "numel": NUMEL, "samples": 8, **kw})


SAMPLES = f"outside 0..{MAX_PUSH_SAMPLES}"


@pytest.mark.parametrize(
    "header, src, awaiting, expected",
    [
        (_push(), 2, False, None),
        (Header(Kind.FETCH), 2, False, None),
        (Header(Kind.PUSH_FETCH, numel=NUMEL), 2, False, None),
        (Header(Kind.INIT, numel=NUMEL), 1, True, None),
        (_push(samples=MAX_PUSH_SAMPLES), 1, False, None),
        (Header(Kind.REPLY), 2, False, "REPLY is not a request"),
        (Header(Kind.FINAL, numel=NUMEL), 2, False, "FINAL is not a request"),
        (_push(shard=1), 2, False, "PUSH addressed to shard 1"),
        (_push(status=Status.REJECTED), 2, False, "PUSH with status 2"),
        (_push(numel=NUMEL + 1), 2, False, "PUSH with 7 elements, expected 6"),
        (Header(Kind.FETCH, numel=3), 2, False, "FETCH with 3 elements, expected 0"),
        (_push(version=4), 2, False, "PUSH against version 4, the shard is at 3"),
        (_push(samples=-1), 2, False, f"PUSH with samples -1, {SAMPLES}"),
        (_push(samples=MAX_PUSH_SAMPLES + 1), 2, False,
         f"PUSH with samples {MAX_PUSH_SAMPLES + 1}, {SAMPLES}"),
        (_push(), 2, True, "PUSH before the warm-start θ (INIT) arrived"),
        (Header(Kind.INIT, numel=NUMEL), 2, True,
         "INIT from rank 2, not from the warm-start worker (rank 1)"),
        (Header(Kind.INIT, numel=NUMEL), 1, False,
         "INIT while no warm start is awaited (θ is seeded once)"),
    ],
)  # fmt: skip
def test_server_request_checks(header, src, awaiting, expected):
    """A request is served (None) or refused with its one reason."""
    assert _problem(header, src, awaiting) == expected


def test_a_header_cut_short_is_refused():
    # gloo accepts a message shorter than the buffer; the buffer was filled with -1s first.
    full = _push().to_tensor()
    for length in range(7):
        received = torch.full((8,), -1, dtype=torch.int64)
        received[:length] = full[:length]
        try:
            header = Header.from_tensor(received)
        except MessageError:
            continue
        assert _problem(header, src=2) is not None, length
    # Seven of eight leave only aux (a worker's step, unused by the server) to -1.
    received = full.clone()
    received[7] = -1
    assert _problem(Header.from_tensor(received), src=2) is None


def test_a_short_message_never_reuses_what_the_buffer_held():
    transport, valid = PeerTransport(), _push().to_tensor()
    messages = [valid, valid[:3], torch.ones(NUMEL), torch.ones(2)]

    def recv(tensor, src, tag):  # gloo's: a short message fills the front of the buffer
        message = messages.pop(0)
        tensor[: message.numel()].copy_(message)
        return 1

    transport._recv = recv
    assert transport.recv_request_any() == (1, _push())
    assert transport.recv_request_any() == (1, None)  # not the previous header's fields
    buf = torch.empty(NUMEL)
    assert torch.equal(transport.recv_payload(1, NUMEL, out=buf), torch.ones(NUMEL))
    short = transport.recv_payload(1, NUMEL, out=buf)  # 2 of 6 elements arrived
    assert math.isnan(short[-1]) and not bool(torch.isfinite(short).all())


# ---------------------------------------------------------------------------- gossip checks
def test_gossip_checks_weights_in_zero_to_w_and_finite_theta_pushed_or_pulled():
    for weight in (0.5, 4.0, 0.0, -0.5, 4.5, 1e6, math.inf, math.nan):
        push = Header(Kind.PUSH, shard=2, numel=10, aux=encode_weight(weight))
        problem = check_request(push, 2, 10, max_weight=4.0)
        assert (problem is None) == (0 < weight <= 4.0), weight  # (0.5 and 4.0 are in)
        assert problem is None or "outside (0, 4.0]" in problem, weight
    # pushed θ must be finite, also once de-biased
    assert check_push(torch.ones(4), 0.5) is None
    assert "non-finite" in check_push(torch.tensor([1.0, math.nan, 0.0, 0.0]), 0.5)
    assert "non-finite" in check_push(torch.tensor([1.0, 0.0, -math.inf, 0.0]), 0.5)
    assert "overflows" in check_push(torch.full((4,), 1e30), 1e-300)
    assert check_push(torch.full((4,), 1e30), 1.0) is None
    # pulled θ is checked
    ok, other = Header(Kind.REPLY, shard=1, numel=3), Header(Kind.REPLY, shard=2, numel=3)
    assert check_reply(ok, 1, 3, torch.ones(3)) is None
    assert "not finite" in check_reply(ok, 1, 3, torch.tensor([0.0, math.inf, 1.0]))
    assert "names worker 2" in check_reply(other, 1, 3, torch.ones(3))
    refused = Header(Kind.REPLY, shard=1, status=Status.REJECTED)
    assert "status" in check_reply(refused, 1, 3, torch.ones(3))


# ----------------------------------------------------------------- the server loop, on a script
class _Script:
    """Requests to hand out (sender, header or None, payload or None), and what came back; a
    payload read with a size the receiver did not know (not its buffer's) fails the test."""

    def __init__(self, messages: list[tuple[int, Header | None, torch.Tensor | None]]):
        self.messages = list(messages)
        self.payloads: dict[int, list[torch.Tensor]] = {}
        self.reads: list[tuple[int, int]] = []  # (sender, elements read)
        self.replies: list[tuple[int, Header, torch.Tensor | None]] = []
        self.stats = CommStats()

    def recv_request_any(self) -> tuple[int, Header | None]:
        if not self.messages:
            raise RuntimeError("Timed out waiting for recv operation to complete")
        src, header, payload = self.messages.pop(0)
        if payload is not None:
            self.payloads.setdefault(src, []).append(payload)
        if header is None:
            self.stats.messages_rejected += 1  # as PeerTransport counts it
        return src, header

    def recv_payload(self, src, numel, final=False, out=None, on_chunk=None):
        assert out is not None and out.numel() == numel, "a payload read without a known buffer"
        queued = self.payloads[src].pop(0)
        assert queued.numel() == numel, f"read {numel} elements of a {queued.numel()} payload"
        self.reads.append((src, numel))
        return out.copy_(queued)

    def send(self, dst, header, payload=None, final=False):
        self.replies.append((dst, header, None if payload is None else payload.clone()))

    def isend_payload(self, dst, payload, reply, prepare=None):
        if prepare is not None:
            prepare(0, payload.numel())
        self.replies.append((dst, Header(Kind.REPLY), payload.clone()))
        return SimpleNamespace(wait=lambda: None)

    def wait_all(self, works):
        pass


def _server(script: _Script, workers: int = 2, **cfg) -> tuple[ServerLoop, RecordingMetrics]:
    config = RunConfig(
        strategy="asgd", workers=workers, servers=1, dataset="synthetic", server_lr=1.0, **cfg
    )
    ranks = list(range(1, workers + 1))
    ctx = FakeNamespace(comm=REAL, cfg=config, rank=0, server_index=0, worker_ranks=ranks)
    ctx.elapsed_s, ctx.transport = (lambda: 0.0), (lambda *a, **kw: script)
    metrics = RecordingMetrics()
    return ServerLoop(ctx, torch.zeros(NUMEL), metrics, liveness=None), metrics


def _serve(loop: ServerLoop, script: _Script) -> None:
    while script.messages:
        src, header = script.recv_request_any()
        loop._serve_one(script, src, header)


def test_server_drains_refused_payloads_drops_what_it_cannot_read_and_applies_the_rest():
    full = torch.full((NUMEL,), 5.0)
    script = _Script(
        [
            (2, _push(version=0, shard=4), full),  # refused: read and discarded
            (2, _push(version=0, numel=3), torch.ones(3)),  # shorter than θ: read, refused
            (2, _push(version=0, numel=2**40), None),  # never read: rank 2 is dropped
            (2, _push(version=0), full),  # ignored (its payload stays unread)
            (1, None, torch.ones(NUMEL)),  # unreadable header: rank 1 dropped at once
            (1, _push(version=0), full),  # ignored
            (3, Header(Kind.FETCH), None),  # not a worker
        ]
    )
    loop, metrics = _server(script)
    _serve(loop, script)
    assert script.reads == [(2, NUMEL), (2, 3)]  # nothing else was read
    assert [(dst, h.status) for dst, h, _ in script.replies] == [(2, Status.REJECTED)] * 2
    assert loop.shard.version == 0 and torch.equal(loop.shard.theta, torch.zeros(NUMEL))
    stats = loop.stats()
    # refused twice, then three senders dropped, then two messages of dropped senders ignored
    assert stats["messages_rejected"] == 7
    assert stats["dropped_peers"] == [1, 2, 3] and stats["lost_workers"] == [1, 2]
    assert [kw["worker"] for event, kw in metrics.records if event == "peer_dropped"] == [2, 1]


def test_server_drops_a_worker_after_max_faults_without_reading_the_last_payload():
    script = _Script([(1, _push(version=9), torch.ones(NUMEL))] * MAX_PEER_FAULTS)
    loop, _ = _server(script)
    _serve(loop, script)
    assert len(script.reads) == MAX_PEER_FAULTS - 1 and loop.faults.dropped_peers() == [1]
    assert len(script.replies) == MAX_PEER_FAULTS - 1  # the dropped one gets no reply


def test_init_only_from_the_warm_start_worker_only_once_and_finite():
    theta0 = torch.arange(NUMEL, dtype=torch.float32)
    nan = torch.where(torch.arange(NUMEL) == 2, math.nan, theta0)
    init = Header(Kind.INIT, numel=NUMEL)
    script = _Script(
        [
            (2, init, torch.full((NUMEL,), 99.0)),  # not the warm-start worker
            (2, _push(version=0), torch.ones(NUMEL)),  # a push before the warm start
            (1, init, nan),  # not finite: refused, still awaiting
            (1, init, theta0),  # the warm start
            (1, init, torch.full((NUMEL,), 77.0)),  # once only
            (2, _push(version=0), torch.ones(NUMEL)),  # applied, exactly
        ]
    )
    loop, _ = _server(script, warm_start_steps=5)
    _serve(loop, script)
    statuses = [h.status for _, h, _ in script.replies]
    assert statuses == [Status.REJECTED] * 3 + [Status.OK, Status.REJECTED, Status.OK]
    assert torch.equal(loop.shard.theta, theta0 + 1.0) and loop.shard.version == 1
    assert loop.stats()["messages_rejected"] == 4 and loop.faults.by_peer == {2: 2, 1: 2}


def test_push_records_are_sampled_and_the_staleness_statistics_count_every_push():
    # 25 pushes against version 0: staleness 0, 1, ..., 24; a non-finite one among them
    pushes = [(1, _push(version=0), torch.ones(NUMEL)) for _ in range(25)]
    nan = torch.where(torch.arange(NUMEL) == 0, math.nan, 1.0)
    pushes.insert(13, (2, _push(version=0), nan))
    script = _Script(pushes)
    loop, metrics = _server(script, push_log_every=10)
    _serve(loop, script)
    records = [(kw["version"], kw["status"]) for event, kw in metrics.records if event == "push"]
    assert records == [(10, "OK"), (13, "REJECTED"), (20, "OK")]
    stats = loop.stats()
    assert stats["version"] == 25 and stats["staleness_sum_versions"] == sum(range(25))
    assert stats["staleness_max_versions"] == 24 and stats["rejected_nonfinite"] == 1


# ---------------------------------------------------------------------- gossip serving and pulling
def _gossip(script: _Script) -> tuple[GossipTransport, Mailbox]:
    transport = GossipTransport(
        None, None, 0, [1, 2], NUMEL, CommStats(), worker_of=lambda r: r, timeout_s=60.0
    )
    transport._serve_in = transport._serve_out = script
    transport.serve_stats = script.stats
    mailbox = Mailbox(NUMEL)
    transport._snapshot, transport._mailbox = Snapshot(NUMEL), mailbox
    return transport, mailbox


def _gossip_push(sender: int, weight: float = 0.5, **kw) -> Header:
    fields = {"shard": sender, "numel": NUMEL, "aux": encode_weight(weight), **kw}
    return Header(Kind.PUSH, **fields)


def test_gossip_serving_refuses_bad_pushes_drops_unreadable_peers_and_keeps_good_ones():
    good = torch.linspace(-1, 1, NUMEL)
    nan = torch.where(torch.arange(NUMEL) == 1, math.nan, 1.0)
    script = _Script(
        [
            (1, _gossip_push(1), nan),  # read, refused: not finite
            (1, _gossip_push(1, weight=7.0), torch.ones(NUMEL)),  # weight above W = 3
            (1, _gossip_push(2), torch.ones(NUMEL)),  # another worker's index: drained
            (2, _gossip_push(1, numel=2**40), None),  # a huge length: dropped, never read
            (2, _gossip_push(2), torch.ones(NUMEL)),  # ignored
            (1, _gossip_push(1), good),  # valid: deposited exactly
            (5, Header(Kind.PING, shard=5), None),  # not a peer
            (1, Header(Kind.DONE, shard=1), None),  # the last DONE awaited (2 is dropped)
        ]
    )
    transport, mailbox = _gossip(script)
    transport._serve()
    assert transport._error is None
    assert script.reads == [(1, NUMEL)] * 4
    received, count, weight = mailbox.take()
    assert torch.equal(received, good) and count == 1 and weight == 0.5
    assert transport.request_faults.by_peer == {1: 3, 2: 1, 5: 1}
    assert transport.dropped_peers() == [2, 5]
    assert transport.counters.requests_rejected == 6 == script.stats.messages_rejected


def test_gossip_serving_drops_an_unreadable_header_and_never_reads_its_payload():
    script = _Script(
        [
            (2, None, torch.full((NUMEL,), 1000.0)),  # bad magic, followed by a payload
            (2, _gossip_push(2), torch.ones(NUMEL)),  # today: would take the 1000s as θ
            (1, Header(Kind.DONE, shard=1), None),
        ]
    )
    transport, mailbox = _gossip(script)
    transport._serve()
    assert transport._error is None and script.reads == []
    assert mailbox.take()[1] == 0 and transport.dropped_peers() == [2]
    assert transport.counters.requests_rejected == 2 == script.stats.messages_rejected


def test_a_bad_pulled_theta_is_refused_and_a_peer_out_of_step_is_no_longer_pulled():
    transport, _ = _gossip(_Script([]))
    sent = []
    transport._requests = SimpleNamespace(send=lambda dst, h, p=None: sent.append(dst))
    replies = {
        1: (Header(Kind.REPLY, shard=1, numel=NUMEL), torch.tensor([0, 1, 2, math.inf, 4, 5.0])),
        2: MessageError("reply from rank 2 carries 7 elements, expected 6"),
    }

    def recv_reply(src, out=None):
        reply = replies[src]
        if isinstance(reply, Exception):
            raise reply
        out.copy_(reply[1])
        return reply[0]

    transport._replies = SimpleNamespace(recv_reply=recv_reply)
    out = torch.zeros(NUMEL)
    assert transport.pull(1, out, step=3) is None  # not finite: refused, 1 still pulled
    assert transport.pull(2, out, step=3) is None  # out of step: 2 dropped
    assert transport.pull(2, out, step=4) is None  # not asked again
    assert sent == [1, 2]
    assert transport.dropped_peers() == [2]
    assert transport.counters.replies_rejected == 2 == transport.stats.messages_rejected
    replies[1] = (Header(Kind.REPLY, shard=1, version=7, numel=NUMEL), torch.ones(NUMEL))
    assert transport.pull(1, out, step=5) == 7 and torch.equal(out, torch.ones(NUMEL))


# ---------------------------------------------------------------------------- a worker dies
class _DiesOnReply(_Script):
    """The worker ``dead`` is gone by the time its reply is sent (gloo raises)."""

    def __init__(self, messages, dead: int):
        super().__init__(messages)
        self.dead = dead

    def send(self, dst, header, payload=None, final=False):
        if dst == self.dead:
            raise RuntimeError("Connection reset by peer")
        super().send(dst, header, payload, final)


@pytest.mark.parametrize("kind", [Kind.PUSH, Kind.PUSH_FETCH], ids=["push", "push_fetch"])
def test_a_push_received_whole_is_applied_and_recorded_though_its_reply_fails(kind):
    """The version counts it and θ holds it, so its record must exist (the clock stays
    exactly the pushes logged), with or without θ in the reply."""
    delta = torch.arange(NUMEL, dtype=torch.float32)
    push = Header(kind, shard=0, version=0, numel=NUMEL, samples=8)
    script = _DiesOnReply([(1, push, delta)], dead=1)
    loop, metrics = _server(script, staleness_compensation="dc", push_log_every=1)
    _serve(loop, script)
    assert loop.shard.version == 1 and 1 in loop.lost
    assert torch.equal(loop.shard.theta, delta)  # server_lr 1: θ = 0 + Δ
    pushes = [kw for event, kw in metrics.records if event == "push"]
    assert [(p["worker"], p["version"], p["status"]) for p in pushes] == [(1, 1, "OK")]


def _liveness(dead: set[int]) -> SimpleNamespace:
    """Heartbeats that name the ranks of ``dead`` they are asked about."""
    return SimpleNamespace(dead=lambda ranks: dead & set(ranks))


class _ResetOnce(_Script):
    """The world group's receive from any worker raises once (a worker died mid-message)."""

    def __init__(self, messages):
        super().__init__(messages)
        self.failed = False

    def recv_request_any(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("Read error: Connection reset by peer")
        return super().recv_request_any()


class _Poisoned(_Script):
    """A worker died with a request announced (torch's gloo, tests/dist/test_request_poison):
    every receive from any source fails from then on; one from a named worker still works."""

    def __init__(self, messages):
        super().__init__(messages)
        self.sources: list[int | None] = []

    def recv_request_any(self, src=None):
        self.sources.append(src)
        if src is None:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")
        assert self.messages and self.messages[0][0] == src, "read from the wrong worker"
        return super().recv_request_any()


SERVED = [(1, Status.OK), (1, Status.FINISHED)]  # rank 1's push applied, its DONE answered


@pytest.mark.parametrize(
    "script_class, workers, dead, lost, replies, error",
    [
        (_ResetOnce, 2, None, {1, 2}, [], None),  # no heartbeats: the group's workers lost
        (_ResetOnce, 2, set(), {1, 2}, [], None),  # none named dead: the same
        (_ResetOnce, 2, {2}, {2}, SERVED, None),  # rank 2 named dead: rank 1 served on
        (_Poisoned, 2, {2}, {2}, SERVED, None),  # the same, on receives from rank 1 alone
        (_Poisoned, 3, {3}, {3}, [], "workers [1, 2] cannot be served apart"),  # the shard stops
    ],
    ids=["no-heartbeats", "all-alive", "one-dead", "poisoned", "poisoned-two-left"],
)
def test_a_failed_receive_from_any_worker_loses_only_the_workers_the_heartbeats_name(
    script_class, workers, dead, lost, replies, error
):
    """The receive from any worker fails once (_ResetOnce) or for good (_Poisoned). The workers
    the heartbeats name dead are lost (without heartbeats or with none dead, the group's), the
    one still training is served (on receives from it alone if poisoned), not lost with them;
    two still training cannot be served apart: the shard stops (restarted under --max-restarts)."""
    script = script_class([(1, _push(version=0), torch.ones(NUMEL)), (1, Header(Kind.DONE), None)])
    loop, _ = _server(script, workers=workers, heartbeat_timeout_s=0.1)
    loop.serving.liveness = None if dead is None else _liveness(dead)
    loop.serving._serve(script, None)  # the world group's serving thread
    assert loop.lost == lost and loop.finished == ({1} if replies else set())
    assert [(dst, h.status) for dst, h, _ in script.replies] == replies
    served = len(replies) // 2
    assert loop.shard.version == served and script.reads == [(1, NUMEL)] * served
    assert (loop.serving._error is None) == (error is None)
    assert error is None or error in str(loop.serving._error)
    if script_class is _Poisoned and replies:  # the death, the poison, then rank 1 alone
        assert script.sources == [None, None, 1, 1]
