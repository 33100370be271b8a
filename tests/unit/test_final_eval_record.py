"""The final evaluation record (cloudburst.loop.summary.finalize_run) carries ``train_time_s`` and
``eval_s`` as every evaluation record does: the clock less the time the evaluating worker
spent on its evaluations during training, wherever that worker's report comes from."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from cloudburst.comm.flat import flatten_params
from cloudburst.config import RunConfig
from cloudburst.data import synthetic
from cloudburst.loop.summary import finalize_run
from cloudburst.models import build_model
from cloudburst.records.metrics import MetricsWriter, read_jsonl
from tests.support import FakeNamespace

pytestmark = pytest.mark.unit


class TickingClock:
    """Moves 0.25 s each time it is read: the final evaluation takes 0.25 s."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        self.t += 0.25
        return self.t


def worker_report(eval_time_s: float | None) -> dict:
    report = {"role": "worker", "samples": 640, "sent_bytes": 0, "received_bytes": 0}
    report["comm_wait_s"] = 0.0
    if eval_time_s is not None:
        report["eval_time_s"] = eval_time_s
    return report


def final_record(tmp_path, own_report: dict, others: dict[int, dict], servers: int = 0) -> dict:
    cfg = RunConfig(strategy="asgd" if servers else "sync", workers=2, servers=servers,
                    dataset="synthetic", train_size=256, test_size=32, model="mlp",
                    out=str(tmp_path))  # fmt: skip
    store = dist.HashStore()
    for rank, report in others.items():
        store.set(f"stats/{rank}", json.dumps(report))
    ctx = FakeNamespace(
        cfg=cfg,
        is_server=bool(servers),
        store=store,
        world_size=2 + servers,
        topology=None,
        device=torch.device("cpu"),
        comm=TickingClock(),
        backend="gloo",
        num_nodes=1,
    )
    data = synthetic(256, 32)
    model = build_model("mlp", data.input_shape, data.num_classes, 0)
    metrics = MetricsWriter(tmp_path, 0, "worker0")
    theta = flatten_params(model)
    finalize_run(ctx, model, theta, data, metrics, own_report, [], 10.0, 1280)
    metrics.close()
    evals = [r for r in read_jsonl(tmp_path / "metrics" / "rank0.jsonl") if r["event"] == "eval"]
    assert len(evals) == 1 and evals[0]["final"] is True
    return evals[0]


def test_final_record_leaves_out_rank0_evaluators_time(tmp_path) -> None:
    # sync: worker 0 is rank 0, the evaluator; it spent 1.5 s evaluating during training.
    record = final_record(tmp_path, worker_report(1.5), {1: worker_report(0.0)})
    assert record["time_s"] == pytest.approx(10.0)
    assert record["train_time_s"] == pytest.approx(8.5)
    assert record["eval_s"] == pytest.approx(0.25)


def test_final_record_takes_the_evaluators_time_from_its_report(tmp_path) -> None:
    # asgd: rank 0 is the server; the evaluator (worker 0, rank 1) handed its report in.
    server = {"role": "server", "sent_bytes": 0, "received_bytes": 0, "comm_wait_s": 0.0}
    server |= {"staleness_max_versions": 0, "version": 3, "shard": 0}
    others = {1: worker_report(2.0), 2: worker_report(0.0)}
    record = final_record(tmp_path, server, others, servers=1)
    assert record["train_time_s"] == pytest.approx(8.0)
    assert record["eval_s"] == pytest.approx(0.25)
