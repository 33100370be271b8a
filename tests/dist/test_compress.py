"""Compressed communication on real gloo processes: sync's DDP hooks (PowerSGD through our
counting wrapper against torch's own hook used directly; our int8 hook) and the quantised
all-gather all-reduce of local SGD / DiLoCo through the real transport."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from tests.helpers import cli, read_summary, spawn

pytestmark = pytest.mark.dist

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _hooks(rank: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        PowerSGDState,
        powerSGD_hook,
    )
    from torch.nn.parallel import DistributedDataParallel

    from cloudburst.comm.allreduce import AllreduceHookState, compressed_hook, counted_ddp
    from cloudburst.comm.compress import compressed_all_reduce_sum
    from cloudburst.comm.p2p import CommStats
    from cloudburst.comm.transport import REAL

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    cpu = torch.device("cpu")
    result: dict = {}

    # PowerSGD: our wrapper (counted) and torch's hook on a twin, same settings and seed.
    model = _model()
    twin = copy.deepcopy(model)
    state = AllreduceHookState(None, CommStats(), compress="powersgd:2")
    ours = counted_ddp(model, None, cpu, state, hook=compressed_hook(state))
    theirs = DistributedDataParallel(twin)
    torch_state = PowerSGDState(
        process_group=None,
        matrix_approximation_rank=2,
        start_powerSGD_iter=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )
    theirs.register_comm_hook(torch_state, powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    same = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        for m, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        same.append(
            all(
                torch.equal(p.grad, q.grad)
                for p, q in zip(ours.parameters(), theirs.parameters(), strict=True)
            )
        )
        for opt in opts:
            opt.step()
    result["powersgd_same"] = same
    result["powersgd_bytes"] = state.stats.sent_bytes

    # int8: the DDP hook's averaged gradient, against the exact average.
    model, exact = _model(), _model()
    state = AllreduceHookState(None, CommStats(), compress="int8")
    ddp = counted_ddp(model, None, cpu, state, hook=compressed_hook(state))
    plain = counted_ddp(exact, None, cpu, AllreduceHookState(None, CommStats()))
    x, y = _batch(rank, 0)
    for m in (ddp, plain):
        nn.functional.cross_entropy(m(x), y).backward()
    result["int8_grad"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()
    result["exact_grad"] = torch.cat([p.grad.reshape(-1) for p in exact.parameters()]).tolist()
    result["int8_bytes"] = state.stats.sent_bytes

    # The quantised all-reduce of the outer syncs, through the real transport (all-gather).
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1000, generator=g)
    y = x.clone()
    compressed_all_reduce_sum(y, None, CommStats(), "int8", async_op=True, comm=REAL).wait()
    result["gathered_sum"] = y.tolist()
    result["own"] = x.tolist()
    dist.destroy_process_group()
    return result


def test_sync_hooks_and_the_quantised_all_reduce_on_gloo(tmp_path):
    from cloudburst.comm.allreduce import ring_bytes
    from cloudburst.comm.compress import gather_cost_bytes, packed_bytes

    results = spawn(_hooks, 2, tmp_path)
    # PowerSGD through our wrapper: the same gradients as torch's hook, every step (2 vanilla
    # steps, then rank-2 P and Q for both weight matrices, the biases uncompressed).
    for r in results:
        assert r["powersgd_same"] == [True] * STEPS
    numel = 32 * 64 + 64 + 64 * 10 + 10
    compressed = 64 + 10 + (64 + 32) * 2 + (10 + 64) * 2
    expected = 2 * ring_bytes(numel, 4, 2) + (STEPS - 2) * ring_bytes(compressed, 4, 2)
    assert [r["powersgd_bytes"] for r in results] == [expected] * 2

    # int8: identical on both ranks, within the rounding bound of the exact mean, and the
    # all-gather of one quantised bucket counted
    a, b = (torch.tensor(r["int8_grad"]) for r in results)
    exact = torch.tensor(results[0]["exact_grad"])
    assert torch.equal(a, b)
    assert float((a - exact).abs().max()) <= float(exact.abs().max()) / 127
    assert [r["int8_bytes"] for r in results] == [
        gather_cost_bytes(packed_bytes(numel, "int8"), 2)
    ] * 2

    # the outer syncs' quantised all-reduce: the same sum on both ranks, near the true one
    sums = [torch.tensor(r["gathered_sum"]) for r in results]
    true = sum(torch.tensor(r["own"]) for r in results)
    assert torch.equal(sums[0], sums[1])
    assert float((sums[0] - true).abs().max()) < 0.1


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
