"""A worker's checkpoints: restored when the run resumes or was restarted, saved every
``checkpoint_every`` steps at the first step the strategy can resume from
(:mod:`cloudburst.records.resilience` says what they hold)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cloudburst.loop.evaluator import Evaluator
from cloudburst.records.metrics import MetricsWriter
from cloudburst.records.resilience import capture_worker_state, resume_worker, save_worker_state
from cloudburst.runtime import restart_count
from cloudburst.runtime.context import Context
from cloudburst.strategies.base import Strategy


@dataclass
class Progress:
    """Where a worker starts: after ``step`` steps, ``samples`` trained on, ``skipped``
    non-finite steps, ``elapsed_s`` on the job's clock; all 0 for a fresh start."""

    resumed: bool = False
    step: int = 0
    samples: int = 0
    skipped: int = 0
    elapsed_s: float = 0.0


class Checkpointer:
    def __init__(
        self,
        ctx: Context,
        metrics: MetricsWriter,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        strategy: Strategy,
        stream: Any,  # the batch stream (its state_dict: where in the epoch it is)
        evaluator: Evaluator | None,
    ):
        self.ctx, self.metrics = ctx, metrics
        self.parts = (model, optimizer, scheduler, strategy, stream, evaluator)
        self.due = False  # a checkpoint step passed, and the strategy was not ready yet

    def resume(self) -> Progress:
        """Restore this worker from its checkpoint, if the run resumes or was restarted."""
        resumed = resume_worker(self.ctx, *self.parts)
        if not resumed:
            return Progress()
        progress = Progress(
            True, resumed["step"], resumed["samples"], resumed["skipped"], resumed["elapsed_s"]
        )
        self.metrics.log(
            "resume",
            step=progress.step,
            attempt=restart_count(),
            samples=progress.samples,
            wall=time.time(),
        )
        return progress

    def after_step(self, step: int, total: int, samples: int, skipped: int) -> None:
        """Save when a checkpoint is due and the strategy is at a point it can resume from
        (never after the last step: the run is over)."""
        cfg, strategy = self.ctx.cfg, self.parts[3]
        self.due |= bool(cfg.faults.checkpoint_every) and step % cfg.faults.checkpoint_every == 0
        if self.due and step < total and strategy.checkpoint_ready():
            self.due = False
            state = capture_worker_state(self.ctx, samples, skipped, *self.parts)
            save_worker_state(cfg, self.ctx.worker_index, step, state)
            self.metrics.log("checkpoint", step=step, time_s=self.ctx.elapsed_s())
