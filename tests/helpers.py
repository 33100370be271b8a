"""Test helpers: one spawn helper for distributed tests, and running the CLI as a user does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    try:
        result = fn(rank, *args)
        Path(out, f"result{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def spawn(fn, world: int, tmp_path: Path, *args: Any, timeout_s: float = 120) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``world`` fresh gloo-ready processes; return their results.

    ``fn`` must be importable (module level) and return something JSON-serialisable.
    """
    ctx = mp.start_processes(
        _child,
        args=(fn, world, free_port(), str(tmp_path), args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    import time

    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"distributed test did not finish in {timeout_s} s")
    results = []
    for r in range(world):  # None for a rank that left without a result (on purpose)
        path = Path(tmp_path, f"result{r}.json")
        results.append(json.loads(path.read_text()) if path.is_file() else None)
    return results


def cli(
    *args: str, timeout_s: float = 300, check: bool = True, **kw
) -> subprocess.CompletedProcess:
    """Run ``python -m cloudburst ARGS`` in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "cloudburst", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=kw.pop("cwd", REPO),
        env=env,
        **kw,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"cloudburst {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def read_summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())
