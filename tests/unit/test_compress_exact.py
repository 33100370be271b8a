"""The compressed all-reduce (cloudburst/comm/compress.py) on a group handle of its own, exactly:
every transport call goes to the group it was given (a transport here refuses any other, the
world's ``None`` included), the quantised forms' results bit for bit against the plain-PyTorch
reference (tests/reference.py) at W = 2 and W = 3 with uneven chunks, each rank's bytes by the
formula, the two-phase pending work (the first step started, the rest run by ``wait``, timed
once on the transport's clock), what the emulated link is charged for each all-to-all and on
which group, the ``none`` / ``bf16`` forms passing the link, the node span, ``async_op``
and the group on to the plain all-reduce, and the default key under which error feedback
keeps its residuals. The W ranks are threads, each transport a ``tests.support.ThreadComm``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cloudburst.comm.collectives import all_reduce_sum, all_to_all_s
from cloudburst.comm.compress import (
    BLOCK,
    OWNER,
    ErrorFeedback,
    compressed_all_reduce_sum,
    quantised_sent_bytes,
)
from cloudburst.comm.stats import CommStats
from tests import reference as ref
from tests.fakes import RecordingLink, prior_stats
from tests.support import RecordedWork, ThreadComm, ThreadGroup, compress_vector, on_comm_threads

GROUP = object()  # the group handle: the only one the transports below accept
UNIT = BLOCK + 4  # wire bytes of one block: its codes and its fp32 scale


def _on_threads(size: int, fn) -> list:
    """``fn(rank, comm)`` on ``size`` threads, each a :class:`ThreadComm` that accepts only
    :data:`GROUP`, its clock reading 10, 10.5, 11, ... (one reading a call)."""
    return on_comm_threads(size, fn, handle=GROUP, start=10.0, tick=0.5)


# ---------------------------------------------------------------------------- W = 3: scatter
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("n", [1000, 300])
def test_the_reduce_scatter_over_a_group_is_the_reference_on_every_rank(method, n):
    """W = 3 over :data:`GROUP`: 1000 values are 4 blocks owned [2, 1, 1], 300 values 2 blocks
    owned [1, 1, 0] (the last rank owns none); every rank ends with the reference's bits, both
    residuals are the reference's, and each rank made exactly the scatter then the gather,
    both asynchronous, with the splits of its share."""
    size = 3
    blocks = [2, 1, 1] if n == 1000 else [1, 1, 0]

    def rank_fn(rank: int, comm: ThreadComm):
        feedback = ErrorFeedback()
        x = compress_vector(n, seed=rank) * (1 + rank)
        y = x.clone()
        compressed_all_reduce_sum(y, GROUP, CommStats(), method, feedback, key="t", comm=comm)
        return x, y, feedback, comm.calls

    results = _on_threads(size, rank_fn)
    expected, sent, owner = ref.quantised_all_reduce(
        [r[0] for r in results], method, [None] * size, [None] * size
    )
    for rank, (_, y, feedback, calls) in enumerate(results):
        assert torch.equal(y, expected)
        assert torch.equal(feedback.residuals["t"], sent[rank])
        assert torch.equal(feedback.residuals["t" + OWNER], owner[rank])
        mine = blocks[rank] * UNIT
        others = [b * UNIT for b in blocks]
        assert calls == [
            ("all_to_all", others, [mine] * size, True),
            ("wait",),
            ("all_to_all", [mine] * size, others, True),
            ("wait",),
        ]


def test_the_quantised_bytes_follow_the_formula_and_total_2_w_minus_1_packed_vectors():
    """Each rank's count is its scatter (the others' chunks) plus its own chunk to the W − 1
    others, in blocks of 260 bytes; over the group 2(W − 1) packed vectors (blocks × 260); at
    W ≤ 2 the all-gather's W − 1 packed vectors for every rank, 0 for a group of one."""
    # 1000 values: 4 blocks; W = 3 owns [2, 1, 1]
    assert [quantised_sent_bytes(1000, 3, p) for p in range(3)] == [
        (2 + 2 * 2) * 260,
        (3 + 2 * 1) * 260,
        (3 + 2 * 1) * 260,
    ]
    for n, size in [(1000, 3), (300, 3), (5000, 4), (1, 5), (123_457, 7)]:
        blocks = -(-n // 256)
        total = sum(quantised_sent_bytes(n, size, p) for p in range(size))
        assert total == 2 * (size - 1) * blocks * 260
    assert [quantised_sent_bytes(1000, 2, p) for p in range(2)] == [4 * 260] * 2
    assert quantised_sent_bytes(1000, 1, 0) == 0


# ---------------------------------------------------------------------------- W = 2: gather
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_pair_all_gathers_over_the_group_and_keeps_the_residual_under_the_default_key(method):
    """W = 2: one asynchronous all-gather of the packed vectors over the group; both ranks get
    the reference's rank-order sum of the two round trips; the sender's residual is kept under
    the default key, the empty string (no owner's residual); counted as one packed vector."""
    n = 700  # 3 blocks, the last one padded

    def rank_fn(rank: int, comm: ThreadComm):
        feedback = ErrorFeedback()
        stats = prior_stats()
        x = compress_vector(n, seed=10 + rank) * (1 + rank)
        y = x.clone()
        compressed_all_reduce_sum(y, GROUP, stats, method, feedback, comm=comm)
        return x, y, feedback, comm.calls, stats

    results = _on_threads(2, rank_fn)
    expected = ref.QuantisedSum(method)([r[0] for r in results])
    for x, y, feedback, calls, stats in results:
        assert torch.equal(y, expected)
        assert set(feedback.residuals) == {""}
        assert torch.equal(feedback.residuals[""], x - ref.quantise_round_trip(x, method))
        assert calls == [("all_gather", 3 * BLOCK + 3 * 4, True), ("wait",)]
        assert stats.sent_bytes == 1000 + 3 * 260
        assert stats.intra_node_bytes == 4000 + 3 * 260 and stats.inter_node_bytes == 3000


# ---------------------------------------------------------------------------- two phases
def test_the_two_phase_work_runs_the_rest_in_wait_timed_once_on_the_transports_clock():
    """With ``async_op`` only the scatter has started when the call returns (the tensor is
    untouched, nothing waited); ``wait`` waits for it, runs the gather, writes the sum, and adds
    exactly one reading-to-reading interval of the transport's clock (0.5 s) to wait_s; a
    second ``wait`` does nothing (no clock reading, no call)."""
    n = 1000

    def rank_fn(rank: int, comm: ThreadComm):
        stats = prior_stats()
        x = compress_vector(n, seed=rank)
        y = x.clone()
        pending = compressed_all_reduce_sum(
            y, GROUP, stats, "int8", ErrorFeedback(), key="g", async_op=True, comm=comm
        )
        started = (list(comm.calls), torch.equal(y, x), stats.wait_s)
        pending.wait()
        after = (len(comm.calls), stats.wait_s, comm.clock, y.clone())
        pending.wait()
        again = (len(comm.calls), stats.wait_s, comm.clock)
        return x, started, after, again, stats

    results = _on_threads(3, rank_fn)
    expected, _, _ = ref.quantised_all_reduce(
        [r[0] for r in results], "int8", [None] * 3, [None] * 3
    )
    for _, started, after, again, stats in results:
        calls, untouched, wait_s = started
        assert [c[0] for c in calls] == ["all_to_all"] and untouched and wait_s == 1.0
        assert after[0] == 4 and after[1] == 1.0 + 0.5 and after[2] == 10.0 + 2 * 0.5
        assert torch.equal(after[3], expected)
        assert again == after[:3]
        assert stats.emulated_link_s == 0.25


def test_two_pending_all_reduces_each_add_their_own_wait():
    """Two asynchronous quantised all-reduces on one stats (a group of one), waited one after
    the other: each wait reads the clock twice and adds one interval (0.5 s) to the running
    total, 1.0 + 0.5 + 0.5; a second wait of the same pending reads nothing."""
    comm, stats = ThreadComm(ThreadGroup(1), 0, handle=GROUP, start=10.0, tick=0.5), prior_stats()
    pending = [
        compressed_all_reduce_sum(
            compress_vector(300, seed=s), GROUP, stats, method, async_op=True, comm=comm
        )
        for s, method in ((1, "int8"), (2, "fp8"))
    ]
    assert stats.wait_s == 1.0 and comm.clock == 10.0
    pending[0].wait()
    assert stats.wait_s == 1.0 + 0.5 and comm.clock == 11.0
    pending[1].wait()
    assert stats.wait_s == 2.0 and comm.clock == 12.0
    pending[1].wait()
    assert stats.wait_s == 2.0 and comm.clock == 12.0


def test_a_blocking_quantised_all_reduce_adds_its_wait_to_the_earlier_total():
    """Without ``async_op`` the call waits itself: wait_s grows by one clock tick (0.75 s)."""

    def rank_fn(rank: int, comm: ThreadComm):
        comm.clock, comm.tick = 100.0, 0.75
        stats = prior_stats()
        compressed_all_reduce_sum(compress_vector(600, seed=rank), GROUP, stats, "fp8", comm=comm)
        return stats.wait_s

    assert _on_threads(3, rank_fn) == [1.0 + 0.75] * 3


# ---------------------------------------------------------------------------- the link
def test_each_all_to_all_is_charged_on_the_group_for_this_ranks_bytes():
    """Across nodes on an active link, W = 3, 1000 values owned [2, 1, 1]: the scatter is
    charged 2 latencies + the others' chunks this rank sends, the gather 2 latencies + its own
    chunk to 2 ranks, each booked once on the group and both added to emulated_link_s; the
    link's completion is waited for on top of each transport work; the bytes count as
    inter-node; without a key the sender's residual is kept under "" and the owner's under
    ":owner"."""
    blocks = [2, 1, 1]
    link_of = [RecordingLink() for _ in range(3)]

    def rank_fn(rank: int, comm: ThreadComm):
        stats, feedback = prior_stats(), ErrorFeedback()
        y = compress_vector(1000, seed=rank)
        compressed_all_reduce_sum(
            y, GROUP, stats, "int8", feedback, link=link_of[rank], spans_nodes=True, comm=comm
        )
        return stats, comm.calls, set(feedback.residuals)

    results = _on_threads(3, rank_fn)
    for rank, (stats, calls, keys) in enumerate(results):
        assert keys == {"", ":owner"}
        mine = blocks[rank]
        scatter = 2 * 0.125 + (4 - mine) * 260 / 1024
        gather = 2 * 0.125 + 2 * mine * 260 / 1024
        assert link_of[rank].booked == [(scatter, GROUP), (gather, GROUP)]
        assert stats.emulated_link_s == 0.25 + scatter + gather
        assert [c[0] for c in calls] == ["all_to_all", "wait", "all_to_all", "wait"]
        moved = quantised_sent_bytes(1000, 3, rank)
        assert stats.inter_node_bytes == 3000 + moved and stats.intra_node_bytes == 4000


@pytest.mark.parametrize(("sizes", "active", "spans_nodes"), [
    ((2, 3), True, False),  # an active link within a node
    ((2, 3), False, True),  # an inactive link across nodes
    ((1,), True, True),  # a group of one across nodes on an active link
])  # fmt: skip
def test_the_link_is_not_charged_unless_active_and_spanning_nodes_of_two_or_more(
    sizes, active, spans_nodes
):
    """The link is booked only when active, spanning nodes and shared by 2 or more ranks:
    otherwise nothing is booked and emulated_link_s keeps its earlier total."""
    for size in sizes:
        links = [RecordingLink(active=active) for _ in range(size)]

        def rank_fn(rank: int, comm: ThreadComm, links=links):
            stats = prior_stats()
            compressed_all_reduce_sum(
                compress_vector(600, seed=rank), GROUP, stats, "int8", link=links[rank],
                spans_nodes=spans_nodes, comm=comm,
            )  # fmt: skip
            return stats.emulated_link_s

        assert _on_threads(size, rank_fn) == [0.25] * size
        assert all(link.booked == [] for link in links)


def test_an_all_to_all_of_one_rank_or_on_a_free_link_costs_nothing():
    """all_to_all_s: (n − 1) latencies + bytes / bandwidth; exactly 0 for a group of one or a
    link without a spec."""
    link = RecordingLink()
    assert all_to_all_s(link, 512, 3) == 2 * 0.125 + 0.5
    assert all_to_all_s(link, 512, 1) == 0.0
    assert all_to_all_s(link, 512, 0) == 0.0
    free = RecordingLink()
    free.spec = None
    assert all_to_all_s(free, 512, 4) == 0.0


# ---------------------------------------------------------------------------- device
def test_the_owners_sum_is_made_on_the_tensors_device_whatever_the_default_device():
    """The reduce-scatter's temporaries live on the tensor's device, not on the default one: a
    W = 3 all-reduce of CPU tensors while each thread's default device is ``meta`` gives the
    reference's sum."""

    def rank_fn(rank: int, comm: ThreadComm):
        x = compress_vector(1000, seed=rank)
        y = x.clone()
        with torch.device("meta"):
            compressed_all_reduce_sum(y, GROUP, CommStats(), "int8", comm=comm)
        return x, y

    results = _on_threads(3, rank_fn)
    expected, _, _ = ref.quantised_all_reduce(
        [r[0] for r in results], "int8", [None] * 3, [None] * 3
    )
    assert all(torch.equal(y, expected) for _, y in results)


# ---------------------------------------------------------------------------- none and bf16
class _OneRank(ThreadComm):
    """One rank of a ``size``-rank group reachable only as :data:`GROUP` (a :class:`ThreadComm`
    with its scripted clock and its record of calls) whose all-reduce adds ``peers``, the
    others' sum, instead of meeting them."""

    def __init__(self, peers: torch.Tensor, size: int = 4):
        super().__init__(ThreadGroup(1), 0, handle=GROUP, start=10.0, tick=0.5)
        self.peers, self.size = peers, size

    def group_size(self, group: Any = None) -> int:
        self._check(group)
        return self.size

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        self._check(group)
        self.calls.append(("all_reduce", tensor.dtype, tensor.numel(), async_op))
        tensor.add_(self.peers.to(tensor.dtype))
        return RecordedWork(self.calls) if async_op else None


def test_none_passes_the_link_the_span_and_the_group_to_the_plain_all_reduce():
    """``none`` across nodes on an active link: the plain all-reduce over the group, asked of
    the link for 3 × 4 bytes over 4 ranks, booked on the group, counted inter-node as a ring
    (2·3/4 · 12 = 18 bytes); with ``async_op`` nothing is waited for until ``wait``."""
    link = RecordingLink(allreduce_cost_s=0.0625)
    comm = _OneRank(torch.tensor([1.0, 2.0, 3.0]))
    stats = prior_stats()
    y = torch.tensor([0.5, 0.25, -1.0])
    pending = compressed_all_reduce_sum(
        y, GROUP, stats, "none", link=link, spans_nodes=True, async_op=True, comm=comm
    )
    assert torch.equal(y, torch.tensor([1.5, 2.25, 2.0]))
    assert comm.calls == [("all_reduce", torch.float32, 3, True)]
    assert stats.wait_s == 1.0  # not waited yet
    assert link.asked == [(12, 4)] and link.booked == [(0.0625, GROUP)]
    assert stats.emulated_link_s == 0.25 + 0.0625
    assert stats.inter_node_bytes == 3000 + 18 and stats.intra_node_bytes == 4000
    pending.wait()
    assert stats.wait_s == 1.0 + 0.5 and comm.calls[-1] == ("wait",)


def test_none_without_a_link_keeps_async_op():
    """``none`` with ``async_op`` and no link: one asynchronous all-reduce, not waited for."""
    comm = _OneRank(torch.tensor([1.0, 1.0]), size=2)
    stats = prior_stats()
    y = torch.tensor([2.0, 3.0])
    compressed_all_reduce_sum(y, GROUP, stats, "none", async_op=True, comm=comm)
    assert comm.calls == [("all_reduce", torch.float32, 2, True)]
    assert stats.wait_s == 1.0 and torch.equal(y, torch.tensor([3.0, 4.0]))
    assert stats.intra_node_bytes == 4000 + 8 and stats.inter_node_bytes == 3000


def test_bf16_passes_the_link_and_the_group_to_the_plain_all_reduce():
    """``bf16`` across nodes on an active link: one asynchronous bf16 all-reduce over the group,
    the link asked for 4 × 2 bytes over 4 ranks and booked on the group, counted inter-node
    (2·3/4 · 8 = 12 bytes); the bf16 sum copied back."""
    link = RecordingLink(allreduce_cost_s=0.125)
    comm = _OneRank(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    stats = prior_stats()
    y = torch.tensor([1.0, 2.0, -0.5, 3.0])
    compressed_all_reduce_sum(y, GROUP, stats, "bf16", link=link, spans_nodes=True, comm=comm)
    assert torch.equal(y, torch.tensor([1.5, 2.5, 0.0, 3.5]))
    assert comm.calls == [("all_reduce", torch.bfloat16, 4, True), ("wait",)]
    assert link.asked == [(8, 4)] and link.booked == [(0.125, GROUP)]
    assert stats.emulated_link_s == 0.25 + 0.125
    assert stats.inter_node_bytes == 3000 + 12 and stats.intra_node_bytes == 4000


def test_a_method_without_an_all_reduce_is_refused_by_name():
    """PowerSGD (a DDP hook) or an unknown name is refused in one line naming it, before any
    transport call."""
    comm = _OneRank(torch.zeros(2))
    for method in ("powersgd", "int4"):
        with pytest.raises(
            ValueError, match=rf"^compressed all-reduce: '{method}' is not bf16, fp8 or int8$"
        ):
            compressed_all_reduce_sum(torch.zeros(2), GROUP, CommStats(), method, comm=comm)
    assert comm.calls == []


# ---------------------------------------------------------------------------- plain all-reduce
def test_a_blocking_plain_all_reduce_runs_on_the_group_within_a_node_by_default():
    """``all_reduce_sum`` with its defaults: one blocking all-reduce over the group, counted as
    intra-node ring bytes (2·3/4 · 8 = 12); its wait timed on the transport's clock (one tick);
    the pending it returns waits on that same clock (one more tick, no works)."""
    comm = _OneRank(torch.tensor([1.0, -1.0]))
    stats = prior_stats()
    y = torch.tensor([0.5, 0.5])
    pending = all_reduce_sum(y, GROUP, stats, comm=comm)
    assert torch.equal(y, torch.tensor([1.5, -0.5]))
    assert comm.calls == [("all_reduce", torch.float32, 2, False)]
    assert stats.intra_node_bytes == 4000 + 12 and stats.inter_node_bytes == 3000
    assert stats.wait_s == 1.0 + 0.5
    pending.wait()
    assert stats.wait_s == 1.0 + 0.5 + 0.5 and comm.calls == [
        ("all_reduce", torch.float32, 2, False)
    ]


def test_a_group_of_one_is_not_charged_to_the_link():
    """A one-rank group across nodes on an active link: the blocking all-reduce as usual (not
    asynchronous), the link neither asked nor booked."""
    link = RecordingLink(allreduce_cost_s=0.0625)
    comm = _OneRank(torch.tensor([0.0, 0.0, 0.0]), size=1)
    stats = prior_stats()
    all_reduce_sum(torch.ones(3), GROUP, stats, link=link, spans_nodes=True, comm=comm)
    assert comm.calls == [("all_reduce", torch.float32, 3, False)]
    assert link.asked == [] and link.booked == [] and stats.emulated_link_s == 0.25


# ---------------------------------------------------------------------------- the default key
def test_calls_without_a_key_share_one_residual_under_the_empty_key():
    """A group of one sums its own round trip. Without a key the residual is kept under "";
    a second call without a key adds it before quantising (the reference round trip of
    x2 + e1, not of x2), and so does a call naming "" itself; a named key starts from zero."""
    x1, x2, x3 = (compress_vector(600, seed=s) for s in (3, 4, 5))
    feedback = ErrorFeedback()

    def reduce(y: torch.Tensor, **key) -> torch.Tensor:
        comm = ThreadComm(ThreadGroup(1), 0, handle=GROUP)
        compressed_all_reduce_sum(y, GROUP, CommStats(), "int8", feedback, comm=comm, **key)
        return y

    e1 = x1 - ref.quantise_round_trip(x1, "int8")
    reduce(x1.clone())
    assert set(feedback.residuals) == {""} and torch.equal(feedback.residuals[""], e1)
    c2 = x2 + e1
    y2 = reduce(x2.clone())
    assert torch.equal(y2, ref.quantise_round_trip(c2, "int8"))
    assert not torch.equal(y2, ref.quantise_round_trip(x2, "int8"))
    e2 = c2 - ref.quantise_round_trip(c2, "int8")
    assert set(feedback.residuals) == {""} and torch.equal(feedback.residuals[""], e2)
    assert torch.equal(reduce(x3.clone(), key=""), ref.quantise_round_trip(x3 + e2, "int8"))
    assert set(feedback.residuals) == {""}
    assert torch.equal(reduce(x3.clone(), key="b"), ref.quantise_round_trip(x3, "int8"))
    assert set(feedback.residuals) == {"", "b"}
