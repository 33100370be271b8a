"""Compressed communication on real gloo processes: the quantised all-reduce and sync's int8 DDP
hook against tests/reference.py bit for bit, PowerSGD against torch's own hook, and compressed
asgd messages through the CLI against the same job on the virtual cluster."""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from cloudburst.comm.allreduce import AllreduceHookState, compressed_hook, counted_ddp, ring_bytes
from cloudburst.comm.compress import (
    OWNER,
    ErrorFeedback,
    compressed_all_reduce_sum,
    quantised_sent_bytes,
)
from cloudburst.comm.stats import CommStats
from cloudburst.comm.transport import REAL
from cloudburst.runtime import shutdown
from tests import reference as ref
from tests.support import cli, read_summary, simulated, spawn
from tests.reference import COMMON, assert_same_params, trained

pytestmark = pytest.mark.dist

STEPS = 5
NUMEL = 32 * 64 + 64 + 64 * 10 + 10  # the model's 2762 gradients: one DDP bucket


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _grads(model: nn.Module) -> list[float]:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()


def _powersgd(rank: int) -> dict:
    """PowerSGD: our wrapper (counted) and torch's hook on a twin, same settings and seed."""
    model = _model()
    twin = copy.deepcopy(model)
    state = AllreduceHookState(None, CommStats(), compress="powersgd:2")
    ours = counted_ddp(model, None, torch.device("cpu"), state, hook=compressed_hook(state))
    theirs = DistributedDataParallel(twin)
    torch_state = PowerSGDState(
        None, 2, start_powerSGD_iter=2, use_error_feedback=True, warm_start=True, random_seed=0
    )
    theirs.register_comm_hook(torch_state, powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    same = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        for m, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        pairs = zip(ours.parameters(), theirs.parameters(), strict=True)
        same.append(all(torch.equal(p.grad, q.grad) for p, q in pairs))
        for opt in opts:
            opt.step()
    del ours, theirs  # before the group goes: see _compressed
    return {"powersgd_same": same, "powersgd_bytes": state.stats.sent_bytes}


def _compressed(rank: int) -> dict:
    """The quantised all-reduce through the real transport (2 int8 rounds with error feedback, the
    second non-blocking; 1 fp8 round), the int8 DDP hook beside the plain one, PowerSGD at W = 2."""
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict = {"inputs": [], "outputs": []}
    feedback, stats = ErrorFeedback(), CommStats()
    for k, method in enumerate(("int8", "int8", "fp8")):
        g = torch.Generator().manual_seed(10 * rank + k)
        x = torch.randn(1000, generator=g) * (1 + rank)
        y = x.clone()
        fb = feedback if method == "int8" else ErrorFeedback()
        compressed_all_reduce_sum(
            y, None, stats, method, feedback=fb, key="t", async_op=k == 1, comm=REAL
        ).wait()
        result["inputs"].append(x.tolist())
        result["outputs"].append(y.tolist())
    result["bytes"] = stats.sent_bytes
    result["residuals"] = {k: v.tolist() for k, v in feedback.state_dict().items()}

    model, exact = _model(), _model()
    state = AllreduceHookState(None, CommStats(), compress="int8")
    ddp = counted_ddp(model, None, torch.device("cpu"), state, hook=compressed_hook(state))
    plain = counted_ddp(exact, None, torch.device("cpu"), AllreduceHookState(None, CommStats()))
    x, y = _batch(rank, 0)
    for m in (ddp, plain):
        nn.functional.cross_entropy(m(x), y).backward()
    result.update(grad=_grads(model), exact_grad=_grads(exact), hook_bytes=state.stats.sent_bytes)
    del ddp, plain  # before the group goes (below)
    if world == 2:
        result.update(_powersgd(rank))
    # The DDP modules gone (one may sit in a reference cycle), leave the group as cloudburst's
    # workers do (``runtime.shutdown``: kept until the process exits; freed earlier, on torch
    # 2.13 its destructor may abort on its own work thread or deadlock on the GIL).
    gc.collect()
    shutdown(None)
    return result


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_quantised_all_reduce_and_sync_hooks_on_gloo_are_the_reference(tmp_path, world):
    """Every rank ends each round with the reference's bits and residuals (the owner's too from
    W = 3) and counts quantised_sent_bytes; the int8 hook gives every rank the same gradients,
    counted alike; PowerSGD's are torch's hook's, every step."""
    results = spawn(_compressed, world, tmp_path)
    sent, owner = [None] * world, [None] * world
    pair = ref.QuantisedSum("int8")  # W = 2: the all-gather, the senders' roundings only
    for k, method in enumerate(("int8", "int8", "fp8")):
        inputs = [torch.tensor(r["inputs"][k]) for r in results]
        fresh = method == "fp8"
        if world == 2:
            expected = (ref.QuantisedSum(method) if fresh else pair)(inputs)
        else:
            prior = ([None] * world, [None] * world) if fresh else (sent, owner)
            expected, *after = ref.quantised_all_reduce(inputs, method, *prior)
            if not fresh:
                sent, owner = after
        for r in results:  # the same bits on every rank, the reference's
            assert torch.equal(torch.tensor(r["outputs"][k]), expected)
    for rank, r in enumerate(results):
        residuals = {key: torch.tensor(v) for key, v in r["residuals"].items()}
        if world == 2:
            assert residuals.keys() == {"t"} and torch.equal(residuals["t"], pair.residuals[rank])
        else:
            assert torch.equal(residuals["t"], sent[rank])
            assert torch.equal(residuals["t" + OWNER], owner[rank])
        assert r["bytes"] == 3 * quantised_sent_bytes(1000, world, rank)
    # sync's int8 hook: one bucket, the same on every rank
    grads = [torch.tensor(r["grad"]) for r in results]
    assert all(torch.equal(g, grads[0]) for g in grads)
    assert [r["hook_bytes"] for r in results] == [
        quantised_sent_bytes(NUMEL, world, p) for p in range(world)
    ]
    if world > 2:
        return
    # W = 2: the int8 mean within the rounding bound of the exact one; PowerSGD through our
    # wrapper is torch's hook (2 vanilla steps, then rank-2 P and Q for both weight matrices,
    # the biases uncompressed), every step
    exact = torch.tensor(results[0]["exact_grad"])
    assert float((grads[0] - exact).abs().max()) <= float(exact.abs().max()) / 127
    assert all(r["powersgd_same"] == [True] * STEPS for r in results)
    compressed = 64 + 10 + (64 + 32) * 2 + (10 + 64) * 2
    expected_bytes = 2 * ring_bytes(NUMEL, 4, 2) + (STEPS - 2) * ring_bytes(compressed, 4, 2)
    assert [r["powersgd_bytes"] for r in results] == [expected_bytes] * 2


def test_powersgd_with_a_model_of_several_ddp_buckets_trains_on_gloo(tmp_path):
    # The wide CNN's gradients (2.1 MB) span two DDP buckets by default; PyTorch's
    # powerSGD_hook then interleaves its P/Q all-reduces with the next bucket's on gloo
    # (a collective mismatch at W = 2, a hang at W = 4). cloudburst gives it one bucket.
    out = tmp_path / "powersgd"
    cli("train", "--strategy", "sync", "--compress", "powersgd:1", "--workers", "2",
        "--model", "benchmarks.bench_models:mnist1d_wide_cnn", "--steps", "12",
        "--eval-every-s", "1000", "--no-progress", "--out", str(out), timeout_s=180)  # fmt: skip
    s = read_summary(out)
    assert s["steps_per_worker"] == 12 and s["sent_bytes"] > 0


# ----------------------------------------------------------------------- compressed asgd messages
def _args(out, compress: str) -> list[str]:
    # Push every step, fetch every 2nd: a plain PUSH, then an overlapped PUSH_FETCH whose reply
    # (θ before the push, compressed) gets the worker's own decompressed Δ added.
    return ["--strategy", "asgd", "--workers", "1", "--servers", "2", "--n-fetch", "2",
        "--n-push", "1", "--server-lr", "0.5", "--steps", "30", "--compress", compress,
        "--out", str(out), *COMMON]  # fmt: skip


def test_asgd_int8_pushes_and_fetches_over_gloo_match_the_simulator(tmp_path):
    args = _args(tmp_path / "int8", "int8")
    cli("train", *args)
    sim = simulated(args)
    assert_same_params(trained(tmp_path / "int8"), trained(sim))
    real, virtual = read_summary(tmp_path / "int8"), read_summary(sim)
    assert real["pushes_rejected"] == 0 and real["messages_rejected"] == 0
    assert real["sent_bytes"] == virtual["sent_bytes"]
    plain = tmp_path / "none"
    cli("train", *_args(plain, "none"))
    assert 0.25 < real["sent_bytes"] / read_summary(plain)["sent_bytes"] < 0.3
