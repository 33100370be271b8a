"""Gradient all-reduce for DDP, counted: a comm hook equal to DDP's default one.

The hook divides each bucket by the group size and all-reduces it (exactly what
``ddp_comm_hooks.default_hooks.allreduce_hook`` does) and also counts bytes and remembers
when the last bucket was launched, so the loop can measure how long backward() then still
waited for communication (the part of the all-reduce that did not overlap with compute).
Bytes are counted as ring all-reduce moves them: 2(W-1)/W of the bucket, sent and received.

(No ``from __future__ import annotations`` here: DDP checks the hook's real annotations.)
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cloudburst.comm.link import LinkEmulator
from cloudburst.comm.p2p import CommStats


@dataclass
class AllreduceHookState:
    group: dist.ProcessGroup | None
    stats: CommStats
    last_launch: float = 0.0
    spans_nodes: bool = False  # the group's ranks are on more than one node
    link: LinkEmulator | None = None  # delays the all-reduce when it spans nodes


def ring_bytes(numel: int, element_size: int, group_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of the tensor."""
    return int(2 * (group_size - 1) / group_size * numel * element_size)


def count_collective(stats: CommStats, moved: int, spans_nodes: bool) -> None:
    stats.bytes_sent += moved
    stats.bytes_received += moved
    if spans_nodes:
        stats.inter_node_bytes += moved
    else:
        stats.intra_node_bytes += moved


def counting_allreduce_hook(
    state: AllreduceHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer()
    world = dist.get_world_size(state.group)
    count_collective(
        state.stats, ring_bytes(tensor.numel(), tensor.element_size(), world), state.spans_nodes
    )
    state.last_launch = time.perf_counter()
    tensor.div_(world)
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()
    link = state.link
    if link is None or not link.active or not state.spans_nodes:
        return fut.then(lambda f: f.value()[0])
    # The emulated link: this bucket cannot be done before the slow link has carried it
    # (after the buckets before it); backward() waits for every bucket, as on a real wire.
    cost = link.allreduce_s(tensor.numel() * tensor.element_size(), world)
    deadline = link.reserve(cost)
    state.stats.emulated_link_s += cost

    def done(f):
        LinkEmulator.wait_until(deadline)
        return f.value()[0]

    return fut.then(done)


def counted_ddp(model: torch.nn.Module, group, device: torch.device, state, hook=None):
    """``model`` in DDP over ``group`` with a counting comm hook on ``state`` (by default
    :func:`counting_allreduce_hook`; ``hook(state, bucket)`` otherwise): the one place sync,
    DASO's node-local part and the benchmarks' PyTorch peer build their DDP."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
    )
    ddp.register_comm_hook(state, hook or counting_allreduce_hook)
    return ddp


def charge_unoverlapped_wait(state) -> None:
    """Called right after ``backward()``: backward returns only when every bucket's
    all-reduce is done, so the time since the last bucket was launched is communication that
    did not overlap with compute; it is added to ``state.stats.wait_s``."""
    if state.last_launch:
        state.stats.wait_s += time.perf_counter() - state.last_launch
        state.last_launch = 0.0
