"""The transport: everything cloudburst's communicating code asks of the world outside a rank.

Strategies, the parameter-server loop, gossip's serving task and the training loop reach other
ranks, the clock and background tasks only through a :class:`Transport` (``ctx.comm``), never
through ``torch.distributed``, ``time`` or ``threading`` directly. Two implementations:

- :class:`TorchTransport`, the real one: ``torch.distributed`` (gloo / NCCL), the wall clock,
  OS threads; DDP itself for the data-parallel gradient average.
- :class:`cloudburst.sim.transport.SimTransport`: the virtual cluster, a deterministic
  discrete-event simulation where the tensors are real and the time is modelled.

Groups are the handles the transport made when the job started (``ctx.workers_group``,
``ctx.groups["node"]``, ...; ``None`` is the world): code passes them through and never looks
inside. Ranks are always global ranks. Message *content* (headers, validation, byte counting)
is the business of :mod:`cloudburst.comm.p2p` above this layer, so both transports count alike.
Where the two clusters differ in what a rank may expect, the transport says so as a capability
(``restarts_ranks``, ``breaks_on_peer_death``): nothing outside ``comm/`` and ``sim/`` asks
which cluster it runs on (``tests/unit/test_transport_seam.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn


@runtime_checkable
class Work(Protocol):
    """A started non-blocking operation."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class Task(Protocol):
    """A background task of this rank (gossip's serving task, a shard's serving thread)."""

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...


class DataParallel(Protocol):
    """The synchronous gradient average of a replicated model (sync, DASO's node-local part),
    made by :func:`cloudburst.comm.allreduce.data_parallel` — DDP itself on the real
    transport; a transport with an average of its own (the simulator's) has a
    ``data_parallel(model, group, device, state)`` method that makes it instead:
    ``module`` is what the loop calls; :meth:`after_backward` runs right after ``backward()``
    and leaves every replica's gradients averaged over the group."""

    module: nn.Module

    def after_backward(self) -> None: ...

    def set_sync(self, enabled: bool) -> None:
        """Whether the next backward averages the gradients (DASO's local skips)."""


class Transport(Protocol):
    """What one rank does to communicate, wait and keep time. See the module docstring."""

    #: Whether a rank that dies can come back while the job runs: its agent restarts it
    #: (``--max-restarts``) and it rejoins, or a standby takes its shard over
    #: (``--shard-standby``). False on the virtual cluster, where a dead rank stays dead.
    restarts_ranks: bool
    #: Whether a receive from any member fails at once when one member dies in the middle of
    #: a message (gloo's does), so that the liveness monitor must tell who died. False on the
    #: virtual cluster: a message arrives whole, and a receive fails only at its timeout.
    breaks_on_peer_death: bool

    # ------------------------------------------------------------------ the clock
    def now(self) -> float:
        """Seconds on a monotonic clock (for measuring waits)."""

    def wall(self) -> float:
        """Seconds since the epoch (real), or virtual seconds since the job began."""

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass on this rank's clock."""

    def step_done(self, compute_s: float, min_step_time_s: float, factor: float) -> None:
        """A training step's compute is done (it took ``compute_s`` here): take the time the
        emulated device takes, ``max(compute_s, min_step_time_s) × factor`` (a straggler's
        factor ≥ 1); the simulator charges its modelled step time instead."""

    def measuring(self) -> AbstractContextManager[None]:
        """Traffic inside is a measurement (evaluating the global model): the simulator
        charges it no virtual time; the real transport does nothing special."""

    def stop_self(self, kind: str) -> None:
        """An injected fault: ``"kill"`` this rank (SIGKILL) or ``"stop"`` it (SIGSTOP)."""

    def device_emulator(self, model: nn.Module, min_step_time_s: float, factor: float) -> Any:
        """The emulated device of a worker's ``model`` (``--min-step-time-s``, a straggler's
        ``factor``): a :class:`~cloudburst.comm.device_emulation.DeviceEmulator` sleeping its
        padding in the layers' hooks, or None when there is nothing to pad or the transport
        charges the modelled step time itself (the simulator: :meth:`step_done`)."""

    def apply_done(self, nbytes: int) -> None:
        """A parameter server applied an update of ``nbytes`` (the real apply took its own
        time; the simulator charges the modelled cost)."""

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, dst: int, tag: int, group: Any = None) -> None: ...

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, group: Any = None) -> Work: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, group: Any = None) -> Work: ...

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int, group: Any = None) -> int:
        """Receive into ``tensor`` from ``src`` (None: any member); returns the sender."""

    # ------------------------------------------------------------------ collectives
    def new_group(
        self,
        name: str,
        ranks: list[int],
        timeout_s: float,
        backend: str | None = None,
        every_rank: bool = False,
    ) -> Any:
        """The group of ``ranks`` (global ranks, in that order; operations on it time out
        after ``timeout_s``), called in the same order by each of them, or by every rank of
        the world when ``every_rank`` (non-members get no usable group); ``name`` names it
        where the transport names groups, ``backend`` the real one's (None: the world's)."""

    def group_size(self, group: Any = None) -> int: ...

    def group_rank(self, group: Any = None) -> int:
        """This rank's position in ``group`` (0 .. size − 1, the group's order)."""

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        """Sum ``tensor`` in place over ``group``; a :class:`Work` when ``async_op``."""

    def all_gather(
        self, output: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ):
        """Every member's ``tensor`` (same size on all), concatenated in group order into
        ``output``; a :class:`Work` when ``async_op``. Used for quantised payloads."""

    def all_to_all(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: Any = None,
        async_op: bool = False,
    ):
        """Piece j of ``tensor`` (``input_splits[j]`` elements, in order) goes to member j;
        piece i of ``output`` (``output_splits[i]`` elements) comes from member i. The splits
        must agree across members (what i sends j is what j expects from i). A :class:`Work`
        when ``async_op``; bounded by the group's timeout like every collective. Used by the
        quantised reduce-scatter all-reduce (:mod:`cloudburst.comm.compress`)."""

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None: ...

    def barrier(self, group: Any = None) -> None: ...

    # ------------------------------------------------------------------ tasks
    def spawn(self, target: Callable[[], None], name: str, daemon: bool = True) -> Task:
        """Run ``target`` beside this rank's main task. Every background task of a rank is
        started here (a shard's serving tasks, gossip's, a standby's). ``daemon=False``: the
        process waits for it to end before it exits (a taken-over shard still serving)."""

    # ------------------------------------------------------------------ liveness
    def heartbeat(self, store, rank: int, interval_s: float):
        """Start this rank's heartbeat (an object with ``stop()``)."""

    def liveness_monitor(self, store, ranks: list[int], timeout_s: float):
        """What tells a server which of ``ranks`` are dead (``dead(ranks)``, ``revive(r)``)."""


# ---------------------------------------------------------------------------- the real one
class _MemberGroup:
    """A gloo group made outside torch.distributed's registry (a restarted worker's rejoin
    group): rank i of the group is global rank ``members[i]``."""

    def __init__(self, group: dist.ProcessGroupGloo, members: list[int]):
        self.group, self.members = group, list(members)
        self._index = {r: i for i, r in enumerate(self.members)}

    def local(self, peer: int) -> int:
        try:
            return self._index[peer]
        except KeyError:
            raise ValueError(f"rank {peer} is not a member of this group {self.members}") from None


def member_group(group: dist.ProcessGroupGloo, members: list[int]) -> _MemberGroup:
    """The handle :class:`TorchTransport` takes for an unregistered gloo group."""
    return _MemberGroup(group, members)


class TorchTransport:
    """The real transport: ``torch.distributed``, the wall clock and OS threads."""

    restarts_ranks = True
    breaks_on_peer_death = True

    # ------------------------------------------------------------------ the clock
    def now(self) -> float:
        return time.perf_counter()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def step_done(self, compute_s: float, min_step_time_s: float, factor: float) -> None:
        target_s = max(compute_s, min_step_time_s) * factor
        if target_s > compute_s:
            time.sleep(target_s - compute_s)

    def device_emulator(self, model, min_step_time_s, factor):
        if min_step_time_s <= 0 and factor <= 1:
            return None
        from cloudburst.comm.device_emulation import DeviceEmulator

        return DeviceEmulator(model, min_step_time_s, factor, self.sleep, self.now)

    def apply_done(self, nbytes: int) -> None:
        pass

    def measuring(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def stop_self(self, kind: str) -> None:
        from cloudburst.config.faults import signal_self

        signal_self(kind)

    # ------------------------------------------------------------------ groups
    def new_group(self, name, ranks, timeout_s, backend=None, every_rank=False):
        # Groups of some ranks only are synchronised among their members (their name hashed
        # from the ranks); those every rank makes are numbered in creation order (two groups
        # of the same ranks, gossip's pair, need that).
        return dist.new_group(
            list(ranks),
            timeout=datetime.timedelta(seconds=timeout_s),
            backend=backend,
            use_local_synchronization=not every_rank,
        )

    # ------------------------------------------------------------------ point to point
    def isend(self, tensor, dst, tag, group=None):
        if isinstance(group, _MemberGroup):
            return group.group.send([tensor], group.local(dst), tag)
        return dist.isend(tensor, dst, group=group, tag=tag)

    def irecv(self, tensor, src, tag, group=None):
        if isinstance(group, _MemberGroup):
            return group.group.recv([tensor], group.local(src), tag)
        return dist.irecv(tensor, src=src, group=group, tag=tag)

    def send(self, tensor, dst, tag, group=None) -> None:
        if isinstance(group, _MemberGroup):
            self.isend(tensor, dst, tag, group).wait()
        else:
            dist.send(tensor, dst, group=group, tag=tag)

    def recv(self, tensor, src, tag, group=None) -> int:
        if not isinstance(group, _MemberGroup):
            return dist.recv(tensor, src=src, group=group, tag=tag)
        if src is not None:
            self.irecv(tensor, src, tag, group).wait()
            return src
        work = group.group.recv_anysource([tensor], tag)
        work.wait()
        return group.members[work._source_rank()]

    # ------------------------------------------------------------------ collectives
    def group_size(self, group=None) -> int:
        return dist.get_world_size(group)

    def all_reduce(self, tensor, group=None, async_op=False):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    def group_rank(self, group=None) -> int:
        if isinstance(group, _MemberGroup):
            return group.group.rank()
        return dist.get_rank(group)

    def all_gather(self, output, tensor, group=None, async_op=False):
        return dist.all_gather_single(output, tensor, group=group, async_op=async_op)

    def all_to_all(self, output, tensor, output_splits, input_splits, group=None, async_op=False):
        # torch.distributed's all_to_all_single: gloo (CPU, CUDA through the host) and NCCL,
        # within the process group's timeout.
        return dist.all_to_all_single(
            output,
            tensor,
            output_split_sizes=list(output_splits),
            input_split_sizes=list(input_splits),
            group=group,
            async_op=async_op,
        )

    def broadcast(self, tensor, src, group=None) -> None:
        dist.broadcast(tensor, src=src, group=group)

    def barrier(self, group=None) -> None:
        dist.barrier(group=group)

    # ------------------------------------------------------------------ tasks
    def spawn(self, target, name, daemon=True) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=daemon)
        thread.start()
        return thread

    # ------------------------------------------------------------------ liveness
    def heartbeat(self, store, rank, interval_s):
        from cloudburst.comm.liveness import Heartbeat

        return Heartbeat(store, rank, interval_s).start()

    def liveness_monitor(self, store, ranks, timeout_s):
        from cloudburst.comm.liveness import LivenessMonitor

        return LivenessMonitor(store, ranks, timeout_s)


#: The real transport, for code used outside a job's Context (tests, benchmarks, the API).
REAL = TorchTransport()


def group_members(group: Any) -> tuple[str, tuple[int, ...]]:
    """(name, global ranks) of a torch.distributed process group (None: the world): what
    names a collective's group the same way on every member (the emulated link's
    ``LinkEmulator.book_collective``)."""
    pg = dist.group.WORLD if group is None else group
    return str(getattr(pg, "group_name", "")), tuple(dist.get_process_group_ranks(pg))
