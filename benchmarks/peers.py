"""Peers run through cloudburst's own training loop, as registered strategies.

``torch_hierarchical`` — PyTorch's two-level blocking scheme, post-local SGD (Lin et al. 2020,
"Don't use large mini-batches, use local SGD"; ``torch.distributed.algorithms``):

- DDP over all workers with ``post_localSGD_hook`` and ``PostLocalSGDState(process_group=None,
  subgroup=<this node's group>, start_localSGD_iter=warm-up steps)``: for the warm-up steps the
  gradients are all-reduced over every worker (plain DDP); afterwards only inside the node.
- ``PeriodicModelAverager(period, warmup_steps=<the same>)``: after each optimizer step from the
  end of the warm-up on, every ``period``-th call averages θ over all workers with one blocking
  fp32 all-reduce (``average_parameters(model.parameters())``).

Why ``PeriodicModelAverager`` and not ``HierarchicalModelAverager``: with the hook's subgroup
all-reduce every step, the replicas of one node are identical after every step, so an
intra-node level of model averaging (what ``HierarchicalModelAverager`` adds) would move bytes
and change nothing; the one level left is the global average, which is what
``PeriodicModelAverager`` does. It is also the pairing torch's own documentation shows.

Both knobs mirror DASO's defaults from the run's config: warm-up = ``daso_warmup_epochs`` epochs
(blocking, every step, like DASO's warm-up), period = ``daso_global_skip`` (B) steps. Unlike
DASO, the average is blocking, fp32, over all W workers, and there is no cool-down. ``finish``
does one more global average so every replica ends with the same θ (as DASO's ``finish`` does).

Synchronous everywhere (nothing is stale); a dead worker makes the next collective raise and
the job stops, as for ``sync``.

The emulated inter-node link (``cloudburst.comm.link``) is applied to this peer's traffic that
crosses nodes exactly as to cloudburst's: a global gradient all-reduce reserves
``link.allreduce_s(bucket_bytes, W)`` when launched and its future completes no earlier than
that (as ``cloudburst.comm.allreduce.counting_allreduce_hook``); a global model average
reserves ``link.allreduce_s(θ_bytes, W)`` from the moment it starts and returns no earlier.
Bytes are counted as ``cloudburst.comm.allreduce.count_collective`` counts them (ring
all-reduce: 2(n-1)/n of the tensor, sent and received; inter-node when the group spans nodes).

Importing this module registers the strategy (``RunConfig(strategy="torch_hierarchical")``).

(No ``from __future__ import annotations``: DDP checks the comm hook's real annotations.)
"""

import datetime
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging import utils as averaging_utils
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from cloudburst.comm.allreduce import (
    charge_unoverlapped_wait,
    count_collective,
    counted_ddp,
    ring_bytes,
)
from cloudburst.comm.flat import flatten_params
from cloudburst.comm.link import LinkEmulator
from cloudburst.comm.p2p import CommStats
from cloudburst.strategies import STRATEGY_CLASSES, Strategy, register_strategy


@dataclass
class CountedPostLocalSGDState:
    """torch's ``PostLocalSGDState`` plus what cloudburst counts and emulates around it."""

    inner: PostLocalSGDState
    stats: CommStats
    link: LinkEmulator | None
    world_size: int
    node_size: int
    spans_nodes: bool  # the global group's ranks are on more than one node
    last_launch: float = 0.0
    global_buckets: int = 0
    local_buckets: int = 0


def counted_post_localSGD_hook(
    state: CountedPostLocalSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """``post_localSGD_hook``, its bytes counted and its global all-reduces on the slow link."""
    tensor = bucket.buffer()
    nbytes = tensor.numel() * tensor.element_size()
    # Decided before the call: torch's hook advances ``iter`` on the iteration's last bucket.
    is_global = state.inner.iter < state.inner.start_localSGD_iter
    if is_global:
        state.global_buckets += 1
        moved = ring_bytes(tensor.numel(), tensor.element_size(), state.world_size)
        count_collective(state.stats, moved, state.spans_nodes)
    else:
        state.local_buckets += 1
        moved = ring_bytes(tensor.numel(), tensor.element_size(), state.node_size)
        count_collective(state.stats, moved, False)
    state.last_launch = time.perf_counter()
    fut = post_localSGD_hook(state.inner, bucket)
    link = state.link
    if not is_global or link is None or not link.active or not state.spans_nodes:
        return fut
    cost = link.allreduce_s(nbytes, state.world_size)
    deadline = link.reserve(cost)
    state.stats.emulated_link_s += cost

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        LinkEmulator.wait_until(deadline)
        return f.value()

    return fut.then(done)


def averaging_due(averager: PeriodicModelAverager) -> bool:
    """Whether ``averager.average_parameters`` will all-reduce on its next call (its own rule)."""
    step, warmup = averager.step, averager.warmup_steps
    return step >= warmup and (step - warmup) % averager.period == 0


class TorchHierarchicalStrategy(Strategy):
    """PyTorch's post-local SGD with periodic global model averaging (see the module doc)."""

    name = "torch_hierarchical"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.steps_per_epoch = 1
        self.total_steps: int | None = None
        self.warmup_steps = 0
        self.period = max(1, self.cfg.daso_global_skip)
        self.averages = 0  # global model averages done (the final one included)
        self.average_log: list[int] = []  # the step after which each average was done

    def configure(self, steps_per_epoch: int, total_steps: int) -> None:
        self.steps_per_epoch = max(1, steps_per_epoch)
        self.total_steps = total_steps
        # DASO's warm-up covers the epochs e < daso_warmup_epochs (its epoch counter is whole).
        warmup_epochs = math.ceil(self.cfg.daso_warmup_epochs)
        self.warmup_steps = min(total_steps, warmup_epochs * self.steps_per_epoch)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.model = model
        ctx = self.ctx
        topology = ctx.topology
        nodes = [topology.ranks_on(n) for n in range(topology.num_nodes)]
        if len({len(r) for r in nodes}) != 1:
            raise RuntimeError(f"torch_hierarchical needs equal nodes, got ranks {nodes}")
        if ctx.num_servers:
            raise RuntimeError("torch_hierarchical runs without parameter servers (--servers 0)")
        # Every rank takes part in creating every node's group.
        self.node_group, _ = dist.new_subgroups_by_enumeration(
            nodes,
            timeout=datetime.timedelta(seconds=self.cfg.comm_timeout_s),
            backend="gloo",
        )
        self.hook_state = CountedPostLocalSGDState(
            inner=PostLocalSGDState(
                process_group=None,
                subgroup=self.node_group,
                start_localSGD_iter=self.warmup_steps,
            ),
            stats=self.stats,
            link=ctx.link,
            world_size=ctx.world_size,
            node_size=len(nodes[0]),
            spans_nodes=topology.num_nodes > 1,
        )
        self.averager = PeriodicModelAverager(
            period=self.period, warmup_steps=self.warmup_steps, process_group=None
        )
        self.ddp = counted_ddp(model, None, ctx.device, self.hook_state, counted_post_localSGD_hook)
        return self.ddp

    def after_backward(self) -> None:
        charge_unoverlapped_wait(self.hook_state)

    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        if averaging_due(self.averager):
            self._global_average(lambda: self.averager.average_parameters(self.model.parameters()))
        else:
            self.averager.average_parameters(self.model.parameters())  # only counts the step

    def _global_average(self, average) -> None:
        """Run ``average`` (a blocking fp32 all-reduce of θ over all W workers), counted, and
        return no earlier than the emulated link could have carried it."""
        numel = sum(p.numel() for p in self.model.parameters() if p.grad is not None)
        world = self.ctx.world_size
        spans = self.hook_state.spans_nodes
        count_collective(self.stats, ring_bytes(numel, 4, world), spans)
        t0 = time.perf_counter()
        average()
        link = self.ctx.link
        if link is not None and link.active and spans:
            cost = link.allreduce_s(numel * 4, world)
            self.stats.emulated_link_s += cost
            link.wait_until(link.reserve(cost, start=t0))
        self.stats.wait_s += time.perf_counter() - t0
        self.averages += 1
        self.average_log.append(self.local_steps)

    def global_params(self) -> tuple[torch.Tensor, int]:
        samples = self.local_steps * self.cfg.batch_size * self.cfg.workers
        return flatten_params(self.model), samples

    def finish(self) -> None:
        # A last global average (outside torch's scheme) so every replica ends with the same θ.
        self._global_average(
            lambda: averaging_utils.average_parameters(iter(list(self.model.parameters())), None)
        )

    def report(self) -> dict[str, Any]:
        r = super().report()
        r.update(
            warmup_steps=self.warmup_steps,
            period=self.period,
            global_averages=self.averages,
            average_log=self.average_log,
            global_grad_buckets=self.hook_state.global_buckets,
            local_grad_buckets=self.hook_state.local_buckets,
            global_grad_steps=self.hook_state.inner.iter,
        )
        return r


if TorchHierarchicalStrategy.name not in STRATEGY_CLASSES:
    register_strategy(TorchHierarchicalStrategy)
