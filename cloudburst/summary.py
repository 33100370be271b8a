"""The summary of a run that did not finish (interrupted, or failed): what was done so far,
read from its metrics files and checkpoints, and the command that continues it.

A finished run's summary is written by rank 0 at the end of training (:mod:`cloudburst.train`);
this one is written by whoever stops the run — the local launcher on Ctrl-C, or rank 0 under a
user's torchrun — from the files alone, so it needs no live rank.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from cloudburst.config import RunConfig
from cloudburst.metrics import iter_jsonl, write_json_atomic


def resume_command(out: str | Path) -> str:
    """The command that continues the run in ``out`` from its checkpoints."""
    return f"cloudburst train --resume {shlex.quote(str(out))}"


def partial_summary(cfg: RunConfig, **status: Any) -> dict[str, Any]:
    """What the run in ``cfg.out`` did so far (``status``: e.g. ``interrupted=True`` or
    ``failed="..."``), from its metrics: each worker's last logged step and samples, the last
    evaluation of the global model, the checkpoints a resume would start from."""
    out = Path(cfg.out)
    last_step: dict[int, dict[str, Any]] = {}
    last_eval: dict[str, Any] | None = None
    wall_time_s = 0.0
    for path in sorted((out / "metrics").glob("rank*.jsonl")):
        for record in iter_jsonl(path):
            time_s = record.get("time_s")
            if isinstance(time_s, int | float):
                wall_time_s = max(wall_time_s, float(time_s))
            event = record.get("event")
            if event == "step" and isinstance(record.get("rank"), int):
                last_step[record["rank"]] = record
            elif event == "eval" and isinstance(record.get("test_accuracy"), int | float):
                if last_eval is None or record.get("time_s", 0) >= last_eval.get("time_s", 0):
                    last_eval = record
    checkpoints = sorted(
        str(p.relative_to(out)) for p in (out / "checkpoints").glob("*.pt") if p.is_file()
    )
    return {
        "strategy": cfg.strategy,
        "workers": cfg.workers,
        "servers": cfg.servers,
        **status,
        "final_test_accuracy": None if last_eval is None else last_eval["test_accuracy"],
        "accuracy_is_last_evaluation": True,
        "wall_time_s": wall_time_s,
        "time_to_target_s": None,
        "samples": sum(int(r.get("samples", 0)) for r in last_step.values()),
        "steps_done": {str(rank): int(r.get("step", 0)) for rank, r in sorted(last_step.items())},
        "bytes_sent": sum(int(r.get("bytes_sent", 0)) for r in last_step.values()),
        "mean_staleness": None,
        "lost_workers": [],
        "checkpoints": checkpoints,
        "resume_command": resume_command(out) if checkpoints else None,
        "config": cfg.to_dict(),
    }


def write_partial_summary(cfg: RunConfig, **status: Any) -> dict[str, Any]:
    summary = partial_summary(cfg, **status)
    write_json_atomic(Path(cfg.out) / "summary.json", summary)
    return summary


def interrupted_message(summary: dict[str, Any]) -> str:
    """One line for the user: where the run stopped and how to continue it."""
    steps = summary.get("steps_done") or {}
    done = f"{max(steps.values())} steps" if steps else "no step logged yet"
    if summary.get("resume_command"):
        return (
            f"cloudburst: interrupted after {done}; the last checkpoints are kept, continue with: "
            f"{summary['resume_command']}"
        )
    return f"cloudburst: interrupted after {done}; no checkpoint was written yet"


def format_summary(summaries: list[dict[str, Any]], labels: list[str] | None = None) -> str:
    """The comparison table the CLI prints: one row per run (``labels``: a first column)."""
    cols = [
        ("strategy", "strategy", "{}"),
        ("W", "workers", "{}"),
        ("S", "servers", "{}"),
        ("test acc", "final_test_accuracy", "{:.4f}"),
        ("wall s", "wall_time_s", "{:.1f}"),
        ("to target s", "time_to_target_s", "{:.1f}"),
        ("samples", "samples", "{}"),
        ("MB sent", "bytes_sent", "{:.1f}"),
        ("staleness", "mean_staleness", "{:.2f}"),
        ("lost", "lost_workers", "{}"),
    ]
    if labels is not None:
        cols.insert(0, ("run", "_label", "{}"))
        summaries = [{**s, "_label": label} for s, label in zip(summaries, labels, strict=True)]
    rows = [[name for name, _, _ in cols]]
    for s in summaries:
        row = []
        for _, key, fmt in cols:
            v = s.get(key)
            if key == "bytes_sent" and v is not None:
                v = v / 1e6
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def failed_message(summary: dict[str, Any]) -> str:
    """One line for the user: why the run stopped and how to continue it."""
    steps = summary.get("steps_done") or {}
    done = f"after {max(steps.values())} steps" if steps else "before any step was logged"
    line = f"cloudburst: the run failed {done}: {summary.get('failed')}"
    if summary.get("resume_command"):
        return f"{line}; the last checkpoints are kept, continue with: {summary['resume_command']}"
    return f"{line}; no checkpoint was written yet"
