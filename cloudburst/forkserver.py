"""The forkserver that a local job's ranks are forked from, and the lifetime of a job's
processes.

The CLI forks it from itself once it has imported torch (``fork=True``): the server then only
imports the training code and a warm-up (:mod:`cloudburst._warm`), on the other core while the
CLI checks the config, instead of a fresh interpreter importing torch as well (about 2 s of CPU
per job). Any other caller (the Python API, in a process that may run threads of its own) gets
multiprocessing's own server, started from a fresh interpreter.

Supervision: every process of a local job dies with its parent (:func:`die_with_parent`, Linux's
``PR_SET_PDEATHSIG``): agents and the forkserver with the launcher, ranks with the process that
forked them. A SIGKILLed launcher leaves no agent, rank or data loader behind. Descriptors: a
job's processes raise their soft ``RLIMIT_NOFILE`` to the hard limit
(:func:`raise_open_files_limit`), since connections to the store and to gloo's listeners cost
one each; children inherit it.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import multiprocessing as mp
import os
import resource
import signal
import socket
import sys
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
    raise_open_files_limit()  # before the server starts: the ranks inherit its limit
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
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the server: never returns into the caller's frames
            code = 1
            try:
                die_with_parent(parent)
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
    # Still this process's child (alive, or a zombie whose pid cannot be reused yet): asked
    # of the kernel without reaping it, and without a descriptor (the launcher's kill path
    # uses this when every descriptor is taken).
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    except AttributeError:  # no waitid (not Linux): the parent from /proc
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return pid if ppid == os.getpid() else None
    return pid


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


# <linux/prctl.h>: deliver a signal to this process when the thread that forked it exits.
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits, however it exits
    (SIGKILL included); at once if it is already gone (``parent_pid``: the pid it had, else
    the current parent's). False (nothing done) off Linux or where ``prctl`` fails.

    SIGKILL reaches a stopped process too. Linux sends it when the parent's *thread* that
    forked this process ends: fork from a thread that outlives the child (every caller here
    forks from its main thread, or from a single-threaded forkserver)."""
    if not sys.platform.startswith("linux"):
        return False
    expected = os.getppid() if parent_pid is None else parent_pid
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0
    except (OSError, AttributeError) as e:
        log.warning("cannot tie this process to its parent's life: %s", e)
        return False
    if failed:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    if os.getppid() != expected:  # the parent died before the request: nobody to signal us
        os.kill(os.getpid(), sig)
    return True


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (children inherit it);
    returns the soft limit now in force. Every store client and every gloo connection holds a
    descriptor: a 1,024 default runs out near 125 local ranks in the launcher, and after about
    a thousand connections to a rank's gloo port (torch 2.13's gloo never closes a connection
    that sent nothing, see docs/failures.md)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited or soft == hard:
        return soft
    # An unlimited hard limit cannot be the soft one on Linux (fs.nr_open caps it) or macOS
    # (OPEN_MAX): smaller values are tried then.
    candidates = [hard] if hard != unlimited else [1 << 20, 1 << 16, 10240]
    for limit in candidates:
        if limit <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            return limit
        except (ValueError, OSError):
            continue
    return soft
