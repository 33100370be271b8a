"""EASGD's settings (``[easgd]``: τ, α, β). Torch-free: the CLI imports it before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cloudburst.config.fields import STEP_COUNT, Bounds, Section, option


@dataclass
class EasgdConfig(Section):
    """EASGD (docs/algorithms.md#easgd): every τ steps e = α (θ_i − θ̃); θ_i −= e; θ̃ += e on the
    servers."""

    section: ClassVar[str] = "easgd"
    title: ClassVar[str] = "EASGD (--strategy easgd, with --servers)"
    prefix: ClassVar[str] = "easgd_"

    tau: int = option(10, "τ: an elastic step every τ local steps", bounds=STEP_COUNT)
    alpha: float | None = option(
        None, "α, the elastic force", shown="β/W", bounds=Bounds(0.0, 1.0, low_open=True)
    )
    beta: float = option(0.9, "β", bounds=Bounds(0.0, 1000.0, low_open=True))

    def alpha_value(self, cfg: Any) -> float:
        """α of EASGD: as given, else β / W (W: the replicas, workers or nodes)."""
        if self.alpha is not None:
            return self.alpha
        return self.beta / cfg.replicas

    def validate(self, cfg: Any) -> None:
        """Its ranges only (the fields' bounds)."""
