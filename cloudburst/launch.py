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
import datetime
import errno
import inspect
import json
import logging
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cloudburst.config import RunConfig
from cloudburst.forkserver import (
    adopt_forkserver,
    die_with_parent,
    forkserver_pid,
    raise_open_files_limit,
    start_forkserver,
)
from cloudburst.metrics import iter_jsonl, write_json_atomic
from cloudburst.rundir import open_append_nofollow, prepare_run_dir
from cloudburst.runtime.devices import is_loopback
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
    survives = cfg.strategy_spec.survives_worker_loss
    procs, store = start_local_job(cfg, run_rank, agent_per_rank=survives)
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
    _Unreadable.failures = 0  # said once per job
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while any(p.is_alive() for p in procs):
            with _unreadable_skipped():  # no descriptor to read the files: look again later
                bar.update(max(0, _steps_done(out) - bar.n))
            time.sleep(0.25)
            if summary_seen_at is None and summary_path.is_file():
                summary_seen_at = time.monotonic()
            if summary_seen_at is not None and time.monotonic() - summary_seen_at > AGENT_GRACE_S:
                # Every rank has finished (rank 0 writes the summary last). Agents still alive
                # wait in torch's exit barrier for an agent whose rank was lost (up to 300 s),
                # blocked inside the store where SIGTERM is not handled: SIGKILL them, and
                # whatever they started (spawned ranks would outlive them).
                _kill_job(procs)
                for p in procs:
                    p.join(timeout=10)
                break
            if failed_at is None and time.monotonic() >= next_failure_check:
                # A rank exited with an error: did a watchdog find a lost peer that the job
                # cannot go on without? Then the rest (a hung rank among them) is stopped.
                next_failure_check = time.monotonic() + 1.0
                with _unreadable_skipped():
                    if any(p.exitcode not in (None, 0) for p in procs) and failure_reason(out):
                        failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILED_GRACE_S:
                with _signals_deferred() as stop:
                    _stop(procs, stop, announce=False)
                break
        with _unreadable_skipped():
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
    _kill_job(procs)
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


def failure_reason(out: Path) -> str | None:
    """The first loss a rank's watchdog recorded (``peer_lost``), e.g. "server shard 1
    (rank 1) lost at 12.3 s", or None."""
    return _first_loss(out)[0]


def _first_loss(out: Path) -> tuple[str | None, int | None]:
    """(reason, lost rank) of the first ``peer_lost`` record, or (None, None)."""
    first = None
    for path in (out / "metrics").glob("rank*.jsonl"):
        for record in iter_jsonl(path):
            if record.get("event") == "peer_lost" and isinstance(record.get("reason"), str):
                if first is None or record.get("time_s", 0) < first.get("time_s", 0):
                    first = record
    if first is None:
        return None, None
    lost = first.get("lost_rank")
    return first["reason"], lost if type(lost) is int else None


def job_failure(out: Path, codes: list[int | None]) -> str:
    """Why a job that wrote no summary failed, in one line: the loss a watchdog recorded
    (with the lost rank's own error, when it left one), else the first error a rank raised
    (``rank 2 failed: OSError: [Errno 28] No space left on device``), else the agents' exit
    codes. Files that cannot be read are skipped."""
    reason, lost_rank = None, None
    with _unreadable_skipped():
        reason, lost_rank = _first_loss(out)
    errors: dict[int, str] = {}
    with _unreadable_skipped():
        errors = first_rank_errors(out)
    if reason is not None:
        own = errors.get(lost_rank) if lost_rank is not None else None
        return f"{reason}: {own}" if own else reason
    if errors:
        rank, line = next(iter(errors.items()))
        return f"rank {rank} failed: {line}"
    return f"ranks failed (agent exit codes {codes})"


# A Python exception's last traceback line: "OSError: [Errno 28] No space left on device".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)\b.*$")
_LOG_TAIL_BYTES = 16384  # how much of a rank's stderr.log is searched for its exception


def first_rank_errors(out: Path) -> dict[int, str]:
    """The first line of the exception each failed rank raised, by global rank, earliest
    first: torch's ``error.json`` under ``logs/agent{a}/<run>/attempt_{n}/{local_rank}/``, or
    where there is none (a full disk, a rank torch did not wrap) the last exception line in
    the tail of the rank's ``stderr.log``. Global rank = agent + local rank (a local job has
    one agent per rank, or one agent with every rank)."""
    found: list[tuple[float, int, str]] = []
    for rank_dir in sorted((out / "logs").glob("agent*/*/attempt_*/*")):
        agent, local = rank_dir.parts[-4].removeprefix("agent"), rank_dir.name
        if not (agent.isdigit() and local.isdigit()):
            continue
        rank = int(agent) + int(local)
        when, line = _error_file_line(rank_dir / "error.json")
        if line is None:
            when, line = float("inf"), _log_exception_line(rank_dir / "stderr.log")
        if line is not None:
            found.append((when, rank, line))
    errors: dict[int, str] = {}
    for _, rank, line in sorted(found):
        errors.setdefault(rank, line)
    return errors


def _error_file_line(path: Path) -> tuple[float, str | None]:
    """(timestamp, first line of the message) of torch's error file, or (inf, None)."""
    try:
        with open(path, "rb") as f:
            message = json.loads(f.read(_LOG_TAIL_BYTES * 4))["message"]
        info = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        message = message["message"] if isinstance(message, dict) else message
    except FileNotFoundError:
        return float("inf"), None
    except (ValueError, KeyError, TypeError, AttributeError):  # not torch's format
        return float("inf"), None
    try:
        when = float(info.get("timestamp", "inf"))
    except (ValueError, TypeError, AttributeError):
        when = float("inf")
    lines = str(message).strip().splitlines()
    return when, (lines[0][:500] if lines else None)


def _log_exception_line(path: Path) -> str | None:
    """The exception line ending the last traceback in the tail of a rank's log, or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace")
    except FileNotFoundError:
        return None
    _, traceback, last = tail.rpartition("Traceback (most recent call last):")
    matches = [x for x in last.splitlines() if _EXCEPTION_LINE.match(x)] if traceback else []
    return matches[-1][:500] if matches else None


def rank_errors(out: Path) -> list[str]:
    """The exception each failed rank reported (torch's ``error.json`` under ``logs/``), one
    line each, the first of every distinct message only."""
    found: list[str] = []
    for path in sorted((out / "logs").glob("**/error.json")):
        try:
            _, line = _error_file_line(path)  # the one reader of torch's error files
        except OSError:
            continue
        if line and line not in found:
            found.append(line)
    return found


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
    pids = _job_processes(procs)
    if pids is None:  # the ranks cannot be found to be asked: no grace, killed now
        print(
            "cloudburst: the job's processes cannot be listed (no file descriptor left): "
            "killing them",
            file=sys.stderr,
            flush=True,
        )
        pids = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        except OSError as e:
            log.warning("could not stop process %d: %s", pid, e)
    # A stopped process (SIGSTOP, a hung rank) cannot act on SIGTERM: no grace to wait for.
    _kill([pid for pid in pids if _state(pid) in ("T", "t")])
    deadline = time.monotonic() + grace_s
    while not request.kill_now and time.monotonic() < deadline and any(map(_running, pids)):
        time.sleep(0.05)
    if request.kill_now:
        print("cloudburst: killing the job's processes", file=sys.stderr, flush=True)
    _kill_job(procs)
    for p in procs:
        p.join(timeout=10)


def _state(pid: int) -> str | None:
    """``pid``'s state letter from ``/proc`` (R, S, T for stopped, Z for a zombie...), None
    when it is gone, ``"?"`` when ``/proc`` cannot be read (no descriptor left)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError as e:
        return None if _gone(e) else "?"
    return text[text.rindex(")") + 2 :].split()[0]


def _gone(error: OSError) -> bool:
    """Whether reading a process's ``/proc`` entry failed because the process is gone."""
    return error.errno in (errno.ENOENT, errno.ESRCH)


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive and not a zombie."""
    return _state(pid) not in (None, "Z")


def descendants(roots: list[int]) -> list[int]:
    """Every live process below the processes ``roots`` (children first found, then theirs),
    read from ``/proc`` parentage: the processes this launcher started, directly or not.
    Raises ``OSError`` when ``/proc`` cannot be read (no descriptor left), rather than
    returning a partial list."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
        except OSError as e:
            if _gone(e):  # exited while the list was read
                continue
            raise
        except (ValueError, IndexError):
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


def _job_processes(procs: list) -> list[int] | None:
    """The live agents and every process below them and the forkserver, or None when
    ``/proc`` cannot be read."""
    try:
        return [p.pid for p in procs if p.is_alive()] + descendants(_our_roots(procs))
    except OSError as e:
        log.debug("cannot list the job's processes: %s", e)
        return None


def _kill_job(procs: list) -> None:
    """SIGKILL every process of the job. When ``/proc`` cannot be read (every descriptor
    taken), the agents and the forkserver are killed by pid, which needs none: each rank
    (and each rank's data loaders) dies with its parent (``die_with_parent``)."""
    pids = _job_processes(procs)
    if pids is None:
        server = forkserver_pid()
        pids = [p.pid for p in procs if p.is_alive()] + ([server] if server else [])
    _kill(pids)


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


class _Unreadable:
    """Counts the launcher's looks at the run's files that failed (``OSError``: EMFILE when a
    flood of connections to the store took every descriptor); says so once on the console."""

    failures = 0


@contextlib.contextmanager
def _unreadable_skipped() -> Iterator[None]:
    """Skip one look at the run's files that raised ``OSError``: the job goes on, and is
    still stopped when it ends (the kill path needs no descriptor)."""
    try:
        yield
    except OSError as e:
        _Unreadable.failures += 1
        if _Unreadable.failures == 1:
            print(
                f"cloudburst: warning: the launcher cannot read the run's files ({e}); "
                "it keeps supervising the job",
                file=sys.stderr,
                flush=True,
            )
        log.debug("cannot read the run's files (%d times): %s", _Unreadable.failures, e)


# ---------------------------------------------------------------------------- agents
# The listening socket of a local job's store, bound before the agents are forked and handed
# to the first agent's store (no port is chosen, released and bound again: no other process
# can take it in between).
_held_listener: socket.socket | None = None
# Set in a launcher that serves its job's store itself (inherited by its forked agents).
_store_in_launcher = False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class AgentSpec:
    nnodes: int
    node_rank: int
    nproc: int


def agent_layout(world_size: int, agent_per_rank: bool) -> list[AgentSpec]:
    """One agent for all ranks, or one agent per rank (so that a rank may die alone)."""
    if agent_per_rank:
        return [AgentSpec(world_size, i, 1) for i in range(world_size)]
    return [AgentSpec(1, 0, world_size)]


def start_local_job(
    cfg: RunConfig, entrypoint, agent_per_rank: bool
) -> tuple[list[mp.Process], dist.TCPStore]:
    """Start the agents of a local job (127.0.0.1) as child processes; returns them and the
    job's store, which this process serves (keep it referenced until the job is over)."""
    global _held_listener, _store_in_launcher
    # Every agent and rank holds store connections, and each connection to the store this
    # process serves holds one of its descriptors: the hard limit, for it and its children.
    raise_open_files_limit()
    _held_listener = loopback_listener(0)
    port = _held_listener.getsockname()[1]
    _store_in_launcher = True
    run_id = uuid.uuid4().hex[:12]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["CLOUDBURST_LOCAL_JOB"] = "1"
    # torch 2.13's agents cannot restart ranks when the rendezvous store is shared with them.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Agents are forked (they inherit the imported torch instead of importing it again: about
    # 2 s of CPU per process, which on a 2-core machine dominates the start of a small job).
    # Their ranks come from one forkserver started here, which imports the training code once.
    if not torch.cuda.is_initialized():
        start_forkserver(entrypoint.__module__)
    # A new job secret, handed to each rank with its entry point (pickled through the
    # forkserver's pipe), never through the store or the environment: cloudburst.auth.
    from cloudburst.auth import with_job_secret

    entrypoint = with_job_secret(entrypoint)
    ctx = mp.get_context("fork")
    procs = []
    for spec in agent_layout(cfg.world_size, agent_per_rank):
        p = ctx.Process(
            target=_run_agent,
            args=(cfg.to_dict(), spec, port, run_id, entrypoint),
            name=f"cloudburst-agent{spec.node_rank}",
        )
        p.start()
        procs.append(p)
    # The store is served from here, started only now: the agents were forked from a process
    # without its server thread. They connect (and retry) until it listens; the socket has
    # been listening since before they started, so no other process can take the port.
    listener, _held_listener = _held_listener, None
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        cfg.world_size,
        True,
        datetime.timedelta(seconds=max(cfg.comm_timeout_s, 60)),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
    )
    return procs, store


LOCAL_RDZV_BACKEND = "cloudburst-static"


def loopback_listener(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port`` for a TCPStore server (``master_listen_fd``):
    torch's own binds every interface, and a local job must not be reachable from outside."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


def _local_rendezvous(params):
    """torch's static rendezvous, with the host's store listening on 127.0.0.1 only."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
        create_rdzv_handler,
    )

    class LoopbackStaticRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return LOCAL_RDZV_BACKEND

    base = create_rdzv_handler(params)  # validates the parameters
    handler = LoopbackStaticRendezvous(
        base.master_addr,
        base.master_port,
        base.rank,
        base.world_size,
        base.run_id,
        int(base.timeout.total_seconds()),
    )
    if _store_in_launcher:
        # The launcher holds the job's store: every agent is a client, so the death of the
        # first agent (or of rank 0) does not take the store away from the others.
        handler._store = dist.TCPStore(
            handler.master_addr,
            handler.master_port,
            handler.world_size,
            False,
            handler.timeout,
            multi_tenant=True,
        )
    elif handler.rank == 0 and is_loopback(handler.master_addr):
        global _held_listener
        held, _held_listener = _held_listener, None
        if held is not None and held.getsockname()[1] == handler.master_port:
            listener = held  # inherited from the launcher, listening since before the fork
        else:
            listener = loopback_listener(handler.master_port)
        handler._store = dist.TCPStore(
            handler.master_addr,
            handler.master_port,
            handler.world_size,
            True,
            handler.timeout,
            multi_tenant=True,
            master_listen_fd=listener.detach(),
        )
    return handler


# How long this launcher's agents wait for a rank to exit after SIGTERM before SIGKILL (torch's
# default is 30 s): a SIGSTOPped rank ignores SIGTERM, and a restart of the job waits for it.
AGENT_STOP_GRACE_S = 3


def _shorten_agent_stop_grace() -> None:
    """In this (agent) process only: torch's agent stops its ranks with a shorter grace —
    when it shuts down, and when one of its ranks failed (``ProcessContext.join`` waits 30 s
    for the others to take SIGTERM before SIGKILL)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.multiprocessing.spawn import ProcessContext

    original = LocalElasticAgent._shutdown
    if getattr(original, "_cloudburst", False):
        return
    join = ProcessContext.join

    def _join(self, timeout=None, grace_period=None):
        return join(self, timeout, AGENT_STOP_GRACE_S if grace_period is None else grace_period)

    ProcessContext.join = _join

    # torch < 2.13's ``_shutdown(death_sig)`` has no timeout (its grace is ProcessContext's,
    # shortened above); a GPU machine's own torch may be one of those.
    takes_timeout = "timeout" in inspect.signature(original).parameters

    def _shutdown(self, death_sig=signal.SIGTERM, timeout: int = AGENT_STOP_GRACE_S) -> None:
        if takes_timeout:
            original(self, death_sig, min(timeout, AGENT_STOP_GRACE_S))
        else:
            original(self, death_sig)

    _shutdown._cloudburst = True
    LocalElasticAgent._shutdown = _shutdown


def _run_agent(cfg_dict: dict, spec: AgentSpec, port: int, run_id: str, entrypoint) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Killed with the launcher, however it ends (its ranks then die with the forkserver, or
    # with this agent when it spawned them).
    launcher = mp.parent_process()
    die_with_parent(launcher.pid if launcher is not None else None)
    rendezvous_handler_registry.register(LOCAL_RDZV_BACKEND, _local_rendezvous)
    _shorten_agent_stop_grace()

    # The agent's own error dump repeats the rank's traceback; the rank's log file has it.
    log_dir = Path(cfg_dict["out"]) / "logs" / f"agent{spec.node_rank}"
    log_dir.mkdir(parents=True, exist_ok=True)
    # The agent's own messages (and its dump of a failed rank's traceback) go to its log file;
    # the terminal gets one line per failed rank.
    terminal = os.fdopen(os.dup(2), "w")
    if _held_listener is not None and (_store_in_launcher or spec.node_rank != 0):
        _held_listener.close()  # the launcher (or only the first agent) serves the store
    agent_log = open_append_nofollow(log_dir / "agent.log")
    os.dup2(agent_log.fileno(), 1)
    os.dup2(agent_log.fileno(), 2)
    # Ranks start from a forkserver that has imported the training code once: a plain fork
    # of this agent (which runs threads: its store and monitor) occasionally left a rank
    # stuck on a lock another thread held at fork time, and a CUDA context cannot cross a
    # fork at all. The server is single-threaded, and ranks still skip the torch import.
    start_method = "spawn" if torch.cuda.is_initialized() else "forkserver"
    if start_method == "forkserver":
        adopt_forkserver()
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=run_id,
        rdzv_backend=LOCAL_RDZV_BACKEND,
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": spec.node_rank, "timeout": 120},
        max_restarts=int(cfg_dict.get("max_restarts", 0)),
        start_method=start_method,
        monitor_interval=0.1,
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
    )
    try:
        elastic_launch(config, entrypoint)(cfg_dict)
    except ChildFailedError as e:
        for global_rank, failure in e.failures.items():
            error = _failure_line(failure)
            print(
                f"cloudburst: rank {global_rank} failed (exit code {failure.exitcode})"
                f"{': ' + error if error else ''}; see {log_dir}",
                file=terminal,
                flush=True,
            )
        raise SystemExit(1) from None


def _failure_line(failure) -> str | None:
    """The first line of the exception a failed rank raised (torch's ``ProcessFailure``:
    from its error file, else from the tail of its ``stderr.log``), or None (a signal)."""
    if failure.error_file_data.get("message") not in (None, "<NONE>"):
        message = failure.message  # torch's newer error files nest it: {"message": ...}
        message = message.get("message") if isinstance(message, dict) else message
        lines = str(message).strip().splitlines()
        return lines[0][:500] if lines else None
    if not failure.error_file:
        return None
    try:
        return _log_exception_line(Path(failure.error_file).parent / "stderr.log")
    except OSError:
        return None
