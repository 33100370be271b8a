"""``async_diloco``: asynchronous DiLoCo (Liu et al. 2024), pseudo-gradients pushed to the
shards every H inner steps with no barrier, Delayed Nesterov there; asgd's worker and shards."""

from __future__ import annotations

from typing import Any

from cloudburst.strategies.asgd import Asgd
from cloudburst.strategies.async_diloco.settings import AsyncDilocoConfig
from cloudburst.strategies.spec import StrategySpec, worker_attributes


class AsyncDiloco(Asgd):
    name = "async_diloco"
    worker = "cloudburst.strategies.async_diloco.worker:AsyncDilocoStrategy"
    rule = "cloudburst.strategies.async_diloco.rule:from_config"
    settings = (AsyncDilocoConfig,)

    @classmethod
    def shard_rule(cls, cfg: Any) -> tuple[str, float]:
        return "dn", cfg.diloco_outer_lr  # Delayed Nesterov, DiLoCo's outer lr

    # asgd's warning (its add rule's λ) and plot label (n_sync) are not this strategy's.
    warnings = StrategySpec.__dict__["warnings"]
    run_label = StrategySpec.__dict__["run_label"]


__getattr__ = worker_attributes(__name__)
