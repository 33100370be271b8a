"""Run a whole job on this machine and wait for its summary (used by the CLI and tests)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from cloudburst.config import RunConfig
from cloudburst.metrics import read_jsonl
from cloudburst.runtime import start_local_job
from cloudburst.strategies import STRATEGY_CLASSES

AGENT_GRACE_S = 5.0


class JobFailed(RuntimeError):
    """The job ended without a summary; the message says where its logs are."""


def run_local_job(cfg: RunConfig, progress: bool | None = None) -> dict[str, Any]:
    """Launch ``cfg`` on 127.0.0.1 with torch's launcher, wait, return ``summary.json``.

    ``summary["failed_agents"]`` lists the exit codes of agents whose rank died (asynchronous
    strategies finish without them).
    """
    from tqdm import tqdm

    from cloudburst.train import run_rank

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.to_json() + "\n")
    if not cfg.resume:
        # A new run: metrics of an earlier run in the same directory would mix into its curves
        # (a resumed run appends to its own).
        shutil.rmtree(out / "metrics", ignore_errors=True)
    (out / "summary.json").unlink(missing_ok=True)
    # A strategy that survives a worker's death gets one agent per rank: torch's agent tears
    # down every rank it started when one of them dies.
    strategy = STRATEGY_CLASSES[cfg.strategy]
    procs = start_local_job(cfg, run_rank, agent_per_rank=strategy.survives_worker_loss)
    show = cfg.progress if progress is None else progress
    try:
        total = cfg.steps_per_worker() * cfg.workers
    except ValueError:  # epochs of a dataset read from a path: its size is known to the ranks
        total = None
    bar = tqdm(
        total=total,
        desc=f"{cfg.strategy} W={cfg.workers}",
        unit="step",
        disable=not show,
        file=sys.stderr,
    )
    summary_path = out / "summary.json"
    summary_seen_at = None
    try:
        while any(p.is_alive() for p in procs):
            bar.update(max(0, _steps_done(out) - bar.n))
            time.sleep(0.25)
            if summary_seen_at is None and summary_path.is_file():
                summary_seen_at = time.monotonic()
            if summary_seen_at is not None and time.monotonic() - summary_seen_at > AGENT_GRACE_S:
                # Every rank has finished (rank 0 writes the summary last). Agents still alive
                # wait in torch's exit barrier for an agent whose rank was lost (up to 300 s),
                # blocked inside the store where SIGTERM is not handled: SIGKILL them.
                for p in procs:
                    if p.is_alive():
                        p.kill()
                for p in procs:
                    p.join(timeout=10)
                break
        bar.update(max(0, _steps_done(out) - bar.n))
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    finally:
        bar.close()
    _reap_ranks(out)
    codes = [p.exitcode for p in procs]
    if not summary_path.is_file():
        raise JobFailed(f"the run failed (agent exit codes {codes}); logs in {out / 'logs'}")
    summary = json.loads(summary_path.read_text())
    summary["failed_agents"] = [c for c in codes if c]
    return summary


def _reap_ranks(out: Path) -> None:
    """SIGKILL ranks of this job that are still alive once it is over (a SIGSTOPped or hung
    one: the agents that started them are gone). Ranks are found by the pids they logged."""
    import os
    import signal

    for path in (out / "metrics").glob("rank*.jsonl"):
        for record in read_jsonl(path):
            if record.get("event") != "start":
                continue
            try:
                pid = int(record["pid"])
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (KeyError, ValueError, OSError):
                continue
            if b"multiprocessing" in cmdline:  # still one of our ranks, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _steps_done(out: Path) -> int:
    """Sum over workers of the last logged step (cheap: reads the tail of each file)."""
    done = 0
    for path in (out / "metrics").glob("rank*.jsonl"):
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 4096))
                lines = f.read().decode(errors="ignore").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            if '"event": "step"' in line:
                try:
                    done += json.loads(line)["step"]
                except (json.JSONDecodeError, KeyError):
                    continue
                break
    return done
