"""``sync``: synchronous data parallelism with ``DistributedDataParallel`` itself.

Algorithm: every step each worker computes the gradient of its mini-batch; DDP averages the
gradients across workers with all-reduce (bucketed, overlapped with backward); every worker
applies the same update. Equal to SGD on a W-times larger batch (docs/algorithms.md#sync).
Synchronous: every step waits for all workers. Staleness: always 0.
A dead worker: the all-reduce raises on every other rank and the job stops (torchrun tears it
down); resume from a checkpoint.
``compress``: the gradient buckets go through PyTorch's ``bf16_compress_hook`` or
``powerSGD_hook``, or cloudburst's int8/fp8 hook (block-wise quantised; a reduce-scatter and
all-gather of quantised chunks from W = 3 on, bytes 2(W−1)/W of the quantised bucket; error
feedback per bucket, the sender's and the chunk owner's); the residuals and PowerSGD's state
are in the checkpoint.
On GPUs the all-reduce runs on NCCL when every worker has its own GPU, else on gloo (which
reduces CUDA tensors through host memory); ``summary.json`` records which.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cloudburst.comm.allreduce import (
    AllreduceHookState,
    data_parallel,
    load_powersgd_state,
    powersgd_state_dict,
)
from cloudburst.strategies.base import Strategy
from cloudburst.strategies.sync import Sync


class SyncStrategy(Sync, Strategy):
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.model = model
        topology = self.ctx.topology
        spans = topology is not None and topology.spans_nodes(self.ctx.worker_ranks)
        self.hook_state = AllreduceHookState(
            self.ctx.workers_group,
            self.stats,
            spans_nodes=spans,
            link=self.ctx.link,
            compress=self.cfg.cluster.compress,
        )
        if self.cfg.job.workers == 1:
            # Nothing to average: DDP would only add its bookkeeping (~25% of a small model's
            # step, benchmarks/results/overhead.md), as torchtitan skips data parallelism at
            # dp = 1. The arithmetic is the same.
            return model
        self.dp = data_parallel(
            self.ctx.comm, model, self.ctx.workers_group, self.ctx.device, self.hook_state
        )
        return self.dp.module

    def after_backward(self) -> None:
        if self.cfg.job.workers > 1:
            self.dp.after_backward()

    def after_step(self, samples: int) -> None:
        self.local_steps += 1

    def global_params(self) -> tuple[torch.Tensor, int]:
        return self.replica_params()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.hook_state.feedback is not None:  # int8 / fp8: the buckets' residuals
            state["compress_feedback"] = self.hook_state.feedback.state_dict()
        if self.hook_state.powersgd is not None:
            state["compress_powersgd"] = powersgd_state_dict(self.hook_state.powersgd)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "compress_feedback" in state and self.hook_state.feedback is not None:
            self.hook_state.feedback.load_state_dict(state["compress_feedback"])
        if "compress_powersgd" in state and self.hook_state.powersgd is not None:
            load_powersgd_state(self.hook_state.powersgd, state["compress_powersgd"])
