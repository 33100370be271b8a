"""``easgd``: elastic averaging SGD (Zhang et al. 2015), the centre on the shards; asgd's
worker and shards with the elastic exchange."""

from __future__ import annotations

from typing import Any

from cloudburst.strategies.asgd import Asgd
from cloudburst.strategies.easgd.settings import EasgdConfig
from cloudburst.strategies.spec import StrategySpec, worker_attributes


class Easgd(Asgd):
    name = "easgd"
    worker = "cloudburst.strategies.easgd.worker:EasgdStrategy"
    rule = "cloudburst.strategies.easgd.rule:from_config"
    settings = (EasgdConfig,)
    # Its exchanges do not reconnect to a restarted shard (yet): a restarted shard fails at
    # once, and the job stops as without restarts (resume it with --resume).
    shards_restart_in_place = False
    standby_shards = False
    compensation_refused = (
        "applies to asgd's pushes, not to EASGD's exchanges (the worker moves by the same "
        "elastic difference the centre takes; a shard-side change would break that)"
    )

    @classmethod
    def shard_rule(cls, cfg: Any) -> tuple[str, float]:
        if cls.message_method(cfg.cluster.compress) != "none":
            # Compressed, the worker computes e = α(θ_i − θ̃) and sends it: the centre adds.
            return "add", 1.0
        return "elastic", cfg.easgd.alpha_value(cfg)

    # asgd's warning (its add rule's λ) and plot label (n_sync) are not this strategy's.
    warnings = StrategySpec.__dict__["warnings"]
    run_label = StrategySpec.__dict__["run_label"]


__getattr__ = worker_attributes(__name__)
