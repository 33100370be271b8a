"""Async DiLoCo through the Python API (``cloudburst.Job``) over gloo: a user's Adam loop, one
worker and one shard, ends on a plain-PyTorch DiLoCo's θ (outer Nesterov: N = W = 1)."""

from __future__ import annotations

import pytest
import torch

import cloudburst
from cloudburst.data import synthetic
from cloudburst.models import build_model
from tests import reference as ref
from tests.support import spawn

pytestmark = pytest.mark.dist

STEPS, H, OUTER_LR, OUTER_MOMENTUM, LR, BATCH = 10, 3, 0.7, 0.9, 0.01, 16


def _batches():
    data = synthetic(400, 100)
    return [
        (data.x_train[BATCH * i : BATCH * (i + 1)], data.y_train[BATCH * i : BATCH * (i + 1)])
        for i in range(STEPS)
    ]


def _api_job(rank: int, out: str) -> list[float] | int:
    cfg = cloudburst.RunConfig(
        strategy="async_diloco", workers=1, servers=1, dataset="synthetic", model="mlp",
        seed=0, batch_size=BATCH, steps=STEPS, period=H, optimizer="adam", lr=LR,
        diloco_outer_lr=OUTER_LR, diloco_outer_momentum=OUTER_MOMENTUM, out=out,
    )  # fmt: skip
    model = build_model("mlp", (40,), 10, seed=0)
    with cloudburst.Job(cfg) as job:
        if job.is_server:
            return ref.flat(job.serve(model)).tolist()
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        net = job.wrap(model, optimizer)
        for x, y in _batches():  # the user's loop
            ref.train_step(net, optimizer, x, y)
    return 0


def _reference() -> torch.Tensor:
    model = build_model("mlp", (40,), 10, seed=0)
    inner = torch.optim.Adam(model.parameters(), lr=LR)
    theta = torch.nn.Parameter(ref.flat(model))
    outer = torch.optim.SGD([theta], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)

    def outer_step() -> None:
        theta.grad = theta.detach() - ref.flat(model)
        outer.step()
        ref.set_flat(model, theta.detach())

    for step, (x, y) in enumerate(_batches(), start=1):
        ref.train_step(model, inner, x, y)
        if step % H == 0:
            outer_step()
    if STEPS % H:
        outer_step()
    return theta.detach()


def test_the_api_runs_async_diloco_and_ends_on_the_reference_theta(tmp_path):
    server, worker = spawn(_api_job, 2, tmp_path, str(tmp_path / "run"))
    assert worker == 0
    torch.testing.assert_close(torch.tensor(server), _reference(), rtol=1e-4, atol=1e-5)
