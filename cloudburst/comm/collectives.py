"""Parameter all-reduces for the strategies: counted, chunked, and slowed by the emulated link.

Mechanism only: the strategies decide what to reduce, when, and over which group.
"""

from __future__ import annotations

from typing import Any

import torch

from cloudburst.comm.link import EmulatedWork, LinkEmulator
from cloudburst.comm.stats import CommStats, count_collective, ring_bytes
from cloudburst.comm.transport import REAL, Transport


class Pending:
    """Works of one (possibly chunked) all-reduce; ``wait`` times the wait into the stats."""

    def __init__(self, works: list, stats: CommStats, comm: Transport = REAL):
        self.works, self.stats, self.comm = works, stats, comm

    def wait(self) -> None:
        t0 = self.comm.now()
        for w in self.works:
            w.wait()
        self.stats.wait_s += self.comm.now() - t0


def all_reduce_sum(
    tensor: torch.Tensor,
    group: Any,
    stats: CommStats,
    link: LinkEmulator | None = None,
    spans_nodes: bool = False,
    chunk_elements: int | None = None,
    async_op: bool = False,
    comm: Transport = REAL,
) -> Pending:
    """Sum ``tensor`` in place over ``group``; returns the pending works (already waited for
    unless ``async_op``). Counted as a ring all-reduce moves it; when the group spans nodes
    and a link is emulated, complete no earlier than that link could carry it (booked once
    per collective on the nodes' NICs where they are shared: ``LinkEmulator.book_collective``)."""
    size = comm.group_size(group)
    chunk = chunk_elements or tensor.numel()
    emulate = link is not None and link.active and spans_nodes and size > 1
    if not async_op and not emulate and chunk >= tensor.numel():
        # The common case, without the asynchronous work objects' round trip.
        t0 = comm.now()
        comm.all_reduce(tensor, group)
        stats.wait_s += comm.now() - t0
        count_collective(
            stats, ring_bytes(tensor.numel(), tensor.element_size(), size), spans_nodes
        )
        return Pending([], stats, comm)
    works = [
        comm.all_reduce(tensor[i : i + chunk], group, async_op=True)
        for i in range(0, tensor.numel(), chunk)
    ]
    count_collective(stats, ring_bytes(tensor.numel(), tensor.element_size(), size), spans_nodes)
    if emulate:
        cost = link.allreduce_s(tensor.numel() * tensor.element_size(), size)
        stats.emulated_link_s += cost
        works[-1] = EmulatedWork(works[-1], link.book_collective(cost, group))
    pending = Pending(works, stats, comm)
    if not async_op:
        pending.wait()
    return pending


def all_to_all_s(link: LinkEmulator, sent_bytes: float, group_size: int) -> float:
    """Seconds an all-to-all of ``group_size`` ranks holds a link back when the busiest rank
    sends ``sent_bytes`` to the others: a pairwise exchange, n − 1 rounds of one latency each,
    and those bytes through the rank's link (0 on a free link or a group of one). The same
    formula for the real run's emulated link and the virtual cluster's clock."""
    spec = link.spec
    if spec is None or group_size < 2:
        return 0.0
    return (group_size - 1) * spec.latency_s + sent_bytes / spec.bytes_per_s


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Any,
    stats: CommStats,
    rank: int,
    comm: Transport = REAL,
) -> None:
    """Broadcast ``tensor`` from global rank ``src`` over ``group`` (blocking). Counted once,
    as intra-group bytes sent by ``src``; the other ranks count what they received."""
    t0 = comm.now()
    comm.broadcast(tensor, src, group)
    stats.wait_s += comm.now() - t0
    moved = tensor.numel() * tensor.element_size()
    if rank == src:
        stats.sent_bytes += moved
        stats.intra_node_bytes += moved
    else:
        stats.received_bytes += moved


def world_sum(
    values: list[float],
    stats: CommStats,
    link: LinkEmulator | None = None,
    spans_nodes: bool = False,
    comm: Transport = REAL,
) -> list[float]:
    """Sum a few numbers over the world group (gloo, CPU), e.g. an epoch's loss and count."""
    t = torch.tensor(values, dtype=torch.float64)
    all_reduce_sum(t, None, stats, link=link, spans_nodes=spans_nodes, comm=comm)
    return t.tolist()
