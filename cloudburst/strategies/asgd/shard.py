"""One parameter-server shard's maths, with no communication: what a shard does with a push
(:class:`ShardState`), the server rules, EASGD's elastic step, the staleness compensators
(:class:`Compensator`), and the helpers the workers share with the servers (they import this
module, never the server loop in :mod:`cloudburst.strategies.asgd.server`).

:class:`ShardState` applies pushes one at a time, in arrival order, keeps the version clock
(number of applied pushes), the per-push staleness and its distribution, drops pushes staler
than ``max_staleness``, compensates a stale push (``--staleness-compensation``: 1/τ, DC-ASGD,
gap-aware, delay-adaptive; docs/algorithms.md#staleness-compensation), rejects non-finite
pushes, and refuses finite ones whose update (the change of θ_k the rule would make, after
compensation) is not finite or larger than ``max_push_ratio``·max(‖θ_k‖, 1)
(``--max-push-ratio``: one push of 3e38 made θ inf and every worker's loss NaN, issue 44).
Async DiLoCo's Delayed Nesterov outer rule (``dn``) lives here too.
DC-ASGD and gap-aware need θ_then, the θ the pushing worker last fetched: the shard keeps a
ring of its own θ after each of the last R versions (R = ``compensation_window``; memory
R·|θ_k|), looked up by the push's base version. A ring, not DC-ASGD's per-worker backup,
because it is a function of the applied pushes alone: a standby copy and a restored
checkpoint rebuild it exactly, and a worker's read-only fetch (evaluation) cannot disturb it.
A push older than the ring uses its oldest θ (counted: ``compensation_clamped``).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cloudburst.comm.p2p import Status
from cloudburst.config import RunConfig
from cloudburst.strategies.asgd.settings import COMPENSATIONS

# --staleness-compensation: the compensators (docs/algorithms.md#staleness-compensation).
# Those whose factor is a function of the staleness alone: a worker rebuilds the server's θ
# from an overlapped PUSH_FETCH reply with add_rule_alpha. The others need θ_then and keep
# per-coordinate state: their replies follow the apply.
SCALAR_COMPENSATIONS = ("none", "scale", "delay-adaptive")
COMPENSATION_BETA = 0.95  # β of DC-ASGD's mean square and of gap-aware's mean step
DC_EPSILON = 1e-7  # DC-ASGD-a's ε in λ0/√(m + ε) (Zheng et al. 2017)
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


def staleness_factor(compensation: str | bool, staleness: int, delay_threshold: int = 1) -> float:
    """The scalar factor s of a push of ``staleness`` τ: 1/max(1, τ) (``scale``, Zhang et al.
    2016), 1 while τ ≤ τ_C and τ_C/τ beyond (``delay-adaptive``, τ_C = ``delay_threshold``),
    else 1. ``True``/``False`` stand for ``scale``/``none`` (``staleness_scaling``).

    delay-adaptive: Koloskova et al. 2022 and Mishchenko et al. 2022 take η_t = η for
    τ_t ≤ τ_C, else min(η, 1/(4Lτ_t)); with their η = 1/(4Lτ_C) the second branch is η·τ_C/τ_t,
    free of L. Built from that rule as ALGORITHMS.md §6 states it: the papers' text was not
    reachable here to confirm their section and equation numbers."""
    if compensation is True or compensation == "scale":
        return 1.0 / max(1, staleness)
    if compensation == "delay-adaptive" and staleness > delay_threshold:
        return delay_threshold / staleness
    return 1.0


def add_rule_alpha(
    lr: float, staleness: int, compensation: str | bool = "none", delay_threshold: int = 1
) -> float:
    """The factor of the add rule, θ ← θ + αΔ: α = λ·s (:func:`staleness_factor`).

    Workers use the same function to rebuild the server's θ from an overlapped reply, so that
    both sides compute bit-identical results.
    """
    return lr * staleness_factor(compensation, staleness, delay_threshold)


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


def norm(t: torch.Tensor) -> float:
    """‖t‖₂, in float64 where float32's sum of squares overflows (elements beyond ~1.8e19)."""
    value = float(t.norm())
    return value if math.isfinite(value) else float(t.norm(dtype=torch.float64))


class Compensator:
    """The state of a per-coordinate compensator on one shard: ``dc``, ``dc-adaptive``
    (Zheng et al. 2017, "Asynchronous SGD with delay compensation": its update rule, and its
    adaptive λ_t = λ0/√(m_t + ε), DC-ASGD-a) or ``gap`` (Barkai et al. 2020, "Gap-aware
    mitigation of gradient staleness": G = 1 + |θ_now − θ_then|/C). Section and equation
    numbers are not cited: the papers' text was not reachable here to check them.

    With g = −Δ/η the push's pseudo-gradient per unit of local lr η (``local_lr``; n_sync
    local steps: g is their sum), DC-ASGD applies Δ̃ = −η·(g + λ·g⊙g⊙(θ_now − θ_then)), where
    λ = ``dc_lambda``, or λ0/√(m_t + ε) with m_t ← β·m + (1−β)·g⊙g updated by this push first;
    gap-aware applies Δ̃ = Δ / G with C the running mean (β) of |Δ| over the pushes applied
    before, the first one its start (G = 1 where C = 0): the gap in units of one worker's
    update, as the paper's C is. (C was the mean step the shard took, λ|Δ̃|: with λ = 1/W
    that counts every concurrent push as 1/W of a step, G grew to ~W on top of λ's 1/W, and
    asgd stopped learning at W = 16: docs/algorithms.md#staleness-compensation.)
    """

    def __init__(
        self, method: str, theta: torch.Tensor, window: int, dc_lambda: float, local_lr: float
    ):
        if method not in ("dc", "dc-adaptive", "gap"):
            raise ValueError(f"{method!r} is not a per-coordinate compensator")
        self.method, self.window = method, max(1, int(window))
        self.dc_lambda, self.local_lr = dc_lambda, local_lr
        self.ring: deque[tuple[int, torch.Tensor]] = deque()
        self.moment = None if method == "dc" else torch.zeros_like(theta)
        self.updates = 0  # applied pushes seen (gap: whether C has its first value)
        self.clamped = 0  # pushes older than the ring (their θ_then: its oldest)
        self.reset(0, theta)

    def reset(self, version: int, theta: torch.Tensor) -> None:
        """θ was replaced (warm start): the ring holds it alone, as ``version``."""
        self.ring.clear()
        self.ring.append((version, theta.detach().clone()))

    def theta_then(self, base_version: int) -> torch.Tensor:
        oldest = self.ring[0][0]
        if base_version < oldest:
            self.clamped += 1
            base_version = oldest
        return self.ring[base_version - oldest][1]

    def compensate(
        self, delta: torch.Tensor, theta_now: torch.Tensor, base_version: int, commit: bool = True
    ) -> torch.Tensor:
        """Δ̃, the push to apply in place of ``delta`` (computed against ``base_version``).
        ``commit=False``: the same Δ̃, leaving the state alone (the mean square, the count of
        clamped pushes), for a push that may still be refused."""
        oldest = self.ring[0][0]
        if commit or base_version >= oldest:
            theta_then = self.theta_then(base_version)
        else:
            theta_then = self.ring[0][1]
        diff = theta_now - theta_then
        if self.method == "gap":
            ratio = torch.where(self.moment > 0, diff.abs_() / self.moment, 0.0)
            applied = delta / ratio.add_(1.0)
            if commit:  # C learns this push's size after judging it
                size = delta.abs()
                if self.updates == 0:
                    self.moment.copy_(size)
                else:
                    self.moment.mul_(COMPENSATION_BETA).add_(size, alpha=1.0 - COMPENSATION_BETA)
            return applied
        g = delta / -self.local_lr
        gg = g * g
        if self.method == "dc-adaptive":
            moment = self.moment if commit else self.moment.clone()
            moment.mul_(COMPENSATION_BETA).add_(gg, alpha=1.0 - COMPENSATION_BETA)
            lam = self.dc_lambda / torch.sqrt(moment + DC_EPSILON)
            correction = lam * gg * diff
        else:
            correction = gg.mul_(diff).mul_(self.dc_lambda)
        return (g + correction) * -self.local_lr

    def record(self, version: int, theta: torch.Tensor) -> None:
        """``theta`` is the shard's θ after the push that made ``version``."""
        self.updates += 1
        if len(self.ring) >= self.window:
            _, buf = self.ring.popleft()
            buf.copy_(theta)
        else:
            buf = theta.detach().clone()
        self.ring.append((version, buf))

    def state_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "ring_versions": [v for v, _ in self.ring],
            "ring": torch.stack([t for _, t in self.ring]).clone(),
            "moment": None if self.moment is None else self.moment.clone(),
            "updates": self.updates,
            "clamped": self.clamped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["method"] != self.method:
            raise ValueError(f"compensator state of {state['method']!r}, not {self.method!r}")
        versions = [int(v) for v in state["ring_versions"]][-self.window :]
        ring = state["ring"][-len(versions) :]
        self.ring = deque((v, t.clone()) for v, t in zip(versions, ring, strict=True))
        if self.moment is not None:
            self.moment.copy_(state["moment"])
        self.updates, self.clamped = int(state["updates"]), int(state["clamped"])


class DelayedNesterov:
    """Asynchronous DiLoCo's outer optimizer on a shard: Delayed Nesterov (Liu et al. 2024,
    "Asynchronous Local-SGD Training for Language Modeling", arXiv:2401.09135, its Delayed
    Nesterov algorithm, as the HALoS authors' utnslab/halos ``src/halos/opt.py`` implements
    it with the paper cited). With g the push's
    pseudo-gradient (−Δ), t the number of pushes applied before it, N = ``period``, η, β, c:

        a ← a + g
        (t+1) mod N = 0:  m ← β·m + a/N;  θ ← θ − η·(1 − c·N + c)·β·m − (η/N)·g;  a ← 0
        otherwise:                         θ ← θ − η·c·β·m − (η/N)·g

    c = 0 (the default) is the paper's DN: between momentum updates, plain SGD of lr η/N.
    """

    def __init__(self, param: torch.Tensor, lr: float, beta: float, period: int, c: float = 0.0):
        self.param, self.lr, self.beta, self.period, self.c = param, lr, beta, period, c
        self.momentum = torch.zeros_like(param)
        self.accumulated = torch.zeros_like(param)
        self.t = 0

    def step(self, g: torch.Tensor) -> None:
        self.accumulated.add_(g)
        if (self.t + 1) % self.period == 0:
            self.momentum.mul_(self.beta).add_(self.accumulated, alpha=1.0 / self.period)
            coeff = (1.0 - self.c * self.period + self.c) * self.beta
            self.param.add_(self.momentum, alpha=-self.lr * coeff)
            self.accumulated.zero_()
        elif self.c:
            self.param.add_(self.momentum, alpha=-self.lr * self.c * self.beta)
        self.param.add_(g, alpha=-self.lr / self.period)
        self.t += 1

    def update(self, g: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The change :meth:`step` would make to θ for ``g``, and whether its new state (the
        momentum, the accumulated g) would be finite, with nothing changed."""
        update = g.mul(-self.lr / self.period)
        if (self.t + 1) % self.period == 0:
            accumulated = self.accumulated.add(g)
            momentum = self.momentum.mul(self.beta).add_(accumulated, alpha=1.0 / self.period)
            coeff = (1.0 - self.c * self.period + self.c) * self.beta
            state_finite = all_finite(accumulated) and all_finite(momentum)
            return update.add_(momentum, alpha=-self.lr * coeff), state_finite
        if self.c:
            update.add_(self.momentum, alpha=-self.lr * self.c * self.beta)
        return update, all_finite(self.accumulated.add(g))

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum.clone(),
            "accumulated": self.accumulated.clone(),
            "t": self.t,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum.copy_(state["momentum"])
        self.accumulated.copy_(state["accumulated"])
        self.t = int(state["t"])


class ShardState:
    """One shard θ_k with its version clock and server rule.

    Rules (Δ = θ_worker − θ_at_its_last_fetch):
      - ``add``:     θ_k ← θ_k + λ·s·Δ_k                       (λ = ``lr``; DistBelief/GPU A-SGD)
      - ``sgd``:     SGD with momentum on the pseudo-gradient −s·Δ_k (``torch.optim.SGD``)
      - ``adagrad``: Adagrad on the pseudo-gradient −s·Δ_k (``torch.optim.Adagrad``)
      - ``dn``:      async DiLoCo's Delayed Nesterov (:class:`DelayedNesterov`) on −s·Δ_k, with
        lr λ, β = ``momentum`` and N = ``dn_period``
      - ``elastic``: EASGD's centre variable; the push carries the worker's θ_i (not Δ) and
        θ̃_k ← θ̃_k + α·(θ_i,k − θ̃_k) with α = ``lr`` (the worker moves by the same e, away)
    where s = :func:`staleness_factor` (``compensation``; ``staleness_scaling=True`` is
    ``scale``), and Δ_k is first replaced by the :class:`Compensator`'s Δ̃ under ``dc``,
    ``dc-adaptive`` and ``gap``.

    A push is applied only if the update u it makes (θ_k ← θ_k + u, by the rule above, after
    compensation) leaves θ_k and the rule's state finite and ‖u‖ ≤ ``max_push_ratio``·
    max(‖θ_k‖, ``PUSH_NORM_FLOOR``) (0: no bound; adagrad: ‖λ·s·Δ̃‖, see :meth:`_update`);
    else it is REFUSED (:meth:`push_problem`).
    """

    def __init__(
        self,
        theta: torch.Tensor,
        rule: str = "add",
        lr: float = 1.0,
        momentum: float = 0.0,
        max_staleness: int | None = None,
        staleness_scaling: bool = False,
        compensation: str | None = None,
        dc_lambda: float = 0.04,
        delay_threshold: int = 1,
        compensation_window: int = 16,
        local_lr: float = 1.0,
        dn_period: int = 1,
        dn_c: float = 0.0,
        max_push_ratio: float = 0.0,
    ):
        self.param = torch.nn.Parameter(
            theta.detach().to(torch.float32).clone(), requires_grad=False
        )
        self.rule, self.lr = rule, lr
        if compensation is None:
            compensation = "scale" if staleness_scaling else "none"
        if compensation not in COMPENSATIONS:
            raise ValueError(f"unknown staleness compensation {compensation!r}")
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
        if compensation not in SCALAR_COMPENSATIONS:
            self.compensator = Compensator(
                compensation, self.param.data, compensation_window, dc_lambda, local_lr
            )
        if rule in ("add", "elastic"):
            self.optimizer = None
        elif rule == "sgd":
            self.optimizer = torch.optim.SGD([self.param], lr=lr, momentum=momentum)
        elif rule == "adagrad":
            self.optimizer = torch.optim.Adagrad([self.param], lr=lr)
        elif rule == "dn":
            self.optimizer = DelayedNesterov(self.param.data, lr, momentum, dn_period, dn_c)
        else:
            raise ValueError(f"unknown server rule {rule!r}")

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
        here). θ_k is finite (every change to it is checked)."""
        theta = self.param.data
        update: torch.Tensor | None = None
        state_finite = True
        if self.rule == "add" and self.compensator is None:
            alpha = add_rule_alpha(self.lr, staleness, self.compensation, self.delay_threshold)
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

    def _update(
        self, delta: torch.Tensor, staleness: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """u, the change :meth:`add_push` would make to θ_k; whether the rule's state would
        stay finite; and, for adagrad, the push's own step λ·s·Δ̃ that the bound applies to
        instead of u (adagrad's step is at most λ per coordinate whatever the push: its first
        one, λ·sign(g), may be longer than θ_k; a refusal would leave its state as it was, so
        every later push would be refused too). Nothing changes."""
        theta = self.param.data
        if self.rule == "elastic":
            return elastic_step(self.lr, delta, theta), True, None
        factor = staleness_factor(self.compensation, staleness, self.delay_threshold)
        push = delta
        if self.compensator is not None:
            base = self.version - staleness
            push = self.compensator.compensate(delta, theta, base, commit=False)
        if self.optimizer is None:  # add
            return push.mul(self.lr * factor), True, None
        g = push.mul(-factor)
        if isinstance(self.optimizer, DelayedNesterov):
            return (*self.optimizer.update(g), None)
        state = self.optimizer.state.get(self.param, {})
        group = self.optimizer.param_groups[0]
        if isinstance(self.optimizer, torch.optim.Adagrad):
            # clr = lr / (1 + (step − 1)·lr_decay), lr_decay = 0; weight_decay = 0
            total = state["sum"].add(g * g)
            own = g.mul(-group["lr"])
            update = g.div(total.sqrt().add_(group["eps"])).mul_(-group["lr"])
            return update, all_finite(total), own
        # SGD (dampening 0, no Nesterov, no weight decay): buf ← μ·buf + g (g on the first step)
        buf = state.get("momentum_buffer")
        if group["momentum"] and buf is not None:
            g = buf.mul(group["momentum"]).add_(g)
        state_finite = all_finite(g)
        return g.mul_(-group["lr"]), state_finite, None

    def add_push(self, delta: torch.Tensor, staleness: int) -> None:
        """The arithmetic half of :meth:`apply_push`: θ moves by a push that
        :meth:`admit_push` accepted with ``staleness`` (right before: the push made the
        current version, and was computed against the version ``staleness`` before it)."""
        with torch.no_grad():
            if self.rule == "elastic":
                self.param.add_(elastic_step(self.lr, delta, self.param))
                return
            scale = staleness_factor(self.compensation, staleness, self.delay_threshold)
            push = delta
            if self.compensator is not None:
                base = self.version - 1 - staleness
                push = self.compensator.compensate(delta, self.param.data, base)
                length = float(delta.norm())
                scale = float(push.norm()) / length if length > 0 else 1.0
            if self.optimizer is None:
                alpha = add_rule_alpha(self.lr, staleness, self.compensation, self.delay_threshold)
                self.param.add_(push, alpha=alpha)
            elif isinstance(self.optimizer, DelayedNesterov):
                factor = staleness_factor(self.compensation, staleness, self.delay_threshold)
                self.optimizer.step(push.mul(-factor))
            else:
                factor = staleness_factor(self.compensation, staleness, self.delay_threshold)
                self.param.grad = push.mul(-factor)
                self.optimizer.step()
                self.param.grad = None
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
        if isinstance(self.optimizer, DelayedNesterov):
            optimizer = self.optimizer.state_dict()
        elif self.optimizer is not None:
            # deepcopy: the optimizer's state_dict shares its buffers with the live optimizer
            optimizer = copy.deepcopy(self.optimizer.state_dict())
        else:
            optimizer = {}
        return {
            "theta": self.param.data.clone(),
            "optimizer": optimizer,
            "compensator": None if self.compensator is None else self.compensator.state_dict(),
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
    return (
        cfg.shard_rule[0] in ("add", "elastic")
        and cfg.staleness_compensation in SCALAR_COMPENSATIONS
    )


# Requests whose header is followed by a payload of the shard's size.


def standby_of(shard: int, num_servers: int) -> int:
    """The server rank that keeps shard ``shard``'s standby copy (``--shard-standby``): the
    next one, cyclically."""
    return (shard + 1) % num_servers


def shard_checkpoint_path(out: str | Path, shard: int) -> Path:
    return Path(out) / "checkpoints" / f"server{shard}.pt"


def make_shard(cfg: RunConfig, theta: torch.Tensor) -> ShardState:
    rule, lr = cfg.shard_rule
    return ShardState(
        theta,
        rule=rule,
        lr=lr,
        momentum=cfg.diloco_outer_momentum if rule == "dn" else cfg.server_momentum,
        max_staleness=cfg.max_staleness,
        compensation="none" if rule == "elastic" else cfg.staleness_compensation,
        dc_lambda=cfg.dc_lambda_value,
        delay_threshold=cfg.delay_threshold_value,
        compensation_window=cfg.compensation_window_value,
        local_lr=cfg.lr,
        dn_period=cfg.dn_period_value,
        dn_c=cfg.dn_c,
        max_push_ratio=cfg.max_push_ratio,
    )


def merged_histogram(stats: list[dict[str, Any]], key: str) -> dict[float, int]:
    """The shards' histograms under ``key`` added up (keys as numbers)."""
    total: dict[float, int] = {}
    for s in stats:
        for k, v in (s.get(key) or {}).items():
            total[float(k)] = total.get(float(k), 0) + int(v)
    return dict(sorted(total.items()))


def histogram_quantiles(hist: dict[float, int], qs=(0.5, 0.9, 0.99)) -> dict[str, float] | None:
    """Exact quantiles (the smallest value with at least q of the counts at or below it) and
    the maximum of a histogram; None when it is empty."""
    n = sum(hist.values())
    if not n:
        return None
    out: dict[str, float] = {}
    for q in qs:
        need, seen = q * n, 0
        for value, count in hist.items():
            seen += count
            if seen >= need:
                out[f"p{round(q * 100):d}"] = value
                break
    out["max"] = max(hist)
    return out


def mean_staleness(stats: list[dict[str, Any]]) -> float:
    applied = sum(s.get("pushes_applied", 0) for s in stats)
    total = sum(s.get("staleness_sum_versions", 0) for s in stats)
    return total / applied if applied else math.nan
