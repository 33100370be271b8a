"""Each strategy's knobs: A-SGD's parameter server (and its staleness compensation), DASO,
local SGD, DiLoCo, asynchronous DiLoCo, EASGD, gossip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cloudburst.config.fields import (
    COMPENSATIONS,
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

# asgd's n_fetch = n_push when neither nor --n-sync is given: at W = 4 as accurate as 1 in
# about half the time (benchmarks/results/defaults.md); --n-sync 1 is DistBelief's every step.
DEFAULT_N_SYNC = 8


@dataclass
class AsgdConfig:
    """GPU A-SGD (docs/algorithms.md#asgd): every n_fetch local steps a worker fetches θ from
    the shards, every n_push steps it pushes its Δ; the shards apply each push by their rule."""

    section: ClassVar[str] = "asgd"
    title: ClassVar[str] = "A-SGD parameter server (--strategy asgd, with --servers)"

    n_sync: int | None = option(
        None,
        "GPU A-SGD n_sync: sets --n-fetch and --n-push (1: DistBelief's every step)",
        shown=f"none, so both are {DEFAULT_N_SYNC}",
    )
    n_fetch: int | None = option(
        None, "fetch θ every this many local steps", shown=f"--n-sync, or {DEFAULT_N_SYNC}"
    )
    n_push: int | None = option(
        None, "push Δ every this many local steps", shown=f"--n-sync, or {DEFAULT_N_SYNC}"
    )
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
        False,
        "scale each push by 1/staleness (staleness-aware A-SGD); the same as "
        "--staleness-compensation scale, kept as its alias",
    )
    staleness_compensation: str = option(
        "none",
        "how the shards compensate a stale push (docs/algorithms.md#staleness-compensation): "
        "scale by 1/τ, DC-ASGD with a fixed or adaptive λ, gap-aware, a delay-adaptive step",
        choices=COMPENSATIONS,
    )
    dc_lambda: float | None = option(
        None,
        "DC-ASGD's λ (dc), or λ0 of its adaptive λ_t = λ0/√(m_t) (dc-adaptive)",
        shown="0.04 for dc, 2 for dc-adaptive (the paper's CIFAR-10 values)",
    )
    delay_threshold: int | None = option(
        None,
        "τ_C of delay-adaptive: full step while τ ≤ τ_C, τ_C/τ of it beyond",
        shown="W, the number of workers",
    )
    compensation_window: int | None = option(
        None,
        "dc and gap: each shard keeps its θ of this many past versions (memory: as many "
        "copies of the shard) to find the θ a push was computed against",
        shown="4·W, or max_staleness + 1 when that is set",
    )
    shard_standby: bool = option(
        False,
        "keep a hot copy of each shard k on server (k+1) mod S, every applied push forwarded "
        "before its reply: a killed shard fails over with no acknowledged push lost",
    )

    def _asgd_defaults(self) -> None:
        """--staleness-scaling is --staleness-compensation scale: either sets both."""
        if self.staleness_scaling and self.staleness_compensation == "none":
            self.staleness_compensation = "scale"
        elif self.staleness_compensation == "scale":
            self.staleness_scaling = True

    @property
    def dc_lambda_value(self) -> float:
        if self.dc_lambda is not None:
            return self.dc_lambda
        return 2.0 if self.staleness_compensation == "dc-adaptive" else 0.04

    @property
    def delay_threshold_value(self) -> int:
        if self.delay_threshold is not None:
            return self.delay_threshold
        return self.workers if isinstance(self.workers, int) and self.workers > 0 else 1

    @property
    def compensation_window_value(self) -> int:
        if self.compensation_window is not None:
            return self.compensation_window
        if self.max_staleness is not None:
            return self.max_staleness + 1
        return 4 * max(1, self.workers if isinstance(self.workers, int) else 1)

    def _validate_asgd(self) -> None:
        _check_int("n_fetch", self.n_fetch, 1)
        _check_int("n_push", self.n_push, 1)
        _check_choice("server_rule", self.server_rule, SERVER_RULES)
        _check_float("server_lr", self.server_lr, 0.0, None, low_open=True)
        _check_float("server_momentum", self.server_momentum, 0.0, 1.0, high_open=True)
        if self.max_staleness is not None:
            _check_int("max_staleness", self.max_staleness, 0)
        _check_choice("staleness_compensation", self.staleness_compensation, COMPENSATIONS)
        if self.staleness_scaling and self.staleness_compensation not in ("none", "scale"):
            raise ConfigError(
                f"staleness_scaling: it is --staleness-compensation scale, which contradicts "
                f"--staleness-compensation {self.staleness_compensation}; give one of them"
            )
        if self.dc_lambda is not None:
            _check_float("dc_lambda", self.dc_lambda, 0.0, None)
        if self.delay_threshold is not None:
            _check_int("delay_threshold", self.delay_threshold, 1)
        if self.compensation_window is not None:
            _check_int("compensation_window", self.compensation_window, 1)
        if self.strategy == "easgd" and self.staleness_compensation not in ("none", "scale"):
            raise ConfigError(
                f"staleness_compensation: {self.staleness_compensation} applies to asgd's "
                "pushes, not to EASGD's exchanges (the worker moves by the same elastic "
                "difference the centre takes; a shard-side change would break that); use "
                "none or scale"
            )
        if self.shard_standby and self.strategy not in ("asgd", "async_diloco"):
            raise ConfigError(
                f"shard_standby: only asgd's shards keep a standby, not {self.strategy}'s "
                "(async_diloco's do too, on the same machinery); drop --shard-standby"
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
        None, "outer SGD lr", shown="0.7 over --optimizer adam, 0.1 over sgd (gpt: 1)"
    )
    diloco_outer_momentum: float | None = option(
        None, "outer momentum", shown="0.9 (gpt: 0, docs/lm.md)"
    )
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


@dataclass
class AsyncDilocoConfig:
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
    )
    dn_c: float = option(
        0.0, "c: the share of the momentum step also taken between momentum steps (0: DN)"
    )
    dylu: bool = option(
        False,
        "Dynamic Local Updates: after each push, worker i runs H_i = max(1, round(H·speed_i / "
        "max speed)) inner steps, speed_i its measured steps per second (the first round: H)",
    )

    @property
    def dn_period_value(self) -> int:
        if self.dn_period is not None:
            return self.dn_period
        return self.workers if isinstance(self.workers, int) and self.workers > 0 else 1

    def _validate_async_diloco(self) -> None:
        if self.dn_period is not None:
            _check_int("dn_period", self.dn_period, 1)
        _check_float("dn_c", self.dn_c, 0.0, 1.0)
        if self.strategy != "async_diloco":
            if self.dylu or self.dn_period is not None or self.dn_c:
                raise ConfigError(
                    f"dylu: Delayed Nesterov's and Dynamic Local Updates' settings apply to "
                    f"--strategy async_diloco only, not {self.strategy!r}"
                )
            return
        if self.n_sync is not None:
            raise ConfigError(
                "n_sync: async_diloco pushes every H = --period inner steps (and its fetch "
                "with it); drop --n-sync"
            )
        if self.server_rule != "add":
            raise ConfigError(
                f"server_rule: async_diloco's shards run Delayed Nesterov, not "
                f"{self.server_rule!r}; drop --server-rule"
            )
        if not self.diloco_nesterov:
            raise ConfigError(
                "diloco_nesterov: async_diloco's outer optimizer is Delayed Nesterov; drop "
                "--diloco-no-nesterov"
            )
        if self.local_sgd_warmup_steps:
            raise ConfigError(
                "local_sgd_warmup_steps: async_diloco has no synchronous warm-up; leave it at 0"
            )
