"""A killed asgd/easgd worker, restarted by its agent (``--max-restarts``), rejoins the running
job: the servers serve it on a group of its own and wait for it to finish."""

import pytest

from cloudburst.metrics import read_jsonl
from tests.helpers import cli, read_summary

pytestmark = pytest.mark.e2e

STEPS = 200
BATCH = 64  # the default batch size


def _events(out, rank):
    return read_jsonl(out / "metrics" / f"rank{rank}.jsonl")


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

    # the victim: a second process, resumed from its step-20 checkpoint (it died after step
    # 30, before that step's checkpoint), trained on to the last step
    events = _events(out, victim)
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    assert len(starts) == 2, proc.stderr
    first, second = events[: starts[1]], events[starts[1] :]
    assert first[0]["pid"] != second[0]["pid"]
    assert [e["step"] for e in first if e["event"] == "checkpoint"] == [10, 20]
    assert [e["step"] for e in first if e["event"] == "step"] == [10, 20]
    resumes = [e for e in second if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 20 and resumes[0]["attempt"] == 1
    steps = [e["step"] for e in second if e["event"] == "step"]
    assert steps == list(range(30, STEPS + 1, 10))
    final = [e for e in second if e["event"] == "final"]
    assert len(final) == 1 and final[0]["samples"] == STEPS * BATCH

    # every server admitted it once and served it to the end; the others were not disturbed
    for server in range(servers):
        records = _events(out, server)
        rejoins = [(e["worker"], e["incarnation"]) for e in records if e["event"] == "rejoin"]
        assert rejoins == [(victim, 1)]
        stats = [e for e in records if e["event"] == "final"][-1]
        assert stats["rejoins"] == 1 and stats["rejoined_workers"] == [victim]
        assert stats["lost_workers"] == []
    for rank in range(servers, servers + 2):
        assert [e for e in _events(out, rank) if e["event"] == "step"][-1]["step"] == STEPS
