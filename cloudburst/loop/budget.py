"""``--max-train-time-s``: stop training once the training clock reaches a budget.

The clock is the one the evaluation records call ``train_time_s``: the job's clock since
training began (a resumed run's continues from its checkpoint), less the time this worker
spent evaluating; virtual seconds on the virtual cluster. A worker whose budget is over ends
as after its last step (the strategy's finish, the final evaluation, the summary).

- Asynchronous strategies (asgd, EASGD, async DiLoCo): each worker reads its own clock after
  every step and stops on it; the shards finish when every worker has said it is done.
- Lockstep strategies (sync, DASO, local SGD, DiLoCo, gossip): every collective needs every
  worker, so all must stop after the same step. At a check the workers all-reduce worker 0's
  training clock (a one-number sum through the transport, within the collectives' timeout,
  counted in the strategy's traffic), so every rank decides on the same number. The steps at
  which they check are a function of agreed values only: the next check comes after half the
  steps the budget still leaves at the last interval's pace, at most ``MAX_CHECK_INTERVAL``
  (100) steps later. A run of N steps checks about N/100 + 11 times (every 100 steps while
  the end is far, then at halvings of what is left, every step in the last few), and stops
  at the first step past the budget unless its steps more than double in time between two
  checks. Why not every step: on a slow link each check costs a latency-bound all-reduce
  (2(W − 1) latencies of a ring), which DiLoCo and local SGD otherwise pay once per H steps.
"""

from __future__ import annotations

import math

import torch

from cloudburst.comm.collectives import all_reduce_sum, world_sum
from cloudburst.loop.evaluator import Evaluator
from cloudburst.runtime.context import Context
from cloudburst.strategies.base import Strategy

#: The most steps between two checks of a lockstep job (bounds the overshoot of a run whose
#: steps suddenly slow down).
MAX_CHECK_INTERVAL = 100


class TimeBudget:
    """``over(step)`` after each step: True once this worker's training time budget is spent
    (for a lockstep strategy: once the agreed clock says so, at the same step on every rank).
    ``evaluator``: this worker's, whose time spent evaluating is left off the clock."""

    def __init__(self, ctx: Context, strategy: Strategy, evaluator: Evaluator | None = None):
        self.ctx, self.strategy, self.evaluator = ctx, strategy, evaluator
        self.budget_s = float(ctx.cfg.training.max_train_time_s)
        self.lockstep = bool(strategy.lockstep) and ctx.num_workers > 1
        # --replica node: a node's workers stop at the same step (their leader's clock), and
        # a lockstep strategy's nodes too (worker 0's).
        self.node = ctx.node_replica_group is not None and not self.lockstep
        self.lockstep |= self.node
        self.next_check: int | None = None  # lockstep: the step of the next check
        self.last: tuple[int, float] | None = None  # lockstep: (step, clock) at the last one
        self.checks = 0
        self.reached = False

    @property
    def active(self) -> bool:
        return self.budget_s > 0

    def train_time_s(self) -> float:
        """This worker's training clock: the job's clock less its evaluations."""
        return self.ctx.elapsed_s() - (self.evaluator.eval_s if self.evaluator else 0.0)

    def over(self, step: int, total: int | None = None) -> bool:
        """After step ``step``: is the budget spent? (Never checked after the last step,
        ``total``: the run ends there anyway.)"""
        if not self.active or self.reached or (total is not None and step >= total):
            return self.reached
        if not self.lockstep:
            self.reached = self.train_time_s() >= self.budget_s
            return self.reached
        if self.next_check is not None and step < self.next_check:
            return False
        clock_s = self._agreed_clock_s()
        self.reached = clock_s >= self.budget_s
        self.next_check = step + self._interval(step, clock_s)
        self.last = (step, clock_s)
        return self.reached

    def _agreed_clock_s(self) -> float:
        """Worker 0's training clock, on every worker (the others add 0)."""
        ctx = self.ctx
        self.checks += 1
        if self.node:
            mine = self.train_time_s() if ctx.leads_replica else 0.0
            t = torch.tensor([mine], dtype=torch.float64)
            all_reduce_sum(t, ctx.node_replica_group, self.strategy.stats, comm=ctx.comm)
            return float(t.item())
        mine = self.train_time_s() if ctx.worker_index == 0 else 0.0
        if ctx.num_servers:  # a lockstep plug-in with servers: the workers' group
            t = torch.tensor([mine], dtype=torch.float64)
            all_reduce_sum(t, ctx.workers_group, self.strategy.stats, comm=ctx.comm)
            return float(t.item())
        # The workers are the world (gloo, CPU); an emulated slow link delays it as it would.
        (clock_s,) = world_sum(
            [mine],
            self.strategy.stats,
            link=ctx.link,
            spans_nodes=ctx.num_nodes > 1,
            comm=ctx.comm,
        )
        return clock_s

    def _interval(self, step: int, clock_s: float) -> int:
        """Steps to the next check: half of what the budget leaves at the last interval's
        pace (1 after the first check: no pace is known yet)."""
        if self.last is None:
            return 1
        last_step, last_s = self.last
        pace_s = (clock_s - last_s) / max(1, step - last_step)
        if pace_s <= 0:
            return 1
        left_steps = (self.budget_s - clock_s) / pace_s
        if not math.isfinite(left_steps):
            return 1
        return int(min(MAX_CHECK_INTERVAL, max(1, left_steps // 2)))

    def stopped_by(self) -> str:
        """Why the worker's training ended: ``time_budget`` or its ``steps``."""
        return "time_budget" if self.reached else "steps"
