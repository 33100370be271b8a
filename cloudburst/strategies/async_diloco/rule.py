"""Async DiLoCo's server rule: Delayed Nesterov on the shards (a :class:`~cloudburst.strategies.
asgd.rules.ServerRule`)."""

from __future__ import annotations

from typing import Any

import torch

from cloudburst.strategies.asgd.rules import ServerRule, all_finite


class DelayedNesterov:
    """Asynchronous DiLoCo's outer optimizer on a shard: Delayed Nesterov (Liu et al. 2024,
    "Asynchronous Local-SGD Training for Language Modeling", arXiv:2401.09135, its Delayed
    Nesterov algorithm, as the HALoS authors' utnslab/halos ``src/halos/opt.py`` implements
    it with the paper cited). With g the push's
    pseudo-gradient (−Δ), t the number of pushes applied before it, N = ``period``, η, β, c:

        a ← a + g
        (t+1) mod N = 0:  m ← β·m + a/N;  θ ← θ − η·(1 − c·N + c)·β·m − (η/N)·g;  a ← 0
        otherwise:                         θ ← θ − η·c·β·m − (η/N)·g

    c = 0 (the default) is the paper's DN: between momentum updates, plain SGD of lr η/N.
    """

    def __init__(self, param: torch.Tensor, lr: float, beta: float, period: int, c: float = 0.0):
        self.param, self.lr, self.beta, self.period, self.c = param, lr, beta, period, c
        self.momentum = torch.zeros_like(param)
        self.accumulated = torch.zeros_like(param)
        self.t = 0

    def step(self, g: torch.Tensor) -> None:
        self.accumulated.add_(g)
        if (self.t + 1) % self.period == 0:
            self.momentum.mul_(self.beta).add_(self.accumulated, alpha=1.0 / self.period)
            coeff = (1.0 - self.c * self.period + self.c) * self.beta
            self.param.add_(self.momentum, alpha=-self.lr * coeff)
            self.accumulated.zero_()
        elif self.c:
            self.param.add_(self.momentum, alpha=-self.lr * self.c * self.beta)
        self.param.add_(g, alpha=-self.lr / self.period)
        self.t += 1

    def update(self, g: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The change :meth:`step` would make to θ for ``g``, and whether its new state (the
        momentum, the accumulated g) would be finite, with nothing changed."""
        update = g.mul(-self.lr / self.period)
        if (self.t + 1) % self.period == 0:
            accumulated = self.accumulated.add(g)
            momentum = self.momentum.mul(self.beta).add_(accumulated, alpha=1.0 / self.period)
            coeff = (1.0 - self.c * self.period + self.c) * self.beta
            state_finite = all_finite(accumulated) and all_finite(momentum)
            return update.add_(momentum, alpha=-self.lr * coeff), state_finite
        if self.c:
            update.add_(self.momentum, alpha=-self.lr * self.c * self.beta)
        return update, all_finite(self.accumulated.add(g))

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum.clone(),
            "accumulated": self.accumulated.clone(),
            "t": self.t,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum.copy_(state["momentum"])
        self.accumulated.copy_(state["accumulated"])
        self.t = int(state["t"])


class DelayedNesterovRule(ServerRule):
    """``dn``: :class:`DelayedNesterov` on the pseudo-gradient −s·Δ_k, with lr η, β =
    ``momentum`` and N = ``period``."""

    name = "dn"

    def __init__(self, lr: float, momentum: float = 0.0, period: int = 1, c: float = 0.0):
        super().__init__(lr)
        self.momentum, self.period, self.c = momentum, period, c
        self.optimizer: DelayedNesterov | None = None

    def bind(self, param):
        super().bind(param)
        self.optimizer = DelayedNesterov(param.data, self.lr, self.momentum, self.period, self.c)

    def update(self, push, factor):
        return (*self.optimizer.update(push.mul(-factor)), None)

    def step(self, push, factor):
        self.optimizer.step(push.mul(-factor))

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


def from_config(cfg: Any) -> ServerRule:
    """Async DiLoCo's shards: Delayed Nesterov with DiLoCo's outer lr and momentum."""
    return DelayedNesterovRule(
        cfg.diloco.outer_lr,
        cfg.diloco.outer_momentum,
        cfg.async_diloco.dn_period_value(cfg),
        cfg.async_diloco.dn_c,
    )
