"""The job's processes as the launcher sees them: their state in ``/proc``, the descendants of
its agents and forkserver, and killing them all (by pid where ``/proc`` is unreadable).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
from pathlib import Path

from cloudburst.forkserver import (
    forkserver_pid,
)

log = logging.getLogger(__name__)


def process_state(pid: int) -> str | None:
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


def is_running(pid: int) -> bool:
    """Whether ``pid`` is alive and not a zombie."""
    return process_state(pid) not in (None, "Z")


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


def job_processes(procs: list) -> list[int] | None:
    """The live agents and every process below them and the forkserver, or None when
    ``/proc`` cannot be read."""
    try:
        return [p.pid for p in procs if p.is_alive()] + descendants(_our_roots(procs))
    except OSError as e:
        log.debug("cannot list the job's processes: %s", e)
        return None


def kill_job(procs: list) -> None:
    """SIGKILL every process of the job. When ``/proc`` cannot be read (every descriptor
    taken), the agents and the forkserver are killed by pid, which needs none: each rank
    (and each rank's data loaders) dies with its parent (``die_with_parent``)."""
    pids = job_processes(procs)
    if pids is None:
        server = forkserver_pid()
        pids = [p.pid for p in procs if p.is_alive()] + ([server] if server else [])
    kill_pids(pids)


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pids`` (this launcher's own descendants); a failure is logged, not
    raised."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except OSError as e:
            log.warning("could not stop process %d: %s", pid, e)
