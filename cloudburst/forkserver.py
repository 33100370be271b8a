"""The forkserver that a local job's ranks are forked from, and its lifetime.

The CLI forks it from itself once it has imported torch (``fork=True``): the server then only
imports the training code and a warm-up (:mod:`cloudburst._warm`), on the other core while the
CLI checks the config, instead of a fresh interpreter importing torch as well (about 2 s of CPU
per job). Any other caller (the Python API, in a process that may run threads of its own) gets
multiprocessing's own server, started from a fresh interpreter.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from multiprocessing import connection, forkserver, resource_tracker, util
from pathlib import Path

log = logging.getLogger(__name__)


def forkserver_preload(module: str = "cloudburst.train") -> list[str]:
    """What the forkserver imports before it forks a rank (``module``: the ranks' entry)."""
    return [module, "torch.distributed.elastic.multiprocessing", "cloudburst._warm"]


def start_forkserver(module: str = "cloudburst.train", fork: bool = False) -> None:
    """Start (once) the forkserver that local jobs' ranks are forked from, preloading
    ``module``; the CLI calls this early so that the server's imports overlap its checks.
    ``fork``: fork it from this process (one thread of Python, torch imported: the CLI)."""
    # Ranks forked from it take its environment, not their agent's: this marks them as ranks
    # of a local job (every rank on this machine; the launcher writes a failed run's summary).
    os.environ["CLOUDBURST_LOCAL_JOB"] = "1"
    preload = forkserver_preload(module)
    mp.set_forkserver_preload(preload)
    if fork and _fork_server(preload):
        return
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


def _fork_server(preload: list[str]) -> bool:
    """Run multiprocessing's forkserver loop in a child forked from this process, registered
    as this process's forkserver; False (nothing done) where that loop's signature is not the
    one this was written for, or a server runs already."""
    server = forkserver._forkserver
    if (
        server._forkserver_pid is not None
        or threading.active_count() > 1
        or list(inspect.signature(forkserver.main).parameters)
        != ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
    ):
        return False
    # (One thread: nothing else holds a lock the child would inherit held.)
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # Every client holds the write end of the "alive" pipe: the server exits once all
        # of them have.
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server: never returns into the caller's frames
            code = 1
            try:
                os.close(alive_w)
                # Neither it nor the ranks it forks may hold the caller's stdout/stderr:
                # a rank that never exits (a SIGSTOPped one) would keep its pipes open.
                devnull = os.open(os.devnull, os.O_WRONLY)
                for fd in (1, 2):
                    os.dup2(devnull, fd)
                forkserver.main(listener.fileno(), alive_r, preload)
                code = 0
            except SystemExit as e:  # the loop's way out: every client has gone
                code = e.code if isinstance(e.code, int) else 0
            finally:
                os._exit(code)
        os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


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
