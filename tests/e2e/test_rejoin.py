"""A killed asgd/easgd worker, restarted by its agent (``--max-restarts``), rejoins the running
job: the servers serve it on a group of its own and wait for it to finish; one restarted after
the servers have finished is refused."""

import os
import signal
import sys
import uuid

import pytest

from tests.e2e.instrumented import kill_marked, start_marked
from tests.support import cli, free_port, rank_events, read_events, read_summary, wait_until

pytestmark = pytest.mark.e2e

STEPS = 100
BATCH = 64  # the default batch size


@pytest.mark.parametrize(
    "strategy, servers",
    # easgd with two shards: a worker's requests to both are in flight at once, as the world
    # group's are, without a deadlock between the two groups
    [("asgd", 1), ("easgd", 2)],
)
def test_a_restarted_worker_rejoins_and_trains_to_the_end(tmp_path, strategy, servers):
    out = tmp_path / "run"
    victim = servers + 2  # the third worker
    proc = cli(
        "train", "--strategy", strategy, "--workers", "3", "--servers", str(servers),
        "--n-sync", "2", "--easgd-tau", "2", "--steps", str(STEPS), "--min-step-time-s", "0.02",
        "--dataset", "synthetic", "--model", "mlp", "--checkpoint-every", "10",
        "--max-restarts", "1", "--inject-fault", f"kill:{victim}@30",
        "--inject-fault", f"nan:{victim}@5",
        # generous: the restart (a new process, data, model, checkpoint) must not look like a
        # lost worker on a loaded machine
        "--heartbeat-timeout-s", "30", "--comm-timeout-s", "60", "--eval-every-s", "60",
        "--no-progress", "--out", str(out),
        timeout_s=150,
    )  # fmt: skip
    summary = read_summary(out)
    assert summary["lost_workers"] == [], proc.stderr
    assert summary["rejoined_workers"] == [victim]
    # every worker's samples count, the rejoined one's from before its death too
    assert summary["samples"] == 3 * STEPS * BATCH

    # the victim: a second process, resumed from its step-20 checkpoint, trained to the end
    events = rank_events(out, victim)
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    assert len(starts) == 2, proc.stderr
    first, second = events[: starts[1]], events[starts[1] :]
    assert first[0]["pid"] != second[0]["pid"]
    assert [e["step"] for e in first if e["event"] == "checkpoint"] == [10, 20]
    assert [e["step"] for e in first if e["event"] == "step"] == [10, 20]
    [resume] = [e for e in second if e["event"] == "resume"]
    assert resume["step"] == 20 and resume["attempt"] == 1
    steps = [e["step"] for e in second if e["event"] == "step"]
    assert steps == list(range(30, STEPS + 1, 10))
    [final] = [e for e in second if e["event"] == "final"]
    assert final["samples"] == STEPS * BATCH
    # Its NaN step (5), skipped before it died, is counted once; the faults fired once.
    faults = [(e["kind"], e["step"]) for e in first if e["event"] == "fault"]
    assert faults == [("nan", 5), ("kill", 30)]
    assert not [e for e in second if e["event"] == "fault"]
    assert final["steps_skipped_nonfinite"] == 1
    assert summary["steps_skipped_nonfinite"] == 1 and summary["pushes_rejected"] == 0

    # every server admitted it once and served it to the end; the others were not disturbed
    for server in range(servers):
        records = rank_events(out, server)
        rejoins = [(e["worker"], e["incarnation"]) for e in records if e["event"] == "rejoin"]
        assert rejoins == [(victim, 1)]
        stats = [e for e in records if e["event"] == "final"][-1]
        assert stats["rejoins"] == 1 and stats["rejoined_workers"] == [victim]
        assert stats["lost_workers"] == []
    for rank in range(servers, servers + 2):
        assert rank_events(out, rank, "step")[-1]["step"] == STEPS


LATE_STEPS = 100


def test_a_worker_restarted_after_the_servers_finished_is_refused(tmp_path):
    """One torchrun per rank, as the README says for asgd, given a job secret file. The
    victim's agent is paused (SIGSTOP) while its worker is killed, so it can restart the
    worker only once the server has declared the worker lost and finished: the restarted
    worker is refused in one line, and the run's result stands."""
    out, token, port = tmp_path / "run", uuid.uuid4().hex, free_port()
    # The victim is killed at about step 20; the other worker then has 80 steps of >= 40 ms.
    args = ["train", "--strategy", "asgd", "--workers", "2", "--servers", "1", "--n-sync", "2",
            "--steps", str(LATE_STEPS), "--min-step-time-s", "0.04", "--dataset", "synthetic",
            "--model", "mlp", "--checkpoint-every", "10", "--heartbeat-timeout-s", "2",
            "--eval-every-s", "60", "--no-progress", "--out", str(out)]  # fmt: skip
    # Under torchrun a restarted rank rejoins only with the job secret, from a private file.
    secret = tmp_path / "job.secret"
    secret.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    secret.chmod(0o600)
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "CLOUDBURST_JOB_SECRET_FILE": str(secret)}
    logs = [tmp_path / f"agent{r}.log" for r in range(3)]
    agents = []
    try:
        for rank, log in enumerate(logs):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "3", "--node-rank",
                   str(rank), "--nproc-per-node", "1", "--rdzv-backend", "static",
                   "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts",
                   "1", "-m", "cloudburst", *args]  # fmt: skip
            agents.append(start_marked(cmd, log, token, env))
        victim = 2

        def victim_pid() -> int | None:
            records = read_events(out / "metrics" / f"rank{victim}.jsonl", growing=True)
            if any(r["event"] == "step" and r["step"] >= 20 for r in records):
                return next(r["pid"] for r in records if r["event"] == "start")
            return None

        pid = wait_until(victim_pid, 120, "the victim's step 20", interval_s=0.1)
        os.kill(agents[victim].pid, signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        # The other worker finishes; the server declares the victim lost and writes the
        # summary (its agent then waits in torch's exit barrier for the others).
        summary = out / "summary.json"
        wait_until(summary.is_file, 120, "the summary", interval_s=0.1)
        os.kill(agents[victim].pid, signal.SIGCONT)
        assert agents[victim].wait(timeout=90) != 0
    finally:
        kill_marked(token)
        for agent in agents:
            agent.wait(timeout=30)
    output = logs[victim].read_text()
    refusal = [line for line in output.splitlines() if "after the parameter servers had" in line]
    assert refusal, output
    assert f"rank {victim} was restarted after the parameter servers had finished" in refusal[0]
    summary = read_summary(out)
    assert summary["lost_workers"] == [victim] and summary["rejoined_workers"] == []
    assert [e["step"] for e in rank_events(out, 1, "step")][-1] == LATE_STEPS
