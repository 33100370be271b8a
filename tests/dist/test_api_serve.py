"""One way to serve a shard: a shard started through the Python API (``Job.serve``) resumes
from its checkpoint exactly as one started by the CLI does."""

from __future__ import annotations

import pytest
import torch

import cloudburst
from cloudburst.data import synthetic
from cloudburst.models import build_model
from cloudburst.records.checkpoint import load_checkpoint
from tests.helpers import cli, final_record, rank_events, spawn

pytestmark = pytest.mark.dist

# n_sync 1: a push every step (the versions below count steps)
FLAGS = dict(strategy="asgd", workers=1, servers=1, dataset="synthetic", model="mlp", seed=0,
             batch_size=16, n_sync=1)  # fmt: skip


def _api_job(rank: int, out: str) -> int | None:
    cfg = cloudburst.RunConfig(**FLAGS, steps=10, out=out, resume=True, checkpoint_every=0)
    model = build_model("mlp", (40,), 10, seed=0)
    with cloudburst.Job(cfg) as job:
        if job.is_server:
            final = job.serve(model)
            return None if final is None else 1
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        net = job.wrap(model, optimizer)
        data = synthetic(400, 100)
        for i in range(10):
            x, y = data.x_train[16 * i : 16 * (i + 1)], data.y_train[16 * i : 16 * (i + 1)]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
    return 0


def test_a_shard_served_through_the_api_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    cli("train", "--strategy", "asgd", "--workers", "1", "--servers", "1", "--dataset",
        "synthetic", "--model", "mlp", "--batch-size", "16", "--steps", "30", "--n-sync", "1",
        "--checkpoint-every", "5", "--no-progress", "--out", str(out))  # fmt: skip
    saved = load_checkpoint(out / "checkpoints" / "server0.pt", "server-shard")
    assert saved["version"] >= 25
    assert spawn(_api_job, 2, tmp_path, str(out)) == [1, 0]
    resumed = rank_events(out, 0, "resume")
    assert [r["version"] for r in resumed] == [saved["version"]]  # continued, not restarted
    # and applied the API worker's pushes
    assert final_record(out, 0)["version"] == saved["version"] + 10
