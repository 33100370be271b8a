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


class _RecordingTime:
    """The ``time`` module as the real transport sees it, with its sleeps written down."""

    def __init__(self, real, path: Path):
        self._real, self._path = real, path

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def sleep(self, seconds: float) -> None:
        _append(self._path, {"sleep": seconds})
        self._real.sleep(seconds)


def _record_device_emulation(path: Path) -> None:
    import cloudburst.comm.transport as transport

    # The loop's hook (fails loudly if it is renamed): TorchTransport.step_done.
    emulate = transport.TorchTransport.step_done
    if getattr(emulate, "recording", False):  # the model is built more than once
        return
    real_time = transport.time

    def recording(self, compute_s: float, min_step_time_s: float, factor: float) -> None:
        _append(
            path, {"compute_s": compute_s, "min_step_time_s": min_step_time_s, "factor": factor}
        )
        # The sleeps this step's emulation asks for (other sleeps of the transport, such as
        # asgd's finish polling, are not the device's).
        transport.time = _RecordingTime(real_time, path)
        try:
            emulate(self, compute_s, min_step_time_s, factor)
        finally:
            transport.time = real_time

    recording.recording = True
    path.parent.mkdir(parents=True, exist_ok=True)
    transport.TorchTransport.step_done = recording


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:  # a whole line per write: readable while the rank runs
        f.write(json.dumps(record) + "\n")


def read_emulation(path: Path) -> list[tuple[dict, float | None]]:
    """(the step's emulation call, the sleep it asked for or None), step by step."""
    steps: list[tuple[dict, float | None]] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "sleep" in record:
            assert steps and steps[-1][1] is None, f"a sleep outside a step in {path}"
            steps[-1] = (steps[-1][0], record["sleep"])
        else:
            steps.append((record, None))
    return steps


def expected_sleep(call: dict) -> float | None:
    """What the README promises: the step is padded to ``--min-step-time-s``, then made
    ``factor`` times longer: a sleep of max(compute, min)·factor − compute, if positive."""
    target = max(call["compute_s"], call["min_step_time_s"]) * call["factor"]
    return target - call["compute_s"] if target > call["compute_s"] else None
