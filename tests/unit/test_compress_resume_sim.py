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
from cloudburst.data import load_dataset
from cloudburst.models import build_model
from cloudburst.records.checkpoint import load_checkpoint, load_model_into
from cloudburst.sim.run import SimulationFailed, simulate

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


def _final_params(out) -> list[torch.Tensor]:
    data = load_dataset("synthetic", test_size=64)
    model = build_model("mlp", data.input_shape, data.num_classes, seed=3)
    load_model_into(out / "model.pt", model)
    return [p.detach().clone() for p in model.parameters()]


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
    pairs = zip(_final_params(tmp_path / "whole"), _final_params(tmp_path / "cut"), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)
