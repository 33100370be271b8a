"""EASGD's elastic update, exact: the shard rule alone on scripted values, one real exchange
between a worker and two server shards over gloo, and a CLI run against its simulation."""

import pytest
import torch

from cloudburst.strategies.asgd.shard import ShardState
from tests.reference import (
    COMMON,
    assert_params_differ,
    assert_same_params,
    easgd_one_worker,
    trained,
)
from tests.helpers import shard_of, simulated, cli, final_record, read_summary, spawn

pytestmark = pytest.mark.dist


def test_elastic_rule_on_scripted_values():
    shard = shard_of(torch.tensor([1.0, 2.0, -4.0]), rule="elastic", lr=0.25)
    result = shard.apply_push(torch.tensor([3.0, 0.0, 4.0]), base_version=0)
    # e = 0.25 * (θ_i - θ̃) = [0.5, -0.5, 2.0]; θ̃ += e
    assert shard.theta.tolist() == [1.5, 1.5, -2.0] and result.status.name == "OK"
    assert shard.version == 1
    assert shard.apply_push(torch.tensor([float("nan"), 0, 0]), 1).status.name == "REJECTED"
    assert shard.theta.tolist() == [1.5, 1.5, -2.0]


CENTRE = [1.0, 2.0, -4.0, 0.5, 0.0, 8.0]  # nn.Linear(2, 2): 4 weights + 2 biases
WORKER = [3.0, 0.0, 4.0, 0.5, -2.0, 0.0]


def _exchange(rank: int, out: str, servers: int) -> dict:
    from torch import nn

    from cloudburst.comm.flat import assign_flat, flatten_params
    from cloudburst.config import RunConfig
    from cloudburst.records.metrics import MetricsWriter
    from cloudburst.comm.liveness import LivenessMonitor
    from cloudburst.runtime import init_distributed, shutdown
    from cloudburst.strategies.asgd.server import ServerLoop
    from cloudburst.strategies.easgd import EasgdStrategy

    cfg = RunConfig(
        strategy="easgd",
        workers=1,
        servers=servers,
        dataset="synthetic",
        easgd_alpha=0.25,
        easgd_tau=1,
        out=out,
        comm_timeout_s=60,
    )
    ctx = init_distributed(cfg)
    model = nn.Linear(2, 2)
    assign_flat(model, torch.tensor(CENTRE))
    if ctx.is_server:
        metrics = MetricsWriter(out, rank, ctx.role)
        loop = ServerLoop(
            ctx, flatten_params(model), metrics, LivenessMonitor(ctx.store, ctx.worker_ranks, 10.0)
        )
        ctx.start_clock()
        loop.run()
        theta = loop.gather_final_theta()
        metrics.close()
        shutdown(ctx)
        return {"centre": None if theta is None else theta.tolist()}
    strategy = EasgdStrategy(ctx)
    strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0))
    ctx.start_clock()
    strategy.start()  # fetches the centre: the replica starts from it
    start = flatten_params(model).tolist()
    assign_flat(model, torch.tensor(WORKER))
    strategy.after_step(1)  # τ = 1: one elastic exchange
    after = flatten_params(model).tolist()
    strategy.finish()
    shutdown(ctx)
    return {"start": start, "after": after}


def test_one_elastic_exchange_with_two_shards_over_gloo(tmp_path):
    results = spawn(_exchange, 3, tmp_path, str(tmp_path), 2)
    worker = results[-1]
    e = [0.25 * (w - c) for w, c in zip(WORKER, CENTRE, strict=True)]
    assert worker["start"] == CENTRE
    assert worker["after"] == pytest.approx([w - x for w, x in zip(WORKER, e, strict=True)])
    assert results[0]["centre"] == pytest.approx([c + x for c, x in zip(CENTRE, e, strict=True)])


def test_cli_easgd_tau_and_beta_against_the_simulation(tmp_path):
    # One worker: α = β / W = 0.5; an elastic exchange every 3 steps (6 of them in 20 steps)
    # and one more for the last 2 steps, when the worker finishes.
    out = tmp_path / "easgd"
    args = ["--strategy", "easgd", "--workers", "1", "--servers", "1", "--easgd-tau", "3",
        "--easgd-beta", "0.5", "--steps", "20", "--out", str(out), *COMMON]  # fmt: skip
    cli("train", *args)
    sim = simulated(args)  # the same job on the virtual cluster
    expected = easgd_one_worker(20, tau=3, alpha=0.5)
    assert_same_params(trained(out), expected)  # the centre θ̃ the server holds
    assert_same_params(trained(sim), trained(out))  # the simulator == gloo
    assert_params_differ(expected, easgd_one_worker(20, tau=3, alpha=0.9))  # default β
    assert_params_differ(expected, easgd_one_worker(20, tau=10, alpha=0.5))  # default τ
    assert final_record(out, 1)["pushes"] == 7
    assert read_summary(out)["samples_applied"] == 20 * 16
