"""Asynchronous DiLoCo in real runs (gloo, 2 workers, 2 shards): workers push every H_i inner
steps (DyLU), the shards run Delayed Nesterov with its state (and DC-ASGD's ring) in their
checkpoints; a SIGKILLed shard fails over to its standby (``--shard-standby``) with no
acknowledged push lost, or restarts in place from its checkpoint (``--max-restarts``)."""

from __future__ import annotations

import pytest

from cloudburst.records.checkpoint import load_checkpoint
from tests.e2e.instrumented import check_shard_restarted
from tests.support import (
    BOUND_S,
    final_record,
    finish_job,
    read_summary,
    start_job,
    survives_a_shard_kill,
)

pytestmark = pytest.mark.e2e

# The failover runs' length: the kill lands at a version of ~30 of ~95, with ~110 steps of
# at least 8 ms left to the fast worker (to push again, and reconnect, after the kill).
STEPS = 150
RUN = (
    "--strategy", "async_diloco", "--workers", "2", "--servers", "2", "--period", "4",
    "--optimizer", "adam", "--lr", "0.003", "--straggler", "1:2", "--dylu",
    "--dataset", "synthetic", "--model", "mlp", "--batch-size", "16", "--no-progress",
    "--heartbeat-timeout-s", "5", "--checkpoint-every", "10", "--push-log-every", "1",
    "--min-step-time-s", "0.008",
    # a stalled wait fails the job in one line well inside BOUND_S (the default: 300 s)
    "--comm-timeout-s", "60",
)  # fmt: skip


def test_a_real_run_pushes_per_dylu_and_checkpoints_the_outer_state(tmp_path):
    out = tmp_path / "run"
    steps = 60
    proc = start_job([*RUN, "--shard-standby", "--steps", str(steps), "--staleness-compensation",
                      "dc", "--out", str(out)])  # fmt: skip
    _, stderr = finish_job(proc, BOUND_S)
    assert proc.returncode == 0, stderr
    summary = read_summary(out)
    assert summary["strategy"] == "async_diloco" and summary["final_test_accuracy"] >= 0.9
    # Each worker pushes to both shards after each round; its rounds (H_i each) add up to its
    # steps; the first runs H = 4 (nothing measured yet). Then worker 1, 2x slower, runs
    # mostly H_1 = 2 (real time: the rule's exact H per round is the unit test's).
    rounds = [final_record(out, rank)["inner_steps_rounds"] for rank in (2, 3)]
    assert [sum(h * n for h, n in r) for r in rounds] == [steps, steps]
    assert rounds[0][0][0] == rounds[1][0][0] == 4
    assert all(1 <= h <= 4 for r in rounds for h, _ in r)
    # the slow worker runs shorter rounds, so more of them (real time: only the direction)
    assert sum(n for _, n in rounds[1]) > sum(n for _, n in rounds[0]), rounds
    pushes = sum(n for r in rounds for _, n in r)
    assert summary["shard_versions"] == [pushes, pushes]
    assert summary["staleness_compensation"] == "dc"
    assert sum(summary["staleness_histogram_versions"].values()) == 2 * pushes
    for k in (0, 1):
        state = load_checkpoint(out / "checkpoints" / f"server{k}.pt", "server-shard")
        assert state["version"] == pushes
        assert state["optimizer"]["t"] == pushes  # Delayed Nesterov's push count
        assert state["optimizer"]["momentum"].abs().sum() > 0
        assert state["compensator"]["ring_versions"][-1] == pushes


def test_a_killed_shard_fails_over_to_its_standby_with_no_push_lost(tmp_path):
    out = tmp_path / "run"
    # gap-aware compensation: the standby's ring and running mean C are its own copy's; a
    # ring of 64 versions (default 8): a loaded machine may see more pushes in one round
    flags = ["--staleness-compensation", "gap", "--compensation-window", "64"]
    survives_a_shard_kill([*RUN, "--shard-standby", *flags, "--steps", str(STEPS)], out)
    summary = read_summary(out)
    assert "failed" not in summary and summary["lost_workers"] == []
    assert (summary["shard_failovers"], summary["pushes_lost"]) == (1, 0)
    assert summary["staleness_compensation"] == "gap" and summary["compensation_clamped"] == 0
    # The standby applied every forwarded push through its own Delayed Nesterov: both shards
    # end with every push (but at most one per worker in flight at the kill).
    pushes = sum(n for rank in (2, 3) for _, n in final_record(out, rank)["inner_steps_rounds"])
    assert summary["shard_versions"][0] == pushes
    assert pushes - 2 <= summary["shard_versions"][1] <= pushes
    assert summary["final_test_accuracy"] >= 0.9


def test_a_killed_shard_restarts_in_place_with_its_delayed_nesterov_state(tmp_path):
    """--max-restarts 1, no standby: shard 1 is SIGKILLed after a checkpoint, its agent restarts
    it from that checkpoint (θ, the version clock and Delayed Nesterov's m, a, t), the workers
    reconnect to it unrestarted, and the pushes it had acknowledged since are pushes_lost."""
    out = tmp_path / "run"
    survives_a_shard_kill([*RUN, "--max-restarts", "1", "--steps", str(STEPS)], out)
    summary, _, _, after = check_shard_restarted(out)
    pushes = sum(n for rank in (2, 3) for _, n in final_record(out, rank)["inner_steps_rounds"])
    # Shard 0 applied every push; shard 1 all but those lost (and at most one per worker in
    # flight at the kill, never acknowledged).
    assert summary["shard_versions"][0] == pushes
    assert summary["shard_versions"][1] == after[-1]["version"]
    assert pushes - summary["pushes_lost"] - 2 <= summary["shard_versions"][1] <= pushes
    # Delayed Nesterov's state came back from the checkpoint: its push count t goes on from
    # the restored one (a fresh optimizer would count only the pushes since the restart).
    state = load_checkpoint(out / "checkpoints" / "server1.pt", "server-shard")
    assert state["version"] == summary["shard_versions"][1]
    assert state["optimizer"]["t"] == state["version"] > len(after)
    assert state["optimizer"]["momentum"].abs().sum() > 0
