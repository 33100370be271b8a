"""Run a whole job on this machine and wait for its summary (used by the CLI and tests).

The launcher supervises: it serves the job's store, watches the agents and the run's files,
and stops every process of the job when it ends, fails or is interrupted. None of that may
depend on a free descriptor (a flood of connections to the store it serves can take them
all): its soft ``RLIMIT_NOFILE`` is raised to the hard limit at start, an ``OSError`` while
reading the run's files skips one look, and the kill path needs none — without ``/proc`` it
kills the agents and the forkserver by pid, and the ranks die with them (each asks the kernel
for SIGKILL when its parent exits, :func:`cloudburst.forkserver.die_with_parent`; the agents
and the forkserver do the same with the launcher, so a SIGKILLed launcher leaves no process).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cloudburst.config import RunConfig
from cloudburst.launch.agents import start_local_job
from cloudburst.launch.failures import Unreadable, failure_reason, job_failure, unreadable_skipped
from cloudburst.launch.processes import (
    is_running,
    job_processes,
    kill_job,
    kill_pids,
    process_state,
)
from cloudburst.loop.summary import write_partial_summary
from cloudburst.records.metrics import write_json_atomic
from cloudburst.records.rundir import prepare_run_dir

AGENT_GRACE_S = 5.0
log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """The job ended without finishing; ``summary`` says why and what it had done (also in
    ``OUT/summary.json``, with ``"failed"``), the message where its logs are."""

    def __init__(self, message: str, summary: dict[str, Any] | None = None):
        super().__init__(message)
        self.summary = summary


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM stopped the job; ``summary`` is what it had done (also in
    ``OUT/summary.json``, with ``"interrupted": true``)."""

    def __init__(self, summary: dict[str, Any]):
        super().__init__("interrupted")
        self.summary = summary


# How long the ranks get to exit after SIGTERM before they are SIGKILLed (a second Ctrl-C
# kills at once).
STOP_GRACE_S = 5.0
# After a rank's watchdog found a lost peer, how long the others get to stop by themselves.
FAILED_GRACE_S = 3.0


def run_local_job(cfg: RunConfig, progress: bool | None = None) -> dict[str, Any]:
    """Launch ``cfg`` on 127.0.0.1 with torch's launcher, wait, return ``summary.json``.

    ``summary["failed_agents"]`` lists the exit codes of agents whose rank died (asynchronous
    strategies finish without them).
    """
    from tqdm import tqdm

    from cloudburst.train import run_rank

    # A new run removes an earlier run's files from a directory marked as a run's (metrics
    # would mix into its curves); a resumed run appends to its own. Anything else is refused.
    out = prepare_run_dir(cfg.output.out, resume=cfg.faults.resume, overwrite=cfg.output.overwrite)
    write_json_atomic(out / "config.json", cfg.to_dict())
    (out / "summary.json").unlink(missing_ok=True)
    # A strategy that survives a worker's death gets one agent per rank: torch's agent tears
    # down every rank it started when one of them dies.
    survives = cfg.strategy_spec.survives_worker_loss
    procs, store = start_local_job(cfg, run_rank, agent_per_rank=survives)
    show = cfg.output.progress if progress is None else progress
    try:
        total = cfg.steps_per_worker() * cfg.job.workers
    except ValueError:  # epochs of a dataset read from a path: its size is known to the ranks
        total = None
    desc = f"{cfg.job.strategy} W={cfg.job.workers}"
    if show and not sys.stderr.isatty():
        bar = LineProgress(total, desc)  # a log file: a line every few seconds, no redraws
    else:
        bar = tqdm(total=total, desc=desc, unit="step", disable=not show, file=sys.stderr)
    summary_path = out / "summary.json"
    summary_seen_at = None
    failed_at, next_failure_check = None, 0.0
    Unreadable.failures = 0  # said once per job
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while any(p.is_alive() for p in procs):
            with unreadable_skipped():  # no descriptor to read the files: look again later
                bar.update(max(0, _steps_done(out) - bar.n))
            time.sleep(0.25)
            if summary_seen_at is None and summary_path.is_file():
                summary_seen_at = time.monotonic()
            if summary_seen_at is not None and time.monotonic() - summary_seen_at > AGENT_GRACE_S:
                # Every rank has finished (rank 0 writes the summary last). Agents still alive
                # wait in torch's exit barrier for an agent whose rank was lost (up to 300 s),
                # blocked inside the store where SIGTERM is not handled: SIGKILL them, and
                # whatever they started (spawned ranks would outlive them).
                kill_job(procs)
                for p in procs:
                    p.join(timeout=10)
                break
            if failed_at is None and time.monotonic() >= next_failure_check:
                # A rank exited with an error: did a watchdog find a lost peer that the job
                # cannot go on without? Then the rest (a hung rank among them) is stopped.
                next_failure_check = time.monotonic() + 1.0
                with unreadable_skipped():
                    if any(p.exitcode not in (None, 0) for p in procs) and failure_reason(out):
                        failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILED_GRACE_S:
                with _signals_deferred() as stop:
                    _stop(procs, stop, announce=False)
                break
        with unreadable_skipped():
            bar.update(max(0, _steps_done(out) - bar.n))
    except KeyboardInterrupt:
        with _signals_deferred() as stop:
            bar.close()
            _stop(procs, stop)
            del store  # its connections' descriptors are free for the summary
            summary = write_partial_summary(cfg, interrupted=True)
        raise JobInterrupted(summary) from None
    except BaseException:
        with _signals_deferred() as stop:
            _stop(procs, stop)
        raise
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, previous_sigterm)
    # Ranks still alive once the job is over (a SIGSTOPped or hung one whose agent is gone):
    # only processes below this launcher's agents and forkserver, never PIDs read from files.
    kill_job(procs)
    del store  # the job is over: its store stops serving (and frees its connections)
    codes = [p.exitcode for p in procs]
    if not summary_path.is_file():
        reason = job_failure(out, codes)
        try:
            summary = write_partial_summary(cfg, failed=reason)
        except OSError as e:  # a full disk: the reason is still said
            message = f"the run failed ({reason}); summary.json could not be written ({e})"
            raise JobFailed(f"{message}; logs in {out / 'logs'}") from None
        raise JobFailed(f"the run failed ({reason}); logs in {out / 'logs'}", summary)
    summary = json.loads(summary_path.read_text())
    summary["failed_agents"] = [c for c in codes if c]
    return summary


class LineProgress:
    """Progress for a non-interactive log: one line every ``every_s`` seconds (and a last one),
    never a redrawn bar. Counts like tqdm (``n``, ``update``, ``close``)."""

    def __init__(self, total: int | None, desc: str, every_s: float = 5.0):
        self.total, self.desc, self.every_s = total, desc, every_s
        self.n = 0
        self._start = self._last = time.monotonic()
        self._closed = False

    def update(self, k: int) -> None:
        self.n += k
        if time.monotonic() - self._last >= self.every_s:
            self._print()

    def close(self) -> None:
        if not self._closed and self.n:
            self._print()
        self._closed = True

    def _print(self) -> None:
        self._last = time.monotonic()
        done = (
            f"{self.n}/{self.total} steps ({100 * self.n / self.total:.0f} %)"
            if (self.total)
            else f"{self.n} steps"
        )
        elapsed = self._last - self._start
        print(f"{self.desc}: {done}, {elapsed:.0f} s", file=sys.stderr, flush=True)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class _StopRequest:
    """Set by a further Ctrl-C / SIGTERM while the job is being stopped: kill at once."""

    kill_now = False


@contextlib.contextmanager
def _signals_deferred() -> Iterator[_StopRequest]:
    """While the job is stopped and its summary written, SIGINT and SIGTERM only ask for the
    processes to be killed at once (they do not interrupt the stopping itself)."""
    request = _StopRequest()

    def on_signal(signum, frame) -> None:
        request.kill_now = True

    signals = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(sig, on_signal) for sig in signals]
    try:
        yield request
    finally:
        for sig, handler in zip(signals, previous, strict=True):
            signal.signal(sig, handler)


def _stop(
    procs: list, request: _StopRequest, grace_s: float = STOP_GRACE_S, announce: bool = True
) -> None:
    """Stop every process of the job: SIGTERM to the agents, the ranks and their loaders,
    up to ``grace_s`` for them to exit, then SIGKILL to whatever is left (at once after a
    further Ctrl-C). Checkpoints are written atomically, so the last complete one survives."""
    if announce:
        print(
            "\ncloudburst: stopping the job (Ctrl-C again to kill it at once)",
            file=sys.stderr,
            flush=True,
        )
    pids = job_processes(procs)
    if pids is None:  # the ranks cannot be found to be asked: no grace, killed now
        print(
            "cloudburst: the job's processes cannot be listed (no file descriptor left): "
            "killing them",
            file=sys.stderr,
            flush=True,
        )
        pids = []
    kill_pids(pids, signal.SIGTERM)
    # A stopped process (SIGSTOP, a hung rank) cannot act on SIGTERM: no grace to wait for.
    kill_pids([pid for pid in pids if process_state(pid) in ("T", "t")])
    deadline = time.monotonic() + grace_s
    while not request.kill_now and time.monotonic() < deadline and any(map(is_running, pids)):
        time.sleep(0.05)
    if request.kill_now:
        print("cloudburst: killing the job's processes", file=sys.stderr, flush=True)
    kill_job(procs)
    for p in procs:
        p.join(timeout=10)


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
