"""A model factory that instruments the rank it is built in, for end-to-end tests.

``--model tests.e2e.instrumented:mlp`` builds cloudburst's MLP. Inside a rank of a job (where
``RANK`` is set; not in the CLI's own check before launch), the environment asks for more:

- ``CLOUDBURST_TEST_RECORD=DIR``: the training loop's device emulation (straggler factor,
  ``slow`` fault, ``--min-step-time-s``) is recorded, call by call, in ``DIR/rank{R}.jsonl``:
  ``{"compute_s", "min_step_time_s", "factor"}`` for each step, followed by ``{"sleep": s}``
  for each sleep it asked for. What a straggler *does* (sleeps proportional to its compute
  time) is then checked exactly, without timing anything.
- ``CLOUDBURST_TEST_POISON=RANK:CALL``: rank RANK's CALL-th training forward pass first sets
  one weight to NaN: a replica gone bad (its loss is NaN, and its next push is not finite).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from cloudburst.models import MLP

RECORD_ENV = "CLOUDBURST_TEST_RECORD"
POISON_ENV = "CLOUDBURST_TEST_POISON"


class _PoisonedMLP(MLP):
    def __init__(self, input_length: int, num_classes: int, at_call: int):
        super().__init__(input_length, num_classes)
        self.at_call, self.calls = at_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at_call:
                with torch.no_grad():
                    self.net[0].weight[0, 0] = math.nan
        return super().forward(x)


def mlp(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    rank = os.environ.get("RANK")
    if rank is not None and os.environ.get(RECORD_ENV):
        _record_device_emulation(Path(os.environ[RECORD_ENV]) / f"rank{rank}.jsonl")
    poison = os.environ.get(POISON_ENV)
    if rank is not None and poison:
        target, call = (int(v) for v in poison.split(":"))
        if int(rank) == target:
            return _PoisonedMLP(math.prod(input_shape), num_classes, call)
    return MLP(math.prod(input_shape), num_classes)


def _record_device_emulation(path: Path) -> None:
    from cloudburst.comm.device_emulation import DeviceEmulator

    # The loop's hook (fails loudly if it is renamed): DeviceEmulator.end_step, once a step.
    end_step = DeviceEmulator.end_step
    if getattr(end_step, "recording", False):  # the model is built more than once
        return

    def recording(self, busy_s: float) -> float:
        slept = end_step(self, busy_s)
        plan = self.last
        _append(
            path,
            {
                "compute_s": plan.compute_s,
                "min_step_time_s": self.min_step_time_s,
                "factor": self.factor,
                "hooks_s": plan.slept_s,
                "remainder_s": plan.remainder_s,
                "debt_before_s": plan.debt_before_s,
                "debt_after_s": plan.debt_after_s,
            },
        )
        return slept

    recording.recording = True
    path.parent.mkdir(parents=True, exist_ok=True)
    DeviceEmulator.end_step = recording


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:  # a whole line per write: readable while the rank runs
        f.write(json.dumps(record) + "\n")


def read_emulation(path: Path) -> list[dict]:
    """The device emulation's account of each step (see _record_device_emulation)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected_padding(call: dict) -> float:
    """What the README promises: the step is padded to ``--min-step-time-s``, then made
    ``factor`` times longer: max(compute, min)·factor − compute."""
    return max(call["compute_s"], call["min_step_time_s"]) * call["factor"] - call["compute_s"]
