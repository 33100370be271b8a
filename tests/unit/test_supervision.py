"""Supervision that survives hostile neighbours (issue 44): the launcher stops its job with every
file descriptor taken; a malformed heartbeat is one unreadable beat, not a lost store; a failed
job says the first error a rank raised, not only its agents' exit codes, and the CLI says each
rank's error once and fails (exit 1) when every worker was lost; ``--resume DIR`` takes DIR's
config and refuses what would change the run."""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import resource
import signal
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from cloudburst import cli, launch
from cloudburst.cli import resume_config
from cloudburst.comm.liveness import HEARTBEAT_KEY, Heartbeat, LivenessMonitor
from cloudburst.config import ConfigError, RunConfig
from cloudburst.forkserver import raise_open_files_limit
from cloudburst.launch import failures, processes
from cloudburst.launch.agents import loopback_listener
from cloudburst.launch.failures import job_failure

ENOSPC = "OSError: [Errno 28] No space left on device"

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@contextlib.contextmanager
def no_descriptor_left():
    """Every descriptor of this process taken (as by ~1,000 store connections), then given back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 32, hard))
    held = []
    try:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as e:
                assert e.errno == errno.EMFILE
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# Above Linux's largest pid (PID_MAX_LIMIT, 2**22): no process can have them.
NO_PID = 2**22 + 1000


class FakeAgent:
    """An agent's process as the launcher sees it: ``on_start`` at the first look, alive for
    ``alive_for`` looks, then ``on_exit`` and ``exitcode``."""

    def __init__(
        self, pid: int, alive_for: int = 10**9, exitcode: int = 0, on_start=None, on_exit=None
    ):
        self.pid, self._left, self._code = pid, alive_for, exitcode
        self._on_start, self._on_exit = on_start, on_exit
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        if self._on_start is not None:
            self._on_start()
            self._on_start = None
        if self.exitcode is None and self._left <= 0:
            if self._on_exit is not None:
                self._on_exit()
            self.exitcode = self._code
        self._left -= 1
        return self.exitcode is None

    def kill(self) -> None:
        self.exitcode = -signal.SIGKILL

    def join(self, timeout: float | None = None) -> None:
        pass


@linux_only
def test_with_no_descriptor_left_stopping_the_job_still_kills_agents_and_forkserver(
    monkeypatch, capsys
):
    """``/proc`` unreadable: agents and forkserver are SIGKILLed by pid (ranks die with them)."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(processes, "forkserver_pid", lambda: NO_PID + 2)
    agents = [FakeAgent(NO_PID), FakeAgent(NO_PID + 1)]
    with no_descriptor_left():
        launch._stop(agents, launch._StopRequest(), grace_s=60)
    assert {(a.pid, signal.SIGKILL) for a in agents} <= set(sent)
    assert (NO_PID + 2, signal.SIGKILL) in sent
    err = capsys.readouterr().err
    assert "stopping the job" in err and "no file descriptor left" in err


def _fake_job(monkeypatch, agents_for) -> None:
    """``run_local_job`` starting ``agents_for(out)`` instead of processes, and not sleeping."""

    def start(cfg, entrypoint, agent_per_rank):
        return agents_for(Path(cfg.output.out)), None

    monkeypatch.setattr(launch, "start_local_job", start)
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)


@linux_only
def test_the_monitor_goes_on_when_it_cannot_read_the_runs_files(tmp_path, monkeypatch, capsys):
    """EMFILE while the agent trains: each look is skipped (said once); the summary is returned."""
    cfg = RunConfig(workers=1, out=str(tmp_path / "run"), progress=False)
    exhausted = no_descriptor_left()

    def finish(out: Path) -> None:
        exhausted.__exit__(None, None, None)
        (out / "summary.json").write_text(json.dumps({"strategy": "sync"}))

    def agents(out: Path) -> list[FakeAgent]:
        (out / "metrics" / "rank0.jsonl").write_text('{"event": "step", "step": 3}\n')
        start, stop = exhausted.__enter__, lambda: finish(out)
        return [FakeAgent(NO_PID, alive_for=8, on_start=start, on_exit=stop)]

    _fake_job(monkeypatch, agents)
    summary = launch.run_local_job(cfg)
    assert summary["strategy"] == "sync" and summary["failed_agents"] == []
    assert capsys.readouterr().err.count("cannot read the run's files") == 1


def _rank_file(out: Path, agent: int, name: str, text: str) -> None:
    """A rank's file (torch's error.json, its stderr.log), where a local job's agents leave it."""
    path = out / "logs" / f"agent{agent}" / "run_x" / "attempt_0" / "0" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _error_file(out: Path, agent: int, message: str, timestamp: int = 1000) -> None:
    info = {"py_callstack": "Traceback ...", "timestamp": str(timestamp)}
    error = {"message": {"message": message, "extraInfo": info}}
    _rank_file(out, agent, "error.json", json.dumps(error))


def test_a_failed_job_names_the_first_error_a_rank_raised(tmp_path):
    """The earliest error file's, else the line ending a stderr.log's last traceback (a lone
    error-like line is not taken), else the exit codes; a lost peer is named with its own."""
    assert job_failure(tmp_path, [1, -9]) == "ranks failed (agent exit codes [1, -9])"
    _rank_file(tmp_path, 1, "stderr.log", "RuntimeError: a retried connection, logged\n")
    assert job_failure(tmp_path, [1, 1]) == "ranks failed (agent exit codes [1, 1])"
    error = "OverflowError: Python int too large to convert to C long"
    log = "RuntimeError: logged\nTraceback (most recent call last):\n  File ...\n"
    _rank_file(tmp_path, 0, "stderr.log", f"{log}{error}\n")
    assert job_failure(tmp_path, [1, 1]) == f"rank 0 failed: {error}"
    _error_file(tmp_path, 1, "RuntimeError: [gloo] Connection closed by peer\nmore", timestamp=1002)
    _error_file(tmp_path, 2, f"{ENOSPC}\n  File ...")
    assert job_failure(tmp_path, [0, 1, 1]) == f"rank 2 failed: {ENOSPC}"
    lost_run = tmp_path / "lost"
    (lost_run / "metrics").mkdir(parents=True)
    lost = {"event": "peer_lost", "lost_rank": 1, "reason": "worker 0 (rank 1) lost at 3.0 s"}
    (lost_run / "metrics" / "rank0.jsonl").write_text(json.dumps({**lost, "time_s": 3.0}) + "\n")
    assert job_failure(lost_run, [1]) == lost["reason"]  # SIGKILLed: nothing more
    _error_file(lost_run, 1, ENOSPC)
    assert job_failure(lost_run, [1]) == f"{lost['reason']}: {ENOSPC}"


def test_the_summary_and_the_error_say_a_ranks_first_error(tmp_path, monkeypatch):
    cfg = RunConfig(workers=1, out=str(tmp_path / "run"), progress=False)

    def agents(out: Path) -> list[FakeAgent]:
        return [FakeAgent(NO_PID, alive_for=1, exitcode=1,
                          on_exit=lambda: _error_file(out, 0, ENOSPC))]  # fmt: skip

    _fake_job(monkeypatch, agents)
    with pytest.raises(launch.JobFailed) as failed:
        launch.run_local_job(cfg)
    assert failed.value.summary["failed"] == f"rank 0 failed: {ENOSPC}"
    assert ENOSPC in str(failed.value)
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["failed"] == f"rank 0 failed: {ENOSPC}"


@pytest.fixture
def store_server():
    """A client factory for a real loopback TCPStore served from this process, as the launcher's."""
    listener = loopback_listener(0)
    port = listener.getsockname()[1]
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout, wait_for_workers=False,
                           multi_tenant=True, master_listen_fd=listener.detach())  # fmt: skip
    yield lambda: dist.TCPStore("127.0.0.1", port, 1, False, timeout)
    del server


def test_a_malformed_heartbeat_is_one_unreadable_beat_not_a_lost_store(store_server):
    """The watchers read (torch's server drops a client ``add``ing to a non-integer): the bad value
    is no beat, the rank's next beat overwrites it, every connection still works."""
    key = HEARTBEAT_KEY.format(rank=1)
    rank_store, watcher_store, neighbour = store_server(), store_server(), store_server()
    beats = [Heartbeat(rank_store, 1, interval_s=3600).start()]
    rank_store.get(key)  # on the same connection: the beat is stored before the monitor looks
    monitor = LivenessMonitor(watcher_store, [1], timeout_s=0.0)  # any read without a beat
    assert monitor.dead([1]) == set()  # it beat since the monitor started
    neighbour.set(key, "not a number")
    assert neighbour.get(key) == b"not a number"
    assert monitor.dead([1]) == {1}  # no beat (and no exception)
    assert monitor.unreadable == 1
    beats.append(Heartbeat(rank_store, 1, interval_s=3600).start())  # its next beat
    for beat in beats:
        beat.stop()
    assert rank_store.get(key).isdigit()
    assert monitor.dead([1]) == set()
    assert monitor.unreadable == 1
    assert watcher_store.get(key).isdigit()  # neither connection was dropped
    # a heartbeat not written yet is no beat (nor unreadable), and looking does not create it
    monitor = LivenessMonitor(watcher_store, [3], timeout_s=0.0)
    assert monitor.dead([3]) == {3}
    assert not watcher_store.check([HEARTBEAT_KEY.format(rank=3)]) and monitor.unreadable == 0


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit is {hard}: nothing to raise")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # a default soft limit
        raised = raise_open_files_limit()
        assert raised > 1024
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (raised, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---------------------------------------------------------------------------- what the CLI says
ERROR = "RuntimeError: unsupported operation: some elements of the input tensor overlap"


def _job(tmp_path, monkeypatch, lost):
    cfg = RunConfig(strategy="asgd", workers=2, servers=1, out=str(tmp_path))
    for rank in lost:
        _error_file(tmp_path, rank, f"{ERROR}\nmore")
    summary = {"strategy": "asgd", "workers": 2, "lost_workers": lost}
    summary["failed_agents"] = [1] * len(lost)
    monkeypatch.setattr(launch, "run_local_job", lambda c: summary)
    monkeypatch.setattr(cli, "format_summary", lambda s: "table")
    return cfg


@pytest.mark.parametrize("lost, code", [([1], 0), ([1, 2], 1)])
def test_failed_ranks_are_reported_and_losing_every_worker_fails(
    tmp_path, monkeypatch, capsys, lost, code
):
    cfg = _job(tmp_path, monkeypatch, lost)
    assert cli.launch_and_report(cfg) == code
    err = capsys.readouterr().err
    assert err.count(f"a rank failed with: {ERROR}\n") == 1  # one line, said once
    assert f"logs in {tmp_path / 'logs'}" in err
    assert ("every worker was lost" in err) == (code == 1)


def test_rank_errors_skips_unreadable_files(tmp_path):
    _rank_file(tmp_path, 0, "error.json", "{not json")
    _rank_file(tmp_path, 1, "error.json", json.dumps({"message": "ValueError: x"}))
    assert failures.rank_errors(tmp_path) == ["ValueError: x"]


def test_a_finished_run_says_where_it_is_and_a_diverged_one_prints_no_table(
    tmp_path, monkeypatch, capsys
):
    cfg = _job(tmp_path, monkeypatch, [])
    assert cli.launch_and_report(cfg) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "table" and f"the run is in {tmp_path} " in err
    diverged = {"strategy": "asgd", "workers": 2, "failed": "the final model's test loss is nan"}
    monkeypatch.setattr(launch, "run_local_job", lambda c: diverged)
    assert cli.launch_and_report(cfg) == 1
    out, err = capsys.readouterr()
    assert out == "" and "test loss is nan" in err  # the numbers of a failed run are no result


# ----------------------------------------------------------------------------------- --resume DIR
def _run_dir(tmp_path) -> None:
    cfg = RunConfig(strategy="local_sgd", workers=2, steps=50, out=str(tmp_path), period=4)
    (tmp_path / "config.json").write_text(cfg.to_json())


def test_resume_takes_the_runs_config_and_allowed_overrides(tmp_path):
    _run_dir(tmp_path)
    cfg = resume_config(str(tmp_path), {"steps": 80, "max_restarts": 2}, has_toml=False)
    assert cfg.faults.resume and cfg.output.out == str(tmp_path) and cfg.local_sgd.period == 4
    assert (cfg.training.steps, cfg.faults.max_restarts, cfg.job.strategy) == (80, 2, "local_sgd")


# What --resume DIR finds in DIR ("run": a run's config.json; None: nothing) and is given.
@pytest.mark.parametrize(
    "saved, flags, has_toml, message",
    [
        ("run", {"strategy": "sync"}, False, "strategy cannot change"),
        ("run", {"workers": 3}, False, "workers cannot change"),
        ("run", {"seed": 1}, False, "seed cannot change"),
        ("run", {"out": "/elsewhere"}, False, "drop --out"),
        ("run", {}, True, "not --config"),
        (None, {}, False, "not a cloudburst run directory"),
        ("{not json", {}, False, "not valid JSON"),
        (json.dumps({"strategy": "x"}), {}, False, "strategy"),
    ],
)
def test_resume_refuses_what_is_not_a_run_and_changes_to_the_runs_identity(
    tmp_path, saved, flags, has_toml, message
):
    if saved == "run":
        _run_dir(tmp_path)
    elif saved is not None:
        (tmp_path / "config.json").write_text(saved)
    with pytest.raises(ConfigError, match=message):
        resume_config(str(tmp_path), flags, has_toml=has_toml)
