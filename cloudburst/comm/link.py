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

The module-level functions below (issue 30) are the rest of the shared physics, pure functions
of their arguments, used by the virtual cluster (:mod:`cloudburst.sim.clock`): a node NIC with
separate egress and ingress queues (:func:`nic_transfer`), the all-reduce algorithms and the
choice among them by size (:func:`best_allreduce_s`), the hierarchical all-reduce
(:func:`hierarchical_allreduce_s`) and DDP's bucketed all-reduce overlapped with backward
(:func:`ddp_overlap_end_s`). docs/simulator.md gives the formulas and what is not modelled.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any


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


#: The most collectives the shared record remembers (the oldest booking goes first): far more
#: than can be in flight at once, so a late member always finds its op.
NIC_OPS = 512
_NIC_MAGIC = b"CBNIC001"
_HEADER = struct.Struct("<8sII")  # magic, nodes, op slots
_NODE = struct.Struct("<dd")  # egress free, ingress free (perf_counter seconds)
_OP = struct.Struct("<16sddI")  # op key (zeros: empty), last arrival, end (NaN: open), members in
# The lock's own clock and sleep, bound once (the unit tests replace this module's ``time``).
_lock_clock, _lock_sleep = time.monotonic, time.sleep


def nic_dir() -> str:
    """Where a shared NIC record lives: ``/dev/shm`` (memory) when present, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shared_clock_ok() -> bool:
    """Whether ``time.perf_counter`` reads one clock for every process of the machine
    (CLOCK_MONOTONIC on Linux), so that free times written by one rank mean the same to
    another."""
    return "CLOCK_MONOTONIC" in time.get_clock_info("perf_counter").implementation


class NicState:
    """The NICs of a job's nodes, in a small file shared by the ranks of one machine: per node
    its egress and ingress free times, and a table of the recent collective bookings (an op's
    key, when it was booked, when it ends). Every read and write is under an exclusive
    ``flock`` of the file (and a thread lock), taken within ``lock_timeout_s``.

    Made, it has created the file at ``path`` (zeros: every link free, no booking) or attached
    to the one another rank created. ``unlink`` removes its name; the ranks that have it open
    keep using it (the memory goes when the last one closes)."""

    def __init__(self, path: str, num_nodes: int, lock_timeout_s: float = 30.0):
        if num_nodes < 1:
            raise ValueError(f"num_nodes: {num_nodes} must be >= 1")
        self.path, self.num_nodes, self.lock_timeout_s = path, num_nodes, lock_timeout_s
        self._threads = threading.Lock()  # flock excludes other processes, not our threads
        self._nodes_at = _HEADER.size
        self._ops_at = self._nodes_at + num_nodes * _NODE.size
        size = self._ops_at + NIC_OPS * _OP.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._fd = fd
            with self._flock():
                current = os.fstat(fd).st_size
                if current == 0:
                    os.ftruncate(fd, size)
                elif current != size:
                    raise OSError(
                        f"{path} holds {current} bytes, not a record of {num_nodes} nodes"
                    )
                self._map = mmap.mmap(fd, size)
                magic, nodes, ops = _HEADER.unpack_from(self._map, 0)
                if magic == bytes(8):
                    _HEADER.pack_into(self._map, 0, _NIC_MAGIC, num_nodes, NIC_OPS)
                elif (magic, nodes, ops) != (_NIC_MAGIC, num_nodes, NIC_OPS):
                    raise OSError(f"{path} is not a NIC record of {num_nodes} nodes")
        except BaseException:
            os.close(fd)
            raise

    @contextmanager
    def _flock(self):
        if not self._threads.acquire(timeout=self.lock_timeout_s):
            raise TimeoutError(f"the shared NIC record {self.path} stayed locked (a thread)")
        try:
            with self._file_lock():
                yield
        finally:
            self._threads.release()

    @contextmanager
    def _file_lock(self):
        deadline = _lock_clock() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if _lock_clock() > deadline:
                    raise TimeoutError(
                        f"the shared NIC record {self.path} stayed locked for "
                        f"{self.lock_timeout_s:g} s"
                    ) from None
                _lock_sleep(0.0002)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def locked(self):
        """The record, held for one booking (a context manager)."""
        return self._flock()

    # ------------------------------------------------------------------ under locked()
    def free(self, node: int) -> tuple[float, float]:
        """(egress free, ingress free) of ``node``."""
        return _NODE.unpack_from(self._map, self._nodes_at + node * _NODE.size)

    def set_free(self, node: int, egress_s: float, ingress_s: float) -> None:
        _NODE.pack_into(self._map, self._nodes_at + node * _NODE.size, egress_s, ingress_s)

    def _find(self, key: bytes) -> int | None:
        for i in range(NIC_OPS):
            if _OP.unpack_from(self._map, self._ops_at + i * _OP.size)[0] == key:
                return i
        return None

    def op(self, key: bytes) -> tuple[float, float, int] | None:
        """Op ``key`` (16 bytes): (its last member's arrival so far, its end — NaN while
        members are still to come —, how many members have arrived); None if unbooked."""
        i = self._find(key)
        return None if i is None else _OP.unpack_from(self._map, self._ops_at + i * _OP.size)[1:]

    def op_end(self, key: bytes) -> float | None:
        """When op ``key`` ends; None if it is unbooked or members are still to come."""
        op = self.op(key)
        return None if op is None or math.isnan(op[1]) else op[1]

    def set_op(self, key: bytes, arrival_s: float, end_s: float, members: int) -> None:
        """Write op ``key``: in its slot, else an empty one, else in place of the closed op
        whose last member arrived first (an open op is never dropped)."""
        slot, oldest, oldest_at = self._find(key), None, math.inf
        if slot is None:
            for i in range(NIC_OPS):
                k, at, end, _ = _OP.unpack_from(self._map, self._ops_at + i * _OP.size)
                if k == bytes(16):
                    oldest = i
                    break
                if not math.isnan(end) and at < oldest_at:
                    oldest, oldest_at = i, at
            if oldest is None:
                raise RuntimeError(f"the shared NIC record {self.path} has {NIC_OPS} open ops")
            slot = oldest
        _OP.pack_into(self._map, self._ops_at + slot * _OP.size, key, arrival_s, end_s, members)

    # ------------------------------------------------------------------ lifetime
    def unlink(self) -> None:
        """Remove the record's name (idempotent; every rank of the job may call it)."""
        with suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        if self._fd is not None:
            self._map.close()
            os.close(self._fd)
            self._fd = None


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


class PendingEnd:
    """The end of a shared collective whose other members are still to book it: known once
    the last one has (:func:`resolve_end`)."""

    #: the most a member waits for the others' bookings once the real collective is done
    #: (they book right after launching it, so a miss means one of them is gone)
    TIMEOUT_S = 60.0

    def __init__(self, nic: NicState, key: bytes, name: str):
        self.nic, self.key, self.name = nic, key, name

    def peek(self) -> float | None:
        with self.nic.locked():
            return self.nic.op_end(self.key)

    def wait(self, timeout_s: float | None = None) -> float:
        limit = self.TIMEOUT_S if timeout_s is None else timeout_s
        deadline = _lock_clock() + limit
        while (end := self.peek()) is None:
            if _lock_clock() > deadline:
                raise TimeoutError(
                    f"emulated link: collective {self.name} still had members to come "
                    f"{limit:g} s after it ran"
                )
            _lock_sleep(0.0002)
        return end


def resolve_end(end: float | PendingEnd) -> float:
    """A booking's end: itself, or a :class:`PendingEnd` waited for."""
    return end.wait() if isinstance(end, PendingEnd) else end


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
