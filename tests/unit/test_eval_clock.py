"""Evaluation off the clock: each eval record's ``train_time_s`` is the job's clock less the
time worker 0 spent evaluating before it (cloudburst.loop.evaluator.Evaluator), on a fake
clock: a one-rank ``tests.support.ThreadComm`` whose clock moves only when told (the
evaluation's cost is added by the strategy's fetch below, which stands for the whole
evaluation)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cloudburst.comm.flat import flatten_params
from cloudburst.data import synthetic
from cloudburst.loop.evaluator import Evaluator
from cloudburst.models import build_model
from cloudburst.records.metrics import MetricsWriter, read_jsonl
from tests.support import ThreadComm, ThreadGroup


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


def evals(tmp_path) -> list[dict]:
    return [r for r in read_jsonl(tmp_path / "metrics" / "rank0.jsonl") if r["event"] == "eval"]


def test_train_time_leaves_out_every_earlier_evaluation(tmp_path) -> None:
    comm, evaluator, strategy, metrics = make(tmp_path, cost_s=0.25)
    evaluator.maybe_eval(strategy, force=True)  # at 0 s: costs 0.25 s
    for _ in range(3):
        comm.clock += 1.5  # training between evaluations
        evaluator.maybe_eval(strategy)
    comm.clock += 0.5
    evaluator.maybe_eval(strategy)  # not due: 0.5 s since the last
    metrics.close()
    records = evals(tmp_path)
    assert [r["time_s"] for r in records] == pytest.approx([0.0, 1.75, 3.5, 5.25])
    # Training time: 1.5 s between evaluations, whatever they cost.
    assert [r["train_time_s"] for r in records] == pytest.approx([0.0, 1.5, 3.0, 4.5])
    assert [r["eval_s"] for r in records] == pytest.approx([0.25] * 4)
    assert evaluator.eval_s == pytest.approx(1.0)
    # The history (summary.json's evals, checkpoints) keeps the job's clock.
    assert [h[0] for h in evaluator.history] == pytest.approx([0.0, 1.75, 3.5, 5.25])


def test_a_resumed_evaluator_continues_the_training_clock(tmp_path) -> None:
    comm, evaluator, strategy, metrics = make(tmp_path, cost_s=0.25)
    evaluator.maybe_eval(strategy, force=True)
    comm.clock += 1.5
    evaluator.maybe_eval(strategy)  # at 1.75 s; a checkpoint at 3 s, then evaluations lost
    comm.clock += 1.5
    evaluator.maybe_eval(strategy)  # at 3.5 s: after the checkpoint (redone on resume)
    metrics.close()
    comm2, resumed, strategy2, metrics2 = make(tmp_path, cost_s=0.25)
    comm2.clock = 3.0  # the resumed clock continues from the checkpoint's elapsed time
    resumed.restore_clock(3.0)
    assert resumed.eval_s == pytest.approx(0.5)  # the two evaluations before 3 s
    resumed.maybe_eval(strategy2, force=True)
    metrics2.close()
    assert evals(tmp_path)[-1]["train_time_s"] == pytest.approx(2.5)
