"""Gossip's settings (``[gossip]``: variant, peer schedule, period). Torch-free: the CLI
imports it before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cloudburst.config.fields import STEP_COUNT, ConfigError, Section, check_choice, option

GOSSIP_VARIANTS = ("pull", "push")
GOSSIP_SCHEDULES = ("random", "ring", "exponential")


@dataclass
class GossipConfig(Section):
    """Gossip (docs/algorithms.md#gossip): pairwise averaging with a peer every gossip_every
    steps."""

    section: ClassVar[str] = "gossip"
    title: ClassVar[str] = "gossip (--strategy gossip)"
    prefix: ClassVar[str] = "gossip_"
    flat_names: ClassVar[dict[str, str]] = {"consensus_every_steps": "consensus_every_steps"}

    variant: str = option(
        "pull", "pull: fetch a peer's θ and average; push: send ours", choices=GOSSIP_VARIANTS
    )
    schedule: str = option(
        "exponential",
        "a random peer, a ring, or the time-varying exponential graph (the default: 3 seeds "
        "all ≥ 90 %, where random peers ended one seed at 89.8 %; benchmarks/results/defaults.md)",
        choices=GOSSIP_SCHEDULES,
    )
    every: int = option(1, "gossip every k local steps", bounds=STEP_COUNT)
    full_step: bool = option(
        True,
        "average the replicas as published at step boundaries and keep each worker's own "
        "step since in full (off: average the post-step θ_i with the peer's θ_j, a step "
        "older, which drops about half of every local step from the replicas' mean)",
        flag="--gossip-no-full-step",
    )
    push_sum: bool = option(
        False, "push-sum weights (Stochastic Gradient Push), with a push variant only"
    )
    consensus_every_steps: int = option(
        50, "log the consensus distance every this many steps", bounds=STEP_COUNT
    )

    def validate(self, cfg: Any) -> None:
        check_choice("gossip_variant", self.variant, GOSSIP_VARIANTS)
        check_choice("gossip_schedule", self.schedule, GOSSIP_SCHEDULES)
        if self.push_sum and self.variant != "push":
            raise ConfigError("gossip_push_sum: push-sum weights need --gossip-variant push")
