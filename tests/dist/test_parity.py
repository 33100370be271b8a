"""Parity with a single-process reference: the distributed strategies compute exactly SGD."""

import pytest
import torch
from torch import nn

from cloudburst.checkpoint import load_model_into
from cloudburst.data import BatchStream, load_dataset, worker_shard
from cloudburst.models import build_model
from tests.helpers import cli

pytestmark = pytest.mark.dist

COMMON = ["--dataset", "synthetic", "--model", "cnn", "--batch-size", "16", "--lr", "0.05",
          "--momentum", "0.9", "--seed", "3", "--no-progress", "--eval-every-s", "1000"]


def reference(steps: int, workers: int, batch: int = 16, seed: int = 3) -> nn.Module:
    """Plain single-process SGD; each step sees the concatenation of the workers' batches."""
    data = load_dataset("synthetic", 4000, 1000)
    model = build_model("cnn", data.input_length, data.num_classes, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    streams = [BatchStream(*worker_shard(data, w, workers), batch, seed * 1000 + w)
               for w in range(workers)]
    for _ in range(steps):
        batches = [next(s) for s in streams]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def trained(out) -> nn.Module:
    model = build_model("cnn", 40, 10, seed=0)
    load_model_into(out / "model.pt", model)
    return model


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_sync_with_two_workers_equals_sgd_on_the_double_batch(tmp_path):
    out = tmp_path / "sync"
    cli("train", "--strategy", "sync", "--workers", "2", "--steps", "40", "--out", str(out), *COMMON)
    assert_same_params(trained(out), reference(40, workers=2))


def test_asgd_one_worker_n_sync_1_add_rule_equals_sgd(tmp_path):
    out = tmp_path / "asgd"
    cli("train", "--strategy", "asgd", "--workers", "1", "--servers", "1", "--n-sync", "1",
        "--server-rule", "add", "--steps", "40", "--out", str(out), *COMMON)
    assert_same_params(trained(out), reference(40, workers=1))


def test_asgd_two_shards_one_worker_n_sync_5_equals_sgd(tmp_path):
    # Sharding must not change the result: with one worker every push is applied unchanged.
    out = tmp_path / "asgd2"
    cli("train", "--strategy", "asgd", "--workers", "1", "--servers", "2", "--n-sync", "5",
        "--steps", "40", "--out", str(out), *COMMON)
    assert_same_params(trained(out), reference(40, workers=1))


def test_asgd_sgd_server_rule_with_lr_1_equals_sgd(tmp_path):
    # The optimizer rules reply with θ after the push (not overlapped): same result, other path.
    out = tmp_path / "asgd-sgd-rule"
    cli("train", "--strategy", "asgd", "--workers", "1", "--servers", "1", "--n-sync", "3",
        "--server-rule", "sgd", "--server-lr", "1.0", "--steps", "30", "--out", str(out), *COMMON)
    assert_same_params(trained(out), reference(30, workers=1))


def test_asgd_fetch_every_2_push_every_3_keeps_unpushed_progress(tmp_path):
    # One worker: a fetch between pushes must keep the not-yet-pushed local steps, so the
    # result is still plain SGD (ending with a final push of the remainder).
    out = tmp_path / "asgd-2-3"
    cli("train", "--strategy", "asgd", "--workers", "1", "--servers", "2", "--n-fetch", "2",
        "--n-push", "3", "--steps", "31", "--out", str(out), *COMMON)
    assert_same_params(trained(out), reference(31, workers=1))
