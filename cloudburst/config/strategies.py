"""Each strategy's knobs: A-SGD's parameter server, DASO, local SGD, DiLoCo, EASGD, gossip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cloudburst.config.fields import (
    DOWNCASTS,
    GOSSIP_SCHEDULES,
    GOSSIP_VARIANTS,
    SERVER_RULES,
    ConfigError,
    _check_choice,
    _check_float,
    _check_int,
    option,
)


@dataclass
class AsgdConfig:
    """GPU A-SGD (docs/algorithms.md#asgd): every n_fetch local steps a worker fetches θ from
    the shards, every n_push steps it pushes its Δ; the shards apply each push by their rule."""

    section: ClassVar[str] = "asgd"
    title: ClassVar[str] = "A-SGD parameter server (--strategy asgd, with --servers)"

    n_sync: int | None = option(
        None, "GPU A-SGD n_sync: sets --n-fetch and --n-push", shown="none, so both are 1"
    )
    n_fetch: int | None = option(
        None, "fetch θ every this many local steps", shown="--n-sync, or 1"
    )
    n_push: int | None = option(None, "push Δ every this many local steps", shown="--n-sync, or 1")
    server_rule: str = option(
        "add",
        "add: θ ← θ + λΔ; sgd and adagrad treat −Δ as a pseudo-gradient",
        choices=SERVER_RULES,
    )
    server_lr: float | None = option(
        None,
        "λ of the add rule; the server optimizer's lr otherwise",
        shown="1/W, which averages the workers' pushes",
    )
    server_momentum: float = option(0.0, "momentum of the sgd server rule")
    max_staleness: int | None = option(
        None,
        "drop pushes staler than this many shard versions",
        shown="none, every push is applied",
    )
    staleness_scaling: bool = option(
        False, "scale each push by 1/staleness (staleness-aware A-SGD)"
    )
    shard_standby: bool = option(
        False,
        "keep a hot copy of each shard k on server (k+1) mod S, every applied push forwarded "
        "before its reply: a killed shard fails over with no acknowledged push lost",
    )

    def _validate_asgd(self) -> None:
        _check_int("n_fetch", self.n_fetch, 1)
        _check_int("n_push", self.n_push, 1)
        _check_choice("server_rule", self.server_rule, SERVER_RULES)
        _check_float("server_lr", self.server_lr, 0.0, None, low_open=True)
        _check_float("server_momentum", self.server_momentum, 0.0, 1.0, high_open=True)
        if self.max_staleness is not None:
            _check_int("max_staleness", self.max_staleness, 0)
        if self.shard_standby and self.strategy != "asgd":
            raise ConfigError(
                f"shard_standby: only asgd's shards keep a standby, not {self.strategy}'s; "
                "drop --shard-standby"
            )
        if self.shard_standby and self.servers < 2:
            raise ConfigError(
                f"shard_standby: a standby lives on another server rank, but servers is "
                f"{self.servers}; use --servers 2 or more"
            )


@dataclass
class DasoConfig:
    """DASO (docs/algorithms.md#daso; Heat's DASO knobs): B = global_skip batches between
    global syncs, each waited for S = batches_to_wait batches later; blocking warm-up and
    cool-down."""

    section: ClassVar[str] = "daso"
    title: ClassVar[str] = "DASO (--strategy daso)"

    daso_global_skip: int = option(4, "B at the start of cycling (0: blocking every batch)")
    daso_batches_to_wait: int = option(1, "S at the start of cycling")
    daso_local_skip: int = option(1, "L: node-local gradient all-reduce every L batches")
    daso_max_global_skips: int = option(8, "B after a reset")
    daso_warmup_epochs: float = option(4.0, "epochs of a blocking global average every batch")
    daso_cooldown_epochs: float = option(4.0, "the same at the end")
    daso_stability_level: float = option(
        0.05, "plateau threshold: a relative improvement below it is not one"
    )
    daso_patience: int = option(2, "epochs without improvement before B and S shrink")
    daso_skip_reduction_factor: int = option(2, "B and S are divided by this on a plateau")
    daso_adaptive: bool = option(True, "keep B and S at their starting values", flag="--daso-fixed")
    daso_downcast: str = option("bf16", "blocking averages' dtype", choices=DOWNCASTS)
    daso_cycling_downcast: str = option(
        "none", "non-blocking syncs' dtype (none = fp32, as Heat)", choices=DOWNCASTS
    )
    daso_epoch_end_sync: bool = option(
        True,
        "no blocking average on the last batch of each cycling epoch (Heat has one)",
        flag="--daso-no-epoch-end-sync",
    )
    daso_chunk_elements: int = option(
        10_000_000, "global all-reduces go in chunks of this many values"
    )

    def _validate_daso(self) -> None:
        _check_int("daso_global_skip", self.daso_global_skip, 0)
        _check_int("daso_batches_to_wait", self.daso_batches_to_wait, 0)
        if self.daso_global_skip == 0 and self.daso_batches_to_wait != 0:
            raise ConfigError(
                "daso_batches_to_wait: must be 0 when daso_global_skip is 0 (blocking every batch)"
            )
        if self.daso_batches_to_wait > max(self.daso_global_skip, 1):
            raise ConfigError(
                f"daso_batches_to_wait: {self.daso_batches_to_wait} is more than "
                f"daso_global_skip {self.daso_global_skip}; a sync must be merged before the next"
            )
        _check_int("daso_local_skip", self.daso_local_skip, 1)
        _check_int("daso_max_global_skips", self.daso_max_global_skips, 1)
        _check_float("daso_warmup_epochs", self.daso_warmup_epochs, 0.0, None)
        _check_float("daso_cooldown_epochs", self.daso_cooldown_epochs, 0.0, None)
        _check_float("daso_stability_level", self.daso_stability_level, 0.0, 1.0, high_open=True)
        _check_int("daso_patience", self.daso_patience, 1)
        _check_int("daso_skip_reduction_factor", self.daso_skip_reduction_factor, 2)
        _check_choice("daso_downcast", self.daso_downcast, DOWNCASTS)
        _check_choice("daso_cycling_downcast", self.daso_cycling_downcast, DOWNCASTS)
        _check_int("daso_chunk_elements", self.daso_chunk_elements, 1)
        if self.strategy == "daso":
            nodes = self.nodes or 1
            if self.workers % nodes:
                raise ConfigError(
                    f"nodes: {self.workers} workers do not split evenly over {nodes} nodes "
                    "(DASO needs the same number of ranks on every node)"
                )


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
        if self.strategy == "diloco" and self.local_sgd_warmup_steps:
            raise ConfigError(
                "local_sgd_warmup_steps: diloco has no synchronous warm-up (it is local_sgd's "
                "post-local SGD); leave it at 0"
            )


@dataclass
class DilocoConfig:
    """DiLoCo (docs/algorithms.md#local_sgd-and-diloco): every H steps the averaged Δ is an
    outer optimizer's gradient (SGD with Nesterov momentum)."""

    section: ClassVar[str] = "diloco"
    title: ClassVar[str] = _LOCAL_SGD_TITLE

    # 0.7 (the paper's) over SGD diverged (benchmarks/results/defaults.md).
    diloco_outer_lr: float | None = option(
        None, "outer SGD lr", shown="0.7 over --optimizer adam, 0.1 over sgd"
    )
    diloco_outer_momentum: float = option(0.9, "outer momentum")
    diloco_nesterov: bool = option(
        True, "plain momentum in the outer optimizer", flag="--diloco-no-nesterov"
    )
    # Streaming DiLoCo (Douillard et al. 2025): F = 1, τ = 0 is DiLoCo itself.
    fragments: int = option(
        1,
        "Streaming DiLoCo: F fragments of contiguous parameter tensors (module order, "
        "balanced by element count), fragment k synchronised at offset (k+1)·H/F",
    )
    fragment_delay: int = option(
        0, "τ: a fragment's all-reduce is applied τ inner steps after it starts (< H/F)"
    )
    fragment_alpha: float = option(
        0.0, "α: θ_fragment ← α·θ_local + (1−α)·θ_global after its outer step (0: DiLoCo's)"
    )

    def _validate_diloco(self) -> None:
        _check_float("diloco_outer_lr", self.diloco_outer_lr, 0.0, None, low_open=True)
        _check_float("diloco_outer_momentum", self.diloco_outer_momentum, 0.0, 1.0, high_open=True)
        _check_int("fragments", self.fragments, 1)
        _check_int("fragment_delay", self.fragment_delay, 0)
        _check_float("fragment_alpha", self.fragment_alpha, 0.0, 1.0)
        streaming = (self.fragments, self.fragment_delay, self.fragment_alpha) != (1, 0, 0.0)
        if streaming and self.strategy != "diloco":
            raise ConfigError(
                f"fragments: Streaming DiLoCo's fragments, fragment_delay and fragment_alpha "
                f"apply to --strategy diloco only, not {self.strategy!r}"
            )
        if self.fragments > self.period:
            raise ConfigError(
                f"fragments: {self.fragments} is more than the period H = {self.period}; "
                f"use 1..{self.period} (each fragment needs a step of its own)"
            )
        if self.fragment_delay >= max(1, self.period // self.fragments):
            raise ConfigError(
                f"fragment_delay: {self.fragment_delay} is not allowed with H = {self.period} and "
                f"{self.fragments} fragments; use 0..{self.period // self.fragments - 1} "
                "(< H/F: one fragment in flight at a time)"
            )


@dataclass
class EasgdConfig:
    """EASGD (docs/algorithms.md#easgd): every τ steps e = α (θ_i − θ̃); θ_i −= e; θ̃ += e on the
    servers."""

    section: ClassVar[str] = "easgd"
    title: ClassVar[str] = "EASGD (--strategy easgd, with --servers)"

    easgd_tau: int = option(10, "τ: an elastic step every τ local steps")
    easgd_alpha: float | None = option(None, "α, the elastic force", shown="β/W")
    easgd_beta: float = option(0.9, "β")

    def _validate_easgd(self) -> None:
        _check_int("easgd_tau", self.easgd_tau, 1)
        if self.easgd_alpha is not None:
            _check_float("easgd_alpha", self.easgd_alpha, 0.0, 1.0, low_open=True)
        _check_float("easgd_beta", self.easgd_beta, 0.0, None, low_open=True)


@dataclass
class GossipConfig:
    """Gossip (docs/algorithms.md#gossip): pairwise averaging with a peer every gossip_every
    steps."""

    section: ClassVar[str] = "gossip"
    title: ClassVar[str] = "gossip (--strategy gossip)"

    gossip_variant: str = option(
        "pull", "pull: fetch a peer's θ and average; push: send ours", choices=GOSSIP_VARIANTS
    )
    gossip_schedule: str = option(
        "exponential",
        "a random peer, a ring, or the time-varying exponential graph (the default: 3 seeds "
        "all ≥ 90 %, where random peers ended one seed at 89.8 %; benchmarks/results/defaults.md)",
        choices=GOSSIP_SCHEDULES,
    )
    gossip_every: int = option(1, "gossip every k local steps")
    gossip_full_step: bool = option(
        True,
        "average the replicas as published at step boundaries and keep each worker's own "
        "step since in full (off: average the post-step θ_i with the peer's θ_j, a step "
        "older, which drops about half of every local step from the replicas' mean)",
        flag="--gossip-no-full-step",
    )
    gossip_push_sum: bool = option(
        False, "push-sum weights (Stochastic Gradient Push), with a push variant only"
    )
    consensus_every_steps: int = option(50, "log the consensus distance every this many steps")

    def _validate_gossip(self) -> None:
        _check_choice("gossip_variant", self.gossip_variant, GOSSIP_VARIANTS)
        _check_choice("gossip_schedule", self.gossip_schedule, GOSSIP_SCHEDULES)
        _check_int("gossip_every", self.gossip_every, 1)
        if self.gossip_push_sum and self.gossip_variant != "push":
            raise ConfigError("gossip_push_sum: push-sum weights need --gossip-variant push")
        _check_int("consensus_every_steps", self.consensus_every_steps, 1)
        if self.strategy == "gossip" and self.workers < 2:
            raise ConfigError("workers: gossip needs at least 2 workers (a peer to average with)")
