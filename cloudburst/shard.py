"""One parameter-server shard's maths, with no communication: what a shard does with a push
(:class:`ShardState`), the server rules, EASGD's elastic step, and the helpers the workers
share with the servers (they import this module, never the server loop in
:mod:`cloudburst.server`).

:class:`ShardState` applies pushes one at a time, in arrival order, keeps the version clock
(number of applied pushes) and the per-push staleness, drops pushes staler than
``max_staleness``, optionally scales a push by 1/staleness, and rejects non-finite pushes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cloudburst.comm.p2p import Status
from cloudburst.config import RunConfig


@dataclass
class PushResult:
    status: Status
    staleness: int


def add_rule_alpha(lr: float, staleness: int, staleness_scaling: bool) -> float:
    """The factor of the add rule, θ ← θ + αΔ: α = λ, or λ/staleness when scaling.

    Workers use the same function to rebuild the server's θ from an overlapped reply, so that
    both sides compute bit-identical results.
    """
    return lr * (1.0 / max(1, staleness) if staleness_scaling else 1.0)


def elastic_step(alpha: float, theta_worker: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """EASGD's elastic difference e = α(θ_i − θ̃): the centre adds it, the worker subtracts it.

    Both sides call this on the same values (the worker gets θ̃ as it was before its push), so
    they compute the same e bit for bit.
    """
    return (theta_worker - centre).mul_(alpha)


def all_finite(t: torch.Tensor) -> bool:
    """Exact, and fast on the common path: a NaN or ±Inf element always makes the sum
    non-finite, so a finite sum proves every element finite (one reduction instead of a full
    boolean tensor). A non-finite sum may still be an overflow of finite values: check exactly.
    """
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


class ShardState:
    """One shard θ_k with its version clock and server rule.

    Rules (Δ = θ_worker − θ_at_its_last_fetch):
      - ``add``:     θ_k ← θ_k + λ·s·Δ_k                       (λ = ``lr``; DistBelief/GPU A-SGD)
      - ``sgd``:     SGD with momentum on the pseudo-gradient −s·Δ_k (``torch.optim.SGD``)
      - ``adagrad``: Adagrad on the pseudo-gradient −s·Δ_k (``torch.optim.Adagrad``)
      - ``elastic``: EASGD's centre variable; the push carries the worker's θ_i (not Δ) and
        θ̃_k ← θ̃_k + α·(θ_i,k − θ̃_k) with α = ``lr`` (the worker moves by the same e, away)
    where s = 1/max(1, staleness) with ``staleness_scaling``, else 1.
    """

    def __init__(
        self,
        theta: torch.Tensor,
        rule: str = "add",
        lr: float = 1.0,
        momentum: float = 0.0,
        max_staleness: int | None = None,
        staleness_scaling: bool = False,
    ):
        self.param = torch.nn.Parameter(
            theta.detach().to(torch.float32).clone(), requires_grad=False
        )
        self.rule, self.lr = rule, lr
        self.max_staleness, self.staleness_scaling = max_staleness, staleness_scaling
        self.version = 0  # pushes applied so far
        self.samples = 0  # training samples behind the applied pushes
        self.staleness_sum = 0
        self.staleness_max = 0
        self.dropped_stale = 0
        self.rejected_nonfinite = 0
        if rule in ("add", "elastic"):
            self.optimizer = None
        elif rule == "sgd":
            self.optimizer = torch.optim.SGD([self.param], lr=lr, momentum=momentum)
        elif rule == "adagrad":
            self.optimizer = torch.optim.Adagrad([self.param], lr=lr)
        else:
            raise ValueError(f"unknown server rule {rule!r}")

    @property
    def theta(self) -> torch.Tensor:
        return self.param.data

    def set_theta(self, theta: torch.Tensor) -> None:
        """Replace θ_k (warm start); the version clock is not advanced."""
        self.param.data.copy_(theta)

    def apply_push(
        self, delta: torch.Tensor, base_version: int, samples: int = 0, finite: bool | None = None
    ) -> PushResult:
        """Apply one push computed against ``base_version``; returns its status and staleness.
        ``finite``: whether ``delta`` is all finite, when the caller checked it already (chunk
        by chunk as it arrived); None: checked here."""
        result = self.admit_push(delta, base_version, samples, finite)
        if result.status == Status.OK:
            self.add_push(delta, result.staleness)
        return result

    def admit_push(
        self, delta: torch.Tensor, base_version: int, samples: int = 0, finite: bool | None = None
    ) -> PushResult:
        """The bookkeeping half of :meth:`apply_push`: decide the push's status and, when it
        is OK, count it (version, samples, staleness) as applied; θ is left alone until
        :meth:`add_push` (a server acknowledges the push in between: what the reply says
        depends on the decision only)."""
        if delta.shape != self.param.shape:
            raise ValueError(
                f"push of shape {tuple(delta.shape)} for shard {tuple(self.param.shape)}"
            )
        if not 0 <= base_version <= self.version:
            raise ValueError(f"push against version {base_version}, shard is at {self.version}")
        staleness = self.version - base_version
        if not (all_finite(delta) if finite is None else finite):
            self.rejected_nonfinite += 1
            return PushResult(Status.REJECTED, staleness)
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.dropped_stale += 1
            return PushResult(Status.STALE_DROPPED, staleness)
        self.version += 1
        self.samples += samples
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        return PushResult(Status.OK, staleness)

    def add_push(self, delta: torch.Tensor, staleness: int) -> None:
        """The arithmetic half of :meth:`apply_push`: θ moves by a push that
        :meth:`admit_push` accepted with ``staleness``."""
        with torch.no_grad():
            if self.rule == "elastic":
                self.param.add_(elastic_step(self.lr, delta, self.param))
            elif self.optimizer is None:
                alpha = add_rule_alpha(self.lr, staleness, self.staleness_scaling)
                self.param.add_(delta, alpha=alpha)
            else:
                scale = 1.0 / max(1, staleness) if self.staleness_scaling else 1.0
                self.param.grad = delta.mul(-scale)
                self.optimizer.step()
                self.param.grad = None

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "samples": self.samples,
            "pushes_applied": self.version,
            "staleness_sum_versions": self.staleness_sum,
            "staleness_max_versions": self.staleness_max,
            "dropped_stale": self.dropped_stale,
            "rejected_nonfinite": self.rejected_nonfinite,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "theta": self.param.data.clone(),
            # deepcopy: the optimizer's state_dict shares its buffers with the live optimizer
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer else {},
            **self.stats(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.param.data.copy_(state["theta"])
        if self.optimizer is not None and state.get("optimizer"):
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.samples = int(state["samples"])
        # (a checkpoint written before the metric names carried their unit has the old keys)
        self.staleness_sum = int(state.get("staleness_sum_versions", state.get("staleness_sum")))
        self.staleness_max = int(state.get("staleness_max_versions", state.get("staleness_max")))
        self.dropped_stale = int(state["dropped_stale"])
        self.rejected_nonfinite = int(state["rejected_nonfinite"])


def server_rule(cfg: RunConfig) -> tuple[str, float]:
    """(rule, lr) of the shards: EASGD's elastic centre, or the configured asgd rule."""
    return cfg.shard_rule


def overlapped_push_fetch(cfg: RunConfig) -> bool:
    """Whether PUSH_FETCH replies carry θ before the push (sent while the push arrives)."""
    return server_rule(cfg)[0] in ("add", "elastic")


# Requests whose header is followed by a payload of the shard's size.


def standby_of(shard: int, num_servers: int) -> int:
    """The server rank that keeps shard ``shard``'s standby copy (``--shard-standby``): the
    next one, cyclically."""
    return (shard + 1) % num_servers


def shard_checkpoint_path(out: str | Path, shard: int) -> Path:
    return Path(out) / "checkpoints" / f"server{shard}.pt"


def make_shard(cfg: RunConfig, theta: torch.Tensor) -> ShardState:
    rule, lr = server_rule(cfg)
    return ShardState(
        theta,
        rule=rule,
        lr=lr,
        momentum=cfg.server_momentum,
        max_staleness=cfg.max_staleness,
        staleness_scaling=cfg.staleness_scaling,
    )


def mean_staleness(stats: list[dict[str, Any]]) -> float:
    applied = sum(s.get("pushes_applied", 0) for s in stats)
    total = sum(s.get("staleness_sum_versions", 0) for s in stats)
    return total / applied if applied else math.nan
