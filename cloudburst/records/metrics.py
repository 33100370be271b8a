"""Per-rank JSONL metrics and the run summary.

Each rank appends one JSON object per line to ``OUT/metrics/rank{R}.jsonl``:

- ``{"event": "step", "step", "time_s", "samples", "loss", "sent_bytes", "received_bytes",
  "comm_wait_s", ...}`` every ``log_every_steps`` (counters are cumulative), with the
  strategy's own fields (``Strategy.step_info``: a parameter-server worker's
  ``staleness_versions``, DASO's phase, gossip's peer, ...);
- ``{"event": "eval", "time_s", "train_time_s", "eval_s", "samples", "test_accuracy",
  "test_loss"}`` for the global model (``samples`` counts all workers' training samples behind
  it; ``train_time_s`` is ``time_s`` less all earlier evaluations' time, ``eval_s`` this one's:
  evaluation off the clock, the same rule for every strategy, see
  :class:`cloudburst.loop.evaluator.Evaluator`); a language model's also carry ``bits_per_byte``
  (``test_loss`` is then nats per token; byte tokens, so bits per byte = test_loss / ln 2);
- ``{"event": "push", ...}`` on servers, one every ``push_log_every`` applied pushes and one for
  each push not applied; ``{"event": "peer_dropped", "worker", "reason"}`` when a server drops a
  worker that sent bad messages; and ``{"event": "final", ...}`` once at the end.

Plots are made from these files only. ``summary.json`` is written once by rank 0.
With ``tensorboard=True`` the same numbers also go to TensorBoard event files under
``OUT/tensorboard/<role>`` (tags ``<event>/<field>``; steps for step events, training samples
for evaluations): ``tensorboard --logdir OUT/tensorboard``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cloudburst.records.rundir import open_append_nofollow


class MetricsWriter:
    def __init__(self, out_dir: str | Path, rank: int, role: str, tensorboard: bool = False):
        self.path = Path(out_dir) / "metrics" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.parent.is_symlink():
            raise OSError(f"{str(self.path.parent)!r} is a symbolic link; not writing through it")
        # Line-buffered (readable while running); never through a planted symlink.
        self._f = open_append_nofollow(self.path)
        self.rank, self.role = rank, role
        self.language_model = False  # eval records get bits_per_byte from test_loss
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard" / role))

    def log(self, event: str, **values: Any) -> None:
        if self.language_model and event == "eval" and "test_loss" in values:
            values["bits_per_byte"] = values["test_loss"] / math.log(2)
        record = {"event": event, "rank": self.rank, "role": self.role, **values}
        self._f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._log_tensorboard(event, values)

    def _log_tensorboard(self, event: str, values: dict[str, Any]) -> None:
        x_key = "samples" if event == "eval" else "step"
        x = values.get(x_key, values.get("step", 0))
        for key, value in values.items():
            if key == x_key or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            self._tb.add_scalar(f"{event}/{key}", value, global_step=x)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of one metrics file, streamed (a long run's file is never held whole)."""
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed process
                if isinstance(record, dict):
                    yield record


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return list(iter_jsonl(path))


def read_run(out_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """All ranks' records of one run directory, keyed by file stem (``rank0`` ...)."""
    return {p.stem: read_jsonl(p) for p in sorted((Path(out_dir) / "metrics").glob("rank*.jsonl"))}


def eval_curve(out_dir: str | Path) -> list[dict[str, Any]]:
    """Every global-model evaluation of a run, sorted by time."""
    evals = [r for recs in read_run(out_dir).values() for r in recs if r["event"] == "eval"]
    return sorted(evals, key=lambda r: r["time_s"])


def time_to_target(evals: list[dict[str, Any]], target: float | None) -> float | None:
    if target is None:
        return None
    for r in sorted(evals, key=lambda r: r["time_s"]):
        if r["test_accuracy"] >= target:
            return r["time_s"]
    return None


TARGET_HELD_EVALS = 3  # a loss target counts once held for this many evaluations in a row


def time_to_target_loss(
    evals: list[list[float]], target: float | None, k: int = TARGET_HELD_EVALS
) -> float | None:
    """The time of the first of ``k`` consecutive evaluations (by time) whose test loss is ≤
    ``target``; None if no such run of ``k`` (also when fewer than ``k`` evaluations follow
    the first one at or under it). ``evals``: ``[time_s, loss]`` pairs."""
    if target is None:
        return None
    ordered = sorted(evals, key=lambda e: e[0])
    held = 0
    for i, (_, loss) in enumerate(ordered):
        held = held + 1 if loss <= target else 0
        if held == k:
            return ordered[i - k + 1][0]
    return None


def write_json_atomic(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
