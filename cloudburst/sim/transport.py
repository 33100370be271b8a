"""The simulated transport: the :class:`~cloudburst.comm.transport.Transport` of a virtual
cluster. Real tensors move between ranks (the maths is real); time is modelled by a
:class:`~cloudburst.sim.clock.ClockModel` and kept by the :mod:`~cloudburst.sim.scheduler`.

What each operation costs, in virtual time (formulas: docs/simulator.md, "The network model"):

- a training step: the clock model's step time (× straggler / slow-fault factor × jitter);
- a point-to-point message: it holds the sender's intra-node link, or across nodes its node's
  NIC egress and then the receiver node's ingress (incast), for latency + bytes ÷ bandwidth; a
  blocking send returns at its arrival, a non-blocking one at once;
- a collective: it starts when the last member has called it and every link it occupies is
  free, and costs its ring / tree (or, under ``--network-model nccl``, hierarchical and DDP's
  overlapped buckets) time on the slowest link it spans; a non-blocking one overlaps with its
  caller's work until ``wait()``;
- a server applying an update: bytes ÷ the modelled memory bandwidth;
- evaluating the global model (inside :meth:`SimTransport.measuring`): nothing.

Payloads (:func:`cloudburst.sim.clock.is_payload`) are charged as ``modelled_params /
actual_params`` times their bytes, so a small model's training drives a stand-in's traffic.
Nothing restarts and a message arrives whole (``restarts_ranks``, ``breaks_on_peer_death``:
False). How this differs from the real run's link emulator: docs/simulator.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from cloudburst.comm.allreduce import count_collective, ring_bytes
from cloudburst.sim.network import (
    PeerDied,
    SimGroup,
    SimNetwork,
    _deadlock,
)
from cloudburst.sim.scheduler import TIMEOUT, Task, TaskKilled


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
        if state.compress in ("int8", "fp8") and state.feedback is None:
            from cloudburst.comm.compress import ErrorFeedback

            # Made here, as the real DDP hook's is (allreduce.compressed_hook), not at the
            # first step: a resumed worker loads its residuals into it before that step.
            state.feedback = ErrorFeedback()

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
        comm = self.comm
        if getattr(
            comm.net.clock, "nccl", False
        ):  # DDP's buckets, overlapped with this step's backward
            op = comm.net.collective(
                "all_reduce", self.group, comm.rank, flat, step_s=comm.last_step_s
            )
            comm.net.wait_collective(op, f"DDP all-reduce over {self.group.name}")
        else:
            comm.all_reduce(flat, self.group)
        self.state.stats.wait_s += self.comm.now() - t0
        flat.div_(n)

    def _compressed_mean(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        """``--compress`` bf16 / int8 / fp8: the same maths as the real DDP hooks, on the one
        flat gradient (one error-feedback residual, not one per DDP bucket), counted and
        charged as the compressed bytes. PowerSGD runs inside DDP only."""
        from cloudburst.comm.compress import compressed_all_reduce_sum

        method = self.state.compress
        if method not in ("bf16", "int8", "fp8"):
            raise ValueError(f"compress: {method!r} is not available on the virtual cluster")
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

    restarts_ranks = False  # a killed rank stays dead: nothing restarts or takes it over
    breaks_on_peer_death = False  # messages arrive whole; a receive fails at its timeout

    def __init__(self, net: SimNetwork, rank: int, worker_index: int | None, factor: float = 1.0):
        """``factor``: this worker's slowness (straggler × slow fault), as the loop's."""
        self.net, self.rank, self.worker_index = net, rank, worker_index
        self.sched = net.sched
        self.factor = factor
        self.steps = 0  # training steps charged (the jitter's index)
        self._charged = False  # this step's compute was charged before its all-reduce
        self.last_step_s = 0.0  # the last step's compute (DDP's overlap under nccl)

    # ------------------------------------------------------------------ the clock
    def now(self) -> float:
        return self.sched.now()

    def wall(self) -> float:
        return self.sched.now()

    def sleep(self, seconds: float) -> None:
        self.sched.advance(max(0.0, seconds))

    def device_emulator(self, model, min_step_time_s, factor) -> None:
        return None  # the modelled step time is charged in step_done

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
        self.last_step_s = dt
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
    def new_group(self, name, ranks, timeout_s, backend=None, every_rank=False) -> SimGroup:
        return self.net.new_group(name, ranks)  # the network's timeout is comm_timeout_s

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

    def group_rank(self, group=None) -> int:
        return (group or self.net.world).members.index(self.rank)

    def all_to_all(self, output, tensor, output_splits, input_splits, group=None, async_op=False):
        group = group or self.net.world
        args = (tensor, output, list(input_splits), list(output_splits))
        op = self.net.collective("all_to_all", group, self.rank, args)
        work = SimWork(lambda: self.net.wait_collective(op, f"all-to-all over {group.name}"))
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
    def spawn(self, target, name, daemon=True) -> Task:
        # Every task of the virtual cluster ends with the run: none is waited for at exit.
        return self.sched.spawn(target, name, self.rank)

    def heartbeat(self, store, rank, interval_s) -> NullHeartbeat:
        return NullHeartbeat()

    def liveness_monitor(self, store, ranks, timeout_s) -> SimLiveness:
        return SimLiveness(self.net, ranks, timeout_s)
