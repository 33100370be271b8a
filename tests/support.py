"""The helpers, fakes and config builders that several test modules share (no test module
imports another): one spawn helper for distributed tests, running the CLI as a user does,
strict readers of what a run writes, and the in-process fakes. Each section's heading names
the test module its helpers were written for, where it was written for one."""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from cloudburst.comm.allreduce import count_collective, ring_bytes
from cloudburst.comm.compress import BLOCK
from cloudburst.comm.flat import flatten_params
from cloudburst.comm.link import Topology
from cloudburst.comm.messages import Header, Kind
from cloudburst.comm.stats import CommStats
from cloudburst.comm.transport import REAL
from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.data import BatchStream, synthetic
from cloudburst.models import build_model
from cloudburst.records.metrics import read_jsonl
from cloudburst.runtime.context import ReplicaView
from cloudburst.sim.run import simulate
from cloudburst.strategies import STRATEGY_CLASSES
from cloudburst.strategies.asgd import AsgdStrategy
from cloudburst.strategies.asgd.server import ServerLoop
from cloudburst.strategies.daso import DasoStrategy
from cloudburst.strategies.diloco import DilocoStrategy
from cloudburst.strategies.local_sgd import LocalSgdStrategy
from cloudburst.strategies.local_sgd import worker as local_sgd
from tests import reference as ref

REPO = Path(__file__).resolve().parents[1]


# Ports for commands that bind one themselves (torchrun's --master-port): below the kernel's
# ephemeral range (no outgoing connection or bind(0) lands there), a lock file per port.
_PORT_RANGE = (20000, 32000)
_PORT_LOCKS = Path(tempfile.gettempdir()) / "cloudburst-test-ports"
_held_ports: list[Any] = []  # the lock files of this test process's ports, open until it exits


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on and that no other test process is given
    (its lock is held until this process ends), for a command that binds it itself."""
    import fcntl
    import random

    _PORT_LOCKS.mkdir(exist_ok=True)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        lock = open(_PORT_LOCKS / f"{port}.lock", "w")  # noqa: SIM115 - held until exit
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use by something else: keep it locked, try another
                _held_ports.append(lock)
                continue
        _held_ports.append(lock)
        return port
    raise RuntimeError(f"no free port in {_PORT_RANGE} after 200 tries")


def _store_server(world: int) -> tuple[Any, int]:
    """A TCPStore server for a spawned job, on a port bound here and handed over as a listening
    socket (as cloudburst's launcher does); the ranks join as its clients: none binds a port."""
    import datetime

    import torch.distributed as dist

    from cloudburst.launch.agents import loopback_listener

    listener = loopback_listener(0)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, world, True, datetime.timedelta(seconds=300),
                          wait_for_workers=False, multi_tenant=True,
                          master_listen_fd=listener.detach())  # fmt: skip
    return store, port


def _child(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store is the test's: every rank a client
        TORCHELASTIC_RUN_ID=f"spawn-{port}",
    )
    try:
        result = fn(rank, *args)
        Path(out, f"result{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


# The ranks fork from one server that imported torch and cloudburst once per test session.
_PRELOAD = ["torch", "torch.distributed", "cloudburst.runtime", "cloudburst._warm"]


def spawn(fn, world: int, tmp_path: Path, *args: Any, timeout_s: float = 120) -> list[Any]:
    """Run ``fn(rank, *args)`` (module level, returning JSON) in ``world`` fresh gloo-ready
    processes; return their results."""
    mp.set_forkserver_preload(_PRELOAD)
    store, port = _store_server(world)
    try:
        ctx = mp.start_processes(
            _child,
            args=(fn, world, port, str(tmp_path), args),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test did not finish in {timeout_s} s")
    finally:
        del store  # the server stops once the job is over
    results = []
    for r in range(world):  # None for a rank that left without a result (on purpose)
        path = Path(tmp_path, f"result{r}.json")
        results.append(json.loads(path.read_text()) if path.is_file() else None)
    return results


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    """Poll ``condition()`` until it is truthy; return its value. A test waits on what it
    needs, not for a fixed time: ``timeout_s`` only bounds a hang (the failure names ``what``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def wait_running(proc, condition, what: str, timeout_s: float = 180, interval_s=0.02) -> Any:
    """:func:`wait_until` ``condition()``, the job ``proc`` still running (else its output)."""

    def running_until() -> Any:
        assert proc.poll() is None, proc.communicate()
        return condition()

    return wait_until(running_until, timeout_s, what, interval_s)


# ---------------------------------------------------------------------------- the CLI
def start_job(args: list[str], cmd: list[str] | None = None, sigint_default: bool = False):
    """``python -m cloudburst train ARGS`` (or ``cmd``) in a session of its own, its output
    captured (a ``subprocess.Popen``, or its stand-in forked from the zygote).
    ``sigint_default``: SIGINT at its default (a shell may start background jobs ignoring it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cmd is None:
        zygote = _zygote_acquire(env)
        if zygote is not None:
            try:
                return _ZygoteJob(zygote, ["train", *args], env, sigint_default)
            except BaseException:
                zygote.lock.release()
                raise

    def default_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return subprocess.Popen(
        cmd or [sys.executable, "-m", "cloudburst", "train", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint if sigint_default else None,
    )


def finish_job(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """(stdout, stderr) of a job from :func:`start_job`. One still running after ``timeout_s``
    hangs: its ranks log their threads' stacks (SIGUSR1), the session is SIGKILLed, and the
    failure carries the tail of every rank's log (where each rank waited)."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out = _option(proc.args, "--out")
        for pid in _rank_pids(out):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(
            f"the job hung for {timeout_s:g} s; its ranks' logs end with:\n{_log_tails(out)}"
        ) from None


def _option(args, name: str) -> Path | None:
    args = [str(a) for a in args]
    return Path(args[args.index(name) + 1]) if name in args[:-1] else None


def _rank_pids(out: Path | None) -> list[int]:
    """The pids in the ``start`` records of a run's metrics (every incarnation's)."""
    from cloudburst.records.metrics import read_run  # skips a line a hung run cut short

    records = [r for rs in read_run(out).values() for r in rs] if out else []
    return [r["pid"] for r in records if r["event"] == "start" and isinstance(r.get("pid"), int)]


def _log_tails(out: Path | None, lines: int = 60) -> str:
    if out is None or not (out / "logs").is_dir():
        return "(no logs)"
    parts = []
    for path in sorted((out / "logs").rglob("stderr.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path.relative_to(out)}\n" + "\n".join(tail))
    return "\n".join(parts) or "(no rank logs)"


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI run: one thread per rank, and this repository importable in
    every rank (for ``--model tests.…:factory``)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(extra or {})}


def cli(
    *args: str, timeout_s: float = 300, check: bool = True, env: dict[str, str] | None = None, **kw
) -> subprocess.CompletedProcess:
    """Run ``python -m cloudburst ARGS`` (``env``: added variables), forked from this test
    process's zygote (tests/zygote.py), or a fresh process where the zygote cannot stand in
    (other options, an environment read at start-up, ``CLOUDBURST_TEST_FRESH_CLI=1``)."""
    cwd, full_env = kw.pop("cwd", REPO), cli_env(env)
    proc = None if kw else _zygote_run(list(args), Path(cwd), full_env, timeout_s)
    if proc is None:
        proc = subprocess.run(
            [sys.executable, "-m", "cloudburst", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=cwd,
            env=full_env,
            **kw,
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"cloudburst {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


class _Zygote:
    """This test process's zygote (tests/zygote.py) and the one job it runs at a time."""

    def __init__(self):
        self.env = cli_env()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.lock = threading.Lock()
        self.runs = 0  # jobs it ran
        self._buffer = b""
        atexit.register(self.close)
        if self._read(120.0) != {"ready": True}:
            raise RuntimeError("the zygote did not start")

    def _read(self, timeout_s: float | None) -> dict:
        fd = self.proc.stdout.fileno()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the zygote exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_zygote: _Zygote | None = None
_zygote_failed = False


def _zygote_acquire(env: dict[str, str]) -> _Zygote | None:
    """The zygote, locked for one job; None where a fresh process must run it."""
    global _zygote, _zygote_failed
    from tests.zygote import startup_env

    if _zygote_failed or os.environ.get("CLOUDBURST_TEST_FRESH_CLI") == "1":
        return None
    try:
        if _zygote is None:
            _zygote = _Zygote()
    except (OSError, RuntimeError, TimeoutError, ValueError):
        _zygote_failed = True
        return None
    if startup_env(env) != startup_env(_zygote.env) or not _zygote.lock.acquire(blocking=False):
        return None  # read at start-up; or a job running already (another thread)
    return _zygote


def _zygote_run(args, cwd: Path, env: dict[str, str], timeout_s: float):
    """``cloudburst ARGS`` forked from the zygote; None where a fresh process must run it."""
    global _zygote_failed
    zygote = _zygote_acquire(env)
    if zygote is None:
        return None
    try:
        job = _ZygoteJob(zygote, args, env, False, cwd)
        try:
            out, err = job.communicate(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            out, err = job.communicate(60.0)
            raise subprocess.TimeoutExpired(["cloudburst", *args], timeout_s, out, err) from None
    except (OSError, RuntimeError, ValueError):  # the zygote died: fresh processes from now
        _zygote_failed = True
        return None
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


class _ZygoteJob:
    """A job of :func:`start_job` or :func:`cli` forked from the zygote, with what tests use of
    a text ``subprocess.Popen`` of piped output; the zygote is locked until its exit is read."""

    def __init__(self, zygote: _Zygote, args: list[str], env: dict, sigint: bool, cwd=REPO):
        self._zygote, self.returncode = zygote, None
        self.args = [sys.executable, "-m", "cloudburst", *args]
        self._tmp = tempfile.TemporaryDirectory()
        paths = [Path(self._tmp.name, name) for name in ("stdout", "stderr")]
        for path in paths:
            os.mkfifo(path, 0o600)
        # Read ends first (non-blocking: no writer yet), so the zygote's opens do not block.
        fds = [os.open(path, os.O_RDONLY | os.O_NONBLOCK) for path in paths]
        request = {"args": args, "cwd": str(cwd), "env": env}
        request.update(stdout=str(paths[0]), stderr=str(paths[1]), sigint_default=sigint)
        zygote.proc.stdin.write((json.dumps(request) + "\n").encode())
        zygote.proc.stdin.flush()
        self.pid = zygote._read(60.0)["pid"]  # the child holds the write ends from here
        zygote.runs += 1
        for fd in fds:
            os.set_blocking(fd, True)
        self.stdout, self.stderr = (os.fdopen(fd, errors="replace") for fd in fds)
        self._readers: list[threading.Thread] | None = None
        self._read: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                code = self._zygote._read(timeout)["code"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self.returncode = code
            self._zygote.lock.release()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self._readers is None:  # kept across calls, as Popen keeps what it read
            self._readers = [
                threading.Thread(target=self._drain, args=(name,), daemon=True)
                for name in ("stdout", "stderr")
            ]
            for reader in self._readers:
                reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._tmp.cleanup()
        return "".join(self._read["stdout"]), "".join(self._read["stderr"])

    def _drain(self, name: str) -> None:
        stream = getattr(self, name)
        self._read[name].append(stream.read())
        stream.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def refused(args: list[str], monkeypatch, capsys) -> subprocess.CompletedProcess:
    """``cloudburst ARGS`` for a command the CLI refuses before it launches anything, through
    ``main()`` in this process (exit code, stdout, stderr, as :func:`cli`); no forkserver is
    started, and a command that gets as far as launching a job fails the test."""
    from cloudburst import cli as cli_module
    from cloudburst import forkserver

    def launched(cfg):
        raise AssertionError(f"cloudburst {' '.join(args)} launched a job")

    monkeypatch.setattr(forkserver, "start_forkserver", lambda *a, **k: None)
    monkeypatch.setattr(forkserver, "stop_forkserver", lambda: None)
    monkeypatch.setattr(cli_module, "launch_and_report", launched)
    capsys.readouterr()
    try:
        code = cli_module.main(args)
    except SystemExit as e:  # argparse's refusals exit
        code = e.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


# ---------------------------------------------------------------------------- reading a run
def read_summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def read_events(path: Path, growing: bool = False) -> list[dict[str, Any]]:
    """Every record of a metrics file; a line that is not one JSON object fails the test.
    ``growing``: the file is being written, so an unfinished last line is left out, and a
    missing file is an empty list."""
    if growing and not path.is_file():
        return []
    lines = path.read_text().split("\n")
    if growing or lines[-1] == "":  # after the last newline: empty, or a line being written
        lines = lines[:-1]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise AssertionError(f"{path}:{number} is not a JSON record ({e}): {line!r}") from None
        assert isinstance(record, dict) and "event" in record, f"{path}:{number}: {line!r}"
        records.append(record)
    return records


def rank_events(out: Path, rank: int, event: str | None = None) -> list[dict[str, Any]]:
    """Rank ``rank``'s records (of kind ``event``) in the run ``out``, strictly read."""
    records = read_events(out / "metrics" / f"rank{rank}.jsonl")
    return records if event is None else [r for r in records if r["event"] == event]


def final_record(out: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s last ``final`` record (a resumed run has one per attempt)."""
    finals = rank_events(out, rank, "final")
    assert finals, f"rank {rank} wrote no final record"
    return finals[-1]


def rank_logs(out: Path) -> str:
    """Everything the ranks and their agents wrote under ``out/logs``."""
    files = sorted(p for p in (out / "logs").rglob("*") if p.is_file())
    assert files, f"no log files under {out / 'logs'}"
    return "\n".join(p.read_text(errors="replace") for p in files)


def saved_state(out: Path, name: str = "model.pt") -> dict[str, Any]:
    """The state dict of a run's saved model (checked like any cloudburst checkpoint)."""
    from cloudburst.records.checkpoint import load_checkpoint

    return load_checkpoint(out / name, "model")["state_dict"]


def simulated(args: list[str] | tuple[str, ...], step_time_s: float = 0.01) -> Path:
    """Run the ``cloudburst train`` arguments ``args`` on the virtual cluster instead, in this
    process (``cloudburst simulate``), into ``--out``'s directory + ``-sim``; returns it."""
    from cloudburst.cli import main

    args = list(args)
    at = args.index("--out") + 1
    out = Path(args[at]).with_name(Path(args[at]).name + "-sim")
    args[at] = str(out)
    assert main(["simulate", *args, "--step-time-s", str(step_time_s)]) == 0
    return out


def write_parent_pid(path: str) -> None:
    """(A forkserver child's target) Write this process's parent pid to ``path``."""
    Path(path).write_text(str(os.getppid()))


def shard_of(theta, rule: str = "add", lr: float = 1.0, momentum: float = 0.0, dn_period: int = 1,
             dn_c: float = 0.0, **shard):  # fmt: skip
    """A ShardState with server rule ``rule`` by name: asgd's (add, sgd, adagrad), EASGD's
    ``elastic`` or async DiLoCo's ``dn`` (period N = ``dn_period``, c = ``dn_c``)."""
    from cloudburst.strategies.asgd.shard import ShardState
    from cloudburst.strategies.async_diloco.rule import DelayedNesterovRule
    from cloudburst.strategies.easgd.rule import ElasticRule

    if rule == "dn":
        rule = DelayedNesterovRule(lr, momentum, dn_period, dn_c)
    elif rule == "elastic":
        rule = ElasticRule(lr)
    return ShardState(theta, rule=rule, lr=lr, momentum=momentum, **shard)


# -------------------- the parameter-server fake comm (tests/unit/test_asgd_worker.py and others)
# An in-process fake of gloo between a parameter-server strategy's workers and each shard's real
# ServerLoop: a shard serves its queued requests when a worker waits for one of its answers, in
# the calling thread, so the order of the workers' ``after_step`` calls is the order the shards
# see their pushes. Not faked: finish's DONE/PING handshake (:func:`flush` pushes what is left).
class Done:
    """A finished (or lazily finishing) work handle: ``wait`` runs ``fn`` once."""

    def __init__(self, fn: Callable[[], None] | None = None):
        self.fn = fn

    def wait(self) -> None:
        if self.fn is not None:
            fn, self.fn = self.fn, None
            fn()

    def is_completed(self) -> bool:
        return self.fn is None


class FakeNetwork:
    """Ordered channels between worker ranks and shards, and the loops that serve the shards."""

    def __init__(self) -> None:
        self.loops: list[ServerLoop] = []
        self.requests: list[collections.deque] = []  # per shard: (src, header), in arrival order
        # per (worker rank, shard): payloads worker → shard, headers and payloads shard → worker
        self.payloads, self.replies, self.reply_payloads = (
            collections.defaultdict(collections.deque) for _ in range(3)
        )

    def add_shard(self, loop: ServerLoop) -> None:
        self.requests.append(collections.deque())
        self.loops.append(loop)

    def pump(self, k: int) -> None:
        """Shard ``k`` handles every request queued for it, one at a time, as its loop does."""
        loop = self.loops[k]
        while self.requests[k]:
            src, header = self.requests[k].popleft()
            loop._serve_one(loop.transport, src, header)


class _Side:
    def wait_all(self, works) -> None:
        for w in works:
            w.wait()


class ServerSide(_Side):
    """Shard ``k``'s end of the fake (what :class:`ServerLoop` uses of ``PeerTransport``)."""

    def __init__(self, net: FakeNetwork, k: int):
        self.net, self.k, self.stats = net, k, CommStats()

    def recv_payload(
        self, src: int, numel: int, final: bool = False, out=None, on_chunk=None
    ) -> torch.Tensor:
        data = self.net.payloads[src, self.k].popleft()
        assert data.numel() == numel, f"payload of {data.numel()} elements, {numel} expected"
        return out.copy_(data) if out is not None else data

    def isend_payload(self, dst: int, payload: torch.Tensor, reply: bool, prepare=None) -> Done:
        if prepare is not None:
            prepare(0, payload.numel())
        self.net.reply_payloads[dst, self.k].append(payload.clone())  # θ as it is now
        return Done()

    def send(self, dst: int, header: Header, payload=None, final: bool = False) -> None:
        self.net.replies[dst, self.k].append(header)
        if payload is not None:
            self.net.reply_payloads[dst, self.k].append(payload.clone())


class WorkerSide(_Side):
    """Worker ``rank``'s end of the fake (what :class:`AsgdStrategy` uses)."""

    def __init__(self, net: FakeNetwork, rank: int, stats: CommStats | None = None):
        self.net, self.rank = net, rank
        self.stats = stats if stats is not None else CommStats()

    def send(self, k: int, header: Header, payload=None, final: bool = False) -> None:
        self.net.requests[k].append((self.rank, header))
        if payload is not None:
            self.net.payloads[self.rank, k].append(payload.clone())

    def isend_payload(self, k: int, payload: torch.Tensor, reply: bool, prepare=None) -> Done:
        if prepare is not None:
            prepare(0, payload.numel())
        self.net.payloads[self.rank, k].append(payload.clone())
        return Done()

    def irecv_payload(self, k: int, out: torch.Tensor, reply: bool) -> Done:
        def arrive() -> None:
            self.net.pump(k)
            out.copy_(self.net.reply_payloads[self.rank, k].popleft())

        return Done(arrive)

    def recv_reply(self, k: int, out: torch.Tensor | None = None) -> Header:
        self.net.pump(k)
        header = self.net.replies[self.rank, k].popleft()
        if header.numel:
            out.copy_(self.net.reply_payloads[self.rank, k].popleft())
        return header


class FakeStore:
    """The job store's counters (``add``), in a dict."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}

    def add(self, key: str, value: int) -> int:
        self.counters[key] = self.counters.get(key, 0) + value
        return self.counters[key]


class RecordingMetrics:
    """Keeps the server's metrics records: (event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def log(self, event: str, **fields: Any) -> None:
        self.records.append((event, fields))


class FakeNamespace(ReplicaView, SimpleNamespace):
    """A context stand-in of the fields a test gives, with Context's replica view."""


@dataclass
class FakeContext(ReplicaView):
    """What a strategy or a server loop reads from :class:`cloudburst.runtime.context.Context`."""

    cfg: RunConfig
    rank: int
    net: FakeNetwork
    store: FakeStore
    # a heartbeat that starts no thread: nobody checks liveness in the fake
    heartbeat: Any = field(default_factory=lambda: SimpleNamespace(stop=lambda: None))
    device: torch.device = torch.device("cpu")
    topology: None = None
    link: None = None
    rejoined: bool = False
    comm: Any = REAL

    def __post_init__(self) -> None:
        self.num_servers, self.world_size = self.cfg.job.servers, self.cfg.world_size
        self.is_server = self.rank < self.num_servers
        self.server_index, self.worker_index = self.rank, self.rank - self.num_servers

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.num_servers, self.world_size))

    def elapsed_s(self) -> float:
        return 0.0

    def transport(self, stats: CommStats | None = None, group=None, members=None):
        if self.is_server:
            return ServerSide(self.net, self.rank)
        return WorkerSide(self.net, self.rank, stats)


@dataclass
class PsJob:
    workers: list[AsgdStrategy]
    loops: list[ServerLoop]
    metrics: list[RecordingMetrics]

    @property
    def server_theta(self) -> torch.Tensor:
        """The whole θ held by the shards, joined."""
        return torch.cat([loop.shard.theta for loop in self.loops])


def ps_job(cfg: RunConfig, models: list[nn.Module], theta: torch.Tensor | None = None) -> PsJob:
    """A parameter-server job of ``cfg.job.servers`` shards (starting from ``theta``, by default
    the first model's θ) and one worker per model (the strategy ``cfg.job.strategy`` names, already
    wrapped around its model, not started): the first ``len(models)`` of ``cfg.job.workers``."""
    if len(models) > cfg.job.workers:
        raise ValueError(f"{len(models)} models for {cfg.job.workers} workers")
    net, store = FakeNetwork(), FakeStore()
    theta = flatten_params(models[0]) if theta is None else theta
    metrics = [RecordingMetrics() for _ in range(cfg.job.servers)]
    nobody_dies = SimpleNamespace(dead=lambda ranks: set(), revive=lambda rank: None)
    for k, recorder in enumerate(metrics):
        net.add_shard(ServerLoop(FakeContext(cfg, k, net, store), theta, recorder, nobody_dies))
    workers = []
    for i, model in enumerate(models):
        strategy = STRATEGY_CLASSES[cfg.job.strategy](
            FakeContext(cfg, cfg.job.servers + i, net, store)
        )
        strategy.wrap(model, None)
        workers.append(strategy)
    return PsJob(workers, list(net.loops), metrics)


def flush(strategy: AsgdStrategy) -> None:
    """What ``finish`` does before its DONE handshake: push the steps not pushed yet."""
    strategy._flush()


class StandbyForwards:
    """A primary shard's link to its standby: keeps what it forwards and answers at once;
    :meth:`replay`: the standby's end, receiving the forwards in order, then DONE."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.sent: list[tuple[Header, torch.Tensor | None]] = []

    def send(self, peer: int, header: Header, payload=None, final: bool = False) -> None:
        self.sent.append((header, None if payload is None else payload.clone()))

    def recv_reply(self, peer: int, out=None) -> Header:
        return Header(Kind.REPLY, shard=self.shard)

    def replay(self) -> SimpleNamespace:
        queue = [*self.sent, (Header(Kind.REPLY, shard=self.shard, aux=int(Kind.DONE)), None)]

        def recv_reply(peer: int, out: torch.Tensor) -> Header:
            header, payload = queue.pop(0)
            if payload is not None:
                out.copy_(payload)
            return header

        return SimpleNamespace(recv_reply=recv_reply, send=lambda *args, **kw: None)


def prior_stats() -> CommStats:
    """Counters holding earlier totals (all distinct), so an overwrite or a subtraction shows."""
    return CommStats(
        sent_bytes=1000, received_bytes=2000, wait_s=1.0, inter_node_bytes=3000,
        intra_node_bytes=4000, emulated_link_s=0.25,
    )  # fmt: skip


class RecordingLink:
    """An emulated link of latency 1/8 s and 1024 bytes/s that charges ``allreduce_cost_s`` for
    any all-reduce; records each cost asked (bytes, group size) and each booking (seconds,
    group); its bookings end at perf_counter 0 (waiting for them never sleeps)."""

    spec = SimpleNamespace(latency_s=0.125, bytes_per_s=1024.0)

    def __init__(self, active: bool = True, allreduce_cost_s: float = 0.0625):
        self.active, self.allreduce_cost_s = active, allreduce_cost_s
        self.asked: list[tuple] = []
        self.booked: list[tuple] = []

    def allreduce_s(self, nbytes: int, group_size: int) -> float:
        self.asked.append((nbytes, group_size))
        return self.allreduce_cost_s

    def book_collective(self, seconds: float, group: Any, start: float | None = None) -> float:
        self.booked.append((seconds, group))
        return 0.0


# ---------------------------------- whole runs on the virtual cluster (tests/unit/test_sim_runs.py)
STEP_S = 0.01  # the modelled step time of every run_sim run


def sim_cfg(out: Path, strategy: str, workers: int, steps: int, **kw) -> RunConfig:
    return RunConfig(
        strategy=strategy, workers=workers, steps=steps, dataset="synthetic", model="cnn",
        batch_size=ref.BATCH, lr=ref.LR, momentum=ref.MOMENTUM, seed=ref.SEED,
        eval_every_s=kw.pop("eval_every_s", 1000.0), out=str(out), **kw,
    )  # fmt: skip


def run_sim(cfg: RunConfig, **clock) -> dict:
    return simulate(cfg, SimulationConfig(step_time_s=clock.pop("step_time_s", STEP_S), **clock))


# -------------------------------------- the clock model's run config (tests/unit/test_sim_clock.py)
def clock_run_config(**kw) -> RunConfig:
    base = {"out": "unused", "dataset": "synthetic", "train_size": 256, "test_size": 32}
    return RunConfig.from_dict({**base, **kw})


# --------------------------- local SGD, DiLoCo on W threads (tests/unit/test_streaming_diloco.py)
BATCH = 8  # samples per local step (what the loop passes to after_step)


class _Workers:
    """The workers' group, for W threads: ``all_reduce_sum`` returns with the sum of every
    worker's vector (a :class:`ThreadGroup`: a worker that does not take part fails the test)."""

    def __init__(self, workers: int):
        self.threads = ThreadGroup(workers)
        self.lock = threading.Lock()
        self.calls: list[tuple[int, Any, bool]] = []  # (worker, link, spans_nodes)

    def all_reduce_sum(self, tensor, group, stats, link=None, spans_nodes=False, **kw):
        assert kw.pop("comm", None) is not None, "the strategy passes its transport"
        assert not kw, kw
        # counted into the caller's stats as the real all-reduce counts it
        moved = ring_bytes(tensor.numel(), tensor.element_size(), self.threads.size)
        count_collective(stats, moved, spans_nodes)
        with self.lock:
            self.calls.append((group, link, spans_nodes))
        tensor.copy_(torch.stack(ThreadComm(self.threads, group)._exchange(tensor)).sum(0))
        return Done()  # a blocking all-reduce: nothing left to wait for


@dataclass
class LocalSgdCtx(ReplicaView):
    """What a local SGD strategy reads from the context; ``workers_group``: the worker's index."""

    cfg: RunConfig
    worker_index: int
    topology: Topology | None = None
    link: Any = None
    comm: Any = REAL
    num_servers: int = 0

    @property
    def workers_group(self) -> int:
        return self.worker_index

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.cfg.job.workers))


def survivor_cfg(strategy: str, workers: int, **kw) -> RunConfig:
    return RunConfig(strategy=strategy, workers=workers, dataset="synthetic", train_size=512, **kw)


class LocalSgdJob:
    """W strategies of ``cfg`` around the replicas of ``replicas``, driven step by step."""

    def __init__(
        self, cfg: RunConfig, replicas: ref.Replicas, monkeypatch: pytest.MonkeyPatch, **ctx: Any
    ):
        self.cfg, self.replicas = cfg, replicas
        self.group = _Workers(cfg.job.workers)
        monkeypatch.setattr(local_sgd, "all_reduce_sum", self.group.all_reduce_sum)
        cls = DilocoStrategy if cfg.job.strategy == "diloco" else LocalSgdStrategy
        self.strategies = [cls(LocalSgdCtx(cfg, w, **ctx)) for w in range(cfg.job.workers)]
        for s, model, opt in zip(
            self.strategies, replicas.models, replicas.optimizers, strict=True
        ):
            assert s.wrap(model, opt) is model
        self.step = 0

    def _all(self, fn) -> None:
        with ThreadPoolExecutor(len(self.strategies)) as pool:
            list(pool.map(fn, self.strategies))  # re-raises a worker's exception

    def run(self, steps: int) -> list[list[torch.Tensor]]:
        """``steps`` more local steps of every worker; θ of each worker after each step."""
        history: list[list[torch.Tensor]] = [[] for _ in self.strategies]
        for _ in range(steps):
            self.step += 1
            for w in range(len(self.strategies)):
                self.replicas.step(w, self.step)
            self._all(lambda s: s.after_step(BATCH))
            for w, model in enumerate(self.replicas.models):
                history[w].append(ref.flat(model))
        return history

    def finish(self) -> list[torch.Tensor]:
        self._all(lambda s: s.finish())
        return [ref.flat(m) for m in self.replicas.models]


# ---------------- one DiLoCo worker, its all-reduces recorded (tests/unit/test_streaming_diloco.py)
class _Recorder:
    """One worker's all-reduce (the sum is the tensor itself); records each call's step,
    fragment size and ``async_op``."""

    def __init__(self):
        self.strategy: DilocoStrategy | None = None
        self.calls: list[tuple[int, int, bool]] = []

    def all_reduce_sum(self, tensor, group, stats, link=None, spans_nodes=False, **kw):
        assert kw.pop("comm", None) is not None
        async_op = kw.pop("async_op", False)
        assert not kw, kw
        self.calls.append((self.strategy.local_steps, tensor.numel(), async_op))
        return Done()  # a blocking all-reduce: nothing left to wait for


def one_diloco_worker(monkeypatch, **kw) -> tuple[DilocoStrategy, ref.Replicas, _Recorder]:
    recorder = _Recorder()
    monkeypatch.setattr(local_sgd, "all_reduce_sum", recorder.all_reduce_sum)
    replicas = ref.Replicas(1, ref.sgd())
    strategy = DilocoStrategy(LocalSgdCtx(survivor_cfg("diloco", 1, **kw), 0))
    strategy.wrap(replicas.models[0], replicas.optimizers[0])
    recorder.strategy = strategy
    return strategy, replicas, recorder


# ----------------------------------- DASO against the reference (tests/unit/test_daso_sync.py)
DASO_REF_STEPS, DASO_REF_GLOBAL_SKIP, DASO_REF_LOCAL_SKIP = 14, 3, 2
DASO_REF_NODES, DASO_REF_WORKERS = 2, 4
DASO_REF_LR, DASO_REF_MOMENTUM = 0.1, 0.9


def daso_reference_cfg(out: str, wait: int, **kw):
    return daso_sync_cfg(
        out, DASO_REF_WORKERS, DASO_REF_NODES, daso_global_skip=DASO_REF_GLOBAL_SKIP,
        daso_batches_to_wait=wait, daso_local_skip=DASO_REF_LOCAL_SKIP, daso_downcast="none",
        daso_cycling_downcast="none", **kw,
    )  # fmt: skip


def daso_reference_drive(ctx) -> list[list[float]]:
    """One rank's DASO run (:func:`drive_strategy`)."""
    model = ref.tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=DASO_REF_LR, momentum=DASO_REF_MOMENTUM)
    strategy = DasoStrategy(ctx)
    strategy.configure(steps_per_epoch=100, total_steps=100)  # all cycling, no epoch ends
    return drive_strategy(ctx, strategy, model, optimizer, DASO_REF_STEPS)


def drive_strategy(ctx, strategy, model, optimizer, steps: int) -> list[list[float]]:
    """One rank's run of ``strategy`` on ``tests.reference``'s batches, as the training loop
    steps it: θ after every step and after finish (the last entry replaced), as lists (JSON
    for the gloo processes)."""
    net = strategy.wrap(model, optimizer)
    strategy.start()
    history = []
    for step in range(1, steps + 1):
        x, y = ref.batch(ctx.rank, step)
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        strategy.after_backward()
        optimizer.step()
        strategy.record_loss(loss.item())
        strategy.after_step(len(y))
        history.append(flatten_params(model).tolist())
    strategy.finish()
    history[-1] = flatten_params(model).tolist()
    return history


def daso_reference_run(wait: int) -> list[list[torch.Tensor]]:
    models = [ref.tiny_model() for _ in range(DASO_REF_WORKERS)]
    optimizers = [ref.sgd(DASO_REF_LR, DASO_REF_MOMENTUM)(m) for m in models]
    schedule = (DASO_REF_NODES, DASO_REF_STEPS, DASO_REF_GLOBAL_SKIP, wait, DASO_REF_LOCAL_SKIP)
    return ref.daso(models, optimizers, ref.batch, *schedule)


def assert_follows_reference(
    runs: list[list[list[float]]], expected: list[list[torch.Tensor]], steps: int
) -> None:
    """Each rank's θ after each of ``steps`` steps (:func:`drive_strategy`'s runs) is the
    reference's, up to float rounding."""
    for rank, (got, want) in enumerate(zip(runs, expected, strict=True)):
        assert len(got) == len(want) == steps
        for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
            torch.testing.assert_close(
                torch.tensor(a), b, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, step {step}"
            )


# ------------------------ DASO's global syncs on a 3-parameter model (tests/unit/test_daso_sync.py)
def daso_sync_cfg(tmp_path, workers: int, nodes: int, **kw) -> RunConfig:
    settings = dict(
        daso_global_skip=1, daso_batches_to_wait=1, daso_local_skip=1, daso_warmup_epochs=0.0,
        daso_cooldown_epochs=0.0, daso_adaptive=False, daso_epoch_end_sync=False,
    )  # fmt: skip
    settings.update(kw)
    return RunConfig(
        strategy="daso", workers=workers, nodes=nodes, dataset="synthetic", out=str(tmp_path),
        comm_timeout_s=60, **settings,
    )  # fmt: skip


def daso_sync_model(rank: int) -> nn.Module:
    """θ = (10r, 10r + 1, 10r + 2) on rank r: every rank's θ differs."""
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[10.0 * rank, 10.0 * rank + 1]]))
        model.bias.fill_(10.0 * rank + 2)
    return model


def daso_sync_drive(
    ctx, steps: int, steps_per_epoch: int, total_steps: int, on_step=None, record=None
):
    """``steps`` steps of one rank as the training loop runs them (lr 0), then the finish.
    ``record(strategy, model)``: wraps the transport before training (sees the wire);
    ``on_step(step, strategy, before, after)``: the virtual clock around each after_step."""
    model = daso_sync_model(ctx.rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    strategy = DasoStrategy(ctx)
    strategy.configure(steps_per_epoch, total_steps)
    net = strategy.wrap(model, optimizer)
    strategy.start()
    if record is not None:
        record(strategy, model)
    x, y = torch.ones(4, 2), torch.zeros(4, 1)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        strategy.after_backward()
        optimizer.step()
        ctx.comm.step_done(0.0, 0.0, 1.0)
        strategy.record_loss(loss.item())
        before = ctx.comm.now()
        strategy.after_step(4)
        if on_step is not None:
            on_step(step, strategy, before, ctx.comm.now())
    strategy.finish()
    return strategy


# --------------- one asgd worker and its shards over tests.support (tests/unit/test_asgd_worker.py)
def make_asgd_worker(cfg: RunConfig, model: nn.Module) -> tuple[AsgdStrategy, list[ServerLoop]]:
    """The first of ``cfg.job.workers`` asgd workers, around ``model``, and the shards."""
    job = ps_job(cfg, [model])
    return job.workers[0], job.loops


def train_asgd_worker(cfg: RunConfig, steps: int, setup=None, each=None):
    """``steps`` SGD steps of one worker against the shards; ``setup(loops)`` before the
    first, ``each(model, loops)`` after each step's push and fetch."""
    data = synthetic(512, 10)
    model = build_model("mlp", 40, 10, seed=0)
    strategy, loops = make_asgd_worker(cfg, model)
    if setup is not None:
        setup(loops)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stream = BatchStream(data.x_train, data.y_train, 32, seed=1)
    strategy.start()
    for _ in range(steps):
        ref.train_step(model, opt, *next(stream))
        strategy.after_step(32)
        if each is not None:
            each(model, loops)
    return model, strategy, loops  # (no finish: the fake has no DONE handshake)


def asgd_cfg(**kw) -> RunConfig:
    return RunConfig(strategy="asgd", workers=1, dataset="synthetic", train_size=512, **kw)


# ------------------------------------------- collectives of W threads (tests/unit/test_compress.py)
def compress_vector(n: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # blocks of very different magnitudes, a zero block, and a length that is not a multiple
    x = torch.randn(n, generator=g) * torch.logspace(-4, 2, n)
    x[BLOCK : 2 * BLOCK] = 0
    return x


class ThreadGroup:
    """W threads' collectives, each rank's transport a :class:`ThreadComm` on it."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.parts: dict[int, torch.Tensor] = {}


#: ``ThreadComm(handle=ANY_GROUP)``: every group handle is accepted.
ANY_GROUP = object()


class ThreadComm:
    """Rank ``rank`` of a :class:`ThreadGroup`: a transport's collectives, by exchanging tensors
    between the threads (group rank = global rank). Records each call in ``calls`` (name,
    sizes, ``async_op``; ("wait",) per work waited for); a collective over a group other than
    ``handle`` fails the test; ``now()`` reads ``start``, ``start + tick``, ... (``clock`` may
    be moved by hand)."""

    def __init__(self, group: ThreadGroup, rank: int, *, handle: Any = ANY_GROUP,
                 start: float = 0.0, tick: float = 0.0):  # fmt: skip
        self.group, self.rank, self.handle = group, rank, handle
        self.clock, self.tick = start, tick
        self.calls: list[tuple] = []

    def _check(self, group: Any) -> None:
        if self.handle is not ANY_GROUP and group is not self.handle:
            raise AssertionError(f"a collective over {group!r}, not the group it was given")

    def now(self) -> float:
        reading = self.clock
        self.clock += self.tick
        return reading

    def measuring(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def group_size(self, group=None) -> int:
        self._check(group)
        return self.group.size

    def group_rank(self, group=None) -> int:
        self._check(group)
        return self.rank

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.group.parts[self.rank] = tensor.clone()
        self.group.barrier.wait()
        parts = [self.group.parts[r] for r in range(self.group.size)]
        self.group.barrier.wait()
        return parts

    def all_reduce(self, tensor, group=None, async_op=False):
        self._check(group)
        self.calls.append(("all_reduce", tensor.dtype, tensor.numel(), async_op))
        tensor.copy_(torch.stack(self._exchange(tensor)).sum(0))
        return RecordedWork(self.calls)

    def all_gather(self, output, tensor, group=None, async_op=False):
        self._check(group)
        self.calls.append(("all_gather", tensor.numel(), async_op))
        output.copy_(torch.cat(self._exchange(tensor)))
        return RecordedWork(self.calls)

    def all_to_all(self, output, tensor, output_splits, input_splits, group=None, async_op=False):
        self._check(group)
        self.calls.append(("all_to_all", list(input_splits), list(output_splits), async_op))
        sent = self._exchange(tensor)
        splits = self._exchange(torch.tensor(input_splits, device="cpu"))
        pieces = [sent[r].split(splits[r].tolist())[self.rank] for r in range(self.group.size)]
        assert [p.numel() for p in pieces] == list(output_splits)
        output.copy_(torch.cat(pieces))
        return RecordedWork(self.calls)

    def broadcast(self, tensor, src, group=None) -> None:
        self._check(group)
        self.calls.append(("broadcast", tensor.dtype, tensor.numel(), src))
        tensor.copy_(self._exchange(tensor)[src])


class RecordedWork:
    """A finished work handle that records its wait in its transport's calls."""

    def __init__(self, calls: list):
        self.calls = calls

    def wait(self) -> bool:
        self.calls.append(("wait",))
        return True


def on_comm_threads(size: int, fn, **comm) -> list:
    """``fn(rank, comm)`` on ``size`` threads, each with a :class:`ThreadComm` (``comm``: its
    keyword arguments); their results, or the first error raised (the barrier aborted)."""
    group = ThreadGroup(size)
    results: list = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, ThreadComm(group, rank, **comm))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# -------------------------- the parameter-server references' config (tests/unit/test_references.py)
def references_cfg(**kw) -> RunConfig:
    return RunConfig(dataset="synthetic", train_size=512, checkpoint_every=0, **kw)


# --------------------------------- killing a shard in a real run (tests/e2e/test_shard_recovery.py)
BOUND_S = 180  # a job that has not ended by then hangs: a failure, not a measurement


def rank_records(out: Path, rank: int) -> list[dict]:
    path = out / "metrics" / f"rank{rank}.jsonl"
    return read_jsonl(path) if path.is_file() else []


def kill_after_a_checkpoint(out: Path, rank: int, proc: subprocess.Popen) -> None:
    """SIGKILL rank ``rank`` (a shard) once its checkpoint exists and it applied more pushes
    since, so that some acknowledged pushes are lost."""

    def due() -> list[dict] | None:
        records = rank_records(out, rank)
        pushes = [r["version"] for r in records if r["event"] == "push"]
        # past a checkpoint, and not at one (where nothing would be lost)
        if (out / "checkpoints" / f"server{rank}.pt").is_file() and pushes and pushes[-1] > 25:
            return records if pushes[-1] % 10 not in (0, 9) else None
        return None

    records = wait_running(proc, due, "a shard checkpoint", BOUND_S)
    [start] = [r for r in records if r["event"] == "start"]
    os.kill(start["pid"], signal.SIGKILL)


def survives_a_shard_kill(args: list, out: Path) -> None:
    """``cloudburst train ARGS --out OUT`` succeeds though shard 1 is killed once, as
    :func:`kill_after_a_checkpoint` kills it."""
    proc = start_job([*args, "--out", str(out)])
    kill_after_a_checkpoint(out, 1, proc)
    _, stderr = finish_job(proc, BOUND_S)
    assert proc.returncode == 0, stderr


# ------------------ the link's clocks and records (tests/unit/test_link.py, test_nic_sharing.py,
# test_sim_network_more.py)
def close(x: float) -> pytest.approx:
    """Equal to ``x`` up to float rounding (1e-12 s)."""
    return pytest.approx(x, abs=1e-12)


class FakeTime:
    """A clock that moves only on ``advance`` or a sleep (recorded; it moves the clock by
    ``step``, or by the asked duration, then runs ``on_sleep``, if any). More than
    ``MAX_SLEEPS`` sleeps is a wait that never ends: it fails at once."""

    MAX_SLEEPS = 1000

    def __init__(self, now: float, step: float | None = None) -> None:
        self.now, self.step = now, step
        self.sleeps: list[float] = []
        self.on_sleep = None

    def perf_counter(self) -> float:
        return self.now

    monotonic = time = perf_counter

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.sleeps.append(seconds)
        assert len(self.sleeps) <= self.MAX_SLEEPS, "still polling after 1000 sleeps"
        self.now += seconds if self.step is None else self.step
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))

    def advance(self, seconds: float) -> None:
        self.now += seconds


def link_ranks(spec, topology: Topology, nic) -> list:
    """One :class:`LinkEmulator` of ``spec`` per rank of ``topology``, sharing ``nic`` (None:
    each its own link)."""
    from cloudburst.comm.link import LinkEmulator

    return [LinkEmulator(spec, topology=topology, rank=r, nic=nic)
            for r in range(len(topology.node_of))]  # fmt: skip


# ---------------------- checkpointed state (tests/unit/test_shard_state.py, test_strategy_state.py)
def same_state(a, b) -> bool:
    """Deep, bit-exact equality of state dicts (tensors by value, dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b
