"""The one training loop, the server entry, and the end-of-run summary.

:func:`run_rank` is what every process of a job runs (under ``cloudburst train`` or a user's
``torchrun``): it joins the job, takes its role, and either serves a parameter shard or trains
a replica through the strategy chosen in the config. The loop is the same for every strategy.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import signal
import sys
import time
from typing import Any

import torch
from torch import nn

from cloudburst.checkpoint import load_model_into, model_buffers_bytes
from cloudburst.comm.collectives import all_reduce_sum
from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.comm.p2p import CommStats
from cloudburst.config import RunConfig
from cloudburst.data import (
    Dataset,
    batch_stream,
    evaluate_dataset,
    in_memory,
    load_dataset,
    loss_function,
    worker_source,
)
from cloudburst.faults import FaultInjector, parse_faults
from cloudburst.liveness import EXIT_PEER_LOST, Watchdog, mark_done, watched_peers
from cloudburst.metrics import MetricsWriter, iter_jsonl, write_json_atomic
from cloudburst.models import build_model
from cloudburst.resilience import capture_worker_state, resume_worker, save_worker_state
from cloudburst.runtime import (
    Context,
    init_distributed,
    restart_count,
    shutdown,
)
from cloudburst.server import serve_shard
from cloudburst.strategies import make_strategy
from cloudburst.summary import (
    failed_message,
    finalize_run,
    hand_in,
    interrupted_message,
    write_partial_summary,
)

log = logging.getLogger(__name__)


def run_rank(cfg_dict: dict[str, Any]) -> None:
    """Entry point of one rank. ``cfg_dict`` is a :meth:`RunConfig.to_dict`."""
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
        data = load_dataset(
            cfg.dataset, cfg.train_size, cfg.test_size, cfg.image_size, context=cfg.context
        )
        model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
        if cfg.init_from:
            load_model_into(cfg.init_from, model)
        model.to(ctx.device)
        if ctx.is_server:
            run_server(ctx, model, data, metrics)
        else:
            run_worker(ctx, model, data, metrics)
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
    (see :mod:`cloudburst.liveness`): record why, and under a user's torchrun write the
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
    cfg = ctx.cfg
    metrics.language_model = data.is_lm  # its eval records carry bits per byte
    strategy = make_strategy(ctx)
    optimizer = make_optimizer(cfg, model.parameters())
    device = ctx.device
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
        pin_memory=device.type == "cuda",
    )
    faults = FaultInjector(
        parse_faults(cfg.inject_fault, cfg.servers, cfg.world_size),
        ctx.rank,
        active=restart_count() == 0 and not cfg.resume,
        on_fire=lambda f, step: metrics.log("fault", step=step, kind=f.kind, wall=time.time()),
        stop=ctx.comm.stop_self,
    )
    factor = cfg.straggler_factor(ctx.worker_index) * faults.slow_factor
    loss_fn = loss_function(data)
    scheduler = make_scheduler(cfg, optimizer, total)
    autocast = cfg.autocast == "bf16"
    skipped = 0  # steps whose gradient was not finite (not applied)

    def train_step(step: int = 0) -> float:
        nonlocal skipped
        xb, yb = next(stream)
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(net(xb), yb)
        if step and faults.corrupt_loss(step):
            loss = loss * float("nan")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        strategy.after_backward()
        clip_gradients(optimizer, cfg.clip_grad_norm)  # after sync's all-reduce: the same clip
        # A non-finite gradient (after sync's all-reduce: the same on every replica) is never
        # applied: the replica stays as it was, and the step is counted as skipped.
        if grads_finite(optimizer):
            optimizer.step()
        else:
            skipped += 1
            log.warning("step %d: non-finite gradient, not applied", step)
        return loss.item()

    def train_step_scheduled(step: int) -> float:
        loss = train_step(step)
        if scheduler is not None:
            scheduler.step()
        return loss

    evaluator = Evaluator(ctx, model, data, metrics) if strategy.is_evaluator else None
    # The emulated device (--min-step-time-s, a straggler's factor): its padding is slept in
    # per-layer forward and backward hooks (cloudburst.device_emulation), so communication
    # overlaps with it where it would on a device. Installed after the evaluator copied the
    # model (the copy has no hooks). The virtual cluster charges its modelled time instead.
    emulator = ctx.comm.device_emulator(model, cfg.min_step_time_s, factor)

    def on_device(step_fn, *args) -> float:
        """One training step on the emulated device: its compute (the step's time less what
        it waited for communication) padded to the device's time, in the step's layers
        (real runs) or by the transport (the virtual cluster's modelled step time)."""
        t_start, waited_before = ctx.comm.now(), strategy.stats.wait_s
        if emulator is not None:
            emulator.begin_step()
        loss = step_fn(*args)
        busy_s = ctx.comm.now() - t_start - (strategy.stats.wait_s - waited_before)
        if emulator is not None:
            emulator.end_step(busy_s)
        else:
            ctx.comm.step_done(busy_s, cfg.min_step_time_s, factor)
        return loss

    resumed = resume_worker(ctx, model, optimizer, scheduler, strategy, stream, evaluator)
    start_step = resumed["step"] if resumed else 0
    samples = resumed["samples"] if resumed else 0
    skipped = resumed["skipped"] if resumed else 0
    if resumed:
        metrics.log(
            "resume", step=start_step, attempt=restart_count(), samples=samples, wall=time.time()
        )
    # Everything above is set-up (the first optimizer alone imports for ~2 s): the clock that
    # measures training starts now, on every rank at once (a resumed run's clock continues).
    ctx.start_clock(resumed["elapsed_s"] if resumed else 0.0)
    if resumed and evaluator:
        evaluator.restore_clock(resumed["elapsed_s"])
    if cfg.warm_start_steps and ctx.worker_index == 0 and not resumed:
        # Warm start (GPU A-SGD experiment 3): this worker trains alone, then seeds the servers.
        for i in range(cfg.warm_start_steps):
            # A warm-up step takes the emulated device's time too (and its modelled time on
            # the virtual cluster), so that a time-to-target includes the warm start.
            loss = on_device(train_step)
            if (i + 1) % cfg.log_every_steps == 0:
                metrics.log("warmup", step=i + 1, time_s=ctx.elapsed_s(), loss=loss)
    strategy.start()
    if evaluator:
        evaluator.maybe_eval(strategy, force=True)

    bar = _progress_bar(ctx, total)
    if bar is not None:
        bar.update(start_step)
    loss = math.nan
    checkpoint_due = False
    for step in range(start_step + 1, total + 1):
        loss = on_device(train_step_scheduled, step)
        strategy.record_loss(loss)
        strategy.after_step(cfg.batch_size)
        samples += cfg.batch_size
        if step == start_step + 1:  # when training really began (the launch's cost ends here)
            metrics.log("first_step", step=step, wall=time.time())
        if evaluator:
            evaluator.maybe_eval(strategy)
        faults.after_step(step)
        checkpoint_due |= bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0
        if checkpoint_due and step < total and strategy.checkpoint_ready():
            checkpoint_due = False
            state = capture_worker_state(
                ctx, samples, skipped, model, optimizer, scheduler, strategy, stream, evaluator
            )
            save_worker_state(cfg, ctx.worker_index, step, state)
            metrics.log("checkpoint", step=step, time_s=ctx.elapsed_s())
        if step % cfg.log_every_steps == 0 or step == total:
            metrics.log(
                "step",
                step=step,
                time_s=ctx.elapsed_s(),
                samples=samples,
                loss=loss,
                staleness_versions=getattr(strategy, "last_staleness", 0),
                **strategy.stats.as_dict(),
                **strategy.step_info(),
            )
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if ctx.num_servers:
        # The servers' θ moves on with the others' pushes: the evaluator keeps scoring it.
        ctx.store.set(steps_over_key(ctx.rank), "1")
        if evaluator:
            evaluate_while_others_train(ctx, evaluator, strategy)
    strategy.finish()
    if hasattr(stream, "close"):
        stream.close()

    report = {
        "role": "worker",
        "device": str(device),
        "steps": total,
        "samples": samples,
        "final_loss": loss,
        "steps_skipped_nonfinite": skipped,
        "resumed_from_step": start_step,
        **strategy.report(),
        "evals": evaluator.history if evaluator else [],
        "loss_evals": evaluator.loss_history if evaluator else [],
        # What the final evaluation record's train_time_s leaves out (finalize_run).
        "eval_time_s": evaluator.eval_s if evaluator else 0.0,
    }
    wall_time_s = ctx.elapsed_s()
    averaged = None
    if strategy.decentralised:
        # Replicas differ at the end (gossip): report each one's accuracy, and make the final
        # model their average (a measurement collective, not counted as the strategy's traffic).
        report["replica_accuracy"], _ = evaluate_dataset(
            model, in_memory(data.test), data.preprocess(augment=False), device
        )
        # Push-sum replicas carry weights: the average that preserves the mass is
        # Σ w_i θ_i / Σ w_i (every w_i = 1 otherwise).
        weight = float(strategy.report().get("push_sum_weight", 1.0))
        averaged = torch.cat([flatten_params(model) * weight, torch.tensor([weight])])
        all_reduce_sum(averaged, ctx.workers_group, CommStats(), comm=ctx.comm)
        averaged = averaged[:-1] / averaged[-1]
    if ctx.worker_index == 0 and ctx.num_servers and any(True for _ in model.buffers()):
        # The servers hold parameters only: the model's buffers (batch-norm statistics) that
        # the final evaluation needs come from worker 0's replica.
        ctx.store.set("buffers", model_buffers_bytes(model))
    hand_in(ctx, metrics, report, wall_time_s)
    if ctx.rank == 0:  # no servers: worker 0 is rank 0 and writes the summary
        flat, global_samples = strategy.global_params()
        if averaged is not None:
            flat = averaged
        finalize_run(ctx, model, flat, data, metrics, report, [], wall_time_s, global_samples)


def steps_over_key(rank: int) -> str:
    """The store key a worker of a job with servers sets when its last step is done."""
    return f"steps_over/{rank}"


def evaluate_while_others_train(
    ctx: Context, evaluator: Evaluator, strategy, poll_s: float = 0.05
) -> None:
    """asgd, easgd: the global model (the servers' θ) keeps moving after the evaluating
    worker's last step, with the other workers' pushes. Keep evaluating it every
    ``eval_every_s`` until every other worker's steps are over (its ``steps_over_key``) or it
    is lost (its heartbeat silent for ``heartbeat_timeout_s``, as the servers decide), so that
    a run whose evaluator finishes first is still seen to reach its target; the final
    evaluation (``finalize_run``) follows once the servers finish."""
    others = [r for r in ctx.worker_ranks if r != ctx.rank]
    monitor = ctx.comm.liveness_monitor(ctx.store, others, ctx.cfg.heartbeat_timeout_s)
    pending = set(others)
    while True:
        pending = {r for r in pending if not ctx.store.check([steps_over_key(r)])}
        pending -= monitor.dead(pending)
        if not pending:
            return
        evaluator.maybe_eval(strategy)
        ctx.comm.sleep(poll_s)


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


def copy_buffers(src: nn.Module, dst: nn.Module) -> None:
    """Copy ``src``'s buffers (batch-norm running statistics) into ``dst`` of the same shape."""
    with torch.no_grad():
        for a, b in zip(src.buffers(), dst.buffers(), strict=True):
            b.copy_(a)


def _progress_bar(ctx: Context, total: int):
    # Under `cloudburst train` the launcher draws the bar from the metrics files; under a
    # user's torchrun, worker 0 draws one when it has a terminal.
    if ctx.worker_index != 0 or not ctx.cfg.progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{ctx.cfg.strategy} worker0", unit="step")


class Evaluator:
    """Evaluates the global model on the test set every ``eval_every_s`` seconds.

    Evaluation is off the clock: each ``eval`` record has ``time_s`` (the job's clock at the
    snapshot) and ``train_time_s``, the same clock less all the time this worker spent
    evaluating before (fetching the snapshot of the global model and scoring it; ``eval_s``
    is this evaluation's). One rule for every strategy: under lockstep strategies (sync,
    local SGD, DiLoCo, DASO, gossip) every other worker waits at its next collective for
    worker 0 while it evaluates, so the whole job stalls by that time and ``train_time_s`` is
    every rank's clock without the stall. Under the asynchronous ones (asgd, EASGD) only
    worker 0 stops; the others keep training, so ``train_time_s`` credits them with up to a
    fraction ``Σ eval_s / time_s`` more training than the clock says (the record carries both,
    so a report can show the fraction; it is small when evaluations are short against
    ``eval_every_s``). Not subtracting would instead charge the evaluations to the lockstep
    strategies in full. Under asgd and EASGD the evaluator goes on evaluating after its own
    last step, until every other worker's steps are over (:func:`evaluate_while_others_train`).
    """

    def __init__(self, ctx: Context, model: nn.Module, data: Dataset, metrics: MetricsWriter):
        self.ctx, self.data, self.metrics = ctx, data, metrics
        self.replica = model
        self.model = copy.deepcopy(model)
        self.test = in_memory(data.test)
        self.preprocess = data.preprocess(augment=False)
        self.last_s = -math.inf
        self.eval_s = 0.0  # time spent evaluating so far (what train_time_s leaves out)
        self.history: list[list[float]] = []  # [time_s, samples, accuracy]
        self.loss_history: list[list[float]] = []  # [time_s, test loss]

    def restore_clock(self, elapsed_s: float) -> None:
        """A resumed run: the evaluation time already spent before ``elapsed_s``, read back
        from this rank's eval records (its metrics file is appended to across restarts)."""
        self.eval_s = 0.0
        self.loss_history = []
        if not self.metrics.path.exists():
            return
        for r in iter_jsonl(self.metrics.path):
            if r.get("event") == "eval" and "train_time_s" in r and r["time_s"] <= elapsed_s:
                self.eval_s = r["time_s"] - r["train_time_s"] + r.get("eval_s", 0.0)
                if not r.get("final") and "test_loss" in r:
                    self.loss_history.append([r["time_s"], r["test_loss"]])

    def maybe_eval(self, strategy, force: bool = False) -> None:
        now = self.ctx.elapsed_s()
        if not force and now - self.last_s < self.ctx.cfg.eval_every_s:
            return
        t_start = self.ctx.comm.now()
        with self.ctx.comm.measuring():  # a measurement: no virtual time in a simulation
            flat, samples = strategy.fetch_global_params()
        self.last_s = now
        assign_flat(self.model, flat)
        # Global parameters; buffers (batch-norm statistics) from this worker's replica.
        copy_buffers(self.replica, self.model)
        acc, loss = evaluate_dataset(
            self.model,
            self.test,
            self.preprocess,
            self.ctx.device,
            autocast=self.ctx.cfg.autocast == "bf16",
        )
        self.history.append([now, samples, acc])
        self.loss_history.append([now, loss])
        eval_s = self.ctx.comm.now() - t_start
        self.metrics.log(
            "eval",
            time_s=now,
            train_time_s=now - self.eval_s,
            eval_s=eval_s,
            samples=samples,
            test_accuracy=acc,
            test_loss=loss,
        )
        self.eval_s += eval_s


# ---------------------------------------------------------------------------- servers
def run_server(ctx: Context, model: nn.Module, data: Dataset, metrics: MetricsWriter) -> None:
    metrics.language_model = data.is_lm  # rank 0's final eval record carries bits per byte
    loop = serve_shard(ctx, flatten_params(model), metrics)
    wall_time_s = ctx.elapsed_s()
    report = {"role": "server", **loop.stats()}
    hand_in(ctx, metrics, report, wall_time_s)
    theta = loop.gather_final_theta()
    if ctx.rank == 0:
        lost = sorted(loop.lost)
        finalize_run(
            ctx, model, theta, data, metrics, report, lost, wall_time_s, loop.shard.samples
        )
