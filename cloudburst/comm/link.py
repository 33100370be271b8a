"""Topology (which rank is on which node) and a software model of a slow inter-node link.

tc/netem is not available on our machines, so a slow interconnect is emulated in software:
traffic that crosses nodes is held back for as long as a link of ``--inter-node-link
GBIT_PER_S[,LATENCY_MS]`` would take to carry it. The real transfer still happens (over
loopback or the real network); the emulation only adds the missing time, and never shortens
anything.

Cost model (what is charged to the slow link):

- an all-reduce over a group of ``n`` ranks spanning more than one node: a ring all-reduce,
  ``2(n-1)`` steps of one latency each, and ``2(n-1)/n`` of the tensor's bytes through each
  rank's link; ranks of one node are adjacent in the ring, so the bytes that cross node
  boundaries are the same as if every link were slow (this is what a bandwidth-optimal
  all-reduce pays on a flat ring);
- a broadcast over a group spanning nodes: ``log2(n)`` rounds of latency + the tensor's bytes;
- a point-to-point message to a rank on another node: one latency + its bytes.

Transfers from one rank share that rank's link: each one starts when the previous one has
finished (``busy_until``), so back-to-back buckets queue as they would on a real wire, while a
non-blocking collective overlaps with compute exactly as much as the real one could.

The module-level functions below (issue 30) are the rest of the shared physics, pure functions
of their arguments, used by the virtual cluster (:mod:`cloudburst.sim.clock`): a node NIC with
separate egress and ingress queues (:func:`nic_transfer`), the all-reduce algorithms and the
choice among them by size (:func:`best_allreduce_s`), the hierarchical all-reduce
(:func:`hierarchical_allreduce_s`) and DDP's bucketed all-reduce overlapped with backward
(:func:`ddp_overlap_end_s`). docs/simulator.md gives the formulas and what is not modelled.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    gbit_per_s: float
    latency_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``"1"`` (1 Gbit/s) or ``"1,0.5"`` (1 Gbit/s, 0.5 ms latency)."""
        try:
            parts = [float(p) for p in str(text).split(",")]
            if len(parts) not in (1, 2):
                raise ValueError
            spec = cls(*parts)
        except (TypeError, ValueError):
            raise ValueError(
                f"{text!r} is not GBIT_PER_S[,LATENCY_MS] (e.g. 1,1 for 1 Gbit/s with 1 ms)"
            ) from None
        if not (math.isfinite(spec.gbit_per_s) and spec.gbit_per_s > 0):
            raise ValueError(f"{text!r}: the speed must be a positive number of Gbit/s")
        if not (math.isfinite(spec.latency_ms) and spec.latency_ms >= 0):
            raise ValueError(f"{text!r}: the latency must be >= 0 ms")
        return spec

    @property
    def bytes_per_s(self) -> float:
        return self.gbit_per_s * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3


@dataclass(frozen=True)
class Topology:
    """``node_of[r]``: the node of global rank ``r``. Nodes hold contiguous ranks."""

    node_of: tuple[int, ...]

    @classmethod
    def contiguous(cls, world_size: int, nodes: int) -> Topology:
        """``nodes`` blocks of near-equal size (rank r on node r * nodes // world_size)."""
        if not 1 <= nodes <= world_size:
            raise ValueError(f"cannot place {world_size} ranks on {nodes} nodes")
        return cls(tuple(r * nodes // world_size for r in range(world_size)))

    @property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def spans_nodes(self, ranks: Sequence[int]) -> bool:
        return len({self.node_of[r] for r in ranks}) > 1

    def crosses(self, a: int, b: int) -> bool:
        return self.node_of[a] != self.node_of[b]


class LinkEmulator:
    """Holds back this rank's traffic across nodes as the emulated link would.

    One per process. ``spec=None`` emulates nothing (every delay is 0).
    """

    def __init__(self, spec: LinkSpec | None):
        self.spec = spec
        self._busy_until = 0.0
        self._lock = threading.Lock()
        self.emulated_s = 0.0  # total link time charged (for reports)

    @property
    def active(self) -> bool:
        return self.spec is not None

    # ------------------------------------------------------------------ cost model
    def allreduce_s(self, nbytes: int, group_size: int) -> float:
        if self.spec is None or group_size < 2:
            return 0.0
        return ring_allreduce_s(nbytes, group_size, self.spec.latency_s, self.spec.bytes_per_s)

    def broadcast_s(self, nbytes: int, group_size: int) -> float:
        if self.spec is None or group_size < 2:
            return 0.0
        rounds = math.ceil(math.log2(group_size))
        return rounds * self.spec.latency_s + nbytes / self.spec.bytes_per_s

    def p2p_s(self, nbytes: int) -> float:
        if self.spec is None:
            return 0.0
        return self.spec.latency_s + nbytes / self.spec.bytes_per_s

    # ------------------------------------------------------------------ the wire
    def reserve(self, seconds: float, start: float | None = None) -> float:
        """Book ``seconds`` of this rank's link from ``start`` (now); return when it ends."""
        now = time.perf_counter() if start is None else start
        with self._lock:
            begin = max(now, self._busy_until)
            self._busy_until = begin + seconds
            self.emulated_s += seconds
            return self._busy_until

    @staticmethod
    def wait_until(deadline: float) -> float:
        """Sleep until ``deadline`` (perf_counter seconds); return the time slept."""
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
            return remaining
        return 0.0


class EmulatedWork:
    """A collective's work handle that completes no earlier than the emulated link allows."""

    def __init__(self, work, deadline: float):
        self.work, self.deadline = work, deadline

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        LinkEmulator.wait_until(self.deadline)
        return True

    def is_completed(self) -> bool:
        done = self.work is None or self.work.is_completed()
        return done and time.perf_counter() >= self.deadline


# ---------------------------------------------------------------------------- issue 30 physics
#: DDP's default bucket size (``bucket_cap_mb=25``), in bytes.
DDP_BUCKET_BYTES = 25 * 1024 * 1024


def ring_allreduce_s(nbytes: float, n: int, latency_s: float, bytes_per_s: float) -> float:
    """Ring: 2(n−1) latencies + 2(n−1)/n × bytes / bandwidth (0 for n < 2)."""
    if n < 2:
        return 0.0
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / bytes_per_s


def tree_allreduce_s(nbytes: float, n: int, latency_s: float, bytes_per_s: float) -> float:
    """NCCL's (double binary) tree, pipelined: a reduce up and a broadcast down,
    2⌈log2 n⌉ latencies + 2 × bytes / bandwidth (0 for n < 2)."""
    if n < 2:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * latency_s + 2 * nbytes / bytes_per_s


def halving_doubling_allreduce_s(
    nbytes: float, n: int, latency_s: float, bytes_per_s: float
) -> float | None:
    """Recursive halving (reduce-scatter) then doubling (all-gather), Gloo's and Goyal et al.'s:
    2 log2 n latencies + 2(n−1)/n × bytes / bandwidth; None unless n is a power of two."""
    if n < 2:
        return 0.0
    if n & (n - 1):
        return None
    return 2 * int(math.log2(n)) * latency_s + 2 * (n - 1) / n * nbytes / bytes_per_s


def best_allreduce_s(
    nbytes: float, n: int, latency_s: float, bytes_per_s: float
) -> tuple[float, str]:
    """(seconds, algorithm): the cheapest of ring, tree and (n a power of two) halving/doubling
    for this size, as NCCL's and Gloo's tuners choose (ties: the first in that order)."""
    costs = {
        "ring": ring_allreduce_s(nbytes, n, latency_s, bytes_per_s),
        "tree": tree_allreduce_s(nbytes, n, latency_s, bytes_per_s),
        "halving_doubling": halving_doubling_allreduce_s(nbytes, n, latency_s, bytes_per_s),
    }
    name = min((k for k, v in costs.items() if v is not None), key=lambda k: costs[k])
    return costs[name], name


def hierarchical_allreduce_s(
    nbytes: float,
    nodes: int,
    ranks_per_node: int,
    intra: LinkSpec | None,
    inter: LinkSpec | None,
) -> float:
    """Reduce-scatter inside each node (a ring of k ranks: (k−1) latencies + (k−1)/k × bytes /
    intra bandwidth), the k stripes of bytes/k all-reduced between the N nodes through the
    node's one NIC (together the bytes of one all-reduce of N: :func:`best_allreduce_s` on the
    inter-node link), then an all-gather inside the node (the reduce-scatter's cost again).
    ``k``: the most ranks of the group on one node. A free link (None) costs nothing."""
    k = ranks_per_node
    intra_s = 0.0
    if intra is not None and k > 1:
        intra_s = 2 * ((k - 1) * intra.latency_s + (k - 1) / k * nbytes / intra.bytes_per_s)
    inter_s = 0.0
    if inter is not None and nodes > 1:
        inter_s = best_allreduce_s(nbytes, nodes, inter.latency_s, inter.bytes_per_s)[0]
    return intra_s + inter_s


def nic_transfer(
    start_s: float,
    ingress_free_s: float,
    nbytes: float,
    latency_s: float,
    egress_bytes_per_s: float,
    ingress_bytes_per_s: float,
) -> tuple[float, float]:
    """A message leaving a node's NIC at ``start_s`` (its egress queue already waited for) for
    a node whose ingress is free at ``ingress_free_s``: (egress free again, arrival).

    The egress is busy latency + bytes / egress bandwidth (as one rank's link always was); the
    message arrives at max(start + latency + bytes / min(egress, ingress bandwidth), ingress
    free + bytes / ingress bandwidth): one message alone costs what it did, and messages from
    many senders into one node (incast) queue at its ingress."""
    egress_free = start_s + latency_s + nbytes / egress_bytes_per_s
    alone = start_s + latency_s + nbytes / min(egress_bytes_per_s, ingress_bytes_per_s)
    return egress_free, max(alone, ingress_free_s + nbytes / ingress_bytes_per_s)


def ddp_overlap_end_s(
    forward_s: float,
    backward_s: float,
    total_bytes: float,
    allreduce_s: Callable[[float], float],
    bucket_bytes: float = DDP_BUCKET_BYTES,
    link_free_s: float = 0.0,
) -> float:
    """When DDP's last gradient bucket is all-reduced, in seconds from the step's start.

    Buckets of ``bucket_bytes`` fill in reverse parameter order; backward spends its time in
    proportion to parameters (as :mod:`cloudburst.device_emulation`), so bucket j (0-based,
    m = ⌈total / bucket⌉ of them) is ready at ``forward + backward × min((j+1)·bucket, total) /
    total``. Its all-reduce starts at max(ready_j, the previous bucket's end, ``link_free_s``
    for the first) and lasts ``allreduce_s(its bytes)``: end_j = max(ready_j, end_{j−1}) +
    allreduce_s(min(bucket, total − j·bucket)). Returns end_{m−1} (forward + backward when
    there is nothing to send)."""
    done = forward_s + backward_s
    if total_bytes <= 0:
        return max(done, link_free_s)
    m = math.ceil(total_bytes / bucket_bytes)
    end = link_free_s
    for j in range(m):
        ready = forward_s + backward_s * min((j + 1) * bucket_bytes, total_bytes) / total_bytes
        end = max(ready, end) + allreduce_s(min(bucket_bytes, total_bytes - j * bucket_bytes))
    return end
