"""The compressed all-reduce's plumbing (cloudburst/comm/compress.py), on fakes that record what
they are handed: the group every collective, rank query and link booking goes to (a fake here
refuses any other handle, the world's ``None`` included), the link, node span and ``async_op``
that ``none`` and ``bf16`` pass on to the plain all-reduce, the emulated time booked for each
all-to-all (hand-computed from this rank's bytes) and when nothing is booked, the two-phase
pending's wait timed on the transport's clock and added to the earlier total, the refusal of an
unknown method by name, and the default key under which error feedback keeps its residuals.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from cloudburst.comm.compress import BLOCK, ErrorFeedback, compressed_all_reduce_sum
from cloudburst.comm.stats import CommStats
from tests import reference as ref
from tests.fakes import RecordingLink, prior_stats, run_on_threads

GROUP = object()  # the only group handle the fakes below accept
UNIT = BLOCK + 4  # wire bytes of one quantised block: its codes and its fp32 scale


def _check(group: Any) -> None:
    if group is not GROUP:
        raise AssertionError(f"a call over {group!r}, not the group it was given")


def _vector(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-2, 1, n)


class _Work:
    """A finished work handle that records its wait."""

    def __init__(self, calls: list):
        self.calls = calls

    def wait(self) -> bool:
        self.calls.append(("wait",))
        return True


class _Clock:
    """A scripted clock: ``now()`` reads ``start``, ``start + tick``, ... (one reading a call)."""

    def __init__(self, start: float = 10.0, tick: float = 0.5):
        self.clock, self.tick = start, tick
        self.calls: list[tuple] = []

    def now(self) -> float:
        reading = self.clock
        self.clock += self.tick
        return reading


class _Alone(_Clock):
    """The one member of a one-rank group: its all-gather is its own packed vector."""

    def group_size(self, group: Any = None) -> int:
        _check(group)
        return 1

    def group_rank(self, group: Any = None) -> int:
        _check(group)
        return 0

    def all_gather(self, output, tensor, group=None, async_op=False):
        _check(group)
        self.calls.append(("all_gather", tensor.numel(), async_op))
        output.copy_(tensor)
        return _Work(self.calls)


class _OneOfMany(_Clock):
    """One rank of a ``size``-rank group whose all-reduce adds ``peers`` (the others' sum)."""

    def __init__(self, peers: torch.Tensor, size: int = 4):
        super().__init__()
        self.peers, self.size = peers, size

    def group_size(self, group: Any = None) -> int:
        _check(group)
        return self.size

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        _check(group)
        self.calls.append(("all_reduce", tensor.dtype, async_op))
        tensor.add_(self.peers.to(tensor.dtype))
        return _Work(self.calls) if async_op else None


class _Board:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.parts: dict[int, torch.Tensor] = {}


class _Member(_Clock):
    """Rank ``rank`` of a group of threads (all-gather and all-to-all through a board)."""

    def __init__(self, board: _Board, rank: int):
        super().__init__()
        self.board, self.rank = board, rank

    def group_size(self, group: Any = None) -> int:
        _check(group)
        return self.board.size

    def group_rank(self, group: Any = None) -> int:
        _check(group)
        return self.rank

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.board.parts[self.rank] = tensor.clone()
        self.board.barrier.wait()
        parts = [self.board.parts[r] for r in range(self.board.size)]
        self.board.barrier.wait()
        return parts

    def all_gather(self, output, tensor, group=None, async_op=False):
        _check(group)
        self.calls.append(("all_gather",))
        output.copy_(torch.cat(self._exchange(tensor)))
        return _Work(self.calls)

    def all_to_all(self, output, tensor, output_splits, input_splits, group=None, async_op=False):
        _check(group)
        self.calls.append(("all_to_all",))
        sent = self._exchange(tensor)
        splits = self._exchange(torch.tensor(input_splits))
        output.copy_(
            torch.cat([sent[r].split(splits[r].tolist())[self.rank] for r in range(len(sent))])
        )
        return _Work(self.calls)


def _on_threads(size: int, fn) -> list:
    board = _Board(size)
    return run_on_threads(size, board.barrier, lambda rank: _Member(board, rank), fn)


# ---------------------------------------------------------------------------- none and bf16
def test_none_hands_the_group_link_span_and_async_op_to_the_plain_all_reduce():
    """``none``, asynchronous, across nodes on an active link, 4 ranks: one asynchronous fp32
    all-reduce over the group; the link asked for 3 × 4 bytes over 4 ranks and booked once on
    the group; 2·3/4 · 12 = 18 ring bytes counted inter-node; nothing waited until ``wait``."""
    link, comm = RecordingLink(allreduce_cost_s=0.0625), _OneOfMany(torch.ones(3))
    stats = prior_stats()
    y = torch.tensor([0.5, -2.0, 4.0])
    pending = compressed_all_reduce_sum(
        y, GROUP, stats, "none", link=link, spans_nodes=True, async_op=True, comm=comm
    )
    assert torch.equal(y, torch.tensor([1.5, -1.0, 5.0]))
    assert comm.calls == [("all_reduce", torch.float32, True)]
    assert link.asked == [(12, 4)] and link.booked == [(0.0625, GROUP)]
    assert stats.emulated_link_s == 0.25 + 0.0625
    assert (stats.inter_node_bytes, stats.intra_node_bytes) == (3000 + 18, 4000)
    assert stats.wait_s == 1.0 and comm.clock == 10.0
    pending.wait()
    assert comm.calls[-1] == ("wait",) and stats.wait_s == 1.0 + 0.5


def test_none_keeps_async_op_without_a_link():
    """``none``, asynchronous, no link, within a node: the all-reduce is started asynchronously
    and not waited for (no clock reading); 2·3/4 · 8 = 12 bytes counted intra-node."""
    comm, stats = _OneOfMany(torch.ones(2)), prior_stats()
    compressed_all_reduce_sum(torch.zeros(2), GROUP, stats, "none", async_op=True, comm=comm)
    assert comm.calls == [("all_reduce", torch.float32, True)]
    assert stats.wait_s == 1.0 and comm.clock == 10.0
    assert (stats.inter_node_bytes, stats.intra_node_bytes) == (3000, 4000 + 12)


def test_bf16_hands_the_group_link_and_span_to_the_plain_all_reduce():
    """``bf16`` across nodes on an active link, 4 ranks: one bf16 all-reduce over the group,
    the link asked for 4 × 2 bytes and booked on the group, 2·3/4 · 8 = 12 bytes counted
    inter-node, the bf16 sum copied back."""
    link, comm = RecordingLink(allreduce_cost_s=0.125), _OneOfMany(torch.full((4,), 0.5))
    stats = prior_stats()
    y = torch.tensor([1.0, 2.0, -0.5, 3.0])
    compressed_all_reduce_sum(y, GROUP, stats, "bf16", link=link, spans_nodes=True, comm=comm)
    assert torch.equal(y, torch.tensor([1.5, 2.5, 0.0, 3.5]))
    assert comm.calls == [("all_reduce", torch.bfloat16, True), ("wait",)]
    assert link.asked == [(8, 4)] and link.booked == [(0.125, GROUP)]
    assert stats.emulated_link_s == 0.25 + 0.125
    assert (stats.inter_node_bytes, stats.intra_node_bytes) == (3000 + 12, 4000)


def test_an_unknown_method_is_refused_by_name():
    """A method with no all-reduce is refused in one line that names it."""
    with pytest.raises(ValueError, match=r"^compressed all-reduce: 'int4' is not bf16, fp8 or"):
        compressed_all_reduce_sum(torch.zeros(2), GROUP, CommStats(), "int4", comm=_Alone())


# ---------------------------------------------------------------------------- the emulated link
def test_each_all_to_all_is_booked_on_the_group_for_the_bytes_this_rank_sends():
    """W = 3 across nodes on an active link, 1000 values = 4 blocks owned [2, 1, 1]: the
    scatter sends the 4 − mine blocks of the others (2 latencies + bytes / 1024 s), the gather
    its own chunk to the 2 others; both booked on the group, both added to emulated_link_s,
    and the transport's work of each waited for under the link's; the default key keeps the
    sender's residual under "" and the owner's under ":owner"."""
    links = [RecordingLink() for _ in range(3)]

    def rank_fn(rank: int, comm: _Member):
        stats, feedback = prior_stats(), ErrorFeedback()
        compressed_all_reduce_sum(
            _vector(1000, seed=rank), GROUP, stats, "int8", feedback, link=links[rank],
            spans_nodes=True, comm=comm,
        )  # fmt: skip
        return stats, comm.calls, set(feedback.residuals)

    for rank, (stats, calls, keys) in enumerate(_on_threads(3, rank_fn)):
        mine = [2, 1, 1][rank]
        scatter = 2 * 0.125 + (4 - mine) * 260 / 1024
        gather = 2 * 0.125 + 2 * mine * 260 / 1024
        assert links[rank].booked == [(scatter, GROUP), (gather, GROUP)]
        assert stats.emulated_link_s == 0.25 + scatter + gather
        assert calls == [("all_to_all",), ("wait",), ("all_to_all",), ("wait",)]
        assert keys == {"", ":owner"}


@pytest.mark.parametrize(("size", "active", "spans_nodes"), [
    (3, True, False),  # an active link within a node
    (3, False, True),  # an inactive link across nodes
    (1, True, True),   # a group of one across nodes on an active link
])  # fmt: skip
def test_nothing_is_booked_off_an_active_link_across_nodes_of_two_or_more(
    size, active, spans_nodes
):
    """The link is booked only when active, spanning nodes and shared by 2 or more ranks:
    otherwise nothing is booked and emulated_link_s keeps its earlier total."""
    links = [RecordingLink(active=active) for _ in range(size)]

    def rank_fn(rank: int, comm: _Member):
        stats = prior_stats()
        compressed_all_reduce_sum(
            _vector(600, seed=rank), GROUP, stats, "int8", link=links[rank],
            spans_nodes=spans_nodes, comm=comm,
        )  # fmt: skip
        return stats.emulated_link_s

    assert _on_threads(size, rank_fn) == [0.25] * size
    assert [link.booked for link in links] == [[]] * size


# ---------------------------------------------------------------------------- the wait
def test_two_waits_each_add_their_interval_on_the_transports_clock():
    """Two asynchronous quantised all-reduces on one stats, waited one after the other: each
    wait reads the transport's clock twice (t0, then t0 + 0.5) and adds now − t0 = 0.5 s to
    the running total, 1.0 + 0.5 + 0.5; a second wait of the same pending reads nothing."""
    comm, stats = _Alone(start=10.0, tick=0.5), prior_stats()
    first = compressed_all_reduce_sum(
        _vector(300, seed=1), GROUP, stats, "int8", async_op=True, comm=comm
    )
    second = compressed_all_reduce_sum(
        _vector(300, seed=2), GROUP, stats, "fp8", async_op=True, comm=comm
    )
    assert stats.wait_s == 1.0 and comm.clock == 10.0
    first.wait()
    assert stats.wait_s == 1.0 + 0.5 and comm.clock == 11.0
    second.wait()
    assert stats.wait_s == 1.0 + 0.5 + 0.5 and comm.clock == 12.0
    second.wait()
    assert stats.wait_s == 2.0 and comm.clock == 12.0


# ---------------------------------------------------------------------------- the default key
def test_calls_without_a_key_share_one_residual_under_the_empty_key():
    """A group of one sums its own round trip. Without a key the residual is kept under "";
    a second call without a key adds it before quantising (the reference round trip of
    x2 + e1, not of x2), and so does a call naming "" itself; a named key starts from zero."""
    n = 600
    x1, x2, x3 = _vector(n, seed=3), _vector(n, seed=4), _vector(n, seed=5)
    feedback = ErrorFeedback()
    e1 = x1 - ref.quantise_round_trip(x1, "int8")
    compressed_all_reduce_sum(x1.clone(), GROUP, CommStats(), "int8", feedback, comm=_Alone())
    assert set(feedback.residuals) == {""}
    assert torch.equal(feedback.residuals[""], e1)

    y2 = x2.clone()
    compressed_all_reduce_sum(y2, GROUP, CommStats(), "int8", feedback, comm=_Alone())
    c2 = x2 + e1
    assert torch.equal(y2, ref.quantise_round_trip(c2, "int8"))
    assert not torch.equal(y2, ref.quantise_round_trip(x2, "int8"))
    e2 = c2 - ref.quantise_round_trip(c2, "int8")
    assert set(feedback.residuals) == {""} and torch.equal(feedback.residuals[""], e2)

    y3 = x3.clone()
    compressed_all_reduce_sum(y3, GROUP, CommStats(), "int8", feedback, key="", comm=_Alone())
    assert torch.equal(y3, ref.quantise_round_trip(x3 + e2, "int8"))
    assert set(feedback.residuals) == {""}

    y4 = x3.clone()
    compressed_all_reduce_sum(y4, GROUP, CommStats(), "int8", feedback, key="b", comm=_Alone())
    assert torch.equal(y4, ref.quantise_round_trip(x3, "int8"))
    assert set(feedback.residuals) == {"", "b"}
