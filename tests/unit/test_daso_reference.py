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
from tests.support import (
    DASO_REF_STEPS,
    assert_follows_daso_reference,
    daso_reference_cfg,
    daso_reference_drive,
    daso_reference_run,
)


@pytest.mark.parametrize("wait", [2, 1, 0])
def test_daso_follows_the_reference_on_the_virtual_cluster(tmp_path, wait):
    from cloudburst.sim.run import run_ranks

    runs = run_ranks(daso_reference_cfg(str(tmp_path), wait), daso_reference_drive)
    expected = daso_reference_run(wait)
    assert_follows_daso_reference(runs, expected)
    # Every rank ends on the same θ (finish's blocking average), and the run is not the
    # one a different S gives: the delay shows in the trajectory.
    assert all(r[-1] == runs[0][-1] for r in runs)
    other = daso_reference_run(wait + 1 if wait < 2 else 0)
    gap = max(
        (torch.tensor(runs[0][t]) - other[0][t]).abs().max().item() for t in range(DASO_REF_STEPS)
    )
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
