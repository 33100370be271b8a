"""No single point of failure and no long hangs: a killed or hung parameter-server shard (the
first one included) stops the whole job through the watchdogs' heartbeat expiry (``peer_lost``
records naming the silent rank), with a summary that names it, intact checkpoints and a
working ``--resume`` command; a hung lockstep worker is restarted; two jobs run side by side."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from cloudburst.records.checkpoint import load_checkpoint
from cloudburst.records.metrics import read_jsonl
from tests.e2e.instrumented import QUIET, session_processes
from tests.support import (
    BOUND_S,
    cli,
    finish_job,
    rank_records,
    read_summary,
    start_job,
    wait_running,
    wait_until,
)

pytestmark = pytest.mark.e2e

ASGD = ("--strategy", "asgd", "--workers", "2", "--servers", "2", "--n-sync", "2")
LIVENESS = ("--heartbeat-timeout-s", "3", "--checkpoint-every", "10")


def _pid(out: Path, rank: int, proc: subprocess.Popen) -> int:
    """The pid rank ``rank`` logged, once a checkpoint of every worker exists."""
    saved = lambda: len(list((out / "checkpoints").glob("worker*-step*.pt"))) >= 2  # noqa: E731
    wait_running(proc, saved, "checkpoints", BOUND_S, 0.1)
    [start] = [r for r in rank_records(out, rank) if r["event"] == "start"]
    return start["pid"]


def _lost_records(out: Path) -> dict[int, str]:
    """rank -> the reason its watchdog recorded."""
    records = [r for p in (out / "metrics").glob("rank*.jsonl") for r in read_jsonl(p)]
    return {r["rank"]: r["reason"] for r in records if r["event"] == "peer_lost"}


@pytest.mark.parametrize(("sig", "rank"), [(signal.SIGKILL, 1), (signal.SIGSTOP, 0)])
def test_a_lost_shard_stops_the_job_with_a_summary_and_a_resume_command(tmp_path, sig, rank):
    """SIGKILL of shard 1; SIGSTOP of shard 0 (rank 0). The printed ``--resume`` command is
    run once, after the kill: both leave the same complete checkpoints (each loaded here)."""
    out = tmp_path / "run"
    proc = start_job([*ASGD, *QUIET, *LIVENESS, "--steps", "2000", "--min-step-time-s", "0.01",
                   "--out", str(out)])  # fmt: skip
    os.kill(_pid(out, rank, proc), sig)
    _, stderr = finish_job(proc, BOUND_S)
    assert proc.returncode == 1, stderr
    summary, who = read_summary(out), f"server shard {rank} (rank {rank}) lost"
    assert re.fullmatch(re.escape(who) + r" at [0-9.]+ s", summary["failed"])
    # Every other rank's watchdog found the same silent shard (heartbeat expiry).
    lost = _lost_records(out)
    assert sorted(lost) == sorted({0, 1, 2, 3} - {rank})
    assert all(reason.startswith(who) for reason in lost.values())
    assert f"continue with: cloudburst train --resume {out}" in stderr
    assert summary["resume_command"] == f"cloudburst train --resume {out}"
    for name in summary["checkpoints"]:
        load_checkpoint(out / name)  # complete and valid
    # every process of the job ends, the hung shard too
    wait_until(lambda: not session_processes(proc.pid), 30, "the job's processes to end")
    if sig == signal.SIGKILL:  # (the same checkpoints either way: one resume is enough)
        done = max(summary["steps_done"].values())
        cli("train", "--resume", str(out), "--steps", str(done + 40), "--no-progress")
        resumed = read_summary(out)
        assert "failed" not in resumed and resumed["final_test_accuracy"] > 0.5


def test_a_hung_lockstep_worker_is_found_and_the_job_restarts(tmp_path):
    out = tmp_path / "run"
    cli("train", "--strategy", "sync", "--workers", "3", *QUIET, *LIVENESS, "--steps", "60",
        "--max-restarts", "1", "--inject-fault", "stop:2@25", "--out", str(out))  # fmt: skip
    summary = read_summary(out)
    assert "failed" not in summary and summary["steps_per_worker"] == 60
    lost = _lost_records(out)
    assert lost and all(r.startswith("worker 2 (rank 2) lost") for r in lost.values())
    resumes = [r for r in read_jsonl(out / "metrics" / "rank0.jsonl") if r["event"] == "resume"]
    assert [r["step"] for r in resumes] == [20]  # the last checkpoint before the fault


def test_two_jobs_on_one_machine_do_not_interfere(tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [
        start_job([*ASGD, *QUIET, "--steps", "150", "--out", str(outs[0])]),
        start_job(["--strategy", "sync", "--workers", "2", *QUIET, "--steps", "150",
                "--out", str(outs[1])]),
    ]  # fmt: skip
    for proc in procs:
        _, stderr = finish_job(proc, BOUND_S)
        assert proc.returncode == 0, stderr
    a, b = (read_summary(o) for o in outs)
    assert (a["strategy"], b["strategy"]) == ("asgd", "sync")
    assert a["final_test_accuracy"] > 0.5 and b["final_test_accuracy"] > 0.5
    assert a["lost_workers"] == b["lost_workers"] == []
    assert json.loads((outs[0] / "config.json").read_text())["out"] == str(outs[0])
