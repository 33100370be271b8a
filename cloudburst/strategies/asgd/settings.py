"""A-SGD's parameter-server settings (``[asgd]``, ``--n-sync`` ...), shared by the strategies
whose workers talk to the shards (asgd, easgd, async_diloco). Torch-free: the CLI imports it
before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cloudburst.config.fields import (
    LR,
    MOMENTUM,
    STEP_COUNT,
    STEP_COUNT_OR_0,
    Bounds,
    ConfigError,
    Section,
    check_choice,
    check_float,
    check_int,
    option,
)

SERVER_RULES = ("add", "sgd", "adagrad")
# --staleness-compensation (strategies/asgd/shard.py; docs/algorithms.md#staleness-compensation).
COMPENSATIONS = ("none", "scale", "dc", "dc-adaptive", "gap", "delay-adaptive")
# asgd's n_fetch = n_push when neither nor --n-sync is given: at W = 4 as accurate as 1 in
# about half the time (benchmarks/results/defaults.md); --n-sync 1 is DistBelief's every step.
DEFAULT_N_SYNC = 8
# An honest update is a small part of θ: at most 0.33·‖θ_k‖ under the add rule and 0.82·‖θ_k‖
# under sgd with momentum 0.9 on 60-step simulated runs (docs/algorithms.md#bounded-pushes);
# one of 3e38, or a diverging worker's, is refused.
DEFAULT_MAX_PUSH_RATIO = 10.0


@dataclass
class AsgdConfig(Section):
    """GPU A-SGD (docs/algorithms.md#asgd): every n_fetch local steps a worker fetches θ from
    the shards, every n_push steps it pushes its Δ; the shards apply each push by their rule."""

    section: ClassVar[str] = "asgd"
    title: ClassVar[str] = "A-SGD parameter server (--strategy asgd, with --servers)"

    n_sync: int | None = option(
        None,
        "GPU A-SGD n_sync: sets --n-fetch and --n-push (1: DistBelief's every step)",
        shown=f"none, so both are {DEFAULT_N_SYNC}",
        bounds=STEP_COUNT,
    )
    n_fetch: int | None = option(
        None,
        "fetch θ every this many local steps",
        shown=f"--n-sync, or {DEFAULT_N_SYNC}",
        bounds=STEP_COUNT,
    )
    n_push: int | None = option(
        None,
        "push Δ every this many local steps",
        shown=f"--n-sync, or {DEFAULT_N_SYNC}",
        bounds=STEP_COUNT,
    )
    server_rule: str = option(
        "add",
        "add: θ ← θ + λΔ; sgd and adagrad treat −Δ as a pseudo-gradient",
        choices=SERVER_RULES,
    )
    server_lr: float | None = option(
        None,
        "λ of the add rule; the server optimizer's lr otherwise",
        shown="1/W, which averages the workers' pushes ((W-1)/W under "
        "--staleness-compensation scale, whose 1/τ averages them)",
        bounds=LR,
    )
    server_momentum: float = option(0.0, "momentum of the sgd server rule", bounds=MOMENTUM)
    max_staleness: int | None = option(
        None,
        "drop pushes staler than this many shard versions",
        shown="none, every push is applied",
        bounds=STEP_COUNT_OR_0,
    )
    staleness_scaling: bool = option(
        False,
        "scale each push by 1/staleness (staleness-aware A-SGD); the same as "
        "--staleness-compensation scale, kept as its alias",
    )
    staleness_compensation: str = option(
        "none",
        "how the shards compensate a stale push (docs/algorithms.md#staleness-compensation): "
        "scale by 1/τ (with λ = (W-1)/W, so that a push of staleness W-1 moves θ as none's "
        "does; λ = 1 ended 3-11 points below none at W = 16 and λ = 1/W 43 below, "
        "docs/algorithms.md), "
        "DC-ASGD with a fixed or adaptive λ, gap-aware, a delay-adaptive step",
        choices=COMPENSATIONS,
    )
    dc_lambda: float | None = option(
        None,
        "DC-ASGD's λ (dc), or λ0 of its adaptive λ_t = λ0/√(m_t) (dc-adaptive)",
        shown="0.04 for dc, 2 for dc-adaptive (the paper's CIFAR-10 values)",
        bounds=Bounds(0.0, 1000.0),
    )
    delay_threshold: int | None = option(
        None,
        "τ_C of delay-adaptive: full step while τ ≤ τ_C, τ_C/τ of it beyond",
        shown="W, the number of workers",
        bounds=STEP_COUNT,
    )
    compensation_window: int | None = option(
        None,
        "dc and gap: each shard keeps its θ of this many past versions (memory: as many "
        "copies of the shard) to find the θ a push was computed against",
        shown="4·W, or max_staleness + 1 when that is set",
        bounds=Bounds(1, 2**20),
    )
    shard_standby: bool = option(
        False,
        "keep a hot copy of each shard k on server (k+1) mod S, every applied push forwarded "
        "before its reply: a killed shard fails over with no acknowledged push lost",
    )
    max_push_ratio: float = option(
        DEFAULT_MAX_PUSH_RATIO,
        "a shard (asgd, easgd, async_diloco) refuses a push whose update of θ_k is longer "
        "than this many times max(‖θ_k‖, 1), or not finite, and tells its worker (0: no "
        "bound on the length)",
        bounds=Bounds(0.0, 1e6),
    )

    def defaults(self, cfg: Any) -> None:
        """n_fetch and n_push from n_sync (or 8: as accurate as 1 in half the time,
        docs/algorithms.md#asgd); --staleness-scaling is --staleness-compensation scale; λ = 1/W
        ((W − 1)/W under ``scale``)."""
        if self.n_sync is not None:
            check_int("n_sync", self.n_sync, 1)
        default_period = self.n_sync if self.n_sync is not None else DEFAULT_N_SYNC
        if self.n_fetch is None:
            self.n_fetch = default_period
        if self.n_push is None:
            self.n_push = default_period
        if self.staleness_scaling and self.staleness_compensation == "none":
            self.staleness_compensation = "scale"
        elif self.staleness_compensation == "scale":
            self.staleness_scaling = True
        if self.server_lr is None:
            # docs/algorithms.md#asgd: the W replicas' pushes are averaged (λ = 1/W), not summed;
            # under `scale` the factor 1/τ averages them (Zhang et al.'s α₀/τ), and λ = (W − 1)/W
            # makes a push of the usual staleness τ = W − 1 move θ exactly as plain asgd's does
            # (λ = 1 moved it W/(W − 1) as far, past the edge: docs/algorithms.md).
            scaled = self.staleness_compensation == "scale" and self.server_rule == "add"
            w = _replicas(cfg)
            self.server_lr = max(1, w - 1) / w if scaled else 1.0 / w

    @property
    def dc_lambda_value(self) -> float:
        if self.dc_lambda is not None:
            return self.dc_lambda
        return 2.0 if self.staleness_compensation == "dc-adaptive" else 0.04

    def delay_threshold_value(self, cfg: Any) -> int:
        if self.delay_threshold is not None:
            return self.delay_threshold
        return _replicas(cfg)

    def compensation_window_value(self, cfg: Any) -> int:
        if self.compensation_window is not None:
            return self.compensation_window
        if self.max_staleness is not None:
            return self.max_staleness + 1
        return 4 * _replicas(cfg)

    def validate(self, cfg: Any) -> None:
        check_int("n_fetch", self.n_fetch, 1)
        check_int("n_push", self.n_push, 1)
        check_choice("server_rule", self.server_rule, SERVER_RULES)
        check_float("server_lr", self.server_lr, 0.0, None, low_open=True)
        check_float("server_momentum", self.server_momentum, 0.0, 1.0, high_open=True)
        if self.max_staleness is not None:
            check_int("max_staleness", self.max_staleness, 0)
        check_choice("staleness_compensation", self.staleness_compensation, COMPENSATIONS)
        if self.staleness_scaling and self.staleness_compensation not in ("none", "scale"):
            raise ConfigError(
                f"staleness_scaling: it is --staleness-compensation scale, which contradicts "
                f"--staleness-compensation {self.staleness_compensation}; give one of them"
            )
        if self.dc_lambda is not None:
            check_float("dc_lambda", self.dc_lambda, 0.0, None)
        if self.delay_threshold is not None:
            check_int("delay_threshold", self.delay_threshold, 1)
        if self.compensation_window is not None:
            check_int("compensation_window", self.compensation_window, 1)
        refused = cfg.strategy_spec.compensation_refused
        if refused and self.staleness_compensation not in ("none", "scale"):
            raise ConfigError(
                f"staleness_compensation: {self.staleness_compensation} {refused}; use none or "
                "scale"
            )
        if self.shard_standby and not cfg.strategy_spec.standby_shards:
            raise ConfigError(
                f"shard_standby: only asgd's shards keep a standby, not {cfg.job.strategy}'s "
                "(async_diloco's do too, on the same machinery); drop --shard-standby"
            )
        if self.shard_standby and cfg.job.servers < 2:
            raise ConfigError(
                f"shard_standby: a standby lives on another server rank, but servers is "
                f"{cfg.job.servers}; use --servers 2 or more"
            )


def _replicas(cfg: Any) -> int:
    """W of the rules' defaults: the replicas that push (workers, or nodes)."""
    ok = isinstance(cfg.job.workers, int) and cfg.job.workers > 0
    return max(1, cfg.replicas) if ok else 1
