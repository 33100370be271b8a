"""``diloco``: DiLoCo (Douillard et al. 2023) and Streaming DiLoCo, on local SGD's worker.

Algorithm (docs/algorithms.md#local_sgd-and-diloco): the local optimizer is the *inner*
optimizer; every H steps the workers average the pseudo-gradient Δ = θ_global − θ_local and an
*outer* optimizer (SGD with Nesterov momentum 0.9; lr 0.1 over an SGD inner optimizer, 0.7 over
Adam by default) applies it to θ_global, which every replica then restarts from. With an outer
SGD of lr 1 and no momentum, θ_global becomes the average of the replicas: ``local_sgd``.

Streaming DiLoCo (``fragments`` F > 1 or ``fragment_delay`` τ > 0; Douillard et al. 2025,
arXiv:2501.18512): the parameters are cut into F fragments of contiguous tensors (module order,
balanced by element count, :func:`~cloudburst.strategies.local_sgd.worker.split_fragments`);
fragment k is averaged every H steps at offset (k+1)·H/F (torchft's schedule), its all-reduce
started non-blocking and applied τ inner steps later, with one outer optimizer per fragment,
and the replica's fragment then set to α·θ_local + (1 − α)·θ_global (α = ``fragment_alpha``;
0 is DiLoCo's replacement). F = 1, τ = 0 is DiLoCo itself, bit for bit.

A synchronous warm start (``local_sgd_warmup_steps`` K, post-local SGD's): for the first K
steps θ_global becomes the replicas' average after every step (no outer optimizer: its
momentum starts after), which over SGD is synchronous SGD; the outer schedule then runs from
step K (fragment k's first outer step after step K + offsets[k]).

``compress``: the averages send the pseudo-gradient θ_global − θ_i compressed, with error
feedback for int8/fp8 (residuals per fragment, checkpointed); a delayed fragment overlaps the
scatter with its τ steps and runs the gather when applied.

Synchronous every H steps (Streaming DiLoCo overlaps each fragment's all-reduce with τ inner
steps); staleness 0 (Streaming DiLoCo: the fragment applied at step t was averaged at step
t − τ). A dead worker: the next average raises on every other rank and the job stops.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cloudburst.comm.collectives import Pending
from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.strategies.diloco import Diloco
from cloudburst.strategies.local_sgd.worker import LocalSgdStrategy, split_fragments


@dataclass
class _InFlight:
    """A fragment's started all-reduce: applied after the inner step ``apply_at``."""

    apply_at: int
    buffer: torch.Tensor  # the sum arrives here: of θ_i (none), of θ_global − θ_i (compressed)
    pending: Pending


class DilocoStrategy(Diloco, LocalSgdStrategy):
    needs_peers = False

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        super().wrap(model, optimizer)
        self._reference = None  # the drift DiLoCo sends is its pseudo-gradient θ_global − θ_i
        self.fragment_params = split_fragments(self._params, self.cfg.diloco.fragments)
        # Fragment k's outer step is due after the steps t with t mod H = offsets[k].
        period, count = self.period(), len(self.fragment_params)
        self.offsets = [((k + 1) * period // count) % period for k in range(count)]
        # θ_global of each fragment lives in a parameter of its own, so each outer optimizer
        # is a plain torch optimizer (with its momentum state) over one flat tensor.
        self.global_thetas = [
            nn.Parameter(flatten_params(ps).clone(), requires_grad=False)
            for ps in self.fragment_params
        ]
        self.outers = [
            torch.optim.SGD(
                [theta],
                lr=self.cfg.diloco.outer_lr,
                momentum=self.cfg.diloco.outer_momentum,
                nesterov=self.cfg.diloco.nesterov and self.cfg.diloco.outer_momentum > 0,
            )
            for theta in self.global_thetas
        ]
        self.synced_at = [0] * count  # the step of each fragment's last outer step
        self.in_flight: dict[int, _InFlight] = {}
        self.moment_averages = 0  # DES-LOC's all-reduces of a moment
        return model

    @property
    def global_theta(self) -> torch.Tensor:
        """θ_global, flat (a parameter with one fragment; their concatenation otherwise)."""
        if len(self.global_thetas) == 1:
            return self.global_thetas[0]
        return torch.cat([t.detach() for t in self.global_thetas])

    @property
    def outer(self) -> torch.optim.Optimizer:
        return self.outers[0]

    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        self.optimizer_state_changed = False
        warm = self.cfg.local_sgd.warmup_steps
        if self.local_steps <= warm:
            for k in range(len(self.fragment_params)):
                self._start(k, 0)
                self._apply(k, 0.0, outer=False)
            return
        for k, offset in enumerate(self.offsets):
            if (self.local_steps - warm) % self.period() == offset:
                self._start(k, self.cfg.diloco.fragment_delay)
        for k in sorted(self.in_flight):
            if self.in_flight[k].apply_at == self.local_steps:
                self._apply(k, self.cfg.diloco.fragment_alpha)
        for key, every in (("exp_avg", self.cfg.diloco.desloc_first_every),
                           ("exp_avg_sq", self.cfg.diloco.desloc_second_every)):  # fmt: skip
            if every and (self.local_steps - warm) % (self.period() * every) == 0:
                self._average_moment(key)

    def _average_moment(self, key: str) -> None:
        """DES-LOC: the replicas' moment ``key`` of every parameter becomes their average
        (one all-reduce of all of them, uncompressed)."""
        state = self.optimizer.state
        moments = [state[p][key] for p in self._params if key in state.get(p, {})]
        if not moments or self.ctx.num_replicas == 1:
            return
        flat = flatten_params(moments)
        self._reduce(flat, key, compress=False)
        assign_flat(moments, flat.div_(self.ctx.num_replicas))
        self.moment_averages += 1
        self.optimizer_state_changed = True

    def _start(self, k: int, delay: int) -> None:
        """Start fragment k's all-reduce (non-blocking when it is applied later)."""
        params = self.fragment_params[k]
        if self.compression.active:
            buffer = self.global_thetas[k].detach() - flatten_params(params)
        else:
            single = len(self.fragment_params) == 1
            buffer = flatten_params(params, out=self._flat if single else None)
        pending = self._reduce(buffer, f"fragment{k}", async_op=delay > 0)
        self.averages += 1
        self.in_flight[k] = _InFlight(self.local_steps + delay, buffer, pending)

    def _apply(self, k: int, alpha: float, outer: bool = True) -> None:
        """Fragment k's outer step on the averaged pseudo-gradient (``outer=False``: θ_global
        ← θ_global − the pseudo-gradient, the replicas' average), then the replica's
        fragment ← α·θ_local + (1 − α)·θ_global."""
        flight = self.in_flight.pop(k)
        flight.pending.wait()
        theta = self.global_thetas[k]
        mean = flight.buffer.div_(self.ctx.num_replicas)
        # Pseudo-gradient: how far the replicas moved away from θ_global, on average.
        grad = mean if self.compression.active else theta.detach() - mean
        if outer:
            theta.grad = grad
            self.outers[k].step()
            theta.grad = None
        else:
            with torch.no_grad():
                theta.sub_(grad)
        params = self.fragment_params[k]
        if alpha == 0.0:
            assign_flat(self.model if len(self.fragment_params) == 1 else params, theta.detach())
        else:
            assign_flat(params, torch.lerp(theta.detach(), flatten_params(params), alpha))
        self.synced_at[k] = self.local_steps

    def finish(self) -> None:
        # End on one model: apply what is in flight, then one more outer step (no mixing) on
        # every fragment that moved since its last one.
        for k in sorted(self.in_flight):
            self._apply(k, self.cfg.diloco.fragment_alpha)
        for k in range(len(self.fragment_params)):
            if self.synced_at[k] != self.local_steps or self.cfg.diloco.fragment_alpha != 0.0:
                self._start(k, 0)
                self._apply(k, 0.0)

    def checkpoint_ready(self) -> bool:
        # A fragment's all-reduce in flight is not saved: checkpoint once none is (as DASO).
        return not self.in_flight

    @property
    def _desloc(self) -> bool:
        return bool(self.cfg.diloco.desloc_first_every or self.cfg.diloco.desloc_second_every)

    def report(self) -> dict[str, Any]:
        r = super().report()
        if self._desloc:
            r["moment_averages"] = self.moment_averages
        return r

    def state_dict(self) -> dict[str, Any]:
        state = {
            **super().state_dict(),
            **({"moment_averages": self.moment_averages} if self._desloc else {}),
            "global_theta": self.global_theta.detach().clone(),
            "outer": copy.deepcopy(self.outers[0].state_dict()),
        }
        if len(self.outers) > 1:
            state["outer_fragments"] = [copy.deepcopy(o.state_dict()) for o in self.outers]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "local_steps" in state:
            super().load_state_dict(state)
        else:
            self._load_compression(state)
        self.moment_averages = int(state.get("moment_averages", 0))
        sizes = [t.numel() for t in self.global_thetas]
        with torch.no_grad():
            for theta, part in zip(
                self.global_thetas, state["global_theta"].split(sizes), strict=True
            ):
                theta.copy_(part)
        outers = state.get("outer_fragments", [state["outer"]])
        for outer, saved in zip(self.outers, outers, strict=True):
            outer.load_state_dict(saved)
        self.synced_at = [self._last_sync(k, self.local_steps) for k in range(len(self.outers))]

    def _last_sync(self, k: int, step: int) -> int:
        """The step of fragment k's last outer step by ``step`` (0: none yet). Every step of
        the warm-up K averages; after it, fragment k's first all-reduce starts after step
        K + offsets[k] (K + H when that is 0) and lands τ steps later."""
        warm, period = self.cfg.local_sgd.warmup_steps, self.period()
        if step <= warm:
            return step
        first = (self.offsets[k] or period) + self.cfg.diloco.fragment_delay
        step -= warm
        return warm if step < first else warm + first + (step - first) // period * period
