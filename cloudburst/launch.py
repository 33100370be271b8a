"""Run a whole job on this machine and wait for its summary (used by the CLI and tests)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cloudburst.config import RunConfig
from cloudburst.forkserver import forkserver_pid
from cloudburst.metrics import iter_jsonl, write_json_atomic
from cloudburst.rundir import prepare_run_dir
from cloudburst.runtime import start_local_job
from cloudburst.strategies import STRATEGY_CLASSES
from cloudburst.summary import write_partial_summary

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
    out = prepare_run_dir(cfg.out, resume=cfg.resume, overwrite=cfg.overwrite)
    write_json_atomic(out / "config.json", cfg.to_dict())
    (out / "summary.json").unlink(missing_ok=True)
    # A strategy that survives a worker's death gets one agent per rank: torch's agent tears
    # down every rank it started when one of them dies.
    strategy = STRATEGY_CLASSES[cfg.strategy]
    procs, store = start_local_job(cfg, run_rank, agent_per_rank=strategy.survives_worker_loss)
    show = cfg.progress if progress is None else progress
    try:
        total = cfg.steps_per_worker() * cfg.workers
    except ValueError:  # epochs of a dataset read from a path: its size is known to the ranks
        total = None
    desc = f"{cfg.strategy} W={cfg.workers}"
    if show and not sys.stderr.isatty():
        bar = LineProgress(total, desc)  # a log file: a line every few seconds, no redraws
    else:
        bar = tqdm(total=total, desc=desc, unit="step", disable=not show, file=sys.stderr)
    summary_path = out / "summary.json"
    summary_seen_at = None
    failed_at, next_failure_check = None, 0.0
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while any(p.is_alive() for p in procs):
            bar.update(max(0, _steps_done(out) - bar.n))
            time.sleep(0.25)
            if summary_seen_at is None and summary_path.is_file():
                summary_seen_at = time.monotonic()
            if summary_seen_at is not None and time.monotonic() - summary_seen_at > AGENT_GRACE_S:
                # Every rank has finished (rank 0 writes the summary last). Agents still alive
                # wait in torch's exit barrier for an agent whose rank was lost (up to 300 s),
                # blocked inside the store where SIGTERM is not handled: SIGKILL them, and
                # whatever they started (spawned ranks would outlive them).
                leftovers = descendants([p.pid for p in procs if p.is_alive()])
                for p in procs:
                    if p.is_alive():
                        p.kill()
                _kill(leftovers)
                for p in procs:
                    p.join(timeout=10)
                break
            if failed_at is None and time.monotonic() >= next_failure_check:
                # A rank exited with an error: did a watchdog find a lost peer that the job
                # cannot go on without? Then the rest (a hung rank among them) is stopped.
                next_failure_check = time.monotonic() + 1.0
                if any(p.exitcode not in (None, 0) for p in procs) and failure_reason(out):
                    failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILED_GRACE_S:
                with _signals_deferred() as stop:
                    _stop(procs, stop, announce=False)
                break
        bar.update(max(0, _steps_done(out) - bar.n))
    except KeyboardInterrupt:
        with _signals_deferred() as stop:
            bar.close()
            _stop(procs, stop)
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
    _kill(descendants(_our_roots(procs)))
    del store  # the job is over: its store stops serving
    codes = [p.exitcode for p in procs]
    if not summary_path.is_file():
        reason = failure_reason(out) or f"ranks failed (agent exit codes {codes})"
        summary = write_partial_summary(cfg, failed=reason)
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


def failure_reason(out: Path) -> str | None:
    """The first loss a rank's watchdog recorded (``peer_lost``), e.g. "server shard 1
    (rank 1) lost at 12.3 s", or None."""
    first = None
    for path in (out / "metrics").glob("rank*.jsonl"):
        for record in iter_jsonl(path):
            if record.get("event") == "peer_lost" and isinstance(record.get("reason"), str):
                if first is None or record.get("time_s", 0) < first.get("time_s", 0):
                    first = record
    return None if first is None else first["reason"]


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
    pids = [p.pid for p in procs if p.is_alive()] + descendants(_our_roots(procs))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        except OSError as e:
            log.warning("could not stop process %d: %s", pid, e)
    deadline = time.monotonic() + grace_s
    while not request.kill_now and time.monotonic() < deadline and any(map(_running, pids)):
        time.sleep(0.05)
    if request.kill_now:
        print("cloudburst: killing the job's processes", file=sys.stderr, flush=True)
    _kill([p.pid for p in procs if p.is_alive()] + descendants(_our_roots(procs)))
    for p in procs:
        p.join(timeout=10)


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive and not a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2 :].split()[0] != "Z"


def descendants(roots: list[int]) -> list[int]:
    """Every live process below the processes ``roots`` (children first found, then theirs),
    read from ``/proc`` parentage: the processes this launcher started, directly or not."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], list(roots)
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def _our_roots(procs: list) -> list[int]:
    """The agents this launcher started, and the forkserver its ranks are forked from."""
    roots = [p.pid for p in procs if p.pid is not None]
    server = forkserver_pid()
    return [*roots, server] if server else roots


def _kill(pids: list[int]) -> None:
    """SIGKILL ``pids`` (this launcher's own descendants); a failure is logged, not raised."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except OSError as e:
            log.warning("could not stop process %d: %s", pid, e)


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
