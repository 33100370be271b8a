"""Local SGD's settings (``[local_sgd]``: H = ``period``, the post-local SGD warm-up), read by
diloco and async_diloco too. Torch-free: the CLI imports it before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cloudburst.config.fields import STEP_COUNT, STEP_COUNT_OR_0, Section, option

_LOCAL_SGD_TITLE = "local SGD and DiLoCo (--strategy local_sgd | diloco)"


@dataclass
class LocalSgdConfig(Section):
    """local_sgd (docs/algorithms.md#local_sgd-and-diloco): average the replicas every
    H = period local steps."""

    section: ClassVar[str] = "local_sgd"
    title: ClassVar[str] = _LOCAL_SGD_TITLE

    period: int = option(
        8, "H: average every H local steps (diloco: an outer step)", bounds=STEP_COUNT
    )
    flat_names: ClassVar[dict[str, str]] = {"warmup_steps": "local_sgd_warmup_steps"}
    warmup_steps: int = option(
        0,
        "post-local SGD: average every step for this many steps first (diloco: a "
        "synchronous warm start, its outer steps from there)",
        bounds=STEP_COUNT_OR_0,
    )

    def validate(self, cfg: Any) -> None:
        """Its ranges only (the fields' bounds)."""
