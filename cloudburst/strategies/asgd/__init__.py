"""``asgd``: asynchronous SGD with a sharded parameter server (Downpour; GPU A-SGD)."""

from __future__ import annotations

from typing import Any

from cloudburst.strategies.asgd.settings import AsgdConfig
from cloudburst.strategies.spec import StrategySpec, worker_attributes


class Asgd(StrategySpec):
    name = "asgd"
    worker = "cloudburst.strategies.asgd.worker:AsgdStrategy"
    rule = "cloudburst.strategies.asgd.rules:from_config"
    server = "cloudburst.strategies.asgd.serve:serve_shard"
    summary = "cloudburst.strategies.asgd.summary:server_summary"
    report_columns = (("staleness", "mean_staleness_versions", "{:.2f}"),)
    settings = (AsgdConfig,)
    needs_servers = True
    compression = ("none", "bf16", "fp8", "int8")
    compresses_messages = True
    survives_worker_loss = True
    shards_restart_in_place = True
    standby_shards = True

    @classmethod
    def has_standby(cls, cfg: Any) -> bool:
        return cls.standby_shards and cfg.asgd.shard_standby

    @classmethod
    def shard_rule(cls, cfg: Any) -> tuple[str, float]:
        return cfg.asgd.server_rule, cfg.asgd.server_lr

    @classmethod
    def warnings(cls, cfg: Any) -> list[str]:
        n, who = cfg.replicas, "node replicas" if cfg.cluster.replica == "node" else "workers"
        # under `scale` each push is divided by its staleness (≈ W − 1) already
        total = cfg.asgd.server_lr * (1 if cfg.asgd.staleness_compensation == "scale" else n)
        if cfg.asgd.server_rule == "add" and n >= 2 and total > 1.5:
            return [
                f"asgd: server lr λ = {cfg.asgd.server_lr:g} with {n} {who} adds up "
                f"their pushes ({total:g}x one worker's step) and "
                f"diverged in our measurements (benchmarks/results/defaults.md); the default "
                f"λ = 1/W = {1 / n:g} averages them"
            ]
        return []

    @classmethod
    def run_label(cls, summary: dict[str, Any]) -> str:
        config = summary.get("config", {})
        n = config.get("n_fetch"), config.get("n_push")
        if n[0] == n[1]:
            return f" S={summary['servers']} n_sync={n[0]}"
        return f" n_fetch={n[0]} n_push={n[1]}"


__getattr__ = worker_attributes(__name__)
