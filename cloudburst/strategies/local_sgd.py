"""``local_sgd`` (post-local SGD) and ``diloco``: average the replicas every H local steps.

``local_sgd`` (docs/algorithms.md#local_sgd-and-diloco; Lin et al. 2020's post-local SGD): each
worker trains its own replica with its local optimizer; every H = ``period`` steps the workers
average their parameters (a blocking all-reduce). The first ``local_sgd_warmup_steps`` steps average
every step, which for SGD (with momentum and weight decay) is exactly synchronous SGD.

``diloco`` (Douillard et al. 2023): the local optimizer is the *inner* optimizer; every H steps
the workers average the pseudo-gradient Δ = θ_global − θ_local and an *outer* optimizer (SGD
with Nesterov momentum 0.9; lr 0.1 over an SGD inner optimizer, 0.7 over Adam by default)
applies it to θ_global, which every replica then restarts from. With an outer SGD of lr 1 and
no momentum, θ_global becomes the average of the replicas: ``local_sgd``.

Synchronous every H steps (a straggler stalls the others once per period); staleness 0.
A dead worker: the next average raises on every other rank and the job stops, as for sync.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from cloudburst.comm.collectives import all_reduce_sum
from cloudburst.comm.flat import adopt_flat, assign_flat, flatten_params
from cloudburst.strategies.base import Strategy


class LocalSgdStrategy(Strategy):
    name = "local_sgd"
    lockstep = True

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.model = model
        self.optimizer = optimizer
        self._params = list(model.parameters())
        self._flat = flatten_params(self._params)
        self.averages = 0
        topo = self.ctx.topology
        self.spans_nodes = topo is not None and topo.spans_nodes(self.ctx.worker_ranks)
        return model

    #: Averaging one replica is a no-op; DiLoCo's outer step is not.
    needs_peers = True

    def period(self) -> int:
        return self.cfg.period

    def _due(self, step: int) -> bool:
        if step <= self.cfg.local_sgd_warmup_steps:
            return True
        return step % self.period() == 0

    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        if (self.cfg.workers > 1 or not self.needs_peers) and self._due(self.local_steps):
            self._synchronise()

    def _average(self, fresh: bool = False) -> torch.Tensor:
        """The average of the replicas' parameters (in ``self._flat``, or a new vector)."""
        flat = flatten_params(self._params, out=None if fresh else self._flat)
        all_reduce_sum(
            flat,
            self.ctx.workers_group,
            self.stats,
            link=self.ctx.link,
            spans_nodes=self.spans_nodes,
            comm=self.ctx.comm,
        )
        self.averages += 1
        return flat.div_(self.cfg.workers)

    def _synchronise(self) -> None:
        # The parameters become views of the fresh averaged vector (no copy back).
        adopt_flat(self._params, self._average(fresh=True))

    def finish(self) -> None:
        # End on one model: average whatever the replicas did since the last period.
        if (self.cfg.workers > 1 or not self.needs_peers) and not self._due(self.local_steps):
            self._synchronise()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "averages": self.averages}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.averages = int(state["averages"])

    def global_params(self) -> tuple[torch.Tensor, int] | None:
        return self.replica_params()

    def report(self) -> dict[str, Any]:
        r = super().report()
        r["averages"] = self.averages
        return r


class DilocoStrategy(LocalSgdStrategy):
    name = "diloco"
    needs_peers = False

    def _due(self, step: int) -> bool:
        return step % self.period() == 0

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        super().wrap(model, optimizer)
        # θ_global lives in a parameter of its own, so the outer optimizer is a plain torch
        # optimizer (with its momentum state) over one flat tensor.
        self.global_theta = nn.Parameter(flatten_params(model).clone(), requires_grad=False)
        self.outer = torch.optim.SGD(
            [self.global_theta],
            lr=self.cfg.diloco_outer_lr,
            momentum=self.cfg.diloco_outer_momentum,
            nesterov=self.cfg.diloco_nesterov and self.cfg.diloco_outer_momentum > 0,
        )
        return model

    def _synchronise(self) -> None:
        mean_local = self._average()
        # Pseudo-gradient: how far the replicas moved away from θ_global, on average.
        self.global_theta.grad = self.global_theta.detach() - mean_local
        self.outer.step()
        self.global_theta.grad = None
        assign_flat(self.model, self.global_theta.detach())

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "global_theta": self.global_theta.detach().clone(),
            "outer": copy.deepcopy(self.outer.state_dict()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "local_steps" in state:
            super().load_state_dict(state)
        with torch.no_grad():
            self.global_theta.copy_(state["global_theta"])
        self.outer.load_state_dict(state["outer"])
