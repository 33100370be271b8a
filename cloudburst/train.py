"""The one training loop, the server entry, and the end-of-run summary.

:func:`run_rank` is what every process of a job runs (under ``cloudburst train`` or a user's
``torchrun``): it joins the job, takes its role, and either serves a parameter shard or trains
a replica through the strategy chosen in the config. The loop is the same for every strategy:
:func:`run_worker` is its driver, read top to bottom; :class:`TrainStep` is one optimizer step;
the components around them (clock, faults, checkpoints, evaluation, finish) are in
:mod:`cloudburst.loop`, shared with :class:`cloudburst.api.Job`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from cloudburst.comm.liveness import EXIT_PEER_LOST, Watchdog, mark_done, watched_peers
from cloudburst.config import RunConfig
from cloudburst.config.faults import FaultInjector
from cloudburst.data import Dataset, batch_stream, load_run_dataset, loss_function, worker_source
from cloudburst.forkserver import die_with_parent, raise_open_files_limit
from cloudburst.loop.budget import TimeBudget
from cloudburst.loop.checkpointer import Checkpointer
from cloudburst.loop.evaluator import Evaluator, announce_steps_over, eval_report
from cloudburst.loop.faults import worker_faults
from cloudburst.loop.finish import finish_strategy, finish_worker, serve
from cloudburst.loop.step import StepClock, progress_bar, step_done
from cloudburst.loop.summary import (
    failed_message,
    finalize_run,
    hand_in,
    interrupted_message,
    write_partial_summary,
)
from cloudburst.models import build_run_model
from cloudburst.records.checkpoint import load_model_into
from cloudburst.records.metrics import MetricsWriter, write_json_atomic
from cloudburst.runtime import init_distributed, shutdown
from cloudburst.runtime.context import Context
from cloudburst.strategies import make_strategy
from cloudburst.strategies.base import Strategy

log = logging.getLogger(__name__)


def run_rank(cfg_dict: dict[str, Any]) -> None:
    """Entry point of one rank. ``cfg_dict`` is a :meth:`RunConfig.to_dict`."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        # Started by torch's agent (or, in a local job, by the forkserver the launcher
        # started): end with that process, however it ends, instead of training on
        # unsupervised. A rank started by hand (no agent) is left to its own parent.
        die_with_parent()
    raise_open_files_limit()  # gloo and the store cost a descriptor per connection
    cfg = RunConfig.from_dict(cfg_dict)
    ctx = init_distributed(cfg, cfg.strategy_spec)
    if ctx.rank == 0:  # what --resume reads back (the local launcher also writes it)
        write_json_atomic(f"{cfg.out}/config.json", cfg.to_dict())
    metrics = MetricsWriter(cfg.out, ctx.rank, ctx.role, tensorboard=cfg.tensorboard)
    metrics.log(
        "start",
        wall=time.time(),
        pid=os.getpid(),
        world_size=ctx.world_size,
        device=str(ctx.device),
        backend=ctx.backend,
    )
    # SIGTERM (torchrun's agent stopping its ranks, or a scheduler) stops a rank as Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    watchdog = start_watchdog(ctx, metrics)
    try:
        run_role(ctx, load_run_dataset(cfg), metrics)
        watchdog.stop()
        mark_done(ctx.liveness_store, ctx.rank)
    except KeyboardInterrupt:
        _interrupted(ctx, metrics, watchdog)
    except Exception:
        # A peer's death reaches this rank first as a failed send or receive: let the
        # watchdog name it (it exits with that reason) before reporting an error of our own.
        # The peer may have been stopped by Ctrl-C like this rank, whose signal then arrives
        # while it waits.
        try:
            watchdog.settle()
        except KeyboardInterrupt:
            _interrupted(ctx, metrics, watchdog)
        raise
    finally:
        metrics.close()
        shutdown(ctx)


def run_role(ctx: Context, data: Dataset, metrics: MetricsWriter) -> None:
    """This rank's part of the job, on a real rank (:func:`run_rank`) and a virtual one
    (:func:`cloudburst.sim.run.simulate`) alike: the run's model (from ``--init-from``), then
    its shard served or its worker's training loop."""
    model = build_run_model(ctx.cfg, data)
    if ctx.cfg.init_from:
        load_model_into(ctx.cfg.init_from, model)
    model.to(ctx.device)
    if ctx.is_server:
        run_server(ctx, model, data, metrics)
    else:
        run_worker(ctx, model, data, metrics)


def _interrupted(ctx: Context, metrics: MetricsWriter, watchdog: Watchdog) -> None:
    """Ctrl-C or SIGTERM: record it; under a user's torchrun rank 0 writes the summary and the
    resume command (a local job's launcher does it itself); exit 130."""
    watchdog.stop()  # the others are stopping too: their silence is no failure
    metrics.log("interrupted", time_s=ctx.elapsed_s())
    if ctx.rank == 0 and not os.environ.get("CLOUDBURST_LOCAL_JOB"):
        summary = write_partial_summary(ctx.cfg, interrupted=True)
        print(interrupted_message(summary), file=sys.stderr, flush=True)
    raise SystemExit(130) from None


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def start_watchdog(ctx: Context, metrics: MetricsWriter) -> Watchdog:
    """Stop this rank within ``heartbeat_timeout_s`` of a rank it depends on going silent
    (see :mod:`cloudburst.comm.liveness`): record why, and under a user's torchrun write the
    run's summary (a local job's launcher writes it), then exit."""
    cfg = ctx.cfg
    watched = watched_peers(
        ctx.rank, ctx.world_size, cfg.servers, cfg.strategy_spec.survives_worker_loss
    )

    def on_lost(rank: int | None, role: str) -> None:
        time_s = ctx.elapsed_s()
        reason = f"{role} lost at {time_s:.1f} s"
        log.error("%s (no heartbeat for %g s): stopping this rank", reason, cfg.heartbeat_timeout_s)
        try:
            metrics.log("peer_lost", lost_rank=rank, reason=reason, time_s=time_s)
            if not os.environ.get("CLOUDBURST_LOCAL_JOB"):
                summary = write_partial_summary(cfg, failed=reason)
                print(failed_message(summary), file=sys.stderr, flush=True)
        finally:
            os._exit(EXIT_PEER_LOST)

    return Watchdog(ctx.liveness_store, watched, cfg.heartbeat_timeout_s, on_lost).start()


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    """SGD (momentum, L2 decay), Adam (β1 = momentum, L2 decay) or AdamW (β1 = momentum,
    decoupled decay: θ ← θ − lr·λ·θ before the Adam step)."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay
        )
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def make_scheduler(
    cfg: RunConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The local learning-rate schedule over a worker's training steps (not the warm start).

    With ``warmup_steps`` N > 0: step k < N has lr·(1/N + (1 − 1/N)·k/N), then the schedule
    (constant, or cosine from lr to 0 over the remaining steps).
    """
    warm = min(cfg.warmup_steps, max(0, total_steps - 1))
    sched = torch.optim.lr_scheduler
    after = None
    if cfg.lr_schedule == "cosine":
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


# ---------------------------------------------------------------------------- workers
def run_worker(ctx: Context, model: nn.Module, data: Dataset, metrics: MetricsWriter) -> None:
    """One worker: set up, resume or warm-start, train its steps, finish (see loop/)."""
    cfg = ctx.cfg
    metrics.language_model = data.is_lm  # its eval records carry bits per byte
    strategy = make_strategy(ctx)
    optimizer = make_optimizer(cfg, model.parameters())
    shard = worker_source(data, ctx.worker_index, cfg.workers)
    total = cfg.steps_per_worker(len(data.train))
    strategy.configure(max(1, len(shard) // cfg.batch_size), total)
    net = strategy.wrap(model, optimizer)
    stream = batch_stream(
        shard,
        cfg.batch_size,
        seed=cfg.seed * 1000 + ctx.worker_index,
        preprocess=data.preprocess(augment=cfg.augment),
        num_workers=data_workers(cfg, data),
        pin_memory=ctx.device.type == "cuda",
    )
    faults = worker_faults(ctx, metrics)
    factor = cfg.straggler_factor(ctx.worker_index) * faults.slow_factor
    loss_fn = loss_function(data)
    scheduler = make_scheduler(cfg, optimizer, total)
    train_step = TrainStep(
        cfg, ctx.device, net, optimizer, stream, loss_fn,
        scheduler=scheduler, strategy=strategy, faults=faults,
    )  # fmt: skip
    evaluator = Evaluator(ctx, model, data, metrics) if strategy.is_evaluator else None
    clock = StepClock(ctx, strategy, model, factor)  # after the evaluator's copy of the model
    checkpointer = Checkpointer(
        ctx, metrics, model, optimizer, scheduler, strategy, stream, evaluator
    )
    budget = TimeBudget(ctx, strategy, evaluator)
    start = checkpointer.resume()
    train_step.skipped, samples = start.skipped, start.samples
    # Everything above is set-up (the first optimizer alone imports for ~2 s).
    clock.start(start.elapsed_s)
    if start.resumed and evaluator:
        evaluator.restore_clock(start.elapsed_s)
    if cfg.warm_start_steps and ctx.replica_index == 0 and not start.resumed:
        warm_start(ctx, metrics, clock, train_step)
    strategy.start()
    if evaluator:
        evaluator.maybe_eval(strategy, force=True)

    bar = progress_bar(ctx, total, start.step)
    loss, last = math.nan, start.step
    for step in range(start.step + 1, total + 1):
        loss = clock.run(train_step, step)
        step_done(strategy, cfg.batch_size, loss)
        samples, last = samples + cfg.batch_size, step
        if step == start.step + 1:  # when training really began (the launch's cost ends here)
            metrics.log("first_step", step=step, wall=time.time())
        if evaluator:
            evaluator.maybe_eval(strategy)
        faults.after_step(step)
        stop = budget.over(step, total)  # --max-train-time-s: this is the last step
        checkpointer.after_step(step, step if stop else total, samples, train_step.skipped)
        if step % cfg.log_every_steps == 0 or step == total or stop:
            metrics.log(
                "step",
                step=step,
                time_s=ctx.elapsed_s(),
                samples=samples,
                loss=loss,
                **strategy.stats.as_dict(),
                **strategy.step_info(),
            )
        bar.update(1)
        if stop:
            break
    bar.close()
    announce_steps_over(ctx, evaluator, strategy)
    report = finish_strategy(
        strategy,
        stream,
        device=str(ctx.device),
        steps=last,
        stopped_by=budget.stopped_by(),
        samples=samples,
        final_loss=loss,
        steps_skipped_nonfinite=train_step.skipped,
        resumed_from_step=start.step,
    )
    finish_worker(ctx, model, data, metrics, strategy, report | eval_report(evaluator))


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
        autocast = self.cfg.autocast == "bf16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = self.loss_fn(self.net(xb), yb)
        if step and self.faults is not None and self.faults.corrupt_loss(step):
            loss = loss * float("nan")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.strategy is not None:
            self.strategy.after_backward()
        clip_gradients(self.optimizer, self.cfg.clip_grad_norm)  # after sync's all-reduce
        if grads_finite(self.optimizer):
            self.optimizer.step()
        else:
            self.skipped += 1
            log.warning("step %d: non-finite gradient, not applied", step)
        loss_value = loss.item()
        if step and self.scheduler is not None:
            self.scheduler.step()
        return loss_value


def calibrate_step_time(cfg: RunConfig, steps: int = 20, warmup_steps: int = 3) -> float:
    """Median seconds of ``steps`` real training steps (:class:`TrainStep`: batch, forward,
    backward, clipping, optimizer) of the run's model on worker 0's shard, after
    ``warmup_steps`` untimed ones; on the GPU with ``--device cuda``, else on the CPU (the
    simulator's maths runs in this process). The virtual cluster's step time when no flag or
    profile gives one (:func:`cloudburst.sim.clock.resolve_step_time`)."""
    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    data = load_run_dataset(cfg)
    model = build_run_model(cfg, data).to(device)
    stream = batch_stream(
        worker_source(data, 0, cfg.workers),
        cfg.batch_size,
        seed=cfg.seed * 1000,
        preprocess=data.preprocess(augment=cfg.augment),
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


def warm_start(
    ctx: Context, metrics: MetricsWriter, clock: StepClock, train_step: TrainStep
) -> None:
    """Warm start (GPU A-SGD experiment 3): worker 0 trains alone, then seeds the servers
    (when the strategy starts). A warm-up step takes the emulated device's time too (and its
    modelled time on the virtual cluster), so that a time-to-target includes the warm start."""
    for i in range(ctx.cfg.warm_start_steps):
        loss = clock.run(train_step)
        if (i + 1) % ctx.cfg.log_every_steps == 0:
            metrics.log("warmup", step=i + 1, time_s=ctx.elapsed_s(), loss=loss)


def grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    grads = [g for g in grads if g is not None]
    if not grads:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def data_workers(cfg: RunConfig, data: Dataset) -> int:
    """DataLoader processes per worker: as configured, else 2 for images, 0 for features."""
    if cfg.data_workers is not None:
        return cfg.data_workers
    return 2 if data.is_image else 0


# ---------------------------------------------------------------------------- servers
def run_server(ctx: Context, model: nn.Module, data: Dataset, metrics: MetricsWriter) -> None:
    metrics.language_model = data.is_lm  # rank 0's final eval record carries bits per byte
    loop, report, wall_time_s = serve(ctx, model, metrics)
    hand_in(ctx, metrics, report, wall_time_s)
    theta = loop.gather_final_theta()
    if ctx.rank == 0:
        lost = sorted(loop.lost)
        finalize_run(
            ctx, model, theta, data, metrics, report, lost, wall_time_s, loop.shard.samples
        )
