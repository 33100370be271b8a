"""One optimizer step, the same everywhere: :class:`TrainStep` is the training step of the loop
(:func:`cloudburst.loop.role.run_worker`), of the warm start and of the virtual cluster's
calibration (:func:`calibrate_step_time`); with the optimizer, the learning-rate schedule and
the gradient clipping it applies."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from cloudburst.config import RunConfig
from cloudburst.config.faults import FaultInjector
from cloudburst.data import batch_stream, load_run_dataset, loss_function, worker_source
from cloudburst.models import build_run_model
from cloudburst.strategies.base import Strategy

log = logging.getLogger(__name__)


class TrainStep:
    """``train_step(step)``: one optimizer step on the replica's next batch — the training
    step of the loop, the warm start and the simulator's calibration alike. A non-finite
    gradient (after sync's all-reduce: the same on every replica) is never applied: the
    replica stays as it was, and the step is counted in ``skipped``. Step 0 is a warm-start
    step: no injected fault, no learning-rate schedule. Without a ``strategy`` (calibration)
    nothing is called after the backward pass; without ``faults`` none is injected."""

    def __init__(
        self,
        cfg: RunConfig,
        device: torch.device,
        net: nn.Module,
        optimizer: torch.optim.Optimizer,
        stream: Iterator[tuple[torch.Tensor, torch.Tensor]],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        strategy: Strategy | None = None,
        faults: FaultInjector | None = None,
    ):
        self.cfg, self.device = cfg, device
        self.net, self.optimizer, self.scheduler = net, optimizer, scheduler
        self.strategy, self.stream, self.loss_fn, self.faults = strategy, stream, loss_fn, faults
        self.skipped = 0

    def __call__(self, step: int = 0) -> float:
        xb, yb = next(self.stream)
        xb, yb = xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)
        autocast = self.cfg.model.autocast == "bf16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = self.loss_fn(self.net(xb), yb)
        if step and self.faults is not None and self.faults.corrupt_loss(step):
            loss = loss * float("nan")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.strategy is not None:
            self.strategy.after_backward()
        clip_gradients(self.optimizer, self.cfg.training.clip_grad_norm)  # after sync's all-reduce
        if grads_finite(self.optimizer):
            self.optimizer.step()
        else:
            self.skipped += 1
            log.warning("step %d: non-finite gradient, not applied", step)
        loss_value = loss.item()
        if step and self.scheduler is not None:
            self.scheduler.step()
        return loss_value


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    """SGD (momentum, L2 decay), Adam (β1 = momentum, L2 decay) or AdamW (β1 = momentum,
    decoupled decay: θ ← θ − lr·λ·θ before the Adam step)."""
    if cfg.training.optimizer == "adamw":
        return torch.optim.AdamW(
            params,
            lr=cfg.training.lr,
            betas=(cfg.training.momentum, 0.999),
            weight_decay=cfg.training.weight_decay,
        )
    if cfg.training.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.training.lr, weight_decay=cfg.training.weight_decay)
    return torch.optim.SGD(
        params,
        lr=cfg.training.lr,
        momentum=cfg.training.momentum,
        weight_decay=cfg.training.weight_decay,
    )


def make_scheduler(
    cfg: RunConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The local learning-rate schedule over a worker's training steps (not the warm start).

    With ``warmup_steps`` N > 0: step k < N has lr·(1/N + (1 − 1/N)·k/N), then the schedule
    (constant, or cosine from lr to 0 over the remaining steps).
    """
    warm = min(cfg.training.warmup_steps, max(0, total_steps - 1))
    sched = torch.optim.lr_scheduler
    after = None
    if cfg.training.lr_schedule == "cosine":
        after = sched.CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warm))
    if not warm:
        return after
    ramp = sched.LinearLR(optimizer, start_factor=1.0 / warm, end_factor=1.0, total_iters=warm)
    if after is None:
        return ramp
    return sched.SequentialLR(optimizer, [ramp, after], milestones=[warm])


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / ‖g‖) (global L2 norm; 0: off)."""
    if max_norm > 0:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    grads = [g for g in grads if g is not None]
    if not grads:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def calibrate_step_time(cfg: RunConfig, steps: int = 20, warmup_steps: int = 3) -> float:
    """Median seconds of ``steps`` real training steps (:class:`TrainStep`: batch, forward,
    backward, clipping, optimizer) of the run's model on worker 0's shard, after
    ``warmup_steps`` untimed ones; on the GPU with ``--device cuda``, else on the CPU (the
    simulator's maths runs in this process). The virtual cluster's step time when no flag or
    profile gives one (:func:`cloudburst.sim.clock.resolve_step_time`)."""
    device = torch.device("cuda" if cfg.model.device == "cuda" else "cpu")
    data = load_run_dataset(cfg)
    model = build_run_model(cfg, data).to(device)
    stream = batch_stream(
        worker_source(data, 0, cfg.job.workers),
        cfg.training.batch_size,
        seed=cfg.training.seed * 1000,
        preprocess=data.preprocess(augment=cfg.data.augment),
    )
    step = TrainStep(
        cfg, device, model, make_optimizer(cfg, model.parameters()), stream, loss_function(data)
    )
    for _ in range(warmup_steps):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()  # its loss.item() waits for the step's kernels on a GPU
        times.append(time.perf_counter() - start)
    return statistics.median(times)
