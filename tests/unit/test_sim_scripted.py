"""Strategy logic driven by hand on the virtual cluster (``cloudburst.sim.run.run_ranks``):
what needs several ranks but not real processes. The real transport's own tests stay in
tests/dist (gossip's serving thread over gloo, DASO's merge over gloo groups)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.config import RunConfig
from cloudburst.sim.run import run_ranks
from cloudburst.strategies.gossip import GossipStrategy

NUMEL = 8  # nn.Linear(3, 2)
VARIANTS = [
    {"gossip_variant": "pull", "gossip_schedule": "random"},
    {"gossip_variant": "pull", "gossip_schedule": "ring"},
    {"gossip_variant": "pull", "gossip_schedule": "exponential"},
    {"gossip_variant": "push", "gossip_schedule": "ring", "gossip_every": 2},
    {"gossip_variant": "push", "gossip_schedule": "random", "gossip_push_sum": True},
    {"gossip_variant": "push", "gossip_schedule": "exponential", "gossip_push_sum": True},
]
ROUNDS = 80  # gossip rounds per variant (steps: ROUNDS × gossip_every)


def _consensus(ctx) -> list[dict]:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rank, results = ctx.rank, []
    for variant in VARIANTS:
        # One job, one set of gossip groups, one strategy after the other: each finish
        # returns only once every worker's serving task has ended.
        steps = ROUNDS * variant.get("gossip_every", 1)
        cfg = ctx.cfg.replace(consensus_every_steps=steps // 2, **variant)
        start = [float((rank + 1) * (i - 3) + 10 * rank) for i in range(NUMEL)]
        assign_flat(model, torch.tensor(start))
        strategy = GossipStrategy(dataclasses.replace(ctx, cfg=cfg))
        strategy.wrap(model, opt)
        initial = strategy.consensus_distance()
        strategy.start()
        for _ in range(steps):
            strategy.after_step(8)
            ctx.comm.sleep(0.01)  # a step's compute: rounds in step, as a barrier would keep
        strategy.finish()
        theta = flatten_params(model).tolist()
        results.append(
            {"initial": initial, "theta": theta, "start": start, "report": strategy.report()}
        )
    return results


@pytest.mark.slow
def test_consensus_distance_falls_to_zero_for_every_schedule_and_variant(tmp_path):
    cfg = RunConfig(strategy="gossip", workers=4, dataset="synthetic", out=str(tmp_path))
    ranks = run_ranks(cfg, _consensus)
    for k, variant in enumerate(VARIANTS):
        runs = [r[k] for r in ranks]
        report = runs[0]["report"]
        steps = ROUNDS * variant.get("gossip_every", 1)
        assert report["gossip_rounds"] == ROUNDS, variant
        assert [s for s, _ in report["consensus_history"]] == [steps // 2, steps]
        assert runs[0]["initial"] > 10
        assert report["final_consensus_distance"] < 1e-4 * runs[0]["initial"], variant
        served = sum(r["report"]["fetches_served"] + r["report"]["pushes_received"] for r in runs)
        assert served == 4 * ROUNDS, variant  # every message was served exactly once
        if variant.get("gossip_push_sum"):
            # Push-sum keeps Σ w_i = W and Σ w_i θ_i = Σ θ_i(0): the consensus is the average.
            weights = [r["report"]["push_sum_weight"] for r in runs]
            assert sum(weights) == pytest.approx(4.0, abs=1e-12)
            mean0 = [sum(r["start"][i] for r in runs) / 4 for i in range(NUMEL)]
            for r in runs:
                assert r["theta"] == pytest.approx(mean0, abs=1e-4)
