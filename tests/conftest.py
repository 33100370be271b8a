"""Test tiers, by directory.

``tests/unit`` tests start no processes and fake the comm layer; they are marked ``unit`` here
and are what ``make test-fast`` runs (the inner loop, 30 s on 2 cores). A unit test that must
start processes (DataLoader workers, say) is marked ``spawns``, and one that trains for a
while on the virtual cluster (about a CPU-second or more: the learning runs, the W = 64/256
byte sweep) ``slow``; both are left to ``make test`` (``make mutation`` runs the slow ones
too). ``tests/dist`` and ``tests/e2e`` mark themselves (``dist``, ``e2e``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

UNIT_DIR = Path(__file__).resolve().parent / "unit"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "unit: starts no processes, comm faked (tests/unit)")
    config.addinivalue_line(
        "markers", "spawns: a tests/unit test that starts processes (not in make test-fast)"
    )
    config.addinivalue_line(
        "markers", "slow: a tests/unit test of about a CPU-second or more (not in make test-fast)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if UNIT_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Every test ends with the environment it started with: a variable a test left set
    (``CLOUDBURST_LOCAL_JOB``, which the CLI sets for its forkserver, say) would reach the
    jobs of tests run after it in the same test process."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
