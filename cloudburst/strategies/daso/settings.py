"""DASO's settings (``[daso]``, ``--daso-*``; Heat's DASO knobs). Torch-free: the CLI imports
it before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cloudburst.config.fields import MAX_EPOCHS, Bounds, ConfigError, Section, check_choice, option

# B, S, L and their factors count batches; a chunk's elements index a flat tensor.
SKIPS = Bounds(0, 2**20)

DOWNCASTS = ("bf16", "fp16", "none")


@dataclass
class DasoConfig(Section):
    """DASO (docs/algorithms.md#daso; Heat's DASO knobs): B = global_skip batches between
    global syncs, each waited for S = batches_to_wait batches later; blocking warm-up and
    cool-down."""

    section: ClassVar[str] = "daso"
    title: ClassVar[str] = "DASO (--strategy daso)"
    prefix: ClassVar[str] = "daso_"

    global_skip: int = option(
        4, "B at the start of cycling (0: blocking every batch)", bounds=SKIPS
    )
    batches_to_wait: int = option(1, "S at the start of cycling", bounds=SKIPS)
    local_skip: int = option(
        1, "L: node-local gradient all-reduce every L batches", bounds=Bounds(1, 2**20)
    )
    max_global_skips: int = option(8, "B after a reset", bounds=Bounds(1, 2**20))
    warmup_epochs: float = option(
        4.0, "epochs of a blocking global average every batch", bounds=Bounds(0.0, MAX_EPOCHS)
    )
    cooldown_epochs: float = option(4.0, "the same at the end", bounds=Bounds(0.0, MAX_EPOCHS))
    stability_level: float = option(
        0.05,
        "plateau threshold: a relative improvement below it is not one",
        bounds=Bounds(0.0, 1.0, high_open=True),
    )
    patience: int = option(
        2, "epochs without improvement before B and S shrink", bounds=Bounds(1, 2**20)
    )
    skip_reduction_factor: int = option(
        2, "B and S are divided by this on a plateau", bounds=Bounds(2, 2**20)
    )
    adaptive: bool = option(True, "keep B and S at their starting values", flag="--daso-fixed")
    downcast: str = option("bf16", "blocking averages' dtype", choices=DOWNCASTS)
    cycling_downcast: str = option(
        "none", "non-blocking syncs' dtype (none = fp32, as Heat)", choices=DOWNCASTS
    )
    epoch_end_sync: bool = option(
        True,
        "no blocking average on the last batch of each cycling epoch (Heat has one)",
        flag="--daso-no-epoch-end-sync",
    )
    chunk_elements: int = option(
        10_000_000, "global all-reduces go in chunks of this many values", bounds=Bounds(1, 2**31)
    )

    def validate(self, cfg: Any) -> None:
        if self.global_skip == 0 and self.batches_to_wait != 0:
            raise ConfigError(
                "daso_batches_to_wait: must be 0 when daso_global_skip is 0 (blocking every batch)"
            )
        if self.batches_to_wait > max(self.global_skip, 1):
            raise ConfigError(
                f"daso_batches_to_wait: {self.batches_to_wait} is more than "
                f"daso_global_skip {self.global_skip}; a sync must be merged before the next"
            )
        check_choice("daso_downcast", self.downcast, DOWNCASTS)
        check_choice("daso_cycling_downcast", self.cycling_downcast, DOWNCASTS)
