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
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
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
        n = group_size
        return 2 * (n - 1) * self.spec.latency_s + 2 * (n - 1) / n * nbytes / self.spec.bytes_per_s

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
