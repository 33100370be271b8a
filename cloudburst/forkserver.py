"""The forkserver that a local job's ranks are forked from, and its lifetime.

No torch here: the CLI starts the forkserver before it imports torch itself, so that the
server's imports (torch, the training code, and a warm-up, :mod:`cloudburst._warm`) run on the
other core while the CLI checks the config.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

log = logging.getLogger(__name__)


def start_forkserver(module: str = "cloudburst.train") -> None:
    """Start (once) the forkserver that local jobs' ranks are forked from, preloading
    ``module``; the CLI calls this early so that the server's imports overlap its checks."""
    # Ranks forked from it take its environment, not their agent's: this marks them as ranks
    # of a local job (every rank on this machine; the launcher writes a failed run's summary).
    os.environ["CLOUDBURST_LOCAL_JOB"] = "1"
    mp.set_forkserver_preload(
        [module, "torch.distributed.elastic.multiprocessing", "cloudburst._warm"]
    )
    # The server and the ranks it forks must not hold this process's stdout/stderr: a rank
    # that never exits (a SIGSTOPped one) would keep a caller's pipes open. Ranks write to
    # their log files (the agents redirect them).
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
        forkserver.ensure_running()
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


def forkserver_pid() -> int | None:
    """The pid of the forkserver this process started (local jobs' ranks are its children)."""
    pid = forkserver._forkserver._forkserver_pid
    if pid is None:
        return None
    try:  # still this process's child (alive, or a zombie whose pid cannot be reused yet)
        text = Path(f"/proc/{pid}/stat").read_text()
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pid if ppid == os.getpid() else None


def stop_forkserver() -> None:
    """Stop this process's forkserver and resource tracker now (the CLI, when its jobs are
    over), instead of leaving them to notice that this process exited."""
    try:
        pid = forkserver_pid()
        if pid is not None:
            # Killed, not asked: a forkserver still importing its preload (a refused config,
            # a job that failed early) would only see the request once it has finished (~4 s).
            # Its ranks are over by now.
            os.kill(pid, signal.SIGKILL)
            forkserver._forkserver._stop()
        if getattr(resource_tracker._resource_tracker, "_pid", None) is not None:
            resource_tracker._resource_tracker._stop()
    except (AttributeError, OSError, ChildProcessError) as e:  # private API: best effort
        log.debug("could not stop the forkserver: %s", e)


def adopt_forkserver() -> None:
    """Let this forked agent start its ranks from the launcher's forkserver.

    multiprocessing checks that its forkserver is alive with ``waitpid``, which only the process
    that started it may call; a forked child has the server's address and its "alive" pipe, so
    it can use the server, it just cannot wait on it.
    """
    server = forkserver._forkserver
    if server._forkserver_pid is None:
        return
    try:
        os.waitpid(server._forkserver_pid, os.WNOHANG)
    except ChildProcessError:  # not ours: keep using it, without the liveness check
        server.ensure_running = resource_tracker.ensure_running
