"""PyTorch's own local-SGD schemes as cloudburst strategies, run through cloudburst's loop (same
data, evaluation, counters and emulated link) so that only the averaging mechanism differs:
the peers ``daso.py`` and ``local_sgd.py`` time against.

- ``torch_post_local``: DDP with ``post_localSGD_hook`` (all-reduce over every worker for the
  warm-up, then inside the node) and ``PeriodicModelAverager(period=B)`` (Lin et al. 2020);
- ``torch_hierarchical``: the same warm-up, then ``HierarchicalModelAverager({1: node, B: W})``;
- ``torch_periodic``: ``PeriodicModelAverager(period=H, warmup_steps=H - 1)``, local_sgd's
  schedule.

Warm-up = ``daso_warmup_epochs``, B = ``daso_global_skip``; ``finish`` averages once more.
Averages spanning nodes are counted and charged to the emulated link as cloudburst's own.

    python benchmarks/peers.py torch_post_local <cloudburst train flags>   # one job

(No ``from __future__ import annotations``: DDP checks the comm hook's real annotations.)
"""

import dataclasses
import datetime
import math
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as hier
from torch.distributed.algorithms.model_averaging import utils as averaging_utils
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from cloudburst.comm.allreduce import charge_unoverlapped_wait, counted_ddp
from cloudburst.comm.link import LinkEmulator
from cloudburst.comm.stats import CommStats, count_collective, ring_bytes
from cloudburst.strategies import STRATEGY_CLASSES, Strategy, register_strategy


@dataclasses.dataclass
class HookState:
    """torch's ``PostLocalSGDState`` plus what cloudburst counts and emulates around it."""

    inner: post_local.PostLocalSGDState
    stats: CommStats
    link: LinkEmulator | None
    world_size: int
    local_size: int  # ranks in the post-warm-up subgroup
    spans_nodes: bool
    last_launch: float = 0.0


def counted_post_localSGD_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """``post_localSGD_hook``, its bytes counted and its global all-reduces on the slow link."""
    tensor = bucket.buffer()
    is_global = state.inner.iter < state.inner.start_localSGD_iter  # the hook advances iter
    group = state.world_size if is_global else state.local_size
    moved = ring_bytes(tensor.numel(), tensor.element_size(), group)
    count_collective(state.stats, moved, is_global and state.spans_nodes)
    state.last_launch = time.perf_counter()
    fut = post_local.post_localSGD_hook(state.inner, bucket)
    link = state.link
    if not is_global or link is None or not link.active or not state.spans_nodes:
        return fut
    cost = link.allreduce_s(tensor.numel() * tensor.element_size(), state.world_size)
    deadline = link.reserve(cost)
    state.stats.emulated_link_s += cost

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        LinkEmulator.wait_until(deadline)
        return f.value()

    return fut.then(done)


class TorchPeerStrategy(Strategy):
    """Shared by the three peers: averaging through a torch averager, counted and timed."""

    lockstep = True
    warmup_steps = 0
    averages = 0  # global averages (the final one included)

    def configure(self, steps_per_epoch: int, total_steps: int) -> None:
        # DASO's warm-up covers the epochs e < daso_warmup_epochs (its epoch counter is whole).
        epochs = math.ceil(self.cfg.daso.warmup_epochs)
        self.warmup_steps = min(total_steps, epochs * max(1, steps_per_epoch))

    def _post_local_ddp(self, model: nn.Module, subgroups: list[list[int]]) -> nn.Module:
        """DDP whose gradients go over every worker for the warm-up, then over ``subgroups``."""
        topo, ctx = self.ctx.topology, self.ctx
        self.model, self.global_period = model, max(1, self.cfg.daso.global_skip)
        if ctx.num_servers or topo is None:
            raise RuntimeError(f"{self.name} needs --servers 0 and --nodes")
        timeout = datetime.timedelta(seconds=self.cfg.faults.comm_timeout_s)
        group = dist.new_subgroups_by_enumeration(subgroups, timeout=timeout, backend="gloo")[0]
        inner = post_local.PostLocalSGDState(None, group, self.warmup_steps)
        self.hook_state = HookState(inner, self.stats, ctx.link, ctx.world_size,
                                    len(subgroups[0]), spans_nodes=topo.num_nodes > 1)  # fmt: skip
        return counted_ddp(model, None, ctx.device, self.hook_state, counted_post_localSGD_hook)

    def after_backward(self) -> None:
        if hasattr(self, "hook_state"):
            charge_unoverlapped_wait(self.hook_state)

    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        self._average(self.cfg.job.workers > 1 and self.global_due(self.averager.step))

    def global_due(self, call: int) -> bool:
        """Whether the averager's ``call``-th call (0-based) averages over all workers."""
        raise NotImplementedError

    def _average(self, is_global: bool, group=None) -> None:
        """The averager's call (or, with ``group``, one average over it); a global one counted
        as a fp32 ring over W and returned no earlier than the emulated link carries it."""
        params = list(self.model.parameters())
        if not is_global:
            self.averager.average_parameters(params)  # counts the step; maybe a node average
            return
        numel = sum(p.numel() for p in params)
        spans = self.ctx.topology is not None and self.ctx.topology.num_nodes > 1
        count_collective(self.stats, ring_bytes(numel, 4, self.cfg.job.workers), spans)
        t0 = time.perf_counter()
        if group is None:
            self.averager.average_parameters(params)
        else:
            averaging_utils.average_parameters(iter(params), group)
        link = self.ctx.link
        if link is not None and link.active and spans:
            cost = link.allreduce_s(numel * 4, self.cfg.job.workers)
            self.stats.emulated_link_s += cost
            link.wait_until(link.reserve(cost, start=t0))
        self.stats.wait_s += time.perf_counter() - t0
        self.averages += 1

    def global_params(self) -> tuple[torch.Tensor, int]:
        return self.replica_params()

    def finish(self) -> None:
        if self.cfg.job.workers > 1:  # one more average, so every replica ends on one θ
            self._average(True, group=self.ctx.workers_group)

    def report(self) -> dict[str, Any]:
        return {**super().report(), "warmup_steps": self.warmup_steps, "averages": self.averages}


class TorchPostLocalStrategy(TorchPeerStrategy):
    name = "torch_post_local"

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        topo = self.ctx.topology
        ddp = self._post_local_ddp(model, [topo.ranks_on(n) for n in range(topo.num_nodes)])
        self.averager = PeriodicModelAverager(self.global_period, self.warmup_steps)
        return ddp

    def global_due(self, call: int) -> bool:  # torch's own rule
        return call >= self.warmup_steps and (call - self.warmup_steps) % self.global_period == 0


class TorchHierarchicalStrategy(TorchPeerStrategy):
    name = "torch_hierarchical"

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        topo = self.ctx.topology
        node = len(topo.ranks_on(0))
        if topo.ranks_on(0) != list(range(node)):
            raise RuntimeError("torch_hierarchical needs consecutive ranks per node")
        ddp = self._post_local_ddp(model, [[r] for r in range(self.cfg.job.workers)])  # local steps
        periods = OrderedDict([(1, node), (self.global_period, self.cfg.job.workers)])
        self.averager = hier.HierarchicalModelAverager(periods, self.warmup_steps)
        self.node_bytes = ring_bytes(sum(p.numel() for p in model.parameters()), 4, node)
        return ddp

    def global_due(self, call: int) -> bool:  # torch's own rule (the largest period wins)
        return call >= self.warmup_steps and call % self.global_period == 0

    def after_step(self, samples: int) -> None:
        call = self.averager.step
        if call >= self.warmup_steps and not self.global_due(call):
            count_collective(self.stats, self.node_bytes, False)  # θ averaged inside the node
        super().after_step(samples)


class TorchPeriodicStrategy(TorchPeerStrategy):
    name = "torch_periodic"

    def configure(self, steps_per_epoch: int, total_steps: int) -> None:
        pass  # no warm-up: cloudburst's local_sgd schedule

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        if self.cfg.local_sgd.warmup_steps:
            raise ValueError("torch_periodic has no warm-up: leave --local-sgd-warmup-steps at 0")
        self.model = model
        # Call c (0-based) averages when c >= H - 1 and (c - H + 1) % H == 0: after steps H, 2H.
        self.averager = PeriodicModelAverager(
            self.cfg.local_sgd.period, self.cfg.local_sgd.period - 1
        )
        return model

    def global_due(self, call: int) -> bool:
        return (call + 1) % self.cfg.local_sgd.period == 0

    def finish(self) -> None:
        if self.local_steps % self.cfg.local_sgd.period:  # as local_sgd: average what is left
            super().finish()


PEERS = {c.name: c for c in (TorchPostLocalStrategy, TorchHierarchicalStrategy,
                              TorchPeriodicStrategy)}  # fmt: skip
for _name, _cls in PEERS.items():
    if _name not in STRATEGY_CLASSES:
        register_strategy(_cls)


def run_arm(arm, seed: int, out_dir: Path):
    """``harness.run_train`` of an arm; a peer's (``--strategy torch_…``) through this file."""
    import harness

    argv = list(arm.argv)
    at = argv.index("--strategy") + 1 if "--strategy" in argv else 0
    if not at or argv[at] not in PEERS:
        return harness.run_train(arm, seed, out_dir)
    peer, argv[at] = argv[at], "sync"  # parsed as sync, then replaced (main)
    command = (sys.executable, __file__, peer)
    return harness.run_train(harness.Arm(arm.name, argv), seed, out_dir, command=command)


def main(argv: list[str]) -> int:
    """Run one job of a peer strategy: ``STRATEGY`` then ``cloudburst train``'s flags (the
    ranks are forked from a server that imports this file as ``__mp_main__``, so they know it)."""
    from cloudburst.cli import build_config, build_parser, launch_and_report
    from cloudburst.config import RunConfig
    from cloudburst.forkserver import start_forkserver, stop_forkserver

    strategy, *flags = argv
    if strategy not in STRATEGY_CLASSES:
        raise SystemExit(f"peers.py: unknown strategy {strategy!r}; use one of {STRATEGY_CLASSES}")
    start_forkserver()
    try:
        cfg = build_config(build_parser().parse_args(["train", *flags]))
        return launch_and_report(RunConfig.from_dict({**cfg.to_dict(), "strategy": strategy}))
    finally:
        stop_forkserver()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
