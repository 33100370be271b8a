"""The one interface every strategy implements; the training loop drives it.

A user's own loop needs four added lines (see docs/api.md): ``model = strategy.wrap(model,
optimizer)``, ``strategy.start()``, ``strategy.after_step()`` after each optimizer step, and
``strategy.finish()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from cloudburst.comm.flat import flatten_params
from cloudburst.comm.stats import CommStats
from cloudburst.strategies.spec import StrategySpec


class Strategy(StrategySpec, ABC):
    """A worker's side of a strategy; its traits (class attributes) come from its package's
    :class:`~cloudburst.strategies.spec.StrategySpec`, which it inherits."""

    @classmethod
    def worker_class(cls) -> type[Strategy]:
        return cls

    def __init__(self, ctx):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.stats = CommStats()
        self.model: nn.Module | None = None
        self.local_steps = 0
        #: Set by :meth:`after_step` at a step where the strategy changed its optimizer's state
        #: (DES-LOC's moment averages): a node replica's followers then take the leader's.
        self.optimizer_state_changed = False

    @abstractmethod
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """Take ownership of the replica; return the module the loop should call."""

    def configure(self, steps_per_epoch: int, total_steps: int) -> None:
        """Called before :meth:`wrap` by loops that know the run's length (for schedules)."""

    def record_loss(self, loss: float) -> None:
        """Called with each step's training loss, before :meth:`after_step`."""

    def step_info(self) -> dict[str, Any]:
        """Extra fields for this step's metrics record (e.g. DASO's phase, B and S)."""
        return {}

    def start(self) -> None:
        """Called once before the first step (after any warm-up on the warm-start worker)."""

    def after_backward(self) -> None:
        """Called right after ``loss.backward()``."""

    @abstractmethod
    def after_step(self, samples: int) -> None:
        """Called after every optimizer step; ``samples`` is the batch size of that step."""

    def replica_weight(self) -> float:
        """This replica's weight in the final average of a decentralised strategy's replicas,
        Σ w_i θ_i / Σ w_i (push-sum's w_i; 1 otherwise)."""
        return 1.0

    def global_params(self) -> tuple[torch.Tensor, int] | None:
        """(flat θ of the global model, training samples behind it) when fresh this step."""
        return None

    def replica_params(self) -> tuple[torch.Tensor, int]:
        """This worker's replica, flat, and every worker's training samples so far: the
        global model of the replicated strategies (sync, daso, local SGD, gossip)."""
        samples = self.local_steps * self.cfg.training.batch_size * self.cfg.job.workers
        return flatten_params(self.model), samples

    def fetch_global_params(self) -> tuple[torch.Tensor, int] | None:
        """Like :meth:`global_params`, communicating if needed (for evaluation when due)."""
        return self.global_params()

    def finish(self) -> None:
        """Called once after the last step: flush pending updates, leave the job cleanly."""

    def state_dict(self) -> dict[str, Any]:
        """What a worker checkpoint needs to continue this strategy (extended by subclasses)."""
        return {"local_steps": self.local_steps, "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local_steps = int(state["local_steps"])
        self.stats.load_state_dict(state["stats"])

    def checkpoint_ready(self) -> bool:
        """False while the state cannot be saved (DASO: a global sync in flight); the loop
        then checkpoints at the next step where it can."""
        return True

    @property
    def is_evaluator(self) -> bool:
        """The worker that evaluates the global model during training: worker 0."""
        return self.ctx.worker_index == 0

    def report(self) -> dict[str, Any]:
        return self.stats.as_dict()
