"""Asynchronous DiLoCo's settings (``[async_diloco]``: Delayed Nesterov's N and c, DyLU), with
its checks of the asgd, local SGD and DiLoCo settings it reads. Torch-free: the CLI imports it
before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cloudburst.config.fields import FRACTION, STEP_COUNT, ConfigError, Section, option


@dataclass
class AsyncDilocoConfig(Section):
    """Asynchronous DiLoCo (docs/algorithms.md#async_diloco; Liu et al. 2024): every H =
    ``period`` inner steps a worker pushes its pseudo-gradient to the shards and fetches θ,
    with no barrier; the shards' outer optimizer is Delayed Nesterov with DiLoCo's outer lr
    and momentum (``diloco_outer_lr``, ``diloco_outer_momentum``)."""

    section: ClassVar[str] = "async_diloco"
    title: ClassVar[str] = "asynchronous DiLoCo (--strategy async_diloco, with --servers)"

    dn_period: int | None = option(
        None,
        "N: Delayed Nesterov's momentum step every N pushes, plain SGD of lr η/N in between",
        shown="W, the number of workers",
        bounds=STEP_COUNT,
    )
    dn_c: float = option(
        0.0,
        "c: the share of the momentum step also taken between momentum steps (0: DN)",
        bounds=FRACTION,
    )
    dylu: bool = option(
        False,
        "Dynamic Local Updates: after each push, worker i runs H_i = max(1, round(H·speed_i / "
        "max speed)) inner steps, speed_i its measured steps per second (the first round: H)",
    )

    def dn_period_value(self, cfg: Any) -> int:
        if self.dn_period is not None:
            return self.dn_period
        ok = isinstance(cfg.job.workers, int) and cfg.job.workers > 0
        return max(1, cfg.replicas) if ok else 1

    def validate(self, cfg: Any) -> None:
        if AsyncDilocoConfig not in cfg.strategy_spec.settings:  # another strategy runs
            if self.dylu or self.dn_period is not None or self.dn_c:
                raise ConfigError(
                    f"dylu: Delayed Nesterov's and Dynamic Local Updates' settings apply to "
                    f"--strategy async_diloco only, not {cfg.job.strategy!r}"
                )
