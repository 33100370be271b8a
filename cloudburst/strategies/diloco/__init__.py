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
    #: The outer step's (lr, momentum) over an SGD inner optimizer (settings' defaults).
    outer_over_sgd = (0.5, 0.8)

    @classmethod
    def changes_optimizer_state(cls, cfg: Any) -> bool:
        return bool(cfg.diloco.desloc_first_every or cfg.diloco.desloc_second_every)  # DES-LOC

    @classmethod
    def warnings(cls, cfg: Any) -> list[str]:
        if (
            cfg.training.optimizer == "sgd"
            and cfg.diloco.outer_lr * (1 + cfg.diloco.outer_momentum) > 1.0
        ):
            return [
                f"diloco: outer lr {cfg.diloco.outer_lr:g} with momentum "
                f"{cfg.diloco.outer_momentum:g} over an SGD inner optimizer makes a first outer "
                "step longer than the averaged one (lr × (1 + momentum) > 1): 0.7/0.9 diverged "
                "and 1/0.7 ended near 50 % in our measurements (benchmarks/results/defaults.md, "
                "per_sample.md); the default over SGD is 0.5 with momentum 0.8"
            ]
        return []


__getattr__ = worker_attributes(__name__)
