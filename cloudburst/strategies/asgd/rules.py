"""Server rules: how a shard moves θ_k by one admitted push. A :class:`~cloudburst.strategies.
asgd.shard.ShardState` applies whatever rule it is given; a strategy whose shards need another
rule ships it in its own package and returns it from its spec's ``server_rule`` (EASGD's
elastic centre, async DiLoCo's Delayed Nesterov). asgd's own: ``--server-rule`` add, sgd,
adagrad.

A rule sees the push after compensation (Δ̃, or Δ) and the scalar staleness factor s, and
gives the change u it makes to θ_k twice: without changing anything (:meth:`ServerRule.update`,
so that a push can be refused before it lands) and for real (:meth:`ServerRule.step`).
"""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar

import torch


def all_finite(t: torch.Tensor) -> bool:
    """Exact, and fast on the common path: a NaN or ±Inf element always makes the sum
    non-finite, so a finite sum proves every element finite (one reduction instead of a full
    boolean tensor). A non-finite sum may still be an overflow of finite values: check exactly.
    """
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


class ServerRule:
    name: ClassVar[str]
    #: The staleness factor and the compensator apply to its pushes (False: EASGD's elastic
    #: step, which the worker mirrors exactly).
    takes_compensation: ClassVar[bool] = True
    #: u depends on the push and θ_k before it alone (no state), so a PUSH_FETCH reply can
    #: carry θ_k before the push, sent while the push arrives: asgd's worker rebuilds the
    #: rest as θ_k + α·Δ with the rule's own :meth:`alpha`, which such a rule must give.
    stateless: ClassVar[bool] = False

    def __init__(self, lr: float):
        self.lr = lr
        self.param: torch.nn.Parameter | None = None

    def bind(self, param: torch.nn.Parameter) -> None:
        """The shard's θ_k, which :meth:`step` moves (called once, by the shard)."""
        self.param = param

    def alpha(self, factor: float) -> float | None:
        """α where u = α·push, when u is that (the cheap bound check); None otherwise."""
        return None

    def update(
        self, push: torch.Tensor, factor: float
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """u; whether the rule's state would stay finite; and the push's own step that
        ``--max-push-ratio`` bounds instead of u (None: u). Nothing changes."""
        raise NotImplementedError

    def step(self, push: torch.Tensor, factor: float) -> None:
        """θ_k ← θ_k + u, the rule's state updated."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (called only with a non-empty one)."""


class AddRule(ServerRule):
    """``add``: θ_k ← θ_k + λ·s·Δ_k (λ = ``lr``; DistBelief/GPU A-SGD)."""

    name = "add"
    stateless = True

    def alpha(self, factor: float) -> float:
        return self.lr * factor

    def update(self, push, factor):
        return push.mul(self.alpha(factor)), True, None

    def step(self, push, factor):
        self.param.add_(push, alpha=self.alpha(factor))


class OptimizerRule(ServerRule):
    """A torch optimizer on the pseudo-gradient −s·Δ_k."""

    def __init__(self, lr: float, momentum: float = 0.0):
        super().__init__(lr)
        self.momentum = momentum
        self.optimizer: torch.optim.Optimizer | None = None

    def bind(self, param):
        super().bind(param)
        self.optimizer = self._build(param)

    def _build(self, param: torch.nn.Parameter) -> torch.optim.Optimizer:
        raise NotImplementedError

    def step(self, push, factor):
        self.param.grad = push.mul(-factor)
        self.optimizer.step()
        self.param.grad = None

    def state_dict(self):
        # deepcopy: the optimizer's state_dict shares its buffers with the live optimizer
        return copy.deepcopy(self.optimizer.state_dict())

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


class SgdRule(OptimizerRule):
    """``sgd``: SGD with momentum (``torch.optim.SGD``: dampening 0, no Nesterov, no weight
    decay) on −s·Δ_k."""

    name = "sgd"

    def _build(self, param):
        return torch.optim.SGD([param], lr=self.lr, momentum=self.momentum)

    def update(self, push, factor):
        g = push.mul(-factor)
        state = self.optimizer.state.get(self.param, {})
        group = self.optimizer.param_groups[0]
        buf = state.get("momentum_buffer")  # buf ← μ·buf + g (g on the first step)
        if group["momentum"] and buf is not None:
            g = buf.mul(group["momentum"]).add_(g)
        state_finite = all_finite(g)
        return g.mul_(-group["lr"]), state_finite, None


class AdagradRule(OptimizerRule):
    """``adagrad``: ``torch.optim.Adagrad`` on −s·Δ_k. The bound applies to the push's own
    step λ·s·Δ̃, not to u: Adagrad's step is at most λ per coordinate whatever the push (its
    first one, λ·sign(g), may be longer than θ_k; a refusal would leave its state as it was,
    so every later push would be refused too)."""

    name = "adagrad"

    def _build(self, param):
        return torch.optim.Adagrad([param], lr=self.lr)

    def update(self, push, factor):
        g = push.mul(-factor)
        state = self.optimizer.state.get(self.param, {})
        group = self.optimizer.param_groups[0]
        # clr = lr / (1 + (step − 1)·lr_decay), lr_decay = 0; weight_decay = 0
        total = state["sum"].add(g * g)
        own = g.mul(-group["lr"])
        update = g.div(total.sqrt().add_(group["eps"])).mul_(-group["lr"])
        return update, all_finite(total), own


#: ``--server-rule`` (settings.SERVER_RULES, which a test keeps equal to these names).
ASGD_RULES: dict[str, type[ServerRule]] = {r.name: r for r in (AddRule, SgdRule, AdagradRule)}


def from_config(cfg: Any) -> ServerRule:
    """asgd's shards: ``--server-rule`` with ``--server-lr`` and ``--server-momentum``."""
    return asgd_rule(cfg.asgd.server_rule, cfg.asgd.server_lr, cfg.asgd.server_momentum)


def asgd_rule(name: str, lr: float, momentum: float = 0.0) -> ServerRule:
    """asgd's rule ``name`` (``momentum``: sgd's)."""
    if name not in ASGD_RULES:
        raise ValueError(f"unknown server rule {name!r}")
    return SgdRule(lr, momentum) if name == "sgd" else ASGD_RULES[name](lr)
