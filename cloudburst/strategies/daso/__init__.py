"""``daso``: DASO (Coquelin et al. 2021), node-local synchronous, global asynchronous."""

from __future__ import annotations

from typing import Any

from cloudburst.config.fields import ConfigError
from cloudburst.strategies.daso.settings import DasoConfig
from cloudburst.strategies.spec import StrategySpec, worker_attributes


class Daso(StrategySpec):
    name = "daso"
    worker = "cloudburst.strategies.daso.worker:DasoStrategy"
    settings = (DasoConfig,)
    compression = ("none", "bf16", "fp8", "int8")
    lockstep = True
    node_replicas_refused = "DASO is already synchronous inside a node, with its own schedule"

    @classmethod
    def validate(cls, cfg: Any) -> None:
        nodes = cfg.cluster.nodes or 1
        if cfg.job.workers % nodes:
            raise ConfigError(
                f"nodes: {cfg.job.workers} workers do not split evenly over {nodes} nodes "
                "(DASO needs the same number of ranks on every node)"
            )

    @classmethod
    def make_groups(cls, cfg: Any, maker: Any) -> dict[str, Any]:
        # One group per node (the node-local all-reduce), and one per local rank across the
        # nodes (local rank g of every node: the global syncs).
        nodes = maker.worker_nodes("DASO", least=1)
        across = [[ranks[g] for ranks in nodes] for g in range(len(nodes[0]))]
        return {"node": maker.one_per("node", nodes), "across": maker.one_per("across", across)}

    @classmethod
    def validate_compress(cls, cfg: Any, method: str) -> None:
        casts = (
            cfg.daso.downcast,
            cfg.daso.cycling_downcast,
        )
        if method != "none" and casts != ("bf16", "none"):
            raise ConfigError(
                f"compress: {cfg.cluster.compress!r} sends every DASO global sync as {method}; "
                f"--daso-downcast {casts[0]} / --daso-cycling-downcast {casts[1]} apply only "
                "with --compress none (leave them at bf16 / none)"
            )

    @classmethod
    def run_label(cls, summary: dict[str, Any]) -> str:
        return f" nodes={summary.get('nodes', 1)}"


__getattr__ = worker_attributes(__name__)
