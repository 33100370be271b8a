"""The real strategies over gloo against :mod:`tests.reference`'s trajectories: four workers run
sync, local_sgd, diloco and gossip; two workers and a shard easgd. Racing workers take turns
through the store: gossip and easgd bit for bit, the others to 1e-6 (summation order)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cloudburst.comm.flat import flatten_params
from cloudburst.comm.liveness import LivenessMonitor
from cloudburst.config import RunConfig
from cloudburst.records.metrics import MetricsWriter
from cloudburst.runtime import init_distributed, shutdown
from cloudburst.strategies import STRATEGY_CLASSES
from cloudburst.strategies.asgd.server import ServerLoop
from cloudburst.strategies.replica import make_strategy
from tests import reference as ref
from tests.support import spawn

pytestmark = pytest.mark.dist

BATCH = 8
ATOL = 1e-6

SYNC_STEPS = 5
LOCAL_STEPS, PERIOD = 7, 3  # averages after steps 3 and 6, and a last one for step 7
GOSSIP_STEPS, GOSSIP_EVERY = 6, 2
EASGD_STEPS, TAU = 6, 3  # exchanges after steps 3 and 6 (the unit test covers the last)
DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's (and cloudburst's over Adam)


class Turns:
    """Events in a fixed order across ranks: event ``i`` waits for event ``i - 1`` (store keys)."""

    def __init__(self, store, name: str):
        self.store, self.name = store, name

    def wait(self, i: int) -> None:
        if i > 0:
            self.store.wait([f"{self.name}/{i - 1}"])

    def done(self, i: int) -> None:
        self.store.set(f"{self.name}/{i}", "1")


def _trajectory(ctx, optimizer, steps: int, turns: Turns | None = None, **cfg_changes):
    """Train the tiny model through the strategy ``cfg_changes`` describes; θ after each step
    (the last one after ``finish``), and ``step_info`` after each step."""
    cfg = ctx.cfg.replace(**cfg_changes)
    ctx = dataclasses.replace(ctx, cfg=cfg)
    worker = ctx.worker_index
    model = ref.tiny_model()
    opt = optimizer(model)
    strategy = make_strategy(ctx)
    net = strategy.wrap(model, opt)
    strategy.start()
    thetas, infos = [], []
    for step in range(1, steps + 1):
        ref.train_step(net, opt, *ref.batch(worker, step, BATCH))
        event = (step - 1) * cfg.job.workers + worker  # every worker's step s before any's s + 1
        if turns:
            turns.wait(event)
        strategy.after_step(BATCH)
        if turns:
            turns.done(event)
        thetas.append(ref.flat(model).tolist())
        infos.append(strategy.step_info())
    strategy.finish()
    thetas[-1] = ref.flat(model).tolist()
    return {"theta": thetas, "info": infos}


def _four_workers(rank: int, out: str) -> dict:
    # Created as a gossip job, so that the gossip groups exist; the other strategies use the
    # workers' (here: the world) group.
    cfg = RunConfig(strategy="gossip", workers=4, dataset="synthetic", device="cpu", out=out,
                    comm_timeout_s=60, consensus_every_steps=1000)  # fmt: skip
    ctx = init_distributed(cfg, STRATEGY_CLASSES[cfg.job.strategy])
    sgd = ref.sgd()
    diloco = dict(diloco_outer_lr=DILOCO_OUTER_LR, diloco_outer_momentum=DILOCO_OUTER_MOMENTUM,
                  period=PERIOD, diloco_nesterov=True)  # fmt: skip
    gossip = dict(gossip_variant="pull", gossip_schedule="ring", gossip_every=GOSSIP_EVERY)
    runs = {
        "sync": _trajectory(ctx, sgd, SYNC_STEPS, strategy="sync"),
        "local_sgd": _trajectory(ctx, sgd, LOCAL_STEPS, strategy="local_sgd", period=PERIOD),
        "diloco": _trajectory(ctx, ref.adamw(), LOCAL_STEPS, strategy="diloco", **diloco),
        "gossip": _trajectory(ctx, sgd, GOSSIP_STEPS, Turns(ctx.store, "gossip"), **gossip),
    }
    shutdown(ctx)
    return runs


def assert_trajectory(
    actual: list[list[float]], expected: list[torch.Tensor], what: str, atol: float = ATOL
) -> None:
    """θ after each step (JSON floats: float32 values, exactly) against the reference's."""
    assert len(actual) == len(expected), what
    for step, (a, b) in enumerate(zip(actual, expected, strict=True), start=1):
        torch.testing.assert_close(
            torch.tensor(a, dtype=torch.float32), b, rtol=0, atol=atol, msg=f"{what}, step {step}"
        )


@pytest.fixture(scope="module")
def four_workers(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("four-workers")
    return spawn(_four_workers, 4, out, str(out), timeout_s=180)


def _expected(strategy: str) -> list[list[torch.Tensor]]:
    """Each worker's θ after every step, by the reference of ``strategy``."""
    if strategy == "sync":  # one process's SGD on the 4 batches joined, for every worker
        model = ref.tiny_model()
        return [ref.large_batch_sgd(model, ref.sgd()(model), workers=4, steps=SYNC_STEPS)] * 4
    replicas = ref.Replicas(4, ref.adamw() if strategy == "diloco" else ref.sgd())
    if strategy == "local_sgd":
        return ref.local_sgd(replicas.models, replicas.step, LOCAL_STEPS, PERIOD)
    # Nesterov outer momentum (the reference's default)
    return ref.diloco(
        replicas.models, replicas.step, LOCAL_STEPS, PERIOD, DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
    )


@pytest.mark.parametrize("strategy", ["sync", "local_sgd", "diloco"])
def test_lockstep_strategies_match_the_reference(four_workers, strategy):
    """θ of every worker after every step, to 1e-6: sync is one SGD on the 4 batches joined;
    local_sgd averages after steps 3, 6 and (finish) 7; diloco (AdamW inside) takes Nesterov
    outer steps (lr 0.7, μ 0.9) there, momentum from the first (d = g + μb)."""
    expected = _expected(strategy)
    for w, run in enumerate(four_workers):
        assert_trajectory(run[strategy]["theta"], expected[w], f"{strategy} worker {w}")


def test_gossip_ring_pull_in_a_scripted_order_matches_the_reference(four_workers):
    """Pull gossip on a ring of 4 every 2 steps, turns 0, 1, 2, 3 each step: workers 0–2 get
    their peer's θ of the previous step (lag 1), worker 3 worker 0's of this one (lag 0). Bit
    for bit: θ after every step (finish does not average), each pull's peer and lag."""
    replicas = ref.Replicas(4, ref.sgd())
    expected = ref.gossip_pull(
        replicas.models, replicas.step, GOSSIP_STEPS, lambda i, r: (i + 1) % 4, GOSSIP_EVERY
    )
    for w, run in enumerate(four_workers):
        gossip = run["gossip"]
        assert_trajectory(gossip["theta"], expected.replicas[w], f"gossip worker {w}", atol=0)
        pulls = [
            (w, info["peer"], info["peer_lag_steps"])
            for step, info in enumerate(gossip["info"], start=1)
            if step % GOSSIP_EVERY == 0
        ]
        assert pulls == [p for p in expected.pulls if p[0] == w]
        assert pulls == [(w, (w + 1) % 4, 0 if w == 3 else 1)] * (GOSSIP_STEPS // GOSSIP_EVERY)


# ---------------------------------------------------------------------------- easgd
def _easgd(rank: int, out: str) -> dict:
    # α: the default, β/W = 0.45
    cfg = RunConfig(strategy="easgd", workers=2, servers=1, easgd_tau=TAU, dataset="synthetic",
                    device="cpu", out=out, comm_timeout_s=60, checkpoint_every=0)  # fmt: skip
    ctx = init_distributed(cfg, STRATEGY_CLASSES[cfg.job.strategy])
    model = ref.tiny_model()
    if ctx.is_server:
        metrics = MetricsWriter(out, rank, ctx.role)
        loop = ServerLoop(
            ctx, flatten_params(model), metrics, LivenessMonitor(ctx.store, ctx.worker_ranks, 30.0)
        )
        ctx.start_clock()
        loop.run()
        centre = loop.gather_final_theta()
        metrics.close()
        shutdown(ctx)
        return {"centre": centre.tolist(), "version": loop.shard.version}
    ctx.start_clock()
    run = _trajectory(ctx, ref.sgd(), EASGD_STEPS, Turns(ctx.store, "easgd"))
    shutdown(ctx)
    return run


def test_easgd_with_tau_3_and_default_alpha_matches_the_reference(tmp_path):
    """Two workers, one shard, exchanges after steps 3 and 6 (worker 0 first), α = β/W: bit for
    bit, each replica's θ after every step and at the end, each staleness, the centre θ̃."""
    server, *workers = spawn(_easgd, 3, tmp_path, str(tmp_path), timeout_s=120)
    replicas = ref.Replicas(2, ref.sgd())
    script = [0, 1] * EASGD_STEPS
    expected = ref.easgd(replicas.models, replicas.step, script, tau=TAU, alpha=0.9 / 2)
    assert expected.pushes == [(0, 0), (1, 1), (0, 1), (1, 1)]
    for w, run in enumerate(workers):
        # finish exchanges nothing (EASGD_STEPS is a multiple of τ): θ after it is step 6's
        assert_trajectory(run["theta"], expected.replicas[w], f"easgd worker {w}", atol=0)
        assert_trajectory(run["theta"][-1:], [expected.final[w]], f"easgd worker {w} at the end", 0)
        staleness = [info["staleness_versions"] for info in run["info"][TAU - 1 :: TAU]]
        assert [(w, s) for s in staleness] == [p for p in expected.pushes if p[0] == w]
    assert server["version"] == len(expected.pushes)
    assert_trajectory([server["centre"]], [expected.server[-1]], "easgd centre", atol=0)
