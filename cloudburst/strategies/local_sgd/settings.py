"""Local SGD's settings (``[local_sgd]``: H = ``period``, the post-local SGD warm-up), read by
diloco and async_diloco too. Torch-free: the CLI imports it before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cloudburst.config.fields import _check_int, option

_LOCAL_SGD_TITLE = "local SGD and DiLoCo (--strategy local_sgd | diloco)"


@dataclass
class LocalSgdConfig:
    """local_sgd (docs/algorithms.md#local_sgd-and-diloco): average the replicas every
    H = period local steps."""

    section: ClassVar[str] = "local_sgd"
    title: ClassVar[str] = _LOCAL_SGD_TITLE

    period: int = option(8, "H: average every H local steps (diloco: an outer step)")
    local_sgd_warmup_steps: int = option(
        0, "post-local SGD: average every step for this many steps first"
    )

    def _validate_local_sgd(self) -> None:
        _check_int("period", self.period, 1)
        _check_int("local_sgd_warmup_steps", self.local_sgd_warmup_steps, 0)
