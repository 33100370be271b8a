"""DiLoCo's settings (``[diloco]``: the outer optimizer, Streaming DiLoCo's fragments), read
by async_diloco too. Torch-free: the CLI imports it before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cloudburst.config.fields import (
    FRACTION,
    LR,
    MOMENTUM,
    STEP_COUNT,
    STEP_COUNT_OR_0,
    ConfigError,
    Section,
    option,
)
from cloudburst.strategies.local_sgd.settings import _LOCAL_SGD_TITLE


@dataclass
class DilocoConfig(Section):
    """DiLoCo (docs/algorithms.md#local_sgd-and-diloco): every H steps the averaged Δ is an
    outer optimizer's gradient (SGD with Nesterov momentum)."""

    section: ClassVar[str] = "diloco"
    title: ClassVar[str] = _LOCAL_SGD_TITLE

    # Over SGD with momentum the outer momentum compounds the inner one: the paper's 0.7/0.9
    # diverged, 0.1/0.9 under-stepped (benchmarks/results/per_sample.md).
    outer_lr: float | None = option(
        None,
        "outer SGD lr",
        shown="0.7 over --optimizer adam, 0.5 over sgd (async_diloco: 0.1; gpt: 1)",
        bounds=LR,
    )
    flat_names: ClassVar[dict[str, str]] = {
        "outer_lr": "diloco_outer_lr",
        "outer_momentum": "diloco_outer_momentum",
        "nesterov": "diloco_nesterov",
    }
    outer_momentum: float | None = option(
        None,
        "outer momentum",
        shown="0.9; 0.8 over sgd (async_diloco: 0.9; gpt: 0, docs/lm.md)",
        bounds=MOMENTUM,
    )
    nesterov: bool = option(
        True, "plain momentum in the outer optimizer", flag="--diloco-no-nesterov"
    )
    # Streaming DiLoCo (Douillard et al. 2025): F = 1, τ = 0 is DiLoCo itself.
    fragments: int = option(
        1,
        "Streaming DiLoCo: F fragments of contiguous parameter tensors (module order, "
        "balanced by element count), fragment k synchronised at offset (k+1)·H/F",
        bounds=STEP_COUNT,
    )
    fragment_delay: int = option(
        0,
        "τ: a fragment's all-reduce is applied τ inner steps after it starts (< H/F)",
        bounds=STEP_COUNT_OR_0,
    )
    fragment_alpha: float = option(
        0.0,
        "α: θ_fragment ← α·θ_local + (1−α)·θ_global after its outer step (0: DiLoCo's)",
        bounds=FRACTION,
    )
    # DES-LOC (Iacob et al. 2025): the inner AdamW's moments averaged on their own schedules.
    desloc_first_every: int = option(
        0,
        "DES-LOC: average the replicas' first moments (Adam's exp_avg) every this many outer "
        "periods (0: never; each replica keeps its own, DiLoCo's). More often than the second "
        "moments it can blow up: docs/algorithms.md#des-loc",
        bounds=STEP_COUNT_OR_0,
    )
    desloc_second_every: int = option(
        0,
        "DES-LOC: average the replicas' second moments (Adam's exp_avg_sq) every this many "
        "outer periods (0: never)",
        bounds=STEP_COUNT_OR_0,
    )

    def defaults(self, cfg: Any) -> None:
        """The outer step's lr and momentum left open: the GPT's outer step is plain averaging
        (lr 1, no momentum): at its budget the paper's Nesterov 0.7/0.9 ended 0.45-0.51 nats
        behind sync, averaging 0.07 (docs/lm.md); over Adam the paper's 0.7/0.9. Over SGD with
        momentum DiLoCo takes 0.5/0.8 (its first step 0.9 Δ, a steady one 2.5 Δ: 0.1/0.9 ended
        10.6 points below it at 4 replicas, 12.5 at 16; benchmarks/results/per_sample.md);
        async DiLoCo's Delayed Nesterov keeps 0.1/0.9 (0.5/0.8 lost ~23 points at W = 16)."""
        from cloudburst.models.gpt import is_gpt_spec

        lm = isinstance(cfg.model.model, str) and is_gpt_spec(cfg.model.model)
        adam = cfg.training.optimizer in ("adam", "adamw")
        # the strategy's outer (lr, momentum) over SGD: DiLoCo's 0.5/0.8, Delayed Nesterov's 0.1/0.9
        sgd_pair = getattr(cfg.strategy_spec, "outer_over_sgd", (0.1, 0.9))
        lr, momentum = (1.0, 0.0) if lm else (0.7, 0.9) if adam else sgd_pair
        if self.outer_lr is None:
            self.outer_lr = lr
        if self.outer_momentum is None:
            self.outer_momentum = momentum

    def validate(self, cfg: Any) -> None:
        desloc = self.desloc_first_every or self.desloc_second_every
        diloco = DilocoConfig in cfg.strategy_spec.settings  # (not async DiLoCo's outer step)
        if desloc and (not diloco or cfg.training.optimizer not in ("adam", "adamw")):
            raise ConfigError(
                "desloc_first_every: DES-LOC averages an Adam optimizer's moments; it applies "
                f"to --strategy diloco with --optimizer adam or adamw, not {cfg.job.strategy!r} "
                f"with {cfg.training.optimizer!r}"
            )
        streaming = (self.fragments, self.fragment_delay, self.fragment_alpha) != (1, 0, 0.0)
        if streaming and not diloco:
            raise ConfigError(
                f"fragments: Streaming DiLoCo's fragments, fragment_delay and fragment_alpha "
                f"apply to --strategy diloco only, not {cfg.job.strategy!r}"
            )
        if self.fragments > cfg.local_sgd.period:
            raise ConfigError(
                f"fragments: {self.fragments} is more than the period H = {cfg.local_sgd.period}; "
                f"use 1..{cfg.local_sgd.period} (each fragment needs a step of its own)"
            )
        period = cfg.local_sgd.period
        if self.fragment_delay >= max(1, period // self.fragments):
            raise ConfigError(
                f"fragment_delay: {self.fragment_delay} is not allowed with H = {period} and "
                f"{self.fragments} fragments; use 0..{period // self.fragments - 1} "
                "(< H/F: one fragment in flight at a time)"
            )
