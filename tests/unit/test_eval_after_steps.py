"""asgd/easgd: the evaluating worker keeps scoring the servers' θ after its own last step,
until every other worker's steps are over or it is lost (cloudburst.loop.evaluator.
evaluate_while_others_train): on a fake store, clock and liveness monitor, and in a whole
easgd run with a straggler on the virtual cluster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from cloudburst.loop.evaluator import evaluate_while_others_train, steps_over_key
from tests.helpers import rank_events, read_summary, simulated

pytestmark = pytest.mark.unit


class Job:
    """Ranks 0 (server), 1 (the evaluator), 2 and 3 (workers). ``finishes[r]``: the poll at
    which rank r's steps end; ``dies[r]``: the poll from which its heartbeat is silent for
    longer than the timeout."""

    def __init__(self, finishes: dict[int, int], dies: dict[int, int] | None = None):
        self.store = dist.HashStore()
        self.finishes, self.dies = finishes, dies or {}
        self.polls = 0
        self.evaluations: list[int] = []
        cfg = SimpleNamespace(faults=SimpleNamespace(heartbeat_timeout_s=10.0))
        self.ctx = SimpleNamespace(
            cfg=cfg, rank=1, worker_ranks=[1, 2, 3], store=self.store, comm=self
        )
        self.evaluator = SimpleNamespace(maybe_eval=lambda strategy: self.evaluations.append(
            self.polls))  # fmt: skip

    # the transport's part
    def sleep(self, seconds: float) -> None:
        self.polls += 1
        for rank, poll in self.finishes.items():
            if poll == self.polls:
                self.store.set(steps_over_key(rank), "1")

    def liveness_monitor(self, store, ranks, timeout_s):
        assert sorted(ranks) == [2, 3] and timeout_s == 10.0
        return SimpleNamespace(
            dead=lambda pending: {r for r in pending if self.polls >= self.dies.get(r, 10**9)}
        )

    def run(self) -> None:
        evaluate_while_others_train(self.ctx, self.evaluator, strategy=None)


def test_evaluates_until_every_other_worker_is_done() -> None:
    job = Job(finishes={2: 3, 3: 5})
    job.run()
    # Polls 0..4 find a worker still training; at poll 5 both are done: no more evaluation.
    assert job.evaluations == [0, 1, 2, 3, 4]


def test_a_lost_worker_ends_the_wait() -> None:
    job = Job(finishes={2: 2}, dies={3: 4})
    job.run()
    assert job.evaluations == [0, 1, 2, 3]


def test_nothing_to_wait_for_when_the_others_are_done() -> None:
    job = Job(finishes={})
    job.store.set(steps_over_key(2), "1")
    job.store.set(steps_over_key(3), "1")
    job.run()
    assert job.evaluations == []


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["easgd", "--easgd-tau", "2"], ["asgd", "--n-sync", "2"]])
def test_the_evaluator_finishing_first_keeps_evaluating_the_servers(tmp_path, strategy) -> None:
    # Worker 1 is 4x slower: worker 0 (rank 1, the evaluator) ends its 60 steps at ~1.2
    # virtual s, the job at ~4.9 s; the servers' θ trains on with worker 1's exchanges (asgd:
    # each evaluation fetches it anew, not the θ of the evaluator's last step). A test set of
    # 200: the ~16 evaluations cost no virtual time, and a fifth of the default set's CPU.
    out = simulated(
        ["--strategy", *strategy, "--workers", "2", "--straggler", "1:4", "--test-size", "200",
         "--steps", "60", "--eval-every-s", "0.3", "--out", str(tmp_path / "run")],
        step_time_s=0.02,
    )  # fmt: skip
    last_step_s = rank_events(out, 1, "step")[-1]["time_s"]
    evals = [e for e in rank_events(out, 1, "eval") if not e.get("final")]
    after = [e for e in evals if e["time_s"] > last_step_s]
    # Every eval_every_s until the straggler's steps are over (~3.6 s after worker 0's).
    assert len(after) >= 8
    samples = [e["samples"] for e in evals]
    assert samples == sorted(samples) and after[-1]["samples"] > after[0]["samples"]
    # The last one within one eval_every_s (and one poll) of worker 1's last step.
    straggler_end_s = rank_events(out, 2, "step")[-1]["time_s"]
    assert straggler_end_s - 0.3 - 0.1 < after[-1]["time_s"] <= straggler_end_s + 0.1
    assert read_summary(out)["final_test_accuracy"] is not None
