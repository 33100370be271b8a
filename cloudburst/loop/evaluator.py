"""The global model's evaluation on the test set every ``eval_every_s`` seconds, off the
training clock (:class:`Evaluator` says how), by the worker the strategy names."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from cloudburst.comm.flat import assign_flat
from cloudburst.data import Dataset, evaluate_dataset, in_memory
from cloudburst.records.metrics import MetricsWriter, iter_jsonl
from cloudburst.runtime.context import Context


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
        if not force and now - self.last_s < self.ctx.cfg.metrics.eval_every_s:
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
            autocast=self.ctx.cfg.model.autocast == "bf16",
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
    monitor = ctx.comm.liveness_monitor(ctx.store, others, ctx.cfg.faults.heartbeat_timeout_s)
    pending = set(others)
    while True:
        pending = {r for r in pending if not ctx.store.check([steps_over_key(r)])}
        pending -= monitor.dead(pending)
        if not pending:
            return
        evaluator.maybe_eval(strategy)
        ctx.comm.sleep(poll_s)


def copy_buffers(src: nn.Module, dst: nn.Module) -> None:
    """Copy ``src``'s buffers (batch-norm running statistics) into ``dst`` of the same shape."""
    with torch.no_grad():
        for a, b in zip(src.buffers(), dst.buffers(), strict=True):
            b.copy_(a)


def eval_report(evaluator: Evaluator | None) -> dict[str, Any]:
    """A worker report's evaluation fields (empty when this worker does not evaluate)."""
    return {
        "evals": evaluator.history if evaluator else [],
        "loss_evals": evaluator.loss_history if evaluator else [],
        # What the final evaluation record's train_time_s leaves out (finalize_run).
        "eval_time_s": evaluator.eval_s if evaluator else 0.0,
    }


def announce_steps_over(ctx: Context, evaluator: Evaluator | None, strategy) -> None:
    """A job with servers: tell the others this worker's steps are over; the evaluator goes on
    scoring the servers' θ, which moves on with the others' pushes."""
    if ctx.num_servers:
        ctx.store.set(steps_over_key(ctx.rank), "1")
        if evaluator:
            evaluate_while_others_train(ctx, evaluator, strategy)
