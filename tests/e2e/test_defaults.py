"""The defaults train, and ``cloudburst compare`` compares: every strategy at its defaults
(shortened only in epochs), 4 workers, one ``compare`` call, its table and plot.

The floors are what 6 epochs reached on seeds 0-2 (benchmarks/results/defaults.md), less 0.05;
chance is 10 %. The asynchronous strategies, whose real interleaving varies with the load, are
held to theirs on the virtual cluster (deterministic); their real runs are checked for
everything but the accuracy."""

from __future__ import annotations

import pytest

from tests.support import cli, read_summary, simulated

pytestmark = pytest.mark.e2e

# The asynchronous strategies' on the virtual cluster (`cloudburst simulate`, --step-time-s 0.01)
FLOORS = {
    "sync": 0.445 - 0.05,
    "asgd": 0.226 - 0.05,
    "easgd": 0.424 - 0.05,
    "gossip": 0.430 - 0.05,
    "local_sgd": 0.424 - 0.05,
    "diloco": 0.464 - 0.05,
    "daso": 0.458 - 0.05,
}
ASYNCHRONOUS = ("asgd", "easgd", "gossip")


def test_every_strategy_learns_with_its_defaults_and_compare_reports_them(tmp_path):
    out = tmp_path / "cmp"
    proc = cli("compare", "--runs", *FLOORS, "--workers", "4", "--epochs", "6", "--out", str(out))
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["run", "strategy", "W", "S"]
    assert [line.split()[0] for line in lines[1:]] == list(FLOORS)
    for strategy, floor in FLOORS.items():
        summary = read_summary(out / strategy)
        config = summary["config"]
        assert (config["lr"], config["momentum"], config["epochs"]) == (0.1, 0.9, 6.0)
        assert summary["servers"] == (1 if strategy in ("asgd", "easgd") else 0)
        accuracy = summary["final_test_accuracy"]
        if strategy in ASYNCHRONOUS:  # its real interleaving depends on the load
            args = ["--strategy", strategy, "--workers", "4", "--epochs", "6", "--no-progress"]
            run = simulated([*args, "--out", str(tmp_path / strategy)])
            accuracy = read_summary(run)["final_test_accuracy"]
        assert accuracy >= floor, (strategy, accuracy)
    assert read_summary(out / "asgd")["config"]["server_lr"] == 0.25  # λ = 1/W
    assert read_summary(out / "diloco")["config"]["diloco_outer_lr"] == 0.5  # over SGD
    assert "warning" not in proc.stderr  # no default is a known-bad combination
    # The progress of a non-interactive run is a few lines, never a redrawn bar.
    assert "\r" not in proc.stderr
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out / "summary.md").read_text().count("\n- ") == len(FLOORS)
