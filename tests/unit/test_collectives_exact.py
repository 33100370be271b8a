"""The counted collectives the strategies call, on W threads, each transport a
``tests.support.ThreadComm`` (a clock that reads ``start``, ``start + tick``, ...; every call
recorded): exactly what ``broadcast`` and ``world_sum`` return, which transport calls they
make, and what they add to the :class:`CommStats` counters (bytes by direction and by whether
they crossed nodes, seconds waited on the transport's own clock, time held back by the
emulated link); and that a pending bf16 all-reduce times its wait on the transport it was
given."""

from __future__ import annotations

import torch

from cloudburst.comm.collectives import broadcast, world_sum
from cloudburst.comm.compress import compressed_all_reduce_sum
from cloudburst.comm.stats import CommStats
from tests.fakes import RecordingLink, prior_stats
from tests.support import on_comm_threads

GROUP = object()  # an opaque group handle: passed through, never looked inside


def _world_sums(values, start, tick, stats=prior_stats, links=None, **kw) -> list[tuple]:
    """Rank r's ``world_sum(values[r], stats(), link=links[r], **kw)`` on ``len(values)``
    threads, whose transports accept only the world group (None): each rank's (sum, calls,
    stats)."""

    def rank_fn(rank, comm):
        counters, link = stats(), links[rank] if links else None
        out = world_sum(values[rank], counters, link=link, comm=comm, **kw)
        return out, comm.calls, counters

    return on_comm_threads(len(values), rank_fn, handle=None, start=start, tick=tick)


# ---------------------------------------------------------------------------- broadcast
def test_broadcast_from_this_rank_counts_its_bytes_as_sent_within_the_group():
    """The source adds numel × element size to sent and intra-node bytes (received untouched)
    and the transport-clock seconds of the call to wait_s; every tensor holds the source's."""
    source = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64)

    def rank_fn(rank, comm):
        stats = prior_stats()
        t = source.clone() if rank == 2 else torch.zeros(3, dtype=torch.float64)
        return broadcast(t, 2, GROUP, stats, rank=rank, comm=comm), t, comm.calls, stats

    ranks = on_comm_threads(4, rank_fn, handle=GROUP, start=10.0, tick=0.5)
    returned, _, calls, stats = ranks[2]
    assert returned is None
    assert all(torch.equal(t, source) for _, t, _, _ in ranks)
    assert calls == [("broadcast", torch.float64, 3, 2)]
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

    def rank_fn(rank, comm):
        stats = prior_stats()
        t = source.clone() if rank == 0 else torch.full((5,), 7.0)
        broadcast(t, 0, None, stats, rank=rank, comm=comm)
        return t, comm.calls, stats

    t, calls, stats = on_comm_threads(2, rank_fn, handle=None, start=3.0, tick=0.25)[1]
    assert torch.equal(t, source)
    assert calls == [("broadcast", torch.float32, 5, 0)]
    assert stats.received_bytes == 2000 + 5 * 4
    assert stats.sent_bytes == 1000
    assert stats.intra_node_bytes == 4000
    assert stats.inter_node_bytes == 3000
    assert stats.wait_s == 1.0 + 0.25


def test_broadcasts_accumulate_on_both_sides():
    """Two broadcasts of the same tensor add up on the source and on a receiver."""
    source = torch.ones(2, dtype=torch.bfloat16)

    def rank_fn(rank, comm):
        stats = CommStats()
        for _ in range(2):
            t = source.clone() if rank == 1 else torch.zeros(2, dtype=torch.bfloat16)
            broadcast(t, 1, None, stats, rank, comm)
        return stats

    ranks = on_comm_threads(4, rank_fn, start=0.0, tick=0.125)
    sender, receiver = ranks[1], ranks[3]
    assert (sender.sent_bytes, sender.intra_node_bytes, sender.received_bytes) == (8, 8, 0)
    assert (receiver.sent_bytes, receiver.intra_node_bytes, receiver.received_bytes) == (0, 0, 8)
    assert sender.wait_s == receiver.wait_s == 0.25


# ---------------------------------------------------------------------------- world_sum
def test_world_sum_adds_in_float64_over_the_world_and_counts_a_ring_within_a_node():
    """The values travel as one float64 tensor over the world group (None); the result is the
    float64 sum as Python floats (0.1 + 0.2 is not the float32 sum); counted as a ring
    all-reduce of 2 × 8 bytes over 4 ranks, 2·3/4·16 = 24 bytes each way, intra-node by
    default; the wait is the transport clock's."""
    values = [[0.1, 3.0], [0.2, 1.0], [0.0, 0.0], [0.0, 0.0]]
    out, calls, stats = _world_sums(values, start=2.0, tick=0.75)[0]
    assert out == [0.1 + 0.2, 4.0]
    assert all(type(v) is float for v in out)
    assert calls == [("all_reduce", torch.float64, 2, False)]
    assert stats.sent_bytes == 1000 + 24 and stats.received_bytes == 2000 + 24
    assert stats.intra_node_bytes == 4000 + 24 and stats.inter_node_bytes == 3000
    assert stats.wait_s == 1.0 + 0.75
    assert stats.emulated_link_s == 0.25


def test_world_sum_across_nodes_counts_inter_node_bytes():
    """``spans_nodes=True`` (no link emulated) moves the same bytes into inter-node bytes."""
    values = [[1.0, 1.0, 1.0], [1.0, 2.0, 3.0]]
    out, _, stats = _world_sums(values, start=10.0, tick=0.5, spans_nodes=True)[0]
    assert out == [2.0, 3.0, 4.0]
    moved = 2 * 1 * 3 * 8 // 2  # a ring of 2: (2·1/2) × 24 bytes
    assert stats.inter_node_bytes == 3000 + moved and stats.intra_node_bytes == 4000
    assert stats.sent_bytes == 1000 + moved and stats.received_bytes == 2000 + moved


def test_world_sum_across_nodes_waits_for_the_emulated_link():
    """With an active link and the group spanning nodes, the link is asked for the cost of an
    all-reduce of the float64 bytes over the world's size, that cost is added to
    emulated_link_s and booked once on the world group; the sum is unchanged, and the
    transport's work waited for."""
    values = [[1.0, -1.0], [3.0, 3.0], [0.0, 0.0], [0.0, 0.0]]
    links = [RecordingLink(allreduce_cost_s=0.0625) for _ in values]
    out, calls, stats = _world_sums(values, 5.0, 0.5, links=links, spans_nodes=True)[0]
    assert out == [4.0, 2.0]
    assert links[0].asked == [(2 * 8, 4)]
    assert links[0].booked == [(0.0625, None)]
    assert stats.emulated_link_s == 0.25 + 0.0625
    assert calls == [("all_reduce", torch.float64, 2, True), ("wait",)]
    assert stats.inter_node_bytes == 3000 + 24 and stats.intra_node_bytes == 4000
    assert stats.wait_s == 1.0 + 0.5


def test_world_sum_within_a_node_ignores_the_link():
    """An active link is not charged when the world does not span nodes."""
    values = [[2.0], [1.0], [0.0], [0.0]]
    links = [RecordingLink(allreduce_cost_s=0.0625) for _ in values]
    out, _, stats = _world_sums(values, 10.0, 0.5, stats=CommStats, links=links)[0]
    assert out == [3.0]
    link = links[0]
    assert link.asked == [] and link.booked == [] and stats.emulated_link_s == 0.0
    assert stats.intra_node_bytes == 12 and stats.inter_node_bytes == 0


# ---------------------------------------------------------------------------- pending bf16
def test_a_bf16_all_reduce_times_its_wait_on_the_transport_it_was_given():
    """The bf16 form's pending work waits on, and reads, the given transport's clock (not the
    wall clock): exactly one tick of it lands in wait_s; the result (copied back to fp32 once)
    is the bf16 sum."""
    xs = [torch.tensor([1.0, 2.0, -0.5, 3.0]), torch.full((4,), 0.5)]

    def rank_fn(rank, comm):
        stats = CommStats()
        pending = compressed_all_reduce_sum(xs[rank], None, stats, "bf16", comm=comm)
        return pending, comm, stats

    pending, comm, stats = on_comm_threads(2, rank_fn, handle=None, start=100.0, tick=2.25)[0]
    x = xs[0]
    assert torch.equal(x, torch.tensor([1.5, 2.5, 0.0, 3.5]))
    assert stats.wait_s == 2.25
    assert comm.calls == [("all_reduce", torch.bfloat16, 4, True), ("wait",)]
    # Waiting again reads the clock again but does not copy the result back a second time.
    x.zero_()
    pending.wait()
    assert torch.equal(x, torch.zeros(4)) and stats.wait_s == 4.5
    assert stats.sent_bytes == 4 * 2 and stats.intra_node_bytes == 4 * 2  # a ring of 2, bf16
