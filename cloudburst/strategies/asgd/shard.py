"""One parameter-server shard's maths, with no communication: what a shard does with a push
(:class:`ShardState`, which applies whatever server rule it is given: ``rules.py``, and the
strategies' own), and the helpers the workers share with the servers (they import this
module, never the server loop in :mod:`cloudburst.strategies.asgd.server`).

:class:`ShardState` applies pushes one at a time, in arrival order, keeps the version clock
(number of applied pushes), the per-push staleness and its distribution, drops pushes staler
than ``max_staleness``, compensates a stale push (``--staleness-compensation``: 1/τ, DC-ASGD,
gap-aware, delay-adaptive; docs/algorithms.md#staleness-compensation), rejects non-finite
pushes, and refuses finite ones whose update (the change of θ_k the rule would make, after
compensation) is not finite or larger than ``max_push_ratio``·max(‖θ_k‖, 1)
(``--max-push-ratio``: one push of 3e38 made θ inf and every worker's loss NaN, issue 44).
DC-ASGD and gap-aware need θ_then, the θ the pushing worker last fetched: the shard keeps a
ring of its own θ after each of the last R versions (R = ``compensation_window``; memory
R·|θ_k|), looked up by the push's base version. A ring, not DC-ASGD's per-worker backup,
because it is a function of the applied pushes alone: a standby copy and a restored
checkpoint rebuild it exactly, and a worker's read-only fetch (evaluation) cannot disturb it.
A push older than the ring uses its oldest θ (counted: ``compensation_clamped``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cloudburst.comm.messages import Status
from cloudburst.config import RunConfig
from cloudburst.strategies.asgd.compensation import (
    PER_COORDINATE,
    SCALAR_FACTORS,
    make_compensator,
    staleness_factor,
)
from cloudburst.strategies.asgd.rules import ServerRule, all_finite, asgd_rule

# The push-scale histogram: scales rounded to this many decimals, clipped to [0, this].
SCALE_DECIMALS, SCALE_CLIP = 3, 10.0
# --max-push-ratio bounds ‖update‖ by ratio·max(‖θ_k‖, this): a shard whose θ_k is near zero
# (zero-initialised biases) still takes honest steps.
PUSH_NORM_FLOOR = 1.0
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# An update with every |u_i| below this cannot take a finite float32 θ_i to inf (half the
# spacing of floats next to FLOAT32_MAX is ~1e31): θ + u is finite with no pass over θ.
SAFE_STEP = 1e30


@dataclass
class PushResult:
    status: Status
    staleness: int


def norm(t: torch.Tensor) -> float:
    """‖t‖₂, in float64 where float32's sum of squares overflows (elements beyond ~1.8e19)."""
    value = float(t.norm())
    return value if math.isfinite(value) else float(t.norm(dtype=torch.float64))


class ShardState:
    """One shard θ_k with its version clock and server rule (a :class:`~cloudburst.strategies.
    asgd.rules.ServerRule`, or the name of one of asgd's: ``add``, ``sgd``, ``adagrad``, with
    ``lr`` and sgd's ``momentum``). With Δ = θ_worker − θ_at_its_last_fetch, the rule gets
    Δ_k, first replaced by the per-coordinate compensator's Δ̃ under ``dc``, ``dc-adaptive``
    and ``gap``, and s = :func:`~cloudburst.strategies.asgd.compensation.staleness_factor`
    (``compensation``; ``staleness_scaling=True`` is ``scale``); a rule that takes no
    compensation (EASGD's elastic centre) gets the push as it came, with s = 1.

    A push is applied only if the update u it makes (θ_k ← θ_k + u, by the rule, after
    compensation) leaves θ_k and the rule's state finite and ‖u‖ ≤ ``max_push_ratio``·
    max(‖θ_k‖, ``PUSH_NORM_FLOOR``) (0: no bound; adagrad: ‖λ·s·Δ̃‖, its ``update``'s own
    step); else it is REFUSED (:meth:`push_problem`).
    """

    def __init__(
        self,
        theta: torch.Tensor,
        rule: ServerRule | str = "add",
        lr: float = 1.0,
        momentum: float = 0.0,
        max_staleness: int | None = None,
        staleness_scaling: bool = False,
        compensation: str | None = None,
        dc_lambda: float = 0.04,
        delay_threshold: int = 1,
        compensation_window: int = 16,
        local_lr: float = 1.0,
        max_push_ratio: float = 0.0,
    ):
        self.param = torch.nn.Parameter(
            theta.detach().to(torch.float32).clone(), requires_grad=False
        )
        self.server_rule = asgd_rule(rule, lr, momentum) if isinstance(rule, str) else rule
        self.server_rule.bind(self.param)
        self.rule, self.lr = self.server_rule.name, self.server_rule.lr
        if compensation is None:
            compensation = "scale" if staleness_scaling else "none"
        if compensation not in SCALAR_FACTORS and compensation not in PER_COORDINATE:
            raise ValueError(f"unknown staleness compensation {compensation!r}")
        if not self.server_rule.takes_compensation:
            compensation = "none"
        self.compensation, self.delay_threshold = compensation, delay_threshold
        self.staleness_scaling = compensation == "scale"
        self.max_staleness = max_staleness
        self.version = 0  # pushes applied so far
        self.samples = 0  # training samples behind the applied pushes
        self.staleness_sum = 0
        self.staleness_max = 0
        self.dropped_stale = 0
        self.rejected_nonfinite = 0
        # --max-push-ratio (0: no bound on the norm; an update that is not finite is refused
        # whatever it is): the pushes refused, and why the last one was (for the log).
        self.max_push_ratio = max_push_ratio
        self.refused = 0
        self.last_refusal = ""
        # The distributions of every applied push's staleness and of the scale it was applied
        # with (s, or |Δ̃|/|Δ| under a per-coordinate compensator), counted exactly.
        self.staleness_hist: dict[int, int] = {}
        self.scale_hist: dict[float, int] = {}
        self.last_scale = 1.0
        self.compensator = None
        if compensation in PER_COORDINATE:
            self.compensator = make_compensator(
                compensation, self.param.data, compensation_window, dc_lambda, local_lr
            )

    @property
    def theta(self) -> torch.Tensor:
        return self.param.data

    def set_theta(self, theta: torch.Tensor) -> None:
        """Replace θ_k (warm start); the version clock is not advanced."""
        self.param.data.copy_(theta)
        if self.compensator is not None:
            self.compensator.reset(self.version, self.param.data)

    def apply_push(
        self,
        delta: torch.Tensor,
        base_version: int,
        samples: int = 0,
        finite: bool | None = None,
        delta_norm: float | None = None,
        refused: bool | None = None,
    ) -> PushResult:
        """Apply one push computed against ``base_version``; returns its status and staleness.
        ``finite``: whether ``delta`` is all finite, when the caller checked it already (chunk
        by chunk as it arrived); None: checked here. ``delta_norm``: ‖delta‖, when the caller
        has it (None: computed here when needed). ``refused``: whether a finite push is
        refused (:meth:`push_problem`), when another shard decided it (a standby copy
        follows its primary); None: decided here."""
        result = self.admit_push(delta, base_version, samples, finite, delta_norm, refused)
        if result.status == Status.OK:
            self.add_push(delta, result.staleness)
        return result

    def admit_push(
        self,
        delta: torch.Tensor,
        base_version: int,
        samples: int = 0,
        finite: bool | None = None,
        delta_norm: float | None = None,
        refused: bool | None = None,
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
        if refused is None:
            problem = self.push_problem(delta, staleness, delta_norm)
        else:
            problem = "refused by the primary shard" if refused else None
        if problem is not None:
            self.refused += 1
            self.last_refusal = problem
            return PushResult(Status.REFUSED, staleness)
        self.version += 1
        self.samples += samples
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_hist[staleness] = self.staleness_hist.get(staleness, 0) + 1
        return PushResult(Status.OK, staleness)

    def push_problem(
        self, delta: torch.Tensor, staleness: int, delta_norm: float | None = None
    ) -> str | None:
        """Why a finite push of ``staleness`` is refused (its update u, computed as
        :meth:`add_push` would, leaves θ_k or the rule's state not finite, or is longer than
        ``max_push_ratio``·max(‖θ_k‖, 1)), or None. Nothing changes. Under the add rule with a
        scalar compensator u = αΔ: ‖Δ‖ (``delta_norm``, when the caller has it), and ‖θ_k‖
        only for an update longer than ``max_push_ratio``; the other rules compute u aside
        (the torch optimizers' steps by their documented formulas, with the defaults built
        there). θ_k is finite (every change to it is checked)."""
        theta = self.param.data
        update: torch.Tensor | None = None
        state_finite = True
        alpha = self.server_rule.alpha(self._factor(staleness))
        if alpha is not None and self.compensator is None:
            length = abs(alpha) * (norm(delta) if delta_norm is None else delta_norm)
        else:
            update, state_finite, own = self._update(delta, staleness)
            length = norm(update if own is None else own)
        if not state_finite:
            return "the server rule's state would not be finite"
        moved = length if update is None else norm(update)
        ratio = self.max_push_ratio
        if (not ratio or length <= ratio * PUSH_NORM_FLOOR) and moved < SAFE_STEP:
            return None  # within the bound whatever ‖θ_k‖, and θ_k + u finite
        theta_norm = norm(theta)
        if ratio and not length <= ratio * max(theta_norm, PUSH_NORM_FLOOR):
            return (
                f"its update's norm {length:.3g} exceeds --max-push-ratio "
                f"{ratio:g} × max(‖θ_k‖ {theta_norm:.3g}, {PUSH_NORM_FLOOR:g})"
            )
        if moved < SAFE_STEP or theta_norm + moved <= FLOAT32_MAX:
            return None  # no element of θ_k + u can overflow
        if update is None:
            update = delta.mul(alpha)
        if not all_finite(update.add_(theta)):
            return "θ + its update would not be finite"
        return None

    def _factor(self, staleness: int) -> float:
        return staleness_factor(self.compensation, staleness, self.delay_threshold)

    def _update(
        self, delta: torch.Tensor, staleness: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """The rule's ``update`` for this push after compensation. Nothing changes."""
        push = delta
        if self.compensator is not None:
            base = self.version - staleness
            push = self.compensator.compensate(delta, self.param.data, base, commit=False)
        return self.server_rule.update(push, self._factor(staleness))

    def add_push(self, delta: torch.Tensor, staleness: int) -> None:
        """The arithmetic half of :meth:`apply_push`: θ moves by a push that
        :meth:`admit_push` accepted with ``staleness`` (right before: the push made the
        current version, and was computed against the version ``staleness`` before it)."""
        with torch.no_grad():
            if not self.server_rule.takes_compensation:
                self.server_rule.step(delta, 1.0)
                return
            scale = factor = self._factor(staleness)
            push = delta
            if self.compensator is not None:
                base = self.version - 1 - staleness
                push = self.compensator.compensate(delta, self.param.data, base)
                length = float(delta.norm())
                scale = float(push.norm()) / length if length > 0 else 1.0
            self.server_rule.step(push, factor)
            if self.compensator is not None:
                self.compensator.record(self.version, self.param.data)
            self.last_scale = scale
            key = round(min(max(scale, 0.0), SCALE_CLIP), SCALE_DECIMALS)
            self.scale_hist[key] = self.scale_hist.get(key, 0) + 1

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "samples": self.samples,
            "pushes_applied": self.version,
            "staleness_sum_versions": self.staleness_sum,
            "staleness_max_versions": self.staleness_max,
            "dropped_stale": self.dropped_stale,
            "rejected_nonfinite": self.rejected_nonfinite,
            "refused_pushes": self.refused,
            "staleness_compensation": self.compensation,
            # JSON objects: keys are strings ("3": pushes applied with staleness 3).
            "staleness_histogram_versions": {
                str(k): v for k, v in sorted(self.staleness_hist.items())
            },
            "push_scale_histogram": {repr(k): v for k, v in sorted(self.scale_hist.items())},
            "compensation_clamped": 0 if self.compensator is None else self.compensator.clamped,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "theta": self.param.data.clone(),
            "optimizer": self.server_rule.state_dict(),
            "compensator": None if self.compensator is None else self.compensator.state_dict(),
            **self.stats(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.param.data.copy_(state["theta"])
        if state.get("optimizer"):
            self.server_rule.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.samples = int(state["samples"])
        # (a checkpoint written before the metric names carried their unit has the old keys)
        self.staleness_sum = int(state.get("staleness_sum_versions", state.get("staleness_sum")))
        self.staleness_max = int(state.get("staleness_max_versions", state.get("staleness_max")))
        self.dropped_stale = int(state["dropped_stale"])
        self.rejected_nonfinite = int(state["rejected_nonfinite"])
        self.refused = int(state.get("refused_pushes", 0))  # (0 in a checkpoint from before)
        hist = state.get("staleness_histogram_versions", {})
        self.staleness_hist = {int(k): int(v) for k, v in hist.items()}
        scales = state.get("push_scale_histogram", {})
        self.scale_hist = {float(k): int(v) for k, v in scales.items()}
        if self.compensator is not None:
            if state.get("compensator"):
                self.compensator.load_state_dict(state["compensator"])
            else:  # a checkpoint written without compensation: the ring starts here
                self.compensator.reset(self.version, self.param.data)


def overlapped_push_fetch(cfg: RunConfig) -> bool:
    """Whether PUSH_FETCH replies carry θ before the push (sent while the push arrives)."""
    rule = cfg.strategy_spec.server_rule(cfg)
    return rule.stateless and (
        not rule.takes_compensation or cfg.asgd.staleness_compensation in SCALAR_FACTORS
    )


# Requests whose header is followed by a payload of the shard's size.


def make_shard(cfg: RunConfig, theta: torch.Tensor) -> ShardState:
    """A shard of ``theta`` with the strategy's server rule and the configured staleness
    handling."""
    return ShardState(
        theta,
        rule=cfg.strategy_spec.server_rule(cfg),
        max_staleness=cfg.asgd.max_staleness,
        compensation=cfg.asgd.staleness_compensation,
        dc_lambda=cfg.asgd.dc_lambda_value,
        delay_threshold=cfg.asgd.delay_threshold_value(cfg),
        compensation_window=cfg.asgd.compensation_window_value(cfg),
        local_lr=cfg.training.lr,
        max_push_ratio=cfg.asgd.max_push_ratio,
    )
