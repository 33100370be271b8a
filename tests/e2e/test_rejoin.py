"""A killed asgd worker, restarted by its agent (``--max-restarts``), rejoins the running job."""

import json

import pytest

from tests.helpers import cli, read_summary

pytestmark = pytest.mark.e2e

STEPS = 200
BATCH = 64  # the default batch size


def _events(out, rank):
    path = out / "metrics" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_restarted_asgd_worker_rejoins_and_trains_to_the_end(tmp_path):
    out = tmp_path / "run"
    proc = cli(
        "train", "--strategy", "asgd", "--workers", "3", "--servers", "1", "--n-sync", "2",
        "--steps", str(STEPS), "--min-step-time-s", "0.02", "--dataset", "synthetic",
        "--model", "mlp", "--checkpoint-every", "10", "--max-restarts", "1",
        "--inject-fault", "kill:3@30",
        # generous: the restart (a new process, data, model, checkpoint) must not look like a
        # lost worker on a loaded machine
        "--heartbeat-timeout-s", "30", "--comm-timeout-s", "60", "--eval-every-s", "60",
        "--no-progress", "--out", str(out),
        timeout_s=150,
    )  # fmt: skip
    summary = read_summary(out)
    assert summary["lost_workers"] == [], proc.stderr
    # every worker's samples count, the rejoined one's from before its death too
    assert summary["samples"] == 3 * STEPS * BATCH

    # worker rank 3: a second process, resumed from its step-20 checkpoint (it died after step
    # 30, before that step's checkpoint), trained on to the last step
    events = _events(out, 3)
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

    # the server admitted it once and served it to the end; the others were not disturbed
    server = _events(out, 0)
    assert [(e["worker"], e["incarnation"]) for e in server if e["event"] == "rejoin"] == [(3, 1)]
    stats = [e for e in server if e["event"] == "final"][-1]
    assert stats["rejoins"] == 1 and stats["rejoined_workers"] == [3]
    assert stats["lost_workers"] == []
    for rank in (1, 2):
        assert [e for e in _events(out, rank) if e["event"] == "step"][-1]["step"] == STEPS
    assert summary["samples_applied"] >= 2 * STEPS * BATCH
