"""The Python API (``cloudburst.Job``): an unchanged PyTorch loop under ``job.wrap`` hooks ends
with exactly the parameters of the loop that calls ``start`` / ``after_backward`` /
``after_step`` itself, the DataLoader example runs under torchrun, ``job.should_stop()`` ends a
time-budgeted sync loop after the same step on both workers, and ``Job.serve`` resumes a shard
from its checkpoint as the CLI does."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import cloudburst
from cloudburst.comm.flat import flatten_params
from cloudburst.data import synthetic
from cloudburst.models import build_model
from cloudburst.records.checkpoint import load_checkpoint
from tests.support import REPO, cli, final_record, free_port, rank_events, spawn

pytestmark = pytest.mark.dist

STEPS, BATCH = 12, 8


def _loop(rank: int, strategy: str, servers: int, hooks: bool, out: str) -> list[float] | None:
    cfg = cloudburst.RunConfig(
        strategy=strategy, workers=2 - servers, servers=servers, period=3, steps=STEPS,
        dataset="synthetic", out=out, lr=0.1, checkpoint_every=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    with cloudburst.Job(cfg) as job:
        if job.is_server:
            final = job.serve(model)
            return flatten_params(final).tolist() if final is not None else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        net = job.wrap(model, optimizer, hooks=hooks)
        g = torch.Generator().manual_seed(10 + job.worker_index)
        if not hooks:
            job.start()
        for _ in range(STEPS):
            # two micro-batches per step: the hooks count both forward passes' samples
            optimizer.zero_grad()
            for _ in range(2):
                x = torch.randn(BATCH, 6, generator=g)
                y = torch.randint(0, 3, (BATCH,), generator=g)
                nn.functional.cross_entropy(net(x), y).backward()
            if not hooks:
                job.after_backward()
            optimizer.step()
            if not hooks:
                job.after_step(2 * BATCH)
            with torch.no_grad():  # an evaluation pass: neither starts nor counts anything
                net.eval()
                net(torch.randn(3, 6, generator=g))
                net.train()
        samples = job.strategy.local_steps
        if hooks:  # an explicit call beside the hooks would step twice: refused
            with pytest.raises(RuntimeError, match="drop the explicit call"):
                job.after_step(1)
        params = flatten_params(model).tolist()
    return [samples, *params]


@pytest.mark.parametrize(("strategy", "servers"), [("sync", 0), ("asgd", 1), ("local_sgd", 0)])
def test_an_unchanged_loop_equals_the_explicit_calls(tmp_path, strategy, servers):
    runs = []
    for hooks in (False, True):
        path = tmp_path / f"hooks{int(hooks)}"
        path.mkdir()
        runs.append(spawn(_loop, 2, path, strategy, servers, hooks, str(path / "out")))
    explicit, hooked = runs
    assert explicit == hooked  # the workers' local steps and parameters, the servers' θ
    assert all(explicit[rank][0] == STEPS for rank in range(servers, 2))
    # and the replicas did move: not a comparison of two untouched models
    torch.manual_seed(0)
    start = flatten_params(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))
    assert not torch.allclose(torch.tensor(hooked[servers][1:]), start)


def test_the_dataloader_example_runs_under_torchrun(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
        "--master-port", str(free_port()), str(REPO / "examples" / "dataloader_loop.py"),
        "--strategy", "asgd", "--servers", "1", "--epochs", "4", "--out", str(tmp_path / "o"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    workers = sorted(line.split(":")[0] for line in lines if line.startswith("worker "))
    assert workers == ["worker 0", "worker 1"]
    [final] = [line for line in lines if line.startswith("final global model")]
    assert float(final.rsplit(" ", 1)[1]) > 0.6  # 4 epochs of the synthetic set learn it


def _budget_loop(rank: int, out: str) -> list:
    cfg = cloudburst.RunConfig(
        strategy="sync", workers=2, steps=100_000, dataset="synthetic", out=out,
        checkpoint_every=0, max_train_time_s=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    with cloudburst.Job(cfg) as job:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        net = job.wrap(model, optimizer)
        steps = 0
        while not job.should_stop():
            x, y = torch.randn(BATCH, 6), torch.randint(0, 3, (BATCH,))
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
            steps += 1
            time.sleep(0.005 * (1 + rank))  # the workers' own (unequal) pace
        report = job.finish()
    return [steps, report["steps"], report["stopped_by"]]


def test_should_stop_ends_every_lockstep_worker_after_the_same_step(tmp_path):
    first, second = spawn(_budget_loop, 2, tmp_path, str(tmp_path / "out"))
    assert first == second
    assert first[0] == first[1] and first[2] == "time_budget"


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
    assert final_record(out, 0)["version"] == saved["version"] + 10  # the API worker's pushes
