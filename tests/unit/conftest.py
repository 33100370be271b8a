"""Unit tests start no processes: an unmarked one that tries fails, naming the way out. And
the fixtures several unit modules share."""

from __future__ import annotations

import multiprocessing.process
import multiprocessing.util
import os
import subprocess

import pytest

from cloudburst import cli, forkserver
from cloudburst.config import RunConfig


@pytest.fixture(autouse=True, scope="session")
def _font_cache() -> None:
    """matplotlib runs ``fc-list`` once per machine to build its font cache, on its first
    import: do that before the fence below, so a fresh machine's first plot test is no spawn."""
    import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def _no_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("spawns"):
        return

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} started a process; unit tests start none "
            "(fake it, or mark the test @pytest.mark.spawns to keep it out of make test-fast)"
        )

    # The CLI starts the forkserver of a local job's ranks before it checks the config (their
    # imports overlap); a unit test reaching it launches nothing, so there is nothing to start.
    monkeypatch.setattr(forkserver, "start_forkserver", lambda *a, **k: None)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", refuse)  # forkserver, trackers
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    if hasattr(os, "posix_spawn"):
        monkeypatch.setattr(os, "posix_spawn", refuse)


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch):
    """``parse(*flags)``: the RunConfig ``cloudburst train *flags`` would launch."""
    seen: list[RunConfig] = []
    monkeypatch.setattr(cli, "cmd_train", lambda args: seen.append(cli.build_config(args)) or 0)

    def run(*flags: str) -> RunConfig:
        assert cli.main(["train", *flags]) == 0
        return seen.pop()

    return run


@pytest.fixture
def record(tmp_path):
    """A factory of shared NIC records (closed at the end; their files live in tmp_path)."""
    from cloudburst.comm.nic import NicState

    opened: list[NicState] = []

    def make(num_nodes: int, name: str = "nic") -> NicState:
        opened.append(NicState(str(tmp_path / name), num_nodes))
        return opened[-1]

    yield make
    for nic in opened:
        nic.close()
