"""The staleness compensations of ``--staleness-compensation``: a registry, so that a new rule
is one entry here (and its name in ``settings.COMPENSATIONS``, which the CLI reads before
torch; a test keeps the two equal). docs/algorithms.md#staleness-compensation.

Two kinds. A *scalar* compensation multiplies a push of staleness τ by a factor s(τ) alone
(``SCALAR_FACTORS``): a worker rebuilds the shard's θ from an overlapped PUSH_FETCH reply with
its rule's ``alpha`` of :func:`staleness_factor`, bit for bit. A *per-coordinate* one
(``PER_COORDINATE``) replaces the push Δ by Δ̃, computed against θ as it was when the worker
fetched it, and keeps state of its own: its replies follow the apply.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

import torch

COMPENSATION_BETA = 0.95  # β of DC-ASGD's mean square and of gap-aware's mean step
DC_EPSILON = 1e-7  # DC-ASGD-a's ε in λ0/√(m + ε) (Zheng et al. 2017)


def _delay_adaptive(staleness: int, threshold: int) -> float:
    """Koloskova et al. 2022 and Mishchenko et al. 2022 take η_t = η for τ_t ≤ τ_C, else
    min(η, 1/(4Lτ_t)); with their η = 1/(4Lτ_C) the second branch is η·τ_C/τ_t, free of L.
    Built from that rule as ALGORITHMS.md §6 states it: the papers' text was not reachable
    here to confirm their section and equation numbers."""
    return threshold / staleness if staleness > threshold else 1.0


#: name: s(τ, τ_C): ``scale`` is 1/max(1, τ) (Zhang et al. 2016); ``delay-adaptive`` is 1
#: while τ ≤ τ_C and τ_C/τ beyond (τ_C = ``--delay-threshold``).
SCALAR_FACTORS: dict[str, Callable[[int, int], float]] = {
    "none": lambda staleness, threshold: 1.0,
    "scale": lambda staleness, threshold: 1.0 / max(1, staleness),
    "delay-adaptive": _delay_adaptive,
}
SCALAR_COMPENSATIONS = tuple(SCALAR_FACTORS)


def staleness_factor(compensation: str | bool, staleness: int, delay_threshold: int = 1) -> float:
    """The scalar factor s of a push of ``staleness`` τ under ``compensation`` (1 under a
    per-coordinate one). ``True``/``False`` stand for ``scale``/``none``
    (``staleness_scaling``)."""
    if compensation is True or compensation is False:
        compensation = "scale" if compensation else "none"
    factor = SCALAR_FACTORS.get(compensation)
    return 1.0 if factor is None else factor(staleness, delay_threshold)


def add_rule_alpha(
    lr: float, staleness: int, compensation: str | bool = "none", delay_threshold: int = 1
) -> float:
    """The factor of the add rule, θ ← θ + αΔ: α = λ·s (:func:`staleness_factor`).

    Workers use the same function to rebuild the server's θ from an overlapped reply, so that
    both sides compute bit-identical results.
    """
    return lr * staleness_factor(compensation, staleness, delay_threshold)


class Compensator:
    """A per-coordinate compensator's state on one shard: a ring of the shard's θ after each
    of its last R versions (R = ``window``), so that a push computed against version v finds
    θ_then; a push older than the ring uses its oldest θ (counted: ``clamped``). Subclasses
    say how Δ becomes Δ̃ (:meth:`_compensate`) and whether they keep a per-coordinate moment.

    With g = −Δ/η the push's pseudo-gradient per unit of local lr η (``local_lr``; n_sync
    local steps: g is their sum). Section and equation numbers of the papers are not cited:
    their text was not reachable here to check them.
    """

    method: ClassVar[str]
    has_moment: ClassVar[bool] = True

    def __init__(self, theta: torch.Tensor, window: int, dc_lambda: float, local_lr: float):
        self.window = max(1, int(window))
        self.dc_lambda, self.local_lr = dc_lambda, local_lr
        self.ring: deque[tuple[int, torch.Tensor]] = deque()
        self.moment = torch.zeros_like(theta) if self.has_moment else None
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
        ``commit=False``: the same Δ̃, leaving the state alone (the moment, the count of
        clamped pushes), for a push that may still be refused."""
        if commit or base_version >= self.ring[0][0]:
            theta_then = self.theta_then(base_version)
        else:
            theta_then = self.ring[0][1]
        return self._compensate(delta, theta_now - theta_then, commit)

    def _compensate(self, delta: torch.Tensor, diff: torch.Tensor, commit: bool) -> torch.Tensor:
        """Δ̃ from Δ and θ_now − θ_then (``diff``, which it may overwrite)."""
        raise NotImplementedError

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


class DelayCompensation(Compensator):
    """``dc``: DC-ASGD (Zheng et al. 2017, "Asynchronous SGD with delay compensation", its
    update rule): Δ̃ = −η·(g + λ·g⊙g⊙(θ_now − θ_then)), λ = ``dc_lambda``."""

    method = "dc"
    has_moment = False

    def _compensate(self, delta, diff, commit):
        g = delta / -self.local_lr
        correction = (g * g).mul_(diff).mul_(self.dc_lambda)
        return (g + correction) * -self.local_lr


class AdaptiveDelayCompensation(Compensator):
    """``dc-adaptive``: DC-ASGD-a, λ_t = λ0/√(m_t + ε) with m_t ← β·m + (1−β)·g⊙g updated by
    this push first."""

    method = "dc-adaptive"

    def _compensate(self, delta, diff, commit):
        g = delta / -self.local_lr
        gg = g * g
        moment = self.moment if commit else self.moment.clone()
        moment.mul_(COMPENSATION_BETA).add_(gg, alpha=1.0 - COMPENSATION_BETA)
        lam = self.dc_lambda / torch.sqrt(moment + DC_EPSILON)
        return (g + lam * gg * diff) * -self.local_lr


class GapAware(Compensator):
    """``gap``: gap-aware mitigation (Barkai et al. 2020): Δ̃ = Δ / G, G = 1 + |θ_now −
    θ_then|/C, C the running mean (β) of |Δ| over the pushes applied before, the first one
    its start (G = 1 where C = 0): the gap in units of one worker's update, as the paper's C
    is. (C was the mean step the shard took, λ|Δ̃|: with λ = 1/W that counts every concurrent
    push as 1/W of a step, G grew to ~W on top of λ's 1/W, and asgd stopped learning at
    W = 16: docs/algorithms.md#staleness-compensation.)"""

    method = "gap"

    def _compensate(self, delta, diff, commit):
        ratio = torch.where(self.moment > 0, diff.abs_() / self.moment, 0.0)
        applied = delta / ratio.add_(1.0)
        if commit:  # C learns this push's size after judging it
            size = delta.abs()
            if self.updates == 0:
                self.moment.copy_(size)
            else:
                self.moment.mul_(COMPENSATION_BETA).add_(size, alpha=1.0 - COMPENSATION_BETA)
        return applied


PER_COORDINATE: dict[str, type[Compensator]] = {
    c.method: c for c in (DelayCompensation, AdaptiveDelayCompensation, GapAware)
}


def make_compensator(
    method: str, theta: torch.Tensor, window: int, dc_lambda: float, local_lr: float
) -> Compensator:
    """The per-coordinate compensator ``method`` on a shard whose θ is ``theta``."""
    if method not in PER_COORDINATE:
        raise ValueError(f"{method!r} is not a per-coordinate compensator")
    return PER_COORDINATE[method](theta, window, dc_lambda, local_lr)
