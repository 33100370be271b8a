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

Transfers share the node's NIC, as in the virtual cluster (:class:`NicState`, issue 30):
the ranks of a job on one machine keep, in one small shared file, each node's egress and
ingress free times and the collectives booked recently. A collective across nodes
(``(group name, global ranks, this rank's i-th booking on the group)`` names it on every
member) starts once its last member has booked it and every NIC of its nodes is free (both
ways), and holds them all until it ends; every member gets that end (the earlier ones wait
for it, :class:`PendingEnd`): a ring cannot finish before its last member joins. So two
collectives of different groups on one node (DASO's global groups) queue, as do back-to-back
buckets. A message across nodes waits for its node's egress and queues at the receiving
node's ingress (:func:`nic_transfer`, incast); the sender is held until it arrives. A
non-blocking collective overlaps with compute exactly as much as the real one could.

Not shared: between machines (each machine's ranks share a record of their own, so a node
on another machine sees only this machine's traffic into it), with a rank that rejoined a
running job after a restart (its link is its own), and wherever the record cannot be opened
(one warning; each rank then queues on a link of its own, as before issue 30, which is also
what ``LinkEmulator(spec)`` alone does). The time charged for each transfer
(``emulated_link_s``) is its cost; the queueing behind the node's other ranks shows in the
time waited (``comm_wait_s``), as in the virtual cluster.

The formulas are :mod:`cloudburst.comm.costs`, which the virtual cluster charges too; the
shared NIC record is :mod:`cloudburst.comm.nic`.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cloudburst.comm.costs import LinkSpec, nic_transfer, ring_allreduce_s
from cloudburst.comm.nic import NicState, PendingEnd, resolve_end


@dataclass(frozen=True)
class Topology:
    """``node_of[r]``: the node of global rank ``r`` (:meth:`place`: where a job's shards and
    workers run)."""

    node_of: tuple[int, ...]

    @classmethod
    def contiguous(cls, world_size: int, nodes: int) -> Topology:
        """``nodes`` blocks of near-equal size (rank r on node r * nodes // world_size)."""
        if not 1 <= nodes <= world_size:
            raise ValueError(f"cannot place {world_size} ranks on {nodes} nodes")
        return cls(tuple(r * nodes // world_size for r in range(world_size)))

    @classmethod
    def place(
        cls,
        workers: int,
        servers: int,
        nodes: int,
        placement: str = "spread",
        ranks_per_node: int | None = None,
    ) -> Topology:
        """Ranks ``0..servers-1`` (parameter-server shards) and ``servers..`` (workers) on
        ``nodes`` nodes. Shards go where ``placement`` says: ``spread`` (shard k on node k mod
        N), ``first`` (all on node 0), ``own`` (together on the last node, which has no
        workers), or a comma list naming each shard's node. Workers fill the worker nodes
        (every node, except under ``own``) in contiguous, near-equal blocks, or, on machines of
        ``ranks_per_node`` ranks each (torchrun's), each node's places the shards left, in node
        order. Raises ValueError (one line) for a placement that cannot be."""
        if nodes < 1 or workers < 1:
            raise ValueError(f"cannot place {workers} workers on {nodes} nodes")
        placement = placement.strip()
        if placement == "spread":
            shard_nodes = [k % nodes for k in range(servers)]
        elif placement == "first":
            shard_nodes = [0] * servers
        elif placement == "own":
            if servers and nodes < 2:
                raise ValueError("'own' needs 2 or more nodes (one of them the shards')")
            shard_nodes = [nodes - 1] * servers
        else:
            try:
                shard_nodes = [int(part) for part in placement.split(",")]
            except ValueError:
                raise ValueError(
                    f"{placement!r} is not spread, first, own or a list of node numbers"
                ) from None
            if len(shard_nodes) != servers:
                raise ValueError(
                    f"{placement!r} names {len(shard_nodes)} node(s) for {servers} shard(s); "
                    "give one node per shard"
                )
            bad = [n for n in shard_nodes if not 0 <= n < nodes]
            if bad:
                raise ValueError(
                    f"{placement!r} names node {bad[0]}, which does not exist; "
                    f"the job's nodes are 0..{nodes - 1}"
                )
        worker_nodes = nodes - 1 if placement == "own" and servers else nodes
        if ranks_per_node is not None:
            free = [ranks_per_node - shard_nodes.count(n) for n in range(worker_nodes)]
            if (
                min(free) < 0
                or sum(free) != workers
                or nodes * ranks_per_node != (workers + servers)
            ):
                counts = [shard_nodes.count(n) for n in range(nodes)]
                raise ValueError(
                    f"{placement!r} puts {','.join(map(str, counts))} shard(s) on nodes "
                    f"0..{nodes - 1}, which leaves no place on nodes of {ranks_per_node} ranks "
                    f"for exactly {workers} workers; change --shard-placement, --servers or "
                    "--workers"
                )
            worker_node = [n for n in range(worker_nodes) for _ in range(free[n])]
            return cls(tuple(shard_nodes + worker_node))
        if workers < worker_nodes:
            raise ValueError(f"{workers} workers cannot fill {worker_nodes} worker node(s)")
        worker_node = [w * worker_nodes // workers for w in range(workers)]
        return cls(tuple(shard_nodes + worker_node))

    def shard_nodes(self, servers: int) -> list[int]:
        """The node of each parameter-server shard (ranks ``0..servers-1``)."""
        return list(self.node_of[:servers])

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

    One per process. ``spec=None`` emulates nothing (every delay is 0). Alone (no ``nic``),
    this rank's transfers queue on a link of its own (``reserve``). With ``nic`` (a
    :class:`NicState` shared by the ranks of the machine), ``topology`` and this ``rank``,
    the node's NIC is shared as the virtual cluster shares it (:meth:`book_collective`,
    :meth:`book_send`).
    """

    def __init__(
        self,
        spec: LinkSpec | None,
        topology: Topology | None = None,
        rank: int | None = None,
        nic: NicState | None = None,
    ):
        self.spec = spec
        self._busy_until = 0.0
        self._lock = threading.Lock()
        self.emulated_s = 0.0  # total link time charged (for reports)
        if nic is not None and (topology is None or rank is None):
            raise ValueError("a shared NIC needs the topology and this rank")
        self.topology, self.rank = topology, rank
        self.nic = nic if spec is not None else None
        self._calls: dict[tuple[str, tuple[int, ...]], int] = {}  # group -> ops booked on it

    @property
    def active(self) -> bool:
        return self.spec is not None

    @property
    def shared(self) -> bool:
        """Whether this rank's node NIC is shared with the other ranks (a :class:`NicState`)."""
        return self.nic is not None

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

    def book_collective(
        self, seconds: float, group: Any, start: float | None = None
    ) -> float | PendingEnd:
        """Book a collective of ``seconds`` across nodes over ``group`` (a process group, None
        for the world, or its ``(name, global ranks)``), this member arriving at ``start``
        (now). Alone: :meth:`reserve`, the end. Shared, as the virtual cluster's
        ``SimNetwork._complete``: the op is this rank's i-th booking on the group; it starts
        when its last member has arrived and every NIC of its nodes is free (both ways), and
        holds them until start + ``seconds``. The last member gets that end; the others a
        :class:`PendingEnd` (:func:`resolve_end` waits for it)."""
        if self.nic is None:
            return self.reserve(seconds, start)
        if isinstance(group, tuple):
            name, ranks = group
        else:
            from cloudburst.comm.transport import group_members

            name, ranks = group_members(group)
        nodes = sorted({self.topology.node_of[r] for r in ranks})
        now = time.perf_counter() if start is None else start
        with self._lock:
            index = self._calls.get((name, ranks), 0)
            self._calls[(name, ranks)] = index + 1
            key = hashlib.blake2b(f"{name}|{ranks}|{index}".encode(), digest_size=16).digest()
            self.emulated_s += seconds
            with self.nic.locked():
                last, _, members = self.nic.op(key) or (now, math.nan, 0)
                last, members = max(last, now), members + 1
                if members < len(ranks):
                    self.nic.set_op(key, last, math.nan, members)
                    return PendingEnd(self.nic, key, f"{name} {ranks} #{index}")
                free = [t for n in nodes for t in self.nic.free(n)]
                end = max([last, *free]) + seconds
                for n in nodes:
                    self.nic.set_free(n, end, end)
                self.nic.set_op(key, last, end, members)
            self._busy_until = max(self._busy_until, end)
            return end

    def book_send(self, nbytes: float, dst: int, start: float | None = None) -> float:
        """Book a message of ``nbytes`` to global rank ``dst`` on another node from ``start``
        (now); return its arrival. Alone: :meth:`reserve` of :meth:`p2p_s`. Shared: it waits
        for this node's egress and queues at ``dst``'s node's ingress
        (:func:`nic_transfer`, the virtual cluster's ``SimNetwork._send``)."""
        out = into = 0
        if self.nic is not None:
            out, into = self.topology.node_of[self.rank], self.topology.node_of[dst]
        if out == into:  # alone (or, never asked, within a node): this rank's own link
            return self.reserve(self.p2p_s(nbytes), start)
        spec = self.spec
        now = time.perf_counter() if start is None else start
        with self._lock, self.nic.locked():
            egress, out_ingress = self.nic.free(out)
            into_egress, ingress = self.nic.free(into)
            bps = spec.bytes_per_s
            egress_free, arrival = nic_transfer(
                max(now, egress), ingress, nbytes, spec.latency_s, bps, bps
            )
            self.nic.set_free(out, egress_free, out_ingress)
            self.nic.set_free(into, into_egress, arrival)
            self._busy_until = max(self._busy_until, arrival)
            self.emulated_s += self.p2p_s(nbytes)
            return arrival

    def release_name(self) -> None:
        """Remove the shared record's name once every rank has it open (after the job's
        start barrier) and again at the end: nothing is left behind in /dev/shm."""
        if self.nic is not None:
            self.nic.unlink()

    @staticmethod
    def wait_until(deadline: float) -> float:
        """Sleep until ``deadline`` (perf_counter seconds); return the time slept."""
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
            return remaining
        return 0.0


class EmulatedWork:
    """A collective's work handle that completes no earlier than the emulated link allows
    (``deadline``: a booking's end, perhaps still pending on the other members)."""

    def __init__(self, work, deadline: float | PendingEnd):
        self.work, self.deadline = work, deadline

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        LinkEmulator.wait_until(resolve_end(self.deadline))
        return True

    def is_completed(self) -> bool:
        done = self.work is None or self.work.is_completed()
        end = self.deadline.peek() if isinstance(self.deadline, PendingEnd) else self.deadline
        return done and end is not None and time.perf_counter() >= end
