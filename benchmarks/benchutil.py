"""Shared helpers of the benchmark scripts: provenance (command, commit, machine) and Markdown.

Imported by the scripts in this folder (``benchmarks/transport.py``, ``benchmarks/overhead.py``);
it imports nothing from ``cloudburst``.
"""

from __future__ import annotations

import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


def command_line() -> str:
    """The command exactly as it was typed (interpreter included), run from the repo root."""
    return shlex.join(sys.orig_argv)


def git_revision() -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` when tracked files have changes.

    Result files under ``benchmarks/results/`` do not count: a benchmark rewrites them itself,
    and they are not code that ran.
    """

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()

    if os.environ.get("CLOUDBURST_GIT_REVISION"):  # a copy of the tree without .git (a GPU box)
        return os.environ["CLOUDBURST_GIT_REVISION"] + " (given; tree copied without .git)"
    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    status = subprocess.run(  # not stripped: the first line's leading space is a column
        ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout
    tracked_changes = [
        ln
        for ln in status.splitlines()
        if ln[:2] != "??" and not ln[3:].startswith("benchmarks/results/")
    ]
    return rev + ("+dirty" if tracked_changes else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def provenance_lines() -> list[str]:
    """Markdown bullet lines: command, commit, machine, torch, time of the run."""
    return [
        f"- command: `{command_line()}` (cwd `{os.getcwd()}`)",
        f"- git commit: `{git_revision()}`",
        f"- machine: `{platform.platform()}`, CPU `{cpu_model()}`, nproc {os.cpu_count()}, "
        f"host `{socket.gethostname()}`",
        f"- python {platform.python_version()}, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}",
        f"- load average at the end of the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
    ]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def verdict(value: float, target: float, higher_is_better: bool) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "MISS"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A Markdown table as a list of lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def write_markdown(path: str | Path, lines: Sequence[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
