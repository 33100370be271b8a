"""Test helpers: one spawn helper for distributed tests, running the CLI as a user does, and
strict readers of what a run writes."""

from __future__ import annotations

import atexit
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
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

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
