"""EASGD's server rule: the shard holds the centre variable θ̃ (a :class:`~cloudburst.
strategies.asgd.rules.ServerRule`)."""

from __future__ import annotations

from typing import Any

import torch

from cloudburst.strategies.asgd.rules import AddRule, ServerRule


def elastic_step(alpha: float, theta_worker: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """EASGD's elastic difference e = α(θ_i − θ̃): the centre adds it, the worker subtracts it.

    Both sides call this on the same values (the worker gets θ̃ as it was before its push), so
    they compute the same e bit for bit.
    """
    return (theta_worker - centre).mul_(alpha)


class ElasticRule(ServerRule):
    """``elastic``: the push carries the worker's θ_i (not Δ) and θ̃_k ← θ̃_k + α·(θ_i,k −
    θ̃_k) with α = ``lr`` (the worker moves by the same e, away). No staleness factor or
    compensator: a shard-side change would break the symmetry."""

    name = "elastic"
    takes_compensation = False
    stateless = True

    def update(self, push, factor):
        return elastic_step(self.lr, push, self.param.data), True, None

    def step(self, push, factor):
        self.param.add_(elastic_step(self.lr, push, self.param))


def from_config(cfg: Any) -> ServerRule:
    """EASGD's shards: the elastic centre with α; compressed, the worker sends e = α(θ_i − θ̃)
    itself and the centre adds it (``Easgd.shard_rule``)."""
    name, lr = cfg.strategy_spec.shard_rule(cfg)
    return AddRule(lr) if name == "add" else ElasticRule(lr)
