"""``async_diloco``: asynchronous DiLoCo (Liu et al. 2024), pseudo-gradients pushed to the
shards every H inner steps with no barrier, Delayed Nesterov there; asgd's worker and shards."""

from __future__ import annotations

from typing import Any

from cloudburst.config.fields import ConfigError
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
        return "dn", cfg.diloco.outer_lr  # Delayed Nesterov, DiLoCo's outer lr

    @classmethod
    def validate(cls, cfg: Any) -> None:
        """asgd's and DiLoCo's settings that mean nothing here are refused, not ignored."""
        if cfg.asgd.n_sync is not None:
            raise ConfigError(
                "n_sync: async_diloco pushes every H = --period inner steps (and its fetch "
                "with it); drop --n-sync"
            )
        if cfg.asgd.server_rule != "add":
            raise ConfigError(
                f"server_rule: async_diloco's shards run Delayed Nesterov, not "
                f"{cfg.asgd.server_rule!r}; drop --server-rule"
            )
        if not cfg.diloco.nesterov:
            raise ConfigError(
                "diloco_nesterov: async_diloco's outer optimizer is Delayed Nesterov; drop "
                "--diloco-no-nesterov"
            )
        if cfg.local_sgd.warmup_steps:
            raise ConfigError(
                "local_sgd_warmup_steps: async_diloco has no synchronous warm-up; leave it at 0"
            )

    # asgd's warning (its add rule's λ) and plot label (n_sync) are not this strategy's.
    warnings = StrategySpec.__dict__["warnings"]
    run_label = StrategySpec.__dict__["run_label"]


__getattr__ = worker_attributes(__name__)
