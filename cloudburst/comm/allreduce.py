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

from cloudburst.comm.p2p import CommStats


@dataclass
class AllreduceHookState:
    group: dist.ProcessGroup | None
    stats: CommStats
    last_launch: float = 0.0


def counting_allreduce_hook(
    state: AllreduceHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer()
    world = dist.get_world_size(state.group)
    moved = int(2 * (world - 1) / world * tensor.numel() * tensor.element_size())
    state.stats.bytes_sent += moved
    state.stats.bytes_received += moved
    state.last_launch = time.perf_counter()
    tensor.div_(world)
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
