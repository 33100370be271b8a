"""An emulated device's time, spread over the forward and backward passes.

``--min-step-time-s M`` makes every training step take at least ``M`` seconds, and a
straggler's factor ``f`` makes it ``f`` times as slow: a step whose real compute took ``c``
seconds (its time less what it waited for communication) takes

    T = max(c, M) × f         (so the padding is P = T − c ≥ 0)

on the emulated device. Sleeping ``P`` after the optimizer step, as a first version did, lets a
strategy whose communication runs in the background (DASO's non-blocking global sync) hide it
under the sleep, while DDP's gradient buckets, which start during the backward pass, could
never overlap with any of it — on a real device they do. :class:`DeviceEmulator` puts the
padding where a device would spend it instead:

- **Where.** Every module that owns parameters directly (a leaf ``Linear``, ``Conv``,
  ``BatchNorm``...) gets a share of the step's padding proportional to its parameter count
  (parameters, not FLOPs: the count does not depend on the input's shape, and for the layers
  that dominate here — dense and convolutional — both scale together; a model whose
  convolutions see large images spends relatively more of a device's time early in the
  network than this model says).
- **Forward : backward = 1 : 2.** A third of the padding is slept in forward hooks (after
  each module's forward, in forward order), two thirds in hooks on each module's output
  gradient, which run *before* that module's own backward computes its parameters'
  gradients: the last layer's share first. So the gradients of the last layers are ready
  — and DDP's bucket holding them is being all-reduced — while the earlier layers' backward
  is still "computing", as on a device.
- **How much.** ``c`` is known only when the step ends, so the hooks sleep a padding
  predicted from the previous step's compute, ``P̂ = max(ĉ, M) × f − ĉ``; at the end of the
  step the loop measures ``c`` (the step's time less its communication waits less what the
  hooks slept) and sleeps what is missing, ``P − slept``. A step that was slower than
  predicted (the hooks slept too much) leaves the excess as a debt that the next step's
  padding pays first, so the total emulated time of a run is exactly ``Σ T`` up to the last
  step's debt (at most one step's misprediction). Hooks never sleep more than their phase's
  budget, even when a module runs twice in a step.

Only the real transport sleeps: the virtual cluster charges its modelled step time at the
gradient all-reduce instead (:meth:`cloudburst.sim.transport.SimTransport.charge_compute`),
so the loop does not install this there. Outside a training step (evaluation) the hooks do
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

#: The share of a step's padding slept in the forward pass (the rest in the backward pass):
#: a backward pass costs about twice its forward (two matrix products per layer instead of one).
FORWARD_SHARE = 1 / 3


def padding_s(compute_s: float, min_step_time_s: float, factor: float) -> float:
    """The time an emulated device adds to a step whose real compute took ``compute_s``:
    ``max(compute_s, min_step_time_s) × factor − compute_s`` (never negative)."""
    return max(0.0, max(compute_s, min_step_time_s) * factor - compute_s)


@dataclass
class StepPlan:
    """One step's padding as it is spent: the budgets per phase and what was slept."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    slept_forward_s: float = 0.0
    slept_backward_s: float = 0.0
    # set by end_step: the step's compute, the debt before and after it, and the remainder
    # asked for at its end (so slept_s + remainder_s = padding − debt_before + debt_after)
    compute_s: float = 0.0
    debt_before_s: float = 0.0
    debt_after_s: float = 0.0
    remainder_s: float = 0.0
    #: (phase, module name) in the order the hooks slept (for tests and inspection)
    events: list[tuple[str, str]] = field(default_factory=list)

    @property
    def slept_s(self) -> float:
        return self.slept_forward_s + self.slept_backward_s


class DeviceEmulator:
    """The padding of :func:`padding_s`, slept in per-module forward and backward hooks.

    ``sleep(seconds)`` and ``now()`` are the transport's (the real clock); the loop calls
    :meth:`begin_step` before a step's forward and :meth:`end_step` with the step's measured
    compute after it.
    """

    def __init__(
        self,
        model: nn.Module,
        min_step_time_s: float,
        factor: float,
        sleep: Callable[[float], None],
        now: Callable[[], float],
    ):
        self.min_step_time_s, self.factor = float(min_step_time_s), float(factor)
        self._sleep, self._now = sleep, now
        owners = [
            (name, m, sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad))
            for name, m in model.named_modules()
        ]
        owners = [(name, m, n) for name, m, n in owners if n > 0]
        if not owners:
            raise ValueError("device emulation: the model has no trainable parameters")
        total = sum(n for _, _, n in owners)
        #: each parameter-owning module's share of a step's padding, by name (sums to 1)
        self.weights = {name: n / total for name, _, n in owners}
        self.predicted_compute_s = 0.0  # ĉ: the last step's compute
        self.debt_s = 0.0  # padding already slept beyond what earlier steps needed
        self.plan: StepPlan | None = None  # the step in progress; None outside a step
        self.last: StepPlan | None = None  # the last finished step (its remainder included)
        self.last_remainder_s = 0.0
        self._handles: list[RemovableHandle] = []
        for name, module, _ in owners:
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    # ------------------------------------------------------------------ the loop's calls
    def begin_step(self) -> StepPlan:
        """Plan this step's padding from the previous step's compute, less any debt."""
        planned = padding_s(self.predicted_compute_s, self.min_step_time_s, self.factor)
        planned = max(0.0, planned - self.debt_s)
        self.plan = StepPlan(planned * FORWARD_SHARE, planned * (1 - FORWARD_SHARE))
        return self.plan

    def end_step(self, busy_s: float) -> float:
        """The step took ``busy_s`` besides its communication waits (the hooks' sleeps
        included): its compute is ``busy_s`` less what the hooks slept; sleep what its
        padding still lacks, or keep the excess as debt. Returns the seconds slept here."""
        plan, self.plan = self.plan or StepPlan(), None
        plan.compute_s = compute_s = max(0.0, busy_s - plan.slept_s)
        plan.debt_before_s = self.debt_s
        owed = padding_s(compute_s, self.min_step_time_s, self.factor) - self.debt_s
        remainder = owed - plan.slept_s
        plan.debt_after_s = self.debt_s = max(0.0, -remainder)
        plan.remainder_s = max(0.0, remainder)
        slept = self._timed_sleep(plan.remainder_s) if plan.remainder_s > 0 else 0.0
        self.predicted_compute_s = compute_s
        self.last, self.last_remainder_s = plan, slept
        return slept

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ the hooks
    def _forward_hook(self, name: str):
        weight = self.weights[name]

        def hook(module: nn.Module, args, output) -> None:
            plan = self.plan
            if plan is None:
                return
            share = min(plan.forward_s * weight, plan.forward_s - plan.slept_forward_s)
            if share > 0:
                plan.slept_forward_s += self._timed_sleep(share)
                plan.events.append(("forward", name))
            out = _first_grad_tensor(output)
            if out is not None and plan.backward_s > 0:
                out.register_hook(self._backward_hook(plan, name, weight))

        return hook

    def _backward_hook(self, plan: StepPlan, name: str, weight: float):
        # Runs when the gradient of the module's output is ready, before the module's own
        # backward computes its parameters' gradients (so before DDP can bucket them).
        def hook(grad: torch.Tensor) -> None:
            if self.plan is not plan:  # a backward after its step ended: not this step's time
                return
            share = min(plan.backward_s * weight, plan.backward_s - plan.slept_backward_s)
            if share > 0:
                plan.slept_backward_s += self._timed_sleep(share)
                plan.events.append(("backward", name))

        return hook

    def _timed_sleep(self, seconds: float) -> float:
        """Sleep; return the time that really passed (a sleep overshoots a little: that is
        emulated time too, and the end-of-step remainder accounts for it)."""
        t = self._now()
        self._sleep(seconds)
        return self._now() - t


def _first_grad_tensor(output) -> torch.Tensor | None:
    """The module's output tensor that carries the gradient back (the first of a tuple)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, tuple | list):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None
