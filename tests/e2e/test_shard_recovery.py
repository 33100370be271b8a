"""A killed parameter-server shard under ``--max-restarts``: its agent restarts it, it restores
its last checkpoint, and the workers reconnect to it and go on without being restarted
themselves; the pushes it had acknowledged after that checkpoint are counted in
``pushes_lost`` exactly (the highest version a worker saw acknowledged, minus the version
restored). Real SIGKILLs in real runs; asserted through records, never timings."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.instrumented import check_shard_restarted
from tests.support import (
    BOUND_S,
    finish_job,
    kill_after_a_checkpoint,
    rank_records,
    read_summary,
    start_job,
    survives_a_shard_kill,
    wait_running,
)

pytestmark = pytest.mark.e2e

RUN = (
    "--strategy", "asgd", "--workers", "2", "--servers", "2", "--n-sync", "2",
    "--dataset", "synthetic", "--model", "mlp", "--batch-size", "16", "--no-progress",
    "--heartbeat-timeout-s", "5", "--checkpoint-every", "10", "--push-log-every", "1",
    "--steps", "140", "--min-step-time-s", "0.02",
)  # fmt: skip
# 140 steps of at least 20 ms: the kills land at a version of ~30, and the ~110 steps left
# take at least 2.2 s, the test's time to see its kill land, or the restart, before the end.
SHORT_STEPS = 85  # a push every step: the worker is killed after ~20 of them (1.3 s left)


def test_a_killed_shard_restarts_in_place_and_the_lost_pushes_are_counted(tmp_path):
    out = tmp_path / "run"
    survives_a_shard_kill([*RUN, "--max-restarts", "1"], out)
    summary, shard, restored, after = check_shard_restarted(out)
    # The dead shard had logged (--push-log-every 1) every acknowledged version but the
    # newest: a push's record is written after its reply has left (the reply does not wait on
    # the file), so a kill between the two loses the record of the one push then in hand.
    restart = [i for i, r in enumerate(shard) if r["event"] == "start"][1]
    logged_before_kill = {r["version"] for r in shard[:restart] if r["event"] == "push"}
    assert set(range(1, restored + summary["pushes_lost"])) <= logged_before_kill
    reconnects = [r for r in shard if r["event"] == "reconnect"]
    assert sorted(r["worker"] for r in reconnects) == [2, 3]
    # The final version clock: the restored version plus every push applied since.
    [final] = [r for r in shard if r["event"] == "final"]
    assert final["version"] == after[-1]["version"]


def test_a_killed_shard_fails_over_to_its_standby_with_no_push_lost(tmp_path):
    """--shard-standby, no restarts: shard 1's copy on server 0 takes it over."""
    out = tmp_path / "run"
    survives_a_shard_kill([*RUN, "--shard-standby"], out)
    summary = read_summary(out)
    assert "failed" not in summary and summary["lost_workers"] == []
    assert summary["pushes_lost"] == 0
    assert (summary["shard_failovers"], summary["shard_restarts"]) == (1, 0)
    # The standby (rank 0) took shard 1 over at the version of the last forwarded push, which
    # the dead primary had applied and logged; the workers reconnected to it, unrestarted.
    [failover] = [r for r in rank_records(out, 0) if r["event"] == "failover"]
    assert failover["shard"] == 1
    shard = rank_records(out, 1)
    assert [r["event"] for r in shard].count("start") == 1
    # (every push the primary logged was forwarded first; one forwarded may not be logged yet)
    logged = max(r["version"] for r in shard if r["event"] == "push")
    assert logged <= failover["version"] <= logged + 1
    acked = 0
    for rank in (2, 3):
        records = rank_records(out, rank)
        assert [r["event"] for r in records].count("start") == 1
        reconnected = [x for r in records for x in r.get("shard_reconnected", [])]
        assert [(x["shard"], x["version"]) for x in reconnected] == [(1, failover["version"])]
        assert reconnected[0]["acked"] <= failover["version"]  # nothing acknowledged is lost
        [final] = [r for r in records if r["event"] == "final"]
        acked += final["pushes_acked_by_shard"][1]
    # Every push a worker saw acknowledged is in shard 1's final version clock (and the
    # pushes in flight at the kill, applied and forwarded but never acknowledged: at most one
    # per worker).
    assert acked <= summary["shard_versions"][1] <= acked + 2


def test_a_worker_killed_while_it_pushes_is_lost_and_every_applied_push_is_counted(tmp_path):
    """n_sync 1 (a push every step), no restarts: SIGKILL worker rank 3 mid-run. The other
    worker finishes, the summary names rank 3 lost, and each shard's version clock is exactly
    the pushes it applied (logged one by one): those the survivor saw acknowledged, plus the
    dead worker's (a push cut off mid-transfer is never applied)."""
    out = tmp_path / "run"
    run = [*RUN, "--out", str(out)]
    run[run.index("--n-sync") + 1], run[run.index("--steps") + 1] = "1", str(SHORT_STEPS)
    proc = start_job(run)

    def pushed() -> bool:
        return sum(r["event"] == "push" and r["worker"] == 3 for r in rank_records(out, 1)) > 20

    wait_running(proc, pushed, "worker rank 3's pushes", BOUND_S)
    [start] = [r for r in rank_records(out, 3) if r["event"] == "start"]
    os.kill(start["pid"], signal.SIGKILL)
    _, stderr = finish_job(proc, BOUND_S)
    assert proc.returncode == 0, stderr
    summary = read_summary(out)
    assert "failed" not in summary and summary["lost_workers"] == [3]
    assert not any(r["event"] == "final" for r in rank_records(out, 3))
    [survivor] = [r for r in rank_records(out, 2) if r["event"] == "final"]
    assert survivor["steps"] == SHORT_STEPS
    for shard in (0, 1):
        records = rank_records(out, shard)
        applied = [r for r in records if r["event"] == "push" and r["status"] == "OK"]
        [final] = [r for r in records if r["event"] == "final"]
        assert [r["version"] for r in applied] == list(range(1, final["version"] + 1))
        by_worker = {w: sum(r["worker"] == w for r in applied) for w in (2, 3)}
        assert by_worker[2] == survivor["pushes_acked_by_shard"][shard]
        assert by_worker[3] > 0 and final["version"] == by_worker[2] + by_worker[3]
        assert final["lost_workers"] == [3]
    assert summary["shard_versions"] == [
        max(r["version"] for r in rank_records(out, k) if r["event"] == "final") for k in (0, 1)
    ]


def test_a_shard_killed_again_after_its_last_restart_ends_the_job_with_the_resume_command(tmp_path):
    """--max-restarts 1: shard 1 is restarted once; killed again, it never comes back. The
    job ends (no hang) with ``failed`` naming the shard, its checkpoints kept, and the
    ``--resume`` command in the summary and on stderr."""
    out = tmp_path / "run"
    proc = start_job([*RUN, "--max-restarts", "1", "--out", str(out)])
    kill_after_a_checkpoint(out, 1, proc)

    def restarted() -> bool:
        return any(r["event"] == "shard_restored" for r in rank_records(out, 1))

    wait_running(proc, restarted, "shard 1's restart", BOUND_S)
    starts = [r for r in rank_records(out, 1) if r["event"] == "start"]
    assert len(starts) == 2
    os.kill(starts[1]["pid"], signal.SIGKILL)
    _, stderr = finish_job(proc, BOUND_S)
    assert proc.returncode != 0
    summary = read_summary(out)
    assert "server shard 1" in summary["failed"], summary["failed"]
    assert "--resume" in summary["resume_command"] and summary["resume_command"] in stderr
    assert all((out / "checkpoints" / f"server{k}.pt").is_file() for k in (0, 1))
    # Nobody trained on: no worker logged a final record of a finished run.
    assert not any(r["event"] == "final" for rank in (2, 3) for r in rank_records(out, rank))
