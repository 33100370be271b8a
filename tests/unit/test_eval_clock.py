"""Every eval record's ``train_time_s`` (Evaluator, finalize_run) is the job's clock less the
evaluator's earlier evaluations, wherever its report comes from; asgd/easgd's evaluator keeps
scoring the servers' θ until every other worker is done or lost (evaluate_while_others_train)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cloudburst.comm.flat import flatten_params
from cloudburst.config import RunConfig
from cloudburst.data import synthetic
from cloudburst.loop.evaluator import Evaluator, evaluate_while_others_train, steps_over_key
from cloudburst.loop.summary import finalize_run
from cloudburst.models import build_model
from cloudburst.records.metrics import MetricsWriter
from tests.support import (
    FakeNamespace,
    ThreadComm,
    ThreadGroup,
    rank_events,
    read_summary,
    simulated,
)


class SlowFetch:
    """A strategy whose snapshot of the global model takes ``cost_s`` on the clock."""

    def __init__(self, comm: ThreadComm, model: torch.nn.Module, cost_s: float) -> None:
        self.comm, self.model, self.cost_s = comm, model, cost_s

    def fetch_global_params(self):
        self.comm.clock += self.cost_s
        return flatten_params(self.model), 64


def make(tmp_path, cost_s: float):
    comm = ThreadComm(ThreadGroup(1), 0)  # tick 0: reads 0 s until moved
    cfg = SimpleNamespace(
        metrics=SimpleNamespace(eval_every_s=1.0), model=SimpleNamespace(autocast="none")
    )
    ctx = SimpleNamespace(cfg=cfg, comm=comm, device=torch.device("cpu"))
    ctx.elapsed_s = comm.now
    data = synthetic(64, 32)
    model = build_model("mlp", data.input_shape, data.num_classes, 0)
    metrics = MetricsWriter(tmp_path, 0, "worker0")
    evaluator = Evaluator(ctx, model, data, metrics)
    return comm, evaluator, SlowFetch(comm, model, cost_s), metrics


def test_train_time_leaves_out_every_earlier_evaluation_also_after_a_resume(tmp_path) -> None:
    comm, evaluator, strategy, metrics = make(tmp_path, cost_s=0.25)
    evaluator.maybe_eval(strategy, force=True)  # at 0 s: costs 0.25 s
    for _ in range(3):
        comm.clock += 1.5  # training between evaluations
        evaluator.maybe_eval(strategy)
    comm.clock += 0.5
    evaluator.maybe_eval(strategy)  # not due: 0.5 s since the last
    metrics.close()
    records = rank_events(tmp_path, 0, "eval")
    assert [r["time_s"] for r in records] == pytest.approx([0.0, 1.75, 3.5, 5.25])
    # Training time: 1.5 s between evaluations, whatever they cost.
    assert [r["train_time_s"] for r in records] == pytest.approx([0.0, 1.5, 3.0, 4.5])
    assert [r["eval_s"] for r in records] == pytest.approx([0.25] * 4)
    assert evaluator.eval_s == pytest.approx(1.0)
    # The history (summary.json's evals, checkpoints) keeps the job's clock.
    assert [h[0] for h in evaluator.history] == pytest.approx([0.0, 1.75, 3.5, 5.25])
    # Resumed from a checkpoint at 3 s, the clock continues from its elapsed time, less the
    # two evaluations before it (read back from the metrics); those after it are redone.
    comm2, resumed, strategy2, metrics2 = make(tmp_path, cost_s=0.25)
    comm2.clock = 3.0
    resumed.restore_clock(3.0)
    assert resumed.eval_s == pytest.approx(0.5)
    resumed.maybe_eval(strategy2, force=True)
    metrics2.close()
    assert rank_events(tmp_path, 0, "eval")[-1]["train_time_s"] == pytest.approx(2.5)


# ---------------------------------------------------------------------------- the final record
class TickingClock:
    """Moves 0.25 s each time it is read: the final evaluation takes 0.25 s."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        self.t += 0.25
        return self.t


def worker_report(eval_s: float) -> dict:
    report = {"role": "worker", "samples": 640, "sent_bytes": 0, "received_bytes": 0}
    return {**report, "comm_wait_s": 0.0, "eval_time_s": eval_s}


def final_record(tmp_path, own_report: dict, others: dict[int, dict], servers: int = 0) -> dict:
    cfg = RunConfig(strategy="asgd" if servers else "sync", workers=2, servers=servers,
                    dataset="synthetic", train_size=256, test_size=32, model="mlp",
                    out=str(tmp_path))  # fmt: skip
    store = dist.HashStore()
    for rank, report in others.items():
        store.set(f"stats/{rank}", json.dumps(report))
    ctx = FakeNamespace(cfg=cfg, is_server=bool(servers), store=store, world_size=2 + servers,
                        topology=None, device=torch.device("cpu"), comm=TickingClock(),
                        backend="gloo", num_nodes=1)  # fmt: skip
    data = synthetic(256, 32)
    model = build_model("mlp", data.input_shape, data.num_classes, 0)
    metrics = MetricsWriter(tmp_path, 0, "worker0")
    finalize_run(ctx, model, flatten_params(model), data, metrics, own_report, [], 10.0, 1280)
    metrics.close()
    [record] = rank_events(tmp_path, 0, "eval")
    assert record["final"] is True
    return record


def test_the_final_record_leaves_out_the_evaluators_time_wherever_its_report_is(tmp_path):
    # sync: worker 0 is rank 0, the evaluator; it spent 1.5 s evaluating during training.
    record = final_record(tmp_path / "sync", worker_report(1.5), {1: worker_report(0.0)})
    got = (record["time_s"], record["train_time_s"], record["eval_s"])
    assert got == pytest.approx((10.0, 8.5, 0.25))
    # asgd: rank 0 is the server; the evaluator (worker 0, rank 1) handed its report in.
    server = {"role": "server", "sent_bytes": 0, "received_bytes": 0, "comm_wait_s": 0.0}
    server |= {"staleness_max_versions": 0, "version": 3, "shard": 0}
    others = {1: worker_report(2.0), 2: worker_report(0.0)}
    record = final_record(tmp_path / "asgd", server, others, servers=1)
    assert (record["train_time_s"], record["eval_s"]) == pytest.approx((8.0, 0.25))


# ------------------------------------------------------------- after the evaluator's last step
class Job:
    """Ranks 0 (server), 1 (the evaluator), 2 and 3 (workers). ``finishes[r]``: the poll at
    which rank r's steps end (0: before the first); ``dies[r]``: the poll from which its
    heartbeat is silent for longer than the timeout."""

    def __init__(self, finishes: dict[int, int], dies: dict[int, int] | None = None):
        self.store = dist.HashStore()
        self.finishes, self.dies = finishes, dies or {}
        for rank in (r for r, poll in finishes.items() if poll == 0):  # over before the first
            self.store.set(steps_over_key(rank), "1")
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


@pytest.mark.parametrize(
    "finishes, dies, evaluations",
    [
        ({2: 3, 3: 5}, {}, [0, 1, 2, 3, 4]),  # at poll 5 both are done: no more evaluation
        ({2: 2}, {3: 4}, [0, 1, 2, 3]),  # a lost worker ends the wait
        ({2: 0, 3: 0}, {}, []),  # nothing to wait for when the others are done
    ],
)
def test_evaluates_until_every_other_worker_is_done_or_lost(finishes, dies, evaluations) -> None:
    job = Job(finishes, dies)
    job.run()
    assert job.evaluations == evaluations


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["easgd", "--easgd-tau", "2"], ["asgd", "--n-sync", "2"]])
def test_the_evaluator_finishing_first_keeps_evaluating_the_servers(tmp_path, strategy) -> None:
    # Worker 1 is 4x slower: the evaluator (rank 1) ends its 60 steps at ~1.2 virtual s, the job
    # at ~4.9 s; the servers' θ trains on (asgd: each evaluation fetches it anew).
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
