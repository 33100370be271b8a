"""``--max-train-time-s`` on a real gloo job: two DiLoCo workers, whose steps the emulated
device makes take real time, end by the budget long before their steps run out, at the same
step (they all-reduce worker 0's training clock to agree on it), and finish cleanly."""

import pytest

from tests.support import cli, rank_events, read_summary

pytestmark = pytest.mark.e2e

BUDGET_S = 1.5
STEPS = 100_000  # far more than the budget allows


def test_lockstep_workers_stop_by_the_budget_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    cli(
        "train", "--strategy", "diloco", "--workers", "2", "--period", "4",
        "--dataset", "synthetic", "--model", "mlp", "--no-progress", "--eval-every-s", "0.5",
        "--steps", str(STEPS), "--min-step-time-s", "0.02",
        "--max-train-time-s", str(BUDGET_S), "--out", str(out),
    )  # fmt: skip
    summary = read_summary(out)
    assert summary["stopped_by"] == "time_budget"
    assert summary["max_train_time_s"] == BUDGET_S
    assert summary["train_time_s"] >= BUDGET_S
    done = summary["steps_done"]
    assert set(done) == {"0", "1"} and done["0"] == done["1"] < STEPS
    for rank in (0, 1):  # each rank's last step record is the agreed step
        assert rank_events(out, rank, "step")[-1]["step"] == done["0"]
    assert summary["final_test_accuracy"] is not None


def test_a_restarted_job_counts_the_training_time_of_its_first_attempt(tmp_path):
    # Worker rank 1 dies after step 41 (~0.8 s of a 3 s budget at 20 ms a step); the job
    # restarts from step 40's checkpoint, whose clock it continues: the second attempt trains
    # what is left of the budget, not a fresh 3 s.
    out, budget_s = tmp_path / "run", 3.0
    cli(
        "train", "--strategy", "sync", "--workers", "2", "--dataset", "synthetic",
        "--model", "mlp", "--no-progress", "--eval-every-s", "60", "--steps", str(STEPS),
        "--min-step-time-s", "0.02", "--checkpoint-every", "20", "--max-restarts", "1",
        "--inject-fault", "kill:1@41", "--max-train-time-s", str(budget_s), "--out", str(out),
        "--log-every-steps", "1",
    )  # fmt: skip
    summary = read_summary(out)
    assert summary["stopped_by"] == "time_budget" and summary["train_time_s"] >= budget_s
    (resume,) = rank_events(out, 0, "resume")
    assert resume["step"] == 40
    steps = rank_events(out, 0, "step")  # both attempts' records, every step
    assert steps[-1]["step"] == summary["steps_done"]["0"] == summary["steps_done"]["1"]
    # The second attempt's clock continues from its checkpoint's, read at step 40 after step
    # 39's record (step 40's own comes after the save, which may be slow) ...
    before_s = next(r["time_s"] for r in steps if r["step"] == 39)
    after = [r for r in steps if r["step"] > 40]
    retried = [r for r in after if r["step"] == 41][-1]  # the step the kill cut, made again
    assert retried["time_s"] > before_s
    # ... and it stops at the first check past the budget on that clock: a handful of steps,
    # where a fresh budget would train > 30 more (the check spacing halves what is left).
    past = [r["step"] for r in after if r["time_s"] >= budget_s]
    assert 1 <= len(past) <= 10, past
