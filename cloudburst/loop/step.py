"""Around one training step: the emulated device's clock, the strategy's after-step call
(shared by the CLI's loop and :class:`cloudburst.api.Job`), worker 0's progress bar."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from cloudburst.runtime.context import Context
from cloudburst.strategies.base import Strategy


def step_done(strategy: Strategy, samples: int, loss: float | None = None) -> None:
    """After each optimizer step: the step's loss (for schedules that watch it, DASO's plateau
    rule), then the strategy's step with the samples it trained on."""
    if loss is not None:
        strategy.record_loss(loss)
    strategy.after_step(samples)


class StepClock:
    """The job's training clock, and each step's time on the emulated device.

    The emulated device (``--min-step-time-s``, a straggler's ``factor``): its padding is slept
    in per-layer forward and backward hooks (:mod:`cloudburst.comm.device_emulation`), so
    communication overlaps with it where it would on a device; the virtual cluster charges its
    modelled time instead. Make it after the evaluator copied the model (the copy has no hooks).
    """

    def __init__(self, ctx: Context, strategy: Strategy, model: nn.Module, factor: float):
        self.ctx, self.strategy, self.factor = ctx, strategy, factor
        self.emulator = ctx.comm.device_emulator(model, ctx.cfg.cluster.min_step_time_s, factor)

    def start(self, elapsed_s: float = 0.0) -> None:
        """Set-up is over: the clock that measures training starts now, on every rank at once
        (a resumed run's clock continues from ``elapsed_s``)."""
        self.ctx.start_clock(elapsed_s)

    def run(self, step_fn: Callable[..., float], *args: Any) -> float:
        """One training step on the emulated device: its compute (the step's time less what it
        waited for communication) padded to the device's time, in the step's layers (real
        runs) or by the transport (the virtual cluster's modelled step time)."""
        comm, stats = self.ctx.comm, self.strategy.stats
        t_start, waited_before = comm.now(), stats.wait_s
        if self.emulator is not None:
            self.emulator.begin_step()
        loss = step_fn(*args)
        busy_s = comm.now() - t_start - (stats.wait_s - waited_before)
        if self.emulator is not None:
            self.emulator.end_step(busy_s)
        else:
            comm.step_done(busy_s, self.ctx.cfg.cluster.min_step_time_s, self.factor)
        return loss


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(ctx: Context, total: int, done: int) -> Any:
    """Under ``cloudburst train`` the launcher draws the bar from the metrics files; under a
    user's torchrun, worker 0 draws one when it has a terminal (else a bar that draws nothing)."""
    if ctx.worker_index != 0 or not ctx.cfg.output.progress or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    bar = tqdm(total=total, desc=f"{ctx.cfg.job.strategy} worker0", unit="step")
    bar.update(done)
    return bar
