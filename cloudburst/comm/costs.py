"""The network's physics as pure functions of their arguments, shared by the real-run link
emulator (:class:`~cloudburst.comm.link.LinkEmulator`) and the virtual cluster
(:mod:`cloudburst.sim.clock`), so that both charge a transfer the same time: a node NIC with
separate egress and ingress queues (:func:`nic_transfer`), the all-reduce algorithms and the
choice among them by size (:func:`best_allreduce_s`), the hierarchical all-reduce and DDP's
bucketed all-reduce overlapped with backward (:func:`ddp_overlap_end_s`). docs/simulator.md
gives the formulas and what is not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


# ---------------------------------------------------------------------------- issue 30 physics
#: DDP's default bucket size (``bucket_cap_mb=25``), in bytes.
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
    proportion to parameters (as :mod:`cloudburst.comm.device_emulation`), so bucket j (0-based,
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
