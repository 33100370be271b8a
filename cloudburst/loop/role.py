"""A rank's part of the job, on a real rank (:func:`cloudburst.train.run_rank`), a virtual one
(:func:`cloudburst.sim.run.simulate`) and alike: the run's model, then its shard served
(:func:`run_server`) or its worker's training loop (:func:`run_worker`, the driver, read top to
bottom). The components around the loop are this package's other modules, shared with
:class:`cloudburst.api.Job`."""

from __future__ import annotations

import math
import time

from torch import nn

from cloudburst.config import RunConfig
from cloudburst.data import Dataset, batch_stream, loss_function, worker_source
from cloudburst.loop.budget import TimeBudget
from cloudburst.loop.checkpointer import Checkpointer
from cloudburst.loop.evaluator import Evaluator, announce_steps_over, eval_report
from cloudburst.loop.faults import worker_faults
from cloudburst.loop.finish import finish_strategy, finish_worker, serve
from cloudburst.loop.step import StepClock, progress_bar, step_done
from cloudburst.loop.summary import finalize_run, hand_in
from cloudburst.loop.train_step import TrainStep, make_optimizer, make_scheduler
from cloudburst.models import build_run_model
from cloudburst.records.checkpoint import load_model_into
from cloudburst.records.metrics import MetricsWriter
from cloudburst.runtime.context import Context
from cloudburst.strategies.replica import make_strategy


def run_role(ctx: Context, data: Dataset, metrics: MetricsWriter) -> None:
    """This rank's part of the job, on a real rank (:func:`run_rank`) and a virtual one
    (:func:`cloudburst.sim.run.simulate`) alike: the run's model (from ``--init-from``), then
    its shard served or its worker's training loop."""
    model = build_run_model(ctx.cfg, data)
    if ctx.cfg.training.init_from:
        load_model_into(ctx.cfg.training.init_from, model)
    model.to(ctx.device)
    if ctx.is_server:
        run_server(ctx, model, data, metrics)
    else:
        run_worker(ctx, model, data, metrics)


def run_worker(ctx: Context, model: nn.Module, data: Dataset, metrics: MetricsWriter) -> None:
    """One worker: set up, resume or warm-start, train its steps, finish (see loop/)."""
    cfg = ctx.cfg
    metrics.language_model = data.is_lm  # its eval records carry bits per byte
    strategy = make_strategy(ctx)
    optimizer = make_optimizer(cfg, model.parameters())
    shard = worker_source(data, ctx.worker_index, cfg.job.workers)
    total = cfg.steps_per_worker(len(data.train))
    strategy.configure(max(1, len(shard) // cfg.training.batch_size), total)
    net = strategy.wrap(model, optimizer)
    stream = batch_stream(
        shard,
        cfg.training.batch_size,
        seed=cfg.training.seed * 1000 + ctx.worker_index,
        preprocess=data.preprocess(augment=cfg.data.augment),
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
    if cfg.training.warm_start_steps and ctx.replica_index == 0 and not start.resumed:
        warm_start(ctx, metrics, clock, train_step)
    strategy.start()
    if evaluator:
        evaluator.maybe_eval(strategy, force=True)

    bar = progress_bar(ctx, total, start.step)
    loss, last = math.nan, start.step
    for step in range(start.step + 1, total + 1):
        loss = clock.run(train_step, step)
        step_done(strategy, cfg.training.batch_size, loss)
        samples, last = samples + cfg.training.batch_size, step
        if step == start.step + 1:  # when training really began (the launch's cost ends here)
            metrics.log("first_step", step=step, wall=time.time())
        if evaluator:
            evaluator.maybe_eval(strategy)
        faults.after_step(step)
        stop = budget.over(step, total)  # --max-train-time-s: this is the last step
        checkpointer.after_step(step, step if stop else total, samples, train_step.skipped)
        if step % cfg.metrics.log_every_steps == 0 or step == total or stop:
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


def warm_start(
    ctx: Context, metrics: MetricsWriter, clock: StepClock, train_step: TrainStep
) -> None:
    """Warm start (GPU A-SGD experiment 3): worker 0 trains alone, then seeds the servers
    (when the strategy starts). A warm-up step takes the emulated device's time too (and its
    modelled time on the virtual cluster), so that a time-to-target includes the warm start."""
    for i in range(ctx.cfg.training.warm_start_steps):
        loss = clock.run(train_step)
        if (i + 1) % ctx.cfg.metrics.log_every_steps == 0:
            metrics.log("warmup", step=i + 1, time_s=ctx.elapsed_s(), loss=loss)


def data_workers(cfg: RunConfig, data: Dataset) -> int:
    """DataLoader processes per worker: as configured, else 2 for images, 0 for features."""
    if cfg.data.workers is not None:
        return cfg.data.workers
    return 2 if data.is_image else 0


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
