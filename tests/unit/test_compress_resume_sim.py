"""A run killed and resumed from its checkpoint ends exactly where the undisturbed run of the
same seed ends, on the virtual cluster: compressed, for the lockstep strategies that keep
error-feedback residuals between rounds, and DiLoCo with node replicas (every worker from the
checkpoint, the leaders' outer state restored). Over real processes:
tests/e2e/test_compress_resume.py."""

from __future__ import annotations

import pytest
import torch

from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.records.checkpoint import load_checkpoint
from cloudburst.sim.run import SimulationFailed, simulate
from tests.reference import trained

pytestmark = pytest.mark.unit

CASES = [
    # (sync int8 on the virtual cluster made its residuals at the first step, after a resumed
    # worker had loaded its checkpoint: they were dropped.)
    pytest.param(dict(strategy="sync", compress="int8"), id="sync-int8"),
    pytest.param(dict(strategy="sync", compress="bf16"), id="sync-bf16"),
    pytest.param(dict(strategy="local_sgd", compress="int8", period=3), id="local_sgd-int8"),
    pytest.param(dict(strategy="diloco", compress="fp8", period=3), id="diloco-fp8"),
    pytest.param(
        dict(strategy="diloco", workers=4, nodes=2, replica="node", period=3),
        id="diloco-node-replicas",
    ),
]
KILL_AT, CHECKPOINT_EVERY = 13, 8


def _cfg(out, workers: int = 2, **kw) -> RunConfig:
    return RunConfig(dataset="synthetic", model="mlp", workers=workers, steps=20, batch_size=16,
                     test_size=64, eval_every_s=60, seed=3, out=str(out), **kw)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_compressed_run_killed_and_resumed_ends_where_the_undisturbed_one_does(tmp_path, case):
    sim = SimulationConfig(step_time_s=0.01)
    whole = simulate(_cfg(tmp_path / "whole", **case), sim)
    cut = _cfg(
        tmp_path / "cut",
        checkpoint_every=CHECKPOINT_EVERY,
        inject_fault=[f"kill:1@{KILL_AT}"],
        **case,
    )
    with pytest.raises(SimulationFailed):
        simulate(cut, sim)
    # The checkpoint resumed from carries the compression state (bf16 and none have none).
    [path] = (tmp_path / "cut" / "checkpoints").glob(f"worker1-step{CHECKPOINT_EVERY:08d}.pt")
    strategy_state = load_checkpoint(path)["strategy"]
    kept = [k for k in strategy_state if k.startswith("compress_")]
    assert bool(kept) == (case.get("compress") in ("int8", "fp8")), sorted(strategy_state)
    resumed = simulate(cut.replace(resume=True, inject_fault=[]), sim)
    assert resumed["final_test_loss"] == whole["final_test_loss"]
    assert (resumed["inter_node_bytes"] > 0) == ("nodes" in case)
    whole_model, cut_model = (trained(tmp_path / run, "mlp") for run in ("whole", "cut"))
    pairs = zip(whole_model.parameters(), cut_model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)
