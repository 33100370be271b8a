"""``diloco``: DiLoCo (and Streaming DiLoCo), an outer Nesterov step on the averaged
pseudo-gradient every H local steps; local SGD's worker with an outer optimizer."""

from __future__ import annotations

from typing import Any

from cloudburst.strategies.diloco.settings import DilocoConfig
from cloudburst.strategies.local_sgd import LocalSgd
from cloudburst.strategies.spec import worker_attributes


class Diloco(LocalSgd):
    name = "diloco"
    worker = "cloudburst.strategies.diloco.worker:DilocoStrategy"
    settings = (DilocoConfig,)

    @classmethod
    def warnings(cls, cfg: Any) -> list[str]:
        if cfg.optimizer == "sgd" and cfg.diloco_outer_lr * (1 + cfg.diloco_outer_momentum) > 1.0:
            return [
                f"diloco: outer lr {cfg.diloco_outer_lr:g} with momentum "
                f"{cfg.diloco_outer_momentum:g} over an SGD inner optimizer diverged in our "
                "measurements (benchmarks/results/local_sgd.md); DiLoCo's defaults assume an "
                "Adam inner optimizer (--optimizer adam), or use --diloco-outer-lr 0.1"
            ]
        return []


__getattr__ = worker_attributes(__name__)
