"""The simulated transport: the :class:`~cloudburst.comm.transport.Transport` of a virtual
cluster. Real tensors move between ranks (the maths is real); time is modelled by a
:class:`~cloudburst.sim.clock.ClockModel` and kept by the :mod:`~cloudburst.sim.scheduler`.

What each operation costs, in virtual time:

- a training step: the clock model's step time (× straggler / slow-fault factor × jitter);
- a point-to-point message: it occupies the sender's link (intra- or inter-node, one queue
  each) from ``max(now, link free)`` for latency + bytes ÷ bandwidth, and arrives when that
  ends; a blocking send returns then (as the real link emulator holds the sender back), a
  non-blocking one at once;
- a collective: it starts when the last member has called it and every member's link is free,
  and ends after the ring (all-reduce) or tree (broadcast) cost of its bytes on the slowest link
  it spans; a blocking call returns then; a non-blocking one overlaps with whatever its caller
  does until ``wait()``: a wait after k steps of compute costs max(0, cost − k·T);
- a server applying an update: bytes ÷ the modelled memory bandwidth;
- evaluating the global model (inside :meth:`SimTransport.measuring`): nothing.

The stand-in model: floating payloads are charged as ``modelled_params / actual_params`` times
their bytes (headers as they are), so a small model's real training drives a large model's
communication.

Where this differs from the real run's link emulator (:mod:`cloudburst.comm.link`), whose cost
formulas it shares: the emulator adds the modelled time *on top of* the real transfer (over
loopback here), the simulator charges the modelled time alone; the emulator holds back only the
sender's own link, while a simulated collective occupies every member's link until it ends;
and DDP overlaps its bucketed gradient all-reduce with the backward pass, while the simulated
average is one all-reduce after it. benchmarks/results/sim_fidelity.md measures what these
differences amount to.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cloudburst.comm.allreduce import count_collective, ring_bytes
from cloudburst.comm.flat import flatten_params
from cloudburst.comm.link import Topology
from cloudburst.sim.scheduler import TIMEOUT, Scheduler, Task, TaskKilled


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
        # When each rank's egress link is free again: (intra-node, inter-node).
        self.link_free: dict[tuple[int, bool], float] = {}
        self.died_at: dict[int, float] = {}  # killed ranks: their peers' calls fail at once
        self.stopped_at: dict[int, float] = {}  # stopped ranks: their peers' calls time out
        self.groups: list[SimGroup] = [self.world]
        self._seq = itertools.count()
        self.measuring: set[int] = set()  # tasks whose traffic is a free measurement
        self._measure_reply: dict[int, set[int]] = {}  # task id -> peers owed a free reply
        self.messages = 0
        self.collectives = 0

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
                tensor.numel() * tensor.element_size(), tensor.is_floating_point()
            )
            key = (src, crosses)
            start = max(now, self.link_free.get(key, 0.0))
            arrival = start + self.clock.p2p_s(nbytes, crosses)
            self.link_free[key] = arrival
        msg = _Message(src, tag, group, tensor.detach().clone(), arrival, next(self._seq), measure)
        self.mailbox[dst].append(msg)
        self.messages += 1
        for task, g, t, s in self.receivers[dst]:
            if g is group and t == tag and s in (None, src):
                sched.wake(task, arrival)
        return arrival

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
        self, kind: str, group: SimGroup, rank: int, tensor: torch.Tensor | None, src=None
    ) -> _Collective:
        index = group.calls.get(rank, 0)
        group.calls[rank] = index + 1
        op = group.ops.get(index)
        if op is None:
            op = group.ops[index] = _Collective(kind, src=src)
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
        start = max(t for t, _ in op.arrivals.values())
        spans = self.spans(group)
        keys = [(r, spans) for r in members]
        start = max([start] + [self.link_free.get(k, 0.0) for k in keys])
        if op.kind == "all_reduce":
            tensors = [op.arrivals[r][1] for r in members]
            total = tensors[0].detach().clone()
            for t in tensors[1:]:
                total += t
            for t in tensors:
                t.copy_(total)
            nbytes = self._wire(tensors[0])
            cost = self.clock.allreduce_s(nbytes, group.size, spans)
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
        elif op.kind == "broadcast":
            source = op.arrivals[op.src][1]
            for r in members:
                if r != op.src:
                    op.arrivals[r][1].copy_(source)
            cost = self.clock.broadcast_s(self._wire(source), group.size, spans)
        else:  # barrier
            cost = self.clock.allreduce_s(0, group.size, spans)
        op.end = start + cost
        for k in keys:
            self.link_free[k] = op.end
        self.collectives += 1
        for t in op.waiters:
            self.sched.wake(t, op.end)
        del group.ops[index]

    def _wire(self, tensor: torch.Tensor) -> float:
        return self.clock.wire_bytes(
            tensor.numel() * tensor.element_size(), tensor.is_floating_point()
        )

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


# ---------------------------------------------------------------------------- works
class SimWork:
    """A non-blocking send (done at its arrival), receive or collective."""

    def __init__(self, wait_fn):
        self._wait_fn = wait_fn
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            self._wait_fn()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


class SimDataParallel:
    """The gradient average of sync / DASO's node-local part on the virtual cluster: after
    ``backward()`` the gradients, flat, are all-reduced and divided by the group size — the
    arithmetic of DDP's default hook, without its bucketing (the simulated all-reduce does not
    overlap with the backward pass: an upper bound on DDP's cost)."""

    def __init__(self, comm: SimTransport, model: nn.Module, group: SimGroup, state):
        self.comm, self.module, self.group, self.state = comm, model, group, state
        self.sync = True

    def after_backward(self) -> None:
        self.comm.charge_compute()
        if not self.sync:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        n = self.group.size
        if self.state.compress != "none":
            flat = self._compressed_mean(flat, n)
        else:
            self._mean(flat, n)
        offset = 0
        for p in params:
            k = p.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(flat[offset : offset + k].view_as(p))
            offset += k

    def _mean(self, flat: torch.Tensor, n: int) -> None:
        count_collective(
            self.state.stats,
            ring_bytes(flat.numel(), flat.element_size(), n),
            self.state.spans_nodes,
        )
        t0 = self.comm.now()
        self.comm.all_reduce(flat, self.group)
        self.state.stats.wait_s += self.comm.now() - t0
        flat.div_(n)

    def _compressed_mean(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        """``--compress`` bf16 / int8 / fp8: the same maths as the real DDP hooks, on the one
        flat gradient (one error-feedback residual, not one per DDP bucket), counted and
        charged as the compressed bytes. PowerSGD runs inside DDP only."""
        from cloudburst.comm.compress import ErrorFeedback, compressed_all_reduce_sum

        method = self.state.compress
        if method not in ("bf16", "int8", "fp8"):
            raise ValueError(f"compress: {method!r} is not available on the virtual cluster")
        if method != "bf16" and self.state.feedback is None:
            self.state.feedback = ErrorFeedback()
        if method == "bf16":  # as PyTorch's bf16_compress_hook: divide in bf16, then sum
            low = flat.to(torch.bfloat16).div_(n)
            compressed_all_reduce_sum(
                low,
                self.group,
                self.state.stats,
                "none",
                spans_nodes=self.state.spans_nodes,
                comm=self.comm,
            )
            return low.float()
        compressed_all_reduce_sum(
            flat,
            self.group,
            self.state.stats,
            method,
            feedback=self.state.feedback,
            key="grads",
            spans_nodes=self.state.spans_nodes,
            comm=self.comm,
        )
        return flat.div_(n)

    def set_sync(self, enabled: bool) -> None:
        self.sync = enabled


# ---------------------------------------------------------------------------- store, liveness
class SimStore:
    """The job store of the virtual cluster (a dict); waits block in virtual time."""

    def __init__(self, net: SimNetwork):
        self.net = net
        self.data: dict[str, bytes] = {}
        self.waiters: list[Task] = []

    def _changed(self) -> None:
        sched = self.net.sched
        for t in self.waiters:
            sched.wake(t, sched.now())

    def set(self, key: str, value) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)
        self._changed()

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + int(amount)
        self.data[key] = str(value).encode()
        self._changed()
        return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def wait(self, keys: list[str], timeout=None) -> None:
        sched = self.net.sched
        me = sched.current
        seconds = self.net.timeout_s if timeout is None else _seconds(timeout)
        deadline = me.clock + seconds
        while not self.check(keys):
            self.waiters.append(me)
            value = sched.block(f"store keys {keys}", deadline)
            self.waiters.remove(me)
            if value is TIMEOUT and not self.check(keys):
                raise RuntimeError(f"store wait for {keys} timed out ({seconds:g} virtual s)")

    def clone(self) -> SimStore:
        return self


def _seconds(timeout) -> float:
    return timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)


class NullHeartbeat:
    """No heartbeats in the virtual cluster: the network knows who died, and when."""

    def stop(self) -> None:
        pass


class SimLiveness:
    """A server's view of which workers are dead: those killed at least ``timeout_s``
    virtual seconds ago (as missed heartbeats would tell it)."""

    def __init__(self, net: SimNetwork, ranks: list[int], timeout_s: float):
        self.net, self.timeout_s = net, timeout_s

    def dead(self, ranks) -> set[int]:
        now = self.net.sched.now()
        silent = {r: self.net.silent_since(r) for r in ranks}
        return {r for r, t in silent.items() if t is not None and now - t >= self.timeout_s}

    def revive(self, rank: int) -> None:
        pass


# ---------------------------------------------------------------------------- the transport
class SimTransport:
    """One rank's :class:`~cloudburst.comm.transport.Transport` in the virtual cluster."""

    simulated = True

    def __init__(self, net: SimNetwork, rank: int, worker_index: int | None, factor: float = 1.0):
        """``factor``: this worker's slowness (straggler × slow fault), as the loop's."""
        self.net, self.rank, self.worker_index = net, rank, worker_index
        self.sched = net.sched
        self.factor = factor
        self.steps = 0  # training steps charged (the jitter's index)
        self.compute_s = 0.0
        self._charged = False  # this step's compute was charged before its all-reduce

    # ------------------------------------------------------------------ the clock
    def now(self) -> float:
        return self.sched.now()

    def wall(self) -> float:
        return self.sched.now()

    def sleep(self, seconds: float) -> None:
        self.sched.advance(max(0.0, seconds))

    def step_done(self, compute_s: float, min_step_time_s: float, factor: float) -> None:
        if self._charged:  # at the gradient all-reduce, where the compute ended
            self._charged = False
            return
        self._charge(factor)

    def charge_compute(self) -> None:
        """The step's forward and backward are done (before a gradient all-reduce): charge
        them now, so the all-reduce starts when they end; the loop's step_done is then free."""
        if not self._charged:
            self._charge(self.factor)
            self._charged = True

    def _charge(self, factor: float) -> None:
        self.steps += 1
        dt = self.net.clock.step_s(self.worker_index or 0, self.steps, factor)
        self.compute_s += dt
        self.sched.advance(dt)

    def apply_done(self, nbytes: int) -> None:
        self.sched.advance(self.net.clock.apply_s(self.net.clock.wire_bytes(nbytes, True)))

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Traffic inside is a measurement (evaluating the global model): delivered at once,
        its replies too, on no link's time; this task's clock is where it was afterwards."""
        me = self.sched.current
        saved = me.clock
        self.net.measuring.add(me.id)
        try:
            yield
        finally:
            self.net.measuring.discard(me.id)
            me.clock = saved

    def stop_self(self, kind: str) -> None:
        """A ``kill`` fault: this rank dies now; ``stop``: it stops forever (SIGSTOP)."""
        if kind == "kill":
            self.net.kill(self.rank)
            raise TaskKilled
        # Its peers are not told: their calls to it wait until their timeouts, as with SIGSTOP.
        self.net.stopped_at.setdefault(self.rank, self.now())
        raise TaskKilled

    # ------------------------------------------------------------------ point to point
    def send(self, tensor, dst, tag, group=None) -> None:
        arrival = self._post(tensor, dst, tag, group)
        if arrival > self.now():
            self.sched.advance(arrival - self.now())

    def isend(self, tensor, dst, tag, group=None) -> SimWork:
        arrival = self._post(tensor, dst, tag, group)

        def wait() -> None:
            if arrival > self.now():
                self.sched.advance(arrival - self.now())

        return SimWork(wait)

    def _post(self, tensor, dst, tag, group) -> float:
        if dst in self.net.died_at:
            raise PeerDied(f"send to rank {dst}, which died at t={self.net.died_at[dst]:.3f}s")
        return self.net.post(self.rank, dst, tag, group, tensor)

    def irecv(self, tensor, src, tag, group=None) -> SimWork:
        return SimWork(lambda: self.recv(tensor, src, tag, group))

    def recv(self, tensor, src, tag, group=None) -> int:
        net, sched = self.net, self.sched
        me = sched.current
        net._measure_reply.pop(me.id, None)  # a measurement's replies were sent
        deadline = me.clock + net.timeout_s
        while True:
            msg, arrival = net.take(self.rank, src, tag, group, me.clock)
            if msg is not None:
                break
            if src is not None and src in net.died_at:
                raise PeerDied(f"receive from rank {src}, which died at t={net.died_at[src]:.3f}s")
            entry = (me, group, tag, src)
            net.receivers[self.rank].append(entry)
            sender = src if src is not None else "any rank"
            # Due at the earliest pending arrival (an earlier message may still come).
            value = sched.block(f"a message (tag {tag}) from {sender}", min(deadline, arrival))
            net.receivers[self.rank].remove(entry)
            if value is TIMEOUT and me.clock >= deadline:
                msg, _ = net.take(self.rank, src, tag, group, me.clock)
                if msg is not None:
                    break
                raise RuntimeError(
                    f"rank {self.rank}: receive timed out after {net.timeout_s:g} virtual s "
                    f"(comm_timeout_s){_deadlock(sched)}"
                )
        n = min(msg.data.numel(), tensor.numel())
        tensor.view(-1)[:n].copy_(msg.data.view(-1)[:n])
        if msg.measure:
            net._measure_reply.setdefault(me.id, set()).add(msg.src)
        return msg.src

    # ------------------------------------------------------------------ collectives
    def group_size(self, group=None) -> int:
        return (group or self.net.world).size

    def all_reduce(self, tensor, group=None, async_op=False):
        group = group or self.net.world
        op = self.net.collective("all_reduce", group, self.rank, tensor)
        work = SimWork(lambda: self.net.wait_collective(op, f"all-reduce over {group.name}"))
        if async_op:
            return work
        work.wait()
        return None

    def all_gather(self, output, tensor, group=None, async_op=False):
        group = group or self.net.world
        op = self.net.collective("all_gather", group, self.rank, (tensor, output))
        work = SimWork(lambda: self.net.wait_collective(op, f"all-gather over {group.name}"))
        if async_op:
            return work
        work.wait()
        return None

    def broadcast(self, tensor, src, group=None) -> None:
        group = group or self.net.world
        op = self.net.collective("broadcast", group, self.rank, tensor, src=src)
        self.net.wait_collective(op, f"broadcast over {group.name}")

    def barrier(self, group=None) -> None:
        group = group or self.net.world
        op = self.net.collective("barrier", group, self.rank, None)
        self.net.wait_collective(op, f"barrier of {group.name}")

    def data_parallel(self, model, group, device, state) -> SimDataParallel:
        return SimDataParallel(self, model, group or self.net.world, state)

    # ------------------------------------------------------------------ tasks, liveness
    def spawn(self, target, name) -> Task:
        return self.sched.spawn(target, name, self.rank)

    def heartbeat(self, store, rank, interval_s) -> NullHeartbeat:
        return NullHeartbeat()

    def liveness_monitor(self, store, ranks, timeout_s) -> SimLiveness:
        return SimLiveness(self.net, ranks, timeout_s)


def replica_numel(model: nn.Module) -> int:
    return flatten_params(model).numel()
