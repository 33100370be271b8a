"""The counted collectives the strategies call, on a scripted transport: exactly what
``broadcast`` and ``world_sum`` return, which transport calls they make, and what they add to
the :class:`CommStats` counters (bytes by direction and by whether they crossed nodes, seconds
waited on the transport's own clock, time held back by the emulated link); and that a pending
bf16 all-reduce times its wait on the transport it was given."""

from __future__ import annotations

from typing import Any

import torch

from cloudburst.comm.collectives import broadcast, world_sum
from cloudburst.comm.compress import compressed_all_reduce_sum
from cloudburst.comm.stats import CommStats
from tests.fakes import RecordingLink, prior_stats

GROUP = object()  # an opaque group handle: passed through, never looked inside


class _Done:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _ScriptedComm:
    """A transport whose clock reads ``start``, ``start + tick``, ... (one reading a call), whose
    world has ``size`` ranks, whose all-reduce adds ``peers`` (the other ranks' sum) to the
    tensor, and whose broadcast writes ``source`` into it. Records every call."""

    def __init__(
        self,
        size: int = 4,
        start: float = 10.0,
        tick: float = 0.5,
        peers: torch.Tensor | None = None,
        source: torch.Tensor | None = None,
    ):
        self.size, self.clock, self.tick = size, start, tick
        self.peers, self.source = peers, source
        self.calls: list[tuple] = []

    def now(self) -> float:
        reading = self.clock
        self.clock += self.tick
        return reading

    def group_size(self, group: Any = None) -> int:
        return self.size

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        self.calls.append(("all_reduce", tensor.dtype, tensor.numel(), group, async_op))
        tensor.add_(self.peers)
        return _Done() if async_op else None

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        self.calls.append(("broadcast", tensor.dtype, tensor.numel(), src, group))
        tensor.copy_(self.source)


# ---------------------------------------------------------------------------- broadcast
def test_broadcast_from_this_rank_counts_its_bytes_as_sent_within_the_group():
    """The source adds numel × element size to sent and intra-node bytes (received untouched)
    and the transport-clock seconds of the call to wait_s; the tensor holds the source's."""
    source = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64)
    comm = _ScriptedComm(start=10.0, tick=0.5, source=source)
    stats = prior_stats()
    t = torch.zeros(3, dtype=torch.float64)
    assert broadcast(t, 2, GROUP, stats, rank=2, comm=comm) is None
    assert torch.equal(t, source)
    assert comm.calls == [("broadcast", torch.float64, 3, 2, GROUP)]
    moved = 3 * 8
    assert stats.sent_bytes == 1000 + moved
    assert stats.intra_node_bytes == 4000 + moved
    assert stats.received_bytes == 2000
    assert stats.inter_node_bytes == 3000
    assert stats.wait_s == 1.0 + 0.5  # clock read at 10.0 before, 10.5 after
    assert stats.emulated_link_s == 0.25


def test_broadcast_to_another_rank_counts_what_it_received():
    """A receiving rank adds the bytes to received only (not to sent or intra-node bytes)."""
    source = torch.arange(5, dtype=torch.float32)
    comm = _ScriptedComm(start=3.0, tick=0.25, source=source)
    stats = prior_stats()
    t = torch.full((5,), 7.0)
    broadcast(t, 0, None, stats, rank=1, comm=comm)
    assert torch.equal(t, source)
    assert comm.calls == [("broadcast", torch.float32, 5, 0, None)]
    assert stats.received_bytes == 2000 + 5 * 4
    assert stats.sent_bytes == 1000
    assert stats.intra_node_bytes == 4000
    assert stats.inter_node_bytes == 3000
    assert stats.wait_s == 1.0 + 0.25


def test_broadcasts_accumulate_on_both_sides():
    """Two broadcasts of the same tensor add up on the source and on a receiver."""
    source = torch.ones(2, dtype=torch.bfloat16)
    sender, receiver = CommStats(), CommStats()
    for _ in range(2):
        for stats, rank in ((sender, 1), (receiver, 3)):
            comm = _ScriptedComm(start=0.0, tick=0.125, source=source)
            broadcast(torch.zeros(2, dtype=torch.bfloat16), 1, None, stats, rank, comm)
    assert (sender.sent_bytes, sender.intra_node_bytes, sender.received_bytes) == (8, 8, 0)
    assert (receiver.sent_bytes, receiver.intra_node_bytes, receiver.received_bytes) == (0, 0, 8)
    assert sender.wait_s == receiver.wait_s == 0.25


# ---------------------------------------------------------------------------- world_sum
def test_world_sum_adds_in_float64_over_the_world_and_counts_a_ring_within_a_node():
    """The values travel as one float64 tensor over the world group (None); the result is the
    float64 sum as Python floats (0.1 + 0.2 is not the float32 sum); counted as a ring
    all-reduce of 2 × 8 bytes over 4 ranks, 2·3/4·16 = 24 bytes each way, intra-node by
    default; the wait is the transport clock's."""
    peers = torch.tensor([0.2, 1.0], dtype=torch.float64)
    comm = _ScriptedComm(size=4, start=2.0, tick=0.75, peers=peers)
    stats = prior_stats()
    out = world_sum([0.1, 3.0], stats, comm=comm)
    assert out == [0.1 + 0.2, 4.0]
    assert all(type(v) is float for v in out)
    assert comm.calls == [("all_reduce", torch.float64, 2, None, False)]
    assert stats.sent_bytes == 1000 + 24 and stats.received_bytes == 2000 + 24
    assert stats.intra_node_bytes == 4000 + 24 and stats.inter_node_bytes == 3000
    assert stats.wait_s == 1.0 + 0.75
    assert stats.emulated_link_s == 0.25


def test_world_sum_across_nodes_counts_inter_node_bytes():
    """``spans_nodes=True`` (no link emulated) moves the same bytes into inter-node bytes."""
    comm = _ScriptedComm(size=2, peers=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    stats = prior_stats()
    assert world_sum([1.0, 1.0, 1.0], stats, spans_nodes=True, comm=comm) == [2.0, 3.0, 4.0]
    moved = 2 * 1 * 3 * 8 // 2  # a ring of 2: (2·1/2) × 24 bytes
    assert stats.inter_node_bytes == 3000 + moved and stats.intra_node_bytes == 4000
    assert stats.sent_bytes == 1000 + moved and stats.received_bytes == 2000 + moved


def test_world_sum_across_nodes_waits_for_the_emulated_link():
    """With an active link and the group spanning nodes, the link is asked for the cost of an
    all-reduce of the float64 bytes over the world's size, that cost is added to
    emulated_link_s and booked once on the world group; the sum is unchanged."""
    link = RecordingLink(allreduce_cost_s=0.0625)
    comm = _ScriptedComm(
        size=4, start=5.0, tick=0.5, peers=torch.tensor([3.0, 3.0], dtype=torch.float64)
    )
    stats = prior_stats()
    out = world_sum([1.0, -1.0], stats, link=link, spans_nodes=True, comm=comm)
    assert out == [4.0, 2.0]
    assert link.asked == [(2 * 8, 4)]
    assert link.booked == [(0.0625, None)]
    assert stats.emulated_link_s == 0.25 + 0.0625
    assert comm.calls == [("all_reduce", torch.float64, 2, None, True)]
    assert stats.inter_node_bytes == 3000 + 24 and stats.intra_node_bytes == 4000
    assert stats.wait_s == 1.0 + 0.5


def test_world_sum_within_a_node_ignores_the_link():
    """An active link is not charged when the world does not span nodes."""
    link = RecordingLink(allreduce_cost_s=0.0625)
    comm = _ScriptedComm(size=4, peers=torch.tensor([1.0], dtype=torch.float64))
    stats = CommStats()
    assert world_sum([2.0], stats, link=link, comm=comm) == [3.0]
    assert link.asked == [] and link.booked == [] and stats.emulated_link_s == 0.0
    assert stats.intra_node_bytes == 12 and stats.inter_node_bytes == 0


# ---------------------------------------------------------------------------- pending bf16
def test_a_bf16_all_reduce_times_its_wait_on_the_transport_it_was_given():
    """The bf16 form's pending work waits on, and reads, the given transport's clock (not the
    wall clock): exactly one tick of it lands in wait_s; the result (copied back to fp32 once)
    is the bf16 sum."""
    x = torch.tensor([1.0, 2.0, -0.5, 3.0])
    peers = torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.bfloat16)
    comm = _ScriptedComm(size=2, start=100.0, tick=2.25, peers=peers)
    stats = CommStats()
    pending = compressed_all_reduce_sum(x, None, stats, "bf16", comm=comm)
    assert torch.equal(x, torch.tensor([1.5, 2.5, 0.0, 3.5]))
    assert stats.wait_s == 2.25
    assert comm.calls == [("all_reduce", torch.bfloat16, 4, None, True)]
    # Waiting again reads the clock again but does not copy the result back a second time.
    x.zero_()
    pending.wait()
    assert torch.equal(x, torch.zeros(4)) and stats.wait_s == 4.5
    assert stats.sent_bytes == 4 * 2 and stats.intra_node_bytes == 4 * 2  # a ring of 2, bf16
