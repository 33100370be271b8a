"""The counted collectives the strategies call (cloudburst/comm/collectives.py), on W threads
(``tests.support.ThreadComm``) and counters holding earlier totals (``prior_stats``): what
``broadcast`` and ``world_sum`` give every rank and add to the counters, and what an all-to-all
costs on a link. ``all_reduce_sum``: tests/unit/test_sim_network_more.py and test_link.py."""

from __future__ import annotations

import pytest
import torch

from cloudburst.comm.collectives import all_to_all_s, broadcast, world_sum
from tests.support import RecordingLink, on_comm_threads, prior_stats

GROUP = object()  # an opaque group handle: passed through, never looked inside


def _world_sums(values, start, tick, links=None, **kw) -> list[tuple]:
    """Rank r's ``world_sum(values[r], prior_stats(), link=links[r], **kw)`` over the world
    group (None): each rank's (sum, calls, stats)."""

    def rank_fn(rank, comm):
        counters, link = prior_stats(), links[rank] if links else None
        out = world_sum(values[rank], counters, link=link, comm=comm, **kw)
        return out, comm.calls, counters

    return on_comm_threads(len(values), rank_fn, handle=None, start=start, tick=tick)


def test_a_broadcast_is_counted_as_sent_within_the_group_by_its_source_and_received_by_the_rest():
    """Every rank ends with the source's tensor; the source counts its bytes as sent (within
    the group's node), the others as received; each adds the call's clock seconds to wait_s."""
    source = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64)

    def rank_fn(rank, comm):
        stats = prior_stats()
        t = source.clone() if rank == 2 else torch.full((3,), 7.0, dtype=torch.float64)
        return broadcast(t, 2, GROUP, stats, rank=rank, comm=comm), t, comm.calls, stats

    moved = 3 * 8
    for rank, (returned, t, calls, stats) in enumerate(
        on_comm_threads(4, rank_fn, handle=GROUP, start=10.0, tick=0.5)
    ):
        assert returned is None and torch.equal(t, source)
        assert calls == [("broadcast", torch.float64, 3, 2)]
        sends = moved if rank == 2 else 0
        assert (stats.sent_bytes, stats.intra_node_bytes) == (1000 + sends, 4000 + sends)
        assert stats.received_bytes == 2000 + moved - sends and stats.inter_node_bytes == 3000
        assert stats.wait_s == 1.0 + 0.5  # clock read at 10.0 before, 10.5 after
        assert stats.emulated_link_s == 0.25


@pytest.mark.parametrize("spans_nodes", [False, True])
def test_a_world_sum_adds_in_float64_counted_as_a_ring_and_charges_no_link_within_a_node(
    spans_nodes,
):
    """The float64 sum as Python floats (0.1 + 0.2 is not the float32 sum), counted as a ring
    of 2 × 8 bytes over 4 ranks (2·3/4·16 = 24 bytes each way), intra-node unless
    ``spans_nodes``. Within a node an active link is neither asked nor booked."""
    values = [[0.1, 3.0], [0.2, 1.0], [0.0, 0.0], [0.0, 0.0]]
    links = None if spans_nodes else [RecordingLink() for _ in values]
    out, calls, stats = _world_sums(values, 2.0, 0.75, links, spans_nodes=spans_nodes)[0]
    assert out == [0.1 + 0.2, 4.0]
    assert all(type(v) is float for v in out)
    assert calls == [("all_reduce", torch.float64, 2, False)]
    assert stats.sent_bytes == 1000 + 24 and stats.received_bytes == 2000 + 24
    inter, intra = (24, 0) if spans_nodes else (0, 24)
    assert (stats.inter_node_bytes, stats.intra_node_bytes) == (3000 + inter, 4000 + intra)
    assert stats.wait_s == 1.0 + 0.75
    assert stats.emulated_link_s == 0.25
    if links:
        assert links[0].asked == [] and links[0].booked == []


def test_a_world_sum_across_nodes_waits_for_the_emulated_link():
    """Across nodes the link's cost of the float64 all-reduce is added to emulated_link_s and
    booked once on the world group; the transport's work is waited for."""
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


def test_an_all_to_all_costs_a_latency_a_peer_plus_its_bytes_and_nothing_alone_or_on_a_free_link():
    """all_to_all_s: (n − 1) latencies + bytes / bandwidth; exactly 0 for a group of one or a
    link without a spec."""
    link = RecordingLink()
    assert all_to_all_s(link, 512, 3) == 2 * 0.125 + 0.5
    assert all_to_all_s(link, 512, 1) == 0.0
    assert all_to_all_s(link, 512, 0) == 0.0
    free = RecordingLink()
    free.spec = None
    assert all_to_all_s(free, 512, 4) == 0.0
