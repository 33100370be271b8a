"""The virtual cluster's network: process groups, mailboxes, links and collectives, shared
by every rank of one simulated job (:class:`SimNetwork`). Each rank reaches it through its
:class:`~cloudburst.sim.transport.SimTransport`; the cost model is described there.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from cloudburst.comm.link import Topology
from cloudburst.sim.clock import is_payload
from cloudburst.sim.scheduler import TIMEOUT, Scheduler, Task


def _deadlock(sched: Scheduler) -> str:
    report, sched.stalled = sched.stalled, ""
    return f"; a deadlock: nothing else could run ({report})" if report else ""


class PeerDied(RuntimeError):
    """A collective or a receive from a rank that was killed (as gloo reports a dead peer)."""


# ---------------------------------------------------------------------------- the network
@dataclass(eq=False)
class SimGroup:
    """A process group of the virtual cluster: its members' global ranks, in order."""

    name: str
    members: list[int]
    ops: dict[int, _Collective] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)  # member -> collectives called

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(eq=False)
class _Collective:
    kind: str
    arrivals: dict[int, tuple[float, torch.Tensor | None]] = field(default_factory=dict)
    src: int | None = None
    end: float | None = None
    error: str | None = None
    steps: dict[int, float] = field(default_factory=dict)  # DDP overlap: member -> step time
    waiters: list[Task] = field(default_factory=list)


@dataclass(eq=False)
class _Message:
    src: int
    tag: int
    group: Any
    data: torch.Tensor
    arrival: float
    seq: int
    measure: bool = False


class SimNetwork:
    """Shared by every rank of one simulated job: mailboxes, links, groups, deaths."""

    def __init__(self, sched: Scheduler, clock, topology: Topology, timeout_s: float):
        self.sched, self.clock, self.topology = sched, clock, topology
        self.timeout_s = timeout_s
        self.world = SimGroup("world", list(range(len(topology.node_of))))
        self.mailbox: dict[int, list[_Message]] = {r: [] for r in self.world.members}
        self.receivers: dict[int, list[tuple[Task, Any, int, int | None]]] = {
            r: [] for r in self.world.members
        }
        # When each link is free again: (rank, False) a rank's intra-node link, ("out", node)
        # and ("in", node) a node's NIC, egress and ingress (shared by the node's ranks).
        self.link_free: dict[tuple[Any, Any], float] = {}
        self.died_at: dict[int, float] = {}  # killed ranks: their peers' calls fail at once
        self.stopped_at: dict[int, float] = {}  # stopped ranks: their peers' calls time out
        self.groups: list[SimGroup] = [self.world]
        self._seq = itertools.count()
        self.measuring: set[int] = set()  # tasks whose traffic is a free measurement
        self._measure_reply: dict[int, set[int]] = {}  # task id -> peers owed a free reply
        self.messages = 0
        self.collectives = 0
        # Bytes through each node's NIC, egress + ingress, on the modelled wire (a stand-in's
        # payloads scaled): messages between nodes, and collectives whose group spans nodes.
        self.node_nic_bytes = [0.0] * topology.num_nodes

    # ------------------------------------------------------------------ deaths
    def kill(self, rank: int) -> None:
        """``rank`` dies now: collectives it belongs to fail, receives from it fail."""
        now = self.sched.now()
        self.died_at.setdefault(rank, now)
        for group in self._groups_of(rank):
            for op in group.ops.values():
                if op.end is None:
                    op.error = f"rank {rank} died at t={now:.3f}s"
                    for t in op.waiters:
                        self.sched.wake(t, now)
        for waiters in self.receivers.values():
            for task, _, _, src in waiters:
                if src == rank:
                    self.sched.wake(task, now)

    def _groups_of(self, rank: int) -> list[SimGroup]:
        return [g for g in self.groups if rank in g.members]

    def new_group(self, name: str, members: list[int]) -> SimGroup:
        """The group ``name`` of ``members``: made by the first member that asks, the same
        object for the others (each rank makes the job's groups as a real rank does)."""
        for group in self.groups:
            if group.name == name:
                if group.members != list(members):
                    raise ValueError(f"group {name!r} is {group.members}, not {list(members)}")
                return group
        group = SimGroup(name, list(members))
        self.groups.append(group)
        return group

    def silent_since(self, rank: int) -> float | None:
        """When ``rank`` stopped taking part (killed or stopped), or None."""
        return self.died_at.get(rank, self.stopped_at.get(rank))

    def crosses(self, a: int, b: int) -> bool:
        return self.topology.crosses(a, b)

    def spans(self, group: SimGroup) -> bool:
        return self.topology.spans_nodes(group.members)

    # ------------------------------------------------------------------ messages
    def post(self, src: int, dst: int, tag: int, group: Any, tensor: torch.Tensor) -> float:
        """Send ``tensor`` (copied) from ``src``; returns its arrival time."""
        sched = self.sched
        now = sched.now()
        me = sched.current
        crosses = self.crosses(src, dst)
        free_reply = me.id in self._measure_reply and dst in self._measure_reply[me.id]
        measure = me.id in self.measuring or free_reply
        if measure:
            arrival = now
        else:
            nbytes = self.clock.wire_bytes(
                tensor.numel() * tensor.element_size(), is_payload(tensor)
            )
            arrival = self._send(src, dst, crosses, nbytes, now)
        msg = _Message(src, tag, group, tensor.detach().clone(), arrival, next(self._seq), measure)
        self.mailbox[dst].append(msg)
        self.messages += 1
        for task, g, t, s in self.receivers[dst]:
            if g is group and t == tag and s in (None, src):
                sched.wake(task, arrival)
        return arrival

    def _send(self, src: int, dst: int, crosses: bool, nbytes: float, now: float) -> float:
        """Queue a message on its links; return its arrival. Within a node: the sender's
        intra-node link (latency + bytes / bandwidth). Across nodes: the sender node's NIC
        egress, then the receiver node's ingress (:meth:`ClockModel.nic_send`)."""
        if not crosses:
            key = (src, False)
            start = max(now, self.link_free.get(key, 0.0))
            arrival = start + self.clock.p2p_s(nbytes, False)
            self.link_free[key] = arrival
            return arrival
        out = ("out", self.topology.node_of[src])
        into = ("in", self.topology.node_of[dst])
        self.node_nic_bytes[out[1]] += nbytes
        self.node_nic_bytes[into[1]] += nbytes
        start = max(now, self.link_free.get(out, 0.0))
        nic_send = getattr(self.clock, "nic_send", None)
        if nic_send is None:  # a clock without a NIC model (a test's): the sender's queue only
            self.link_free[out] = arrival = start + self.clock.p2p_s(nbytes, True)
            return arrival
        egress_free, arrival = nic_send(start, self.link_free.get(into, 0.0), nbytes)
        self.link_free[out], self.link_free[into] = egress_free, arrival
        return arrival

    def _links(self, members: list[int], spans: bool) -> list[tuple[Any, Any]]:
        """The links a collective occupies: its nodes' NICs (both ways) when it spans nodes,
        else its members' intra-node links."""
        if not spans:
            return [(r, False) for r in members]
        nodes = sorted({self.topology.node_of[r] for r in members})
        return [(d, n) for n in nodes for d in ("out", "in")]

    def ranks_per_node(self, members: list[int]) -> list[int]:
        """How many of ``members`` each of their nodes holds (in node order)."""
        counts: dict[int, int] = {}
        for r in members:
            counts[self.topology.node_of[r]] = counts.get(self.topology.node_of[r], 0) + 1
        return [counts[n] for n in sorted(counts)]

    def take(self, dst: int, src: int | None, tag: int, group: Any, now: float):
        """The earliest message for ``dst`` that matches, if it has arrived by ``now``;
        else (None, the earliest arrival of a matching one or inf)."""
        best = None
        for m in self.mailbox[dst]:
            if m.group is group and m.tag == tag and src in (None, m.src):
                if best is None or (m.arrival, m.seq) < (best.arrival, best.seq):
                    best = m
        if best is None:
            return None, math.inf
        if best.arrival > now:
            return None, best.arrival
        self.mailbox[dst].remove(best)
        return best, best.arrival

    # ------------------------------------------------------------------ collectives
    def collective(
        self,
        kind: str,
        group: SimGroup,
        rank: int,
        tensor: torch.Tensor | None,
        src=None,
        step_s: float | None = None,
    ) -> _Collective:
        """``step_s`` (an all-reduce of gradients under ``--network-model nccl``): the caller's
        step just took this long; the all-reduce is DDP's, overlapped with the backward of the
        member that arrived last (:meth:`ClockModel.ddp_end_s`)."""
        index = group.calls.get(rank, 0)
        group.calls[rank] = index + 1
        op = group.ops.get(index)
        if op is None:
            op = group.ops[index] = _Collective(kind, src=src)
        if step_s is not None:
            op.steps[rank] = step_s
        if op.kind != kind:
            raise RuntimeError(
                f"collective mismatch in group {group.name}: rank {rank} called {kind}, "
                f"another member {op.kind}"
            )
        dead = [r for r in group.members if r in self.died_at]
        if dead:
            op.error = f"rank {dead[0]} died at t={self.died_at[dead[0]]:.3f}s"
        op.arrivals[rank] = (self.sched.now(), tensor)
        if len(op.arrivals) == group.size and op.error is None:
            self._complete(group, index, op)
        return op

    def _complete(self, group: SimGroup, index: int, op: _Collective) -> None:
        members = group.members
        last = max(t for t, _ in op.arrivals.values())
        spans = self.spans(group)
        keys = self._links(members, spans)
        free = max([0.0] + [self.link_free.get(k, 0.0) for k in keys])
        start = max(last, free)
        if op.kind == "all_reduce":
            tensors = [op.arrivals[r][1] for r in members]
            total = tensors[0].detach().clone()
            for t in tensors[1:]:
                total += t
            for t in tensors:
                t.copy_(total)
            nbytes = self._wire(tensors[0])
            per_node = self.ranks_per_node(members)
            if len(op.steps) == group.size:  # DDP: buckets overlapped with the last backward
                latest = max(members, key=lambda r: op.arrivals[r][0])  # first of ties
                step = op.steps[latest]
                start = last - step  # that member's step began here
                cost = self.clock.ddp_end_s(step, nbytes, per_node, free - start)
            elif hasattr(self.clock, "group_allreduce_s"):
                cost = self.clock.group_allreduce_s(nbytes, per_node)
            else:  # a clock without the group model (a test's): the flat ring
                cost = self.clock.allreduce_s(nbytes, group.size, spans)
            self._count_ring(members, spans, 2 * (group.size - 1) / group.size * nbytes)
        elif op.kind == "all_gather":
            output = torch.cat([op.arrivals[r][1][0].reshape(-1) for r in members])
            for r in members:
                op.arrivals[r][1][1].view(-1).copy_(output)
            # A quantised payload stands for the model's values: scaled like a floating one.
            # A ring all-gather moves (n − 1)/n of the n pieces, an all-reduce's bandwidth
            # on half of them (its 2(n − 1) latencies overstate the gather's n − 1).
            piece = op.arrivals[members[0]][1][0]
            nbytes = self.clock.wire_bytes(piece.numel() * piece.element_size(), True)
            cost = self.clock.allreduce_s(nbytes * group.size / 2, group.size, spans)
            self._count_ring(members, spans, (group.size - 1) * nbytes)
        elif op.kind == "all_to_all":
            cost = self._all_to_all(members, op, spans)
        elif op.kind == "broadcast":
            source = op.arrivals[op.src][1]
            for r in members:
                if r != op.src:
                    op.arrivals[r][1].copy_(source)
            cost = self.clock.broadcast_s(self._wire(source), group.size, spans)
            self._count_chain(members, op.src, spans, self._wire(source))
        else:  # barrier
            cost = self.clock.allreduce_s(0, group.size, spans)
        op.end = start + cost
        for k in keys:
            self.link_free[k] = op.end
        self.collectives += 1
        for t in op.waiters:
            self.sched.wake(t, op.end)
        del group.ops[index]

    def _count_ring(self, members: list[int], spans: bool, per_link: float) -> None:
        """A ring over ``members`` with each node's members adjacent (as
        :class:`~cloudburst.comm.link.LinkEmulator` charges it): when it spans nodes, every
        node's NIC carries the ring's ``per_link`` bytes out and as many in."""
        if spans:
            for node in {self.topology.node_of[r] for r in members}:
                self.node_nic_bytes[node] += 2 * per_link

    def _count_chain(self, members: list[int], src: int, spans: bool, nbytes: float) -> None:
        """A broadcast as a chain of the nodes from the source's (NCCL's pipelined
        broadcast): every node but the last sends ``nbytes``, every node but the source's
        receives them."""
        if not spans:
            return
        first = self.topology.node_of[src]
        others = sorted({self.topology.node_of[r] for r in members} - {first})
        for node in [first, *others][:-1]:
            self.node_nic_bytes[node] += nbytes
        for node in others:
            self.node_nic_bytes[node] += nbytes

    def _all_to_all(self, members: list[int], op: _Collective, spans: bool) -> float:
        """Deliver an all-to-all (member s's piece i to member i's piece s) and return its
        cost: the busiest member's bytes to the others (a payload, scaled as one). Vectorised
        over the pieces: W² of them at W = 256 would otherwise dominate the simulation."""
        args = [op.arrivals[r][1] for r in members]
        splits = torch.tensor([a[2] for a in args], dtype=torch.int64)  # [sender, receiver]
        expects = torch.tensor([a[3] for a in args], dtype=torch.int64)  # [receiver, sender]
        sizes = torch.tensor([a[0].numel() for a in args], dtype=torch.int64)
        if splits.shape != (len(members), len(members)) or not torch.equal(splits.sum(1), sizes):
            raise RuntimeError("all-to-all: a member's input splits do not fit its tensor")
        if not torch.equal(splits.t(), expects):
            raise RuntimeError("all-to-all: what a member sends is not what its peer expects")
        flat = torch.cat([a[0].reshape(-1) for a in args])
        base = torch.cumsum(sizes, 0) - sizes
        starts = base[:, None] + torch.cumsum(splits, 1) - splits  # where piece (s, i) begins
        for i, (_, output, _, _) in enumerate(args):
            lengths, first = splits[:, i], starts[:, i]
            total = int(lengths.sum())
            offsets = torch.cumsum(lengths, 0) - lengths
            index = torch.repeat_interleave(first - offsets, lengths) + torch.arange(total)
            output.view(-1).copy_(flat[index])
        element = args[0][0].element_size()
        sent = (splits.sum(1) - splits.diagonal()).tolist()
        if spans:  # each piece between nodes: out of its sender's NIC, into its receiver's
            node = [self.topology.node_of[r] for r in members]
            for s, row in enumerate(splits.tolist()):
                for i, n in enumerate(row):
                    if n and node[s] != node[i]:
                        nbytes = self._wire_n(n * element, args[s][0])
                        self.node_nic_bytes[node[s]] += nbytes
                        self.node_nic_bytes[node[i]] += nbytes
        busiest = max(self._wire_n(n * element, args[k][0]) for k, n in enumerate(sent))
        return self.clock.all_to_all_s(busiest, len(members), spans)

    def _wire_n(self, nbytes: int, tensor: torch.Tensor) -> float:
        return self.clock.wire_bytes(nbytes, is_payload(tensor))

    def _wire(self, tensor: torch.Tensor) -> float:
        return self.clock.wire_bytes(tensor.numel() * tensor.element_size(), is_payload(tensor))

    def wait_collective(self, op: _Collective, what: str) -> None:
        sched = self.sched
        me = sched.current
        deadline = me.clock + self.timeout_s
        while op.end is None and op.error is None:
            op.waiters.append(me)
            value = sched.block(what, deadline)
            if me in op.waiters:
                op.waiters.remove(me)
            if value is TIMEOUT and op.end is None and op.error is None:
                raise RuntimeError(
                    f"{what} timed out after {self.timeout_s:g} virtual s (comm_timeout_s)"
                    f"{_deadlock(sched)}"
                )
        if op.error is not None and op.end is None:
            raise PeerDied(f"{what} failed: {op.error}")
        if op.end > me.clock:
            sched.advance(op.end - me.clock)
