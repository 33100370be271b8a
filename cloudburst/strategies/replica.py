"""``--replica node``: a node's workers are one replica, and the strategy runs between nodes.

Every worker of a node computes its own batch's gradients; they are averaged over the node
(an all-reduce on the node's group, every step: data parallelism inside the replica), so the
node's workers hold the same θ and optimizer state, and the replica trains with the node's
batch (G workers × ``batch_size``). Only the node's first worker, its *leader*, runs the
configured strategy, among the leaders (the Context's ``replica_*`` view); whenever the
strategy changes the leader's θ (an average, an outer step, a fetch from the servers, a gossip
fold), the leader broadcasts it to its node before the next step. What crosses the slow link
is what N replicas send, not W workers. DASO is this idea with a schedule of its own
(docs/algorithms.md#node-replicas).

Contract: the node's workers call every hook at the same steps (the loop does); a follower
that dies stalls its leader's next node all-reduce, which times out (``comm_timeout_s``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cloudburst.comm.collectives import all_reduce_sum, broadcast
from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.strategies import strategy_spec
from cloudburst.strategies.base import Strategy
from cloudburst.strategies.spec import StrategySpec

#: What the leader tells its node after each step: θ changed, optimizer state reset,
#: a checkpoint may be taken now, optimizer state changed (the leader's is sent).
_CHANGED, _RESET, _READY, _STATE = range(4)


class NodeReplica(Strategy):
    """One worker's side of a node replica: the leader's wraps the configured strategy
    (``inner``), a follower's (``inner`` None) mirrors its leader."""

    def __init__(self, ctx, inner: Strategy | None):
        super().__init__(ctx)
        self.inner = inner
        spec = ctx.cfg.strategy_spec
        for trait in StrategySpec.__annotations__:  # the configured strategy's traits
            setattr(self, trait, getattr(spec, trait))
        if inner is not None:
            self.stats = inner.stats  # the node's traffic is counted with the strategy's
        self.group = ctx.node_replica_group
        self.leader = ctx.replica_leaders[ctx.replica_index]
        self.ranks_per_replica = ctx.comm.group_size(self.group)
        self._ready = True
        self.broadcasts = 0  # the times the leader's θ was sent to its node
        # The flag of each step carries _STATE only for a strategy that uses it.
        self._flags = 4 if spec.changes_optimizer_state(ctx.cfg) else 3

    # ------------------------------------------------------------------ set-up
    def configure(self, steps_per_epoch: int, total_steps: int) -> None:
        if self.inner is not None:
            self.inner.configure(steps_per_epoch, total_steps)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.model, self.optimizer = model, optimizer
        self._device = next(model.parameters()).device
        return self.inner.wrap(model, optimizer) if self.inner is not None else model

    def start(self) -> None:
        if self.inner is not None:
            self.inner.start()
        self._share_theta()  # a fetch from the servers, a resumed replica: the leader's

    # ------------------------------------------------------------------ every step
    def after_backward(self) -> None:
        """Average the node's gradients (the replica's gradient over its G batches)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            flat = flatten_params(grads)
            all_reduce_sum(flat, self.group, self.stats, comm=self.ctx.comm)
            assign_flat(grads, flat.div_(self.ranks_per_replica))
        if self.inner is not None:
            self.inner.after_backward()

    def record_loss(self, loss: float) -> None:
        if self.inner is not None:
            self.inner.record_loss(loss)

    def after_step(self, samples: int) -> None:
        """The leader's strategy step (with the node's samples); then the node learns
        whether θ changed, and gets it if so."""
        self.local_steps += 1
        flag = torch.zeros(self._flags, device=self._device)
        if self.inner is not None:
            before = flatten_params(self.model)
            had_state = bool(self.optimizer.state)
            self.inner.after_step(samples * self.ranks_per_replica)
            flag[_CHANGED] = float(not torch.equal(before, flatten_params(self.model)))
            flag[_RESET] = float(had_state and not self.optimizer.state)
            flag[_READY] = float(self.inner.checkpoint_ready())
            if self._flags > _STATE:
                flag[_STATE] = float(self.inner.optimizer_state_changed)
        self._broadcast(flag)
        if self.inner is None:
            if flag[_RESET]:
                self.optimizer.state.clear()  # the leader's strategy reset its optimizer
            self._ready = bool(flag[_READY])
        if flag[_CHANGED]:
            self._share_theta()
        if self._flags > _STATE and flag[_STATE]:
            self._share_optimizer_state()

    def _share_optimizer_state(self) -> None:
        """The leader's optimizer state tensors (every parameter's, by key), to its node."""
        state = self.optimizer.state
        tensors = [
            state[p][k]
            for p in self.model.parameters()
            if p in state
            for k in sorted(state[p])
            if k != "step" and torch.is_tensor(state[p][k])
        ]
        if tensors:
            flat = flatten_params(tensors)
            self._broadcast(flat)
            if self.inner is None:
                assign_flat(tensors, flat)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        ctx = self.ctx
        broadcast(tensor, self.leader, self.group, self.stats, ctx.rank, comm=ctx.comm)

    def _share_theta(self) -> None:
        flat = flatten_params(self.model)
        self._broadcast(flat)
        self.broadcasts += 1
        if self.inner is None:
            assign_flat(self.model, flat)

    # ------------------------------------------------------------------ the global model
    def step_info(self) -> dict[str, Any]:
        return self.inner.step_info() if self.inner is not None else {}

    def global_params(self) -> tuple[torch.Tensor, int] | None:
        return self.inner.global_params() if self.inner is not None else None

    def replica_weight(self) -> float:
        return self.inner.replica_weight() if self.inner is not None else 1.0

    def replica_params(self) -> tuple[torch.Tensor, int]:
        if self.inner is not None:
            return self.inner.replica_params()
        return super().replica_params()

    def fetch_global_params(self) -> tuple[torch.Tensor, int] | None:
        return self.inner.fetch_global_params() if self.inner is not None else None

    @property
    def is_evaluator(self) -> bool:
        return self.inner is not None and self.inner.is_evaluator

    # ------------------------------------------------------------------ the end, checkpoints
    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()
        self._share_theta()  # the replica's final θ (a last average, a folded push)

    def checkpoint_ready(self) -> bool:
        return self.inner.checkpoint_ready() if self.inner is not None else self._ready

    def state_dict(self) -> dict[str, Any]:
        own = {"node_broadcasts": self.broadcasts}
        if self.inner is not None:
            return {**self.inner.state_dict(), **own}
        return {**super().state_dict(), **own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.broadcasts = int(state.get("node_broadcasts", 0))
        if self.inner is not None:
            self.inner.load_state_dict(state)
        else:
            super().load_state_dict(state)

    def report(self) -> dict[str, Any]:
        own = {"node_broadcasts": self.broadcasts, "replica": self.ctx.replica_index}
        if self.inner is not None:
            return {**self.inner.report(), **own}
        return {**super().report(), **own}

    def __getattr__(self, name: str) -> Any:
        """The leader's strategy's own attributes (e.g. ``last_staleness``); nothing on a
        follower."""
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def make_strategy(ctx) -> Strategy:
    """This worker's strategy (the registry's worker class for ``ctx.cfg.job.strategy``); with
    ``--replica node``, wrapped as its node's replica: only a node's leader runs the strategy
    itself."""
    worker = strategy_spec(ctx.cfg.job.strategy).worker_class()
    if ctx.replica_leaders is None:
        return worker(ctx)
    return NodeReplica(ctx, worker(ctx) if ctx.leads_replica else None)
