"""EASGD's settings (``[easgd]``: τ, α, β). Torch-free: the CLI imports it before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cloudburst.config.fields import _check_float, _check_int, option


@dataclass
class EasgdConfig:
    """EASGD (docs/algorithms.md#easgd): every τ steps e = α (θ_i − θ̃); θ_i −= e; θ̃ += e on the
    servers."""

    section: ClassVar[str] = "easgd"
    title: ClassVar[str] = "EASGD (--strategy easgd, with --servers)"

    easgd_tau: int = option(10, "τ: an elastic step every τ local steps")
    easgd_alpha: float | None = option(None, "α, the elastic force", shown="β/W")
    easgd_beta: float = option(0.9, "β")

    @property
    def easgd_alpha_value(self) -> float:
        """α of EASGD: as given, else β / W."""
        return self.easgd_alpha if self.easgd_alpha is not None else self.easgd_beta / self.workers

    def _validate_easgd(self) -> None:
        _check_int("easgd_tau", self.easgd_tau, 1)
        if self.easgd_alpha is not None:
            _check_float("easgd_alpha", self.easgd_alpha, 0.0, 1.0, low_open=True)
        _check_float("easgd_beta", self.easgd_beta, 0.0, None, low_open=True)
