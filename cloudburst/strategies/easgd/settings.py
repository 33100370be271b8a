"""EASGD's settings (``[easgd]``: τ, α, β). Torch-free: the CLI imports it before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cloudburst.config.fields import STEP_COUNT, Bounds, option


@dataclass
class EasgdConfig:
    """EASGD (docs/algorithms.md#easgd): every τ steps e = α (θ_i − θ̃); θ_i −= e; θ̃ += e on the
    servers."""

    section: ClassVar[str] = "easgd"
    title: ClassVar[str] = "EASGD (--strategy easgd, with --servers)"

    easgd_tau: int = option(10, "τ: an elastic step every τ local steps", bounds=STEP_COUNT)
    easgd_alpha: float | None = option(
        None, "α, the elastic force", shown="β/W", bounds=Bounds(0.0, 1.0, low_open=True)
    )
    easgd_beta: float = option(0.9, "β", bounds=Bounds(0.0, 1000.0, low_open=True))

    @property
    def easgd_alpha_value(self) -> float:
        """α of EASGD: as given, else β / W (W: the replicas, workers or nodes)."""
        if self.easgd_alpha is not None:
            return self.easgd_alpha
        return self.easgd_beta / getattr(self, "replicas", self.workers)

    def _validate_easgd(self) -> None:
        """Its ranges only (the fields' bounds)."""
