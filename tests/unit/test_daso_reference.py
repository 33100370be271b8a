"""DASO with S > 0 against the plain-PyTorch reference (tests/reference.py): four ranks on two
nodes, driven step by step on the virtual cluster, must follow the reference's trajectory —
the merge S steps after each sync with the weight 2S, the rotating sender, the node broadcast
(with L = 2 the ranks of a node drift apart between local averages, so which rank sends and
that its merge reaches the whole node both show). tests/dist/test_daso.py runs the same ranks
over gloo."""

from __future__ import annotations

import pytest
import torch

from tests import reference as ref

STEPS, GLOBAL_SKIP, LOCAL_SKIP, NODES, WORKERS = 14, 3, 2, 2, 4
LR, MOMENTUM = 0.1, 0.9


def daso_cfg(out: str, wait: int, **kw):
    from cloudburst.config import RunConfig

    return RunConfig(strategy="daso", workers=WORKERS, nodes=NODES, dataset="synthetic",
                     daso_global_skip=GLOBAL_SKIP, daso_batches_to_wait=wait,
                     daso_local_skip=LOCAL_SKIP, daso_warmup_epochs=0, daso_cooldown_epochs=0,
                     daso_adaptive=False, daso_epoch_end_sync=False, daso_downcast="none",
                     daso_cycling_downcast="none", out=out, comm_timeout_s=60, **kw)  # fmt: skip


def drive(ctx) -> list[list[float]]:
    """One rank's DASO run, as the training loop steps it: θ after every step and after
    finish (the last entry replaced), as lists (JSON for the gloo processes)."""
    from torch import nn

    from cloudburst.comm.flat import flatten_params
    from cloudburst.strategies.daso import DasoStrategy

    model = ref.tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    strategy = DasoStrategy(ctx)
    strategy.configure(steps_per_epoch=100, total_steps=100)  # all cycling, no epoch ends
    net = strategy.wrap(model, optimizer)
    strategy.start()
    history = []
    for step in range(1, STEPS + 1):
        x, y = ref.batch(ctx.rank, step)
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        strategy.after_backward()
        optimizer.step()
        strategy.record_loss(loss.item())
        strategy.after_step(len(y))
        history.append(flatten_params(model).tolist())
    strategy.finish()
    history[-1] = flatten_params(model).tolist()
    return history


def reference_run(wait: int) -> list[list[torch.Tensor]]:
    models = [ref.tiny_model() for _ in range(WORKERS)]
    optimizers = [ref.sgd(LR, MOMENTUM)(m) for m in models]
    return ref.daso(models, optimizers, ref.batch, NODES, STEPS, GLOBAL_SKIP, wait, LOCAL_SKIP)


def assert_follows(runs: list[list[list[float]]], expected: list[list[torch.Tensor]]) -> None:
    for rank, (got, want) in enumerate(zip(runs, expected, strict=True)):
        assert len(got) == len(want) == STEPS
        for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
            torch.testing.assert_close(
                torch.tensor(a), b, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, step {step}"
            )


@pytest.mark.parametrize("wait", [2, 1, 0])
def test_daso_follows_the_reference_on_the_virtual_cluster(tmp_path, wait):
    from cloudburst.sim.run import run_ranks

    runs = run_ranks(daso_cfg(str(tmp_path), wait), drive)
    expected = reference_run(wait)
    assert_follows(runs, expected)
    # Every rank ends on the same θ (finish's blocking average), and the run is not the
    # one a different S gives: the delay shows in the trajectory.
    assert all(r[-1] == runs[0][-1] for r in runs)
    other = reference_run(wait + 1 if wait < 2 else 0)
    gap = max((torch.tensor(runs[0][t]) - other[0][t]).abs().max().item() for t in range(STEPS))
    assert gap > 1e-3


def test_the_reference_itself_merges_late_with_the_weight_2s_and_rotates():
    # The reference's own semantics on scripted numbers, so that it cannot drift into
    # agreeing with a wrong implementation: one parameter per rank, no training (lr 0).
    models = [torch.nn.Linear(1, 1, bias=False) for _ in range(4)]
    for r, m in enumerate(models):
        torch.nn.init.constant_(m.weight, float(10 * r))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in models]
    data = lambda r, t: (torch.ones(1, 1), torch.zeros(1, dtype=torch.long))  # noqa: E731

    got = ref.daso(models, optimizers, data, nodes=2, steps=3, global_skip=1, wait=1)
    # t=1: sync 0 starts (local rank 0 sends: 0 and 20). t=2: merged with S = 1, P = 2:
    # node 0: (2·0 + 20)/4 = 5 on ranks 0, 1; node 1: (2·20 + 20)/4 = 15 on ranks 2, 3;
    # then sync 1 (local rank 1 sends: 5, 15). t=3: merged: (2·5 + 20)/4 = 7.5,
    # (2·15 + 20)/4 = 12.5; sync 2 (local rank 0). finish: merged, (2·7.5 + 20)/4 = 8.75,
    # (2·12.5 + 20)/4 = 11.25; then the blocking average (20)/2 = 10 everywhere.
    assert [[float(v[0]) for v in rank] for rank in got] == [
        [0.0, 5.0, 10.0], [10.0, 5.0, 10.0], [20.0, 15.0, 10.0], [30.0, 15.0, 10.0]
    ]  # fmt: skip
