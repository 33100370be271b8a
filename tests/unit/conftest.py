"""Unit tests start no processes: an unmarked one that tries fails, naming the way out."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("spawns"):
        return

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} started a process; unit tests start none "
            "(fake it, or mark the test @pytest.mark.spawns to keep it out of make test-fast)"
        )

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    if hasattr(os, "posix_spawn"):
        monkeypatch.setattr(os, "posix_spawn", refuse)
