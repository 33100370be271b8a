"""Gossip's worker, step by step, against hand-computed values: what ``after_step`` pulls or
sends and to whom, the mailbox fold (plain, with the step boundaries, push-sum), and the
consensus distance d = (1/W)·Σ_i ‖θ_i − θ̄‖₂ (docs/algorithms.md#gossip). One worker is driven
with its transport faked (the test fills the real mailbox as the serving thread would) and the
consensus all-reduces faked as the other workers' sums; the distance is also measured for real
on the virtual cluster (``run_ranks``), where every schedule and variant drives it to zero."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import cloudburst.strategies.gossip.worker as gossip_worker
from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.comm.link import LinkEmulator, Topology
from cloudburst.config import RunConfig
from cloudburst.sim.run import run_ranks
from cloudburst.strategies.gossip import GossipStrategy
from tests.support import FakeNamespace

W = 4
ME = 1  # the driven worker's index (no servers: also its rank)


# ---------------------------------------------------------------------------- one worker, faked
class _Replica(nn.Module):
    def __init__(self, values, dtype=torch.float32):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor(values, dtype=dtype))


class _FakeTransport:
    """The worker's end of gossip: pulls answered from ``replies`` (θ_j, j's step; or None,
    a refused reply), pushes recorded; the mailbox is the real one, filled by the test."""

    def __init__(self):
        self.replies: list[tuple[torch.Tensor, int] | None] = []
        self.pulls: list[tuple[int, int]] = []  # (peer rank, our step)
        self.pushes: list[tuple[int, list[float], float, int]] = []  # (rank, θ, weight, step)
        self.mailbox = None
        self.counters = None

    def start(self, snapshot, mailbox) -> None:
        self.snapshot, self.mailbox = snapshot, mailbox

    def pull(self, peer: int, out: torch.Tensor, step: int) -> int | None:
        self.pulls.append((peer, step))
        reply = self.replies.pop(0)
        if reply is None:
            return None
        out.copy_(reply[0])
        return reply[1]

    def push(self, peer: int, payload: torch.Tensor, weight: float, step: int) -> None:
        self.pushes.append((peer, payload.tolist(), weight, step))

    def check(self) -> None:
        pass

    keepalive = merge_serving_stats = check

    def dropped_peers(self) -> list[int]:
        return []


def _ctx(spans: bool = True, **overrides) -> SimpleNamespace:
    cfg = RunConfig(strategy="gossip", workers=W, dataset="synthetic", out="unused")
    cfg = cfg.replace(**{"consensus_every_steps": 1000, **overrides})
    return FakeNamespace(cfg=cfg, rank=ME, worker_index=ME, num_servers=0,
                         worker_ranks=list(range(W)), workers_group="workers",
                         groups={"requests": "requests", "replies": "replies"},
                         topology=Topology((0, 0, 1, 1) if spans else (0, 0, 0, 0)),
                         link=LinkEmulator(LinkSpec(1.0, 1.0)),
                         comm=SimpleNamespace(now=lambda: 0.0))  # fmt: skip


def _worker(values, dtype=torch.float32, spans: bool = True, **overrides):
    strategy = GossipStrategy(_ctx(spans, **overrides))
    model = _Replica(values, dtype)
    strategy.wrap(model, None)  # gossip keeps no optimizer state
    strategy.transport = fake = _FakeTransport()
    strategy.start()
    return strategy, model, fake


def _set(model: nn.Module, values) -> None:
    """A local step: the optimizer leaves θ at ``values``."""
    with torch.no_grad():
        model.theta.copy_(torch.tensor(values, dtype=model.theta.dtype))


def _theta(model: nn.Module) -> list[float]:
    return model.theta.tolist()


def test_pull_every_k_steps_from_the_scheduled_peer_averages_the_boundaries():
    # k = 2, exponential W = 4: worker 1 pulls at steps 2, 4, 6 from 1+1, 1+2, 1+1.
    strategy, model, fake = _worker([1.0, 2.0, 3.0], gossip_every=2)
    peer_theta = torch.tensor([5.0, 6.0, 7.0])
    fake.replies = [(peer_theta, 1), None, (peer_theta, 5)]
    _set(model, [1.5, 2.5, 3.5])
    strategy.after_step(8)  # no round: θ as the step left it, published as θ^b
    assert fake.pulls == [] and strategy.step_info() == {"peer": None}
    assert _theta(model) == [1.5, 2.5, 3.5]
    _set(model, [1.75, 2.75, 3.75])  # θ_i; θ_i^b = (1.5, 2.5, 3.5)
    strategy.after_step(8)
    assert fake.pulls == [(2, 2)]
    # (θ_i^b + θ_j)/2 + (θ_i − θ_i^b) = (3.25, 4.25, 5.25) + 0.25
    assert _theta(model) == [3.5, 4.5, 5.5]
    assert strategy.step_info() == {"peer": 2, "peer_lag_steps": 1}
    strategy.after_step(8)
    strategy.after_step(8)  # the reply is refused: θ unchanged, the round counted as skipped
    assert fake.pulls == [(2, 2), (3, 4)]
    assert _theta(model) == [3.5, 4.5, 5.5]
    assert strategy.rounds_skipped == 1 and strategy.step_info()["peer"] == 3
    strategy.after_step(8)
    strategy.after_step(8)  # θ_i = θ_i^b here: (θ_i + θ_j) / 2
    assert fake.pulls == [(2, 2), (3, 4), (2, 6)]
    assert _theta(model) == [4.25, 5.25, 6.25]
    assert strategy.step_info() == {"peer": 2, "peer_lag_steps": 1}
    assert strategy.report()["gossip_rounds"] == 3


def test_pull_without_full_step_averages_the_post_step_replica():
    strategy, model, fake = _worker([1.0, 2.0, 3.0], gossip_full_step=False)
    fake.replies = [(torch.tensor([5.0, 6.0, 7.0]), 0)]
    _set(model, [3.0, 4.0, 5.0])
    strategy.after_step(8)
    assert fake.pulls == [(2, 1)]
    assert _theta(model) == [4.0, 5.0, 6.0]  # (θ_i + θ_j) / 2


def test_push_sends_the_post_step_replica_and_folds_the_mailbox_at_the_next_boundary():
    # ring, k = 2: worker 1 pushes θ to worker 2 at steps 2 and 4; its own θ does not change.
    kw = dict(gossip_variant="push", gossip_schedule="ring", gossip_every=2)
    strategy, model, fake = _worker([1.0, 2.0, 4.0], **kw)
    fake.mailbox.deposit(torch.tensor([4.0, 5.0, 6.0]), 1.0)
    fake.mailbox.deposit(torch.tensor([1.0, 2.0, 5.0]), 1.0)
    _set(model, [2.0, 3.0, 6.0])  # θ_j; θ_j^b = (1, 2, 4)
    strategy.after_step(8)
    # (θ_j^b + Σ received)/(1 + n) + (θ_j − θ_j^b) = (2, 3, 5) + (1, 1, 2)
    assert _theta(model) == [3.0, 4.0, 7.0]
    assert fake.pushes == [] and strategy.messages_folded == 2
    _set(model, [3.5, 4.5, 7.5])
    strategy.after_step(8)  # an empty mailbox: nothing folded; a push of θ as it is
    assert fake.pushes == [(2, [3.5, 4.5, 7.5], 1.0, 2)]
    assert _theta(model) == [3.5, 4.5, 7.5] and strategy.messages_folded == 2
    assert strategy.step_info() == {"peer": 2}
    fake.mailbox.deposit(torch.tensor([0.5, 0.5, 0.5]), 1.0)  # arrived during step 3
    _set(model, [4.5, 5.5, 8.5])
    strategy.after_step(8)  # (θ^b + m)/2 + (θ − θ^b) = (2, 2.5, 4) + (1, 1, 1)
    assert _theta(model) == [3.0, 3.5, 5.0] and strategy.messages_folded == 3
    strategy.after_step(8)
    assert fake.pushes[1] == (2, [3.0, 3.5, 5.0], 1.0, 4)
    assert strategy.report()["messages_folded"] == 3


def test_push_without_full_step_folds_into_the_post_step_replica():
    strategy, model, fake = _worker([0.0, 0.0], gossip_variant="push", gossip_full_step=False)
    fake.mailbox.deposit(torch.tensor([3.0, 6.0]), 1.0)
    fake.mailbox.deposit(torch.tensor([2.0, 3.0]), 1.0)
    _set(model, [1.0, 3.0])
    strategy.after_step(8)
    assert _theta(model) == [2.0, 4.0]  # (θ + Σ received) / (1 + n)
    assert fake.pushes == [(2, [2.0, 4.0], 1.0, 1)]


def test_push_sum_halves_the_weight_on_each_push_and_folds_numerators_and_weights():
    strategy, model, fake = _worker([2.0, 4.0], gossip_variant="push", gossip_push_sum=True)
    strategy.after_step(8)  # keeps w/2 = 0.5, sends θ·w/2 with weight 0.5 to 1 + 2^0
    assert fake.pushes == [(2, [1.0, 2.0], 0.5, 1)] and strategy.weight == 0.5
    fake.mailbox.deposit(torch.tensor([3.0, 0.0]), 0.25)
    fake.mailbox.deposit(torch.tensor([1.0, 1.0]), 0.25)
    strategy.after_step(8)
    # (θ·w + Σ numerators)/(w + Σ weights) = ((1, 2) + (4, 1)) / 1 = (5, 3); w = 1, then halved
    assert _theta(model) == [5.0, 3.0]
    assert fake.pushes[1] == (3, [2.5, 1.5], 0.5, 2)  # exponential: 1 + 2^1
    assert strategy.weight == 0.5 and strategy.messages_folded == 2
    assert strategy.report()["push_sum_weight"] == 0.5


@pytest.mark.parametrize("variant", ["pull", "push"])
def test_a_step_with_nothing_received_and_no_pull_leaves_the_parameters_untouched(variant):
    # Float64 parameters: rewriting them through the fp32 flat vector would round them. A
    # push does not change the sender; a pull variant's step without a round changes nothing.
    third = [1 / 3, 2 / 3]
    strategy, model, fake = _worker(third, torch.float64, gossip_variant=variant, gossip_every=3)
    for _ in range(2 if variant == "pull" else 6):
        strategy.after_step(8)
        assert _theta(model) == third
    assert fake.pulls == [] and len(fake.pushes) == (0 if variant == "pull" else 2)


# ---------------------------------------------------------------------------- consensus distance
# Four replicas of two values; worker 1 is driven, the others' θ are given.
REPLICAS = [[0.0, 0.0], [3.0, 0.0], [0.0, 6.0], [5.0, 2.0]]


def _hand_distance(replicas) -> float:
    w = len(replicas)
    mean = [sum(r[k] for r in replicas) / w for k in range(len(replicas[0]))]
    return sum(math.dist(r, mean) for r in replicas) / w


class _OtherWorkers:
    """The consensus all-reduces, faked: the first call adds the other workers' θ, the second
    their distances ‖θ_j − θ̄‖; each call's arguments are recorded."""

    def __init__(self, replicas):
        self.replicas, self.calls = replicas, []

    def all_reduce_sum(self, tensor, group, stats, link=None, spans_nodes=False, **kw):
        self.calls.append((tensor.numel(), group, stats, link, spans_nodes, kw))
        others = [r for i, r in enumerate(self.replicas) if i != ME]
        if len(self.calls) % 2:
            tensor.add_(torch.tensor(others).sum(0))
        else:
            mean = torch.tensor(self.replicas, dtype=torch.float64).mean(0)
            tensor.add_(sum(torch.linalg.vector_norm(torch.tensor(r) - mean) for r in others))


@pytest.mark.parametrize("spans", [True, False])
def test_consensus_distance_is_the_mean_distance_to_the_average_over_the_workers_group(
    monkeypatch, spans
):
    # d = (1/W)·Σ_i ‖θ_i − θ̄‖₂: θ̄ = (2, 2); distances 2√2, √5, √20, 3 over 4 workers.
    assert _hand_distance(REPLICAS) == pytest.approx(
        (2 * math.sqrt(2) + math.sqrt(5) + math.sqrt(20) + 3) / 4
    )
    others = _OtherWorkers(REPLICAS)
    monkeypatch.setattr(gossip_worker, "all_reduce_sum", others.all_reduce_sum)
    strategy, model, _ = _worker([9.0, 9.0], spans=spans)
    _set(model, REPLICAS[ME])
    assert strategy.consensus_distance() == pytest.approx(_hand_distance(REPLICAS), rel=1e-6)
    # Two all-reduces (θ̄, then the distances) over the workers' group, counted apart in
    # measure_stats, on the job's link, as crossing nodes when the workers span them.
    ctx = strategy.ctx
    assert [c[:5] for c in others.calls] == [
        (2, "workers", strategy.measure_stats, ctx.link, spans),
        (1, "workers", strategy.measure_stats, ctx.link, spans),
    ]
    assert [type(c[4]) for c in others.calls] == [bool, bool]
    assert all(c[5] == {"comm": ctx.comm} for c in others.calls)


def test_a_measurement_is_reported_once_at_the_step_it_was_made(monkeypatch):
    others = _OtherWorkers(REPLICAS)
    monkeypatch.setattr(gossip_worker, "all_reduce_sum", others.all_reduce_sum)
    strategy, model, _ = _worker(REPLICAS[ME], consensus_every_steps=2, gossip_variant="push")
    d = _hand_distance(REPLICAS)
    strategy.after_step(8)
    assert strategy.step_info() == {"peer": 2} and others.calls == []
    strategy.after_step(8)
    info = strategy.step_info()
    assert info["consensus_step"] == 2 and info["consensus_distance"] == pytest.approx(d)
    assert set(strategy.step_info()) == {"peer"}  # reported once
    assert strategy.consensus_history == [[2, pytest.approx(d)]]


def _measure(ctx, replicas) -> float:
    model = _Replica(replicas[ctx.worker_index])
    strategy = GossipStrategy(ctx)
    strategy.wrap(model, None)  # gossip keeps no optimizer state
    return strategy.consensus_distance()


@pytest.mark.parametrize(
    "replicas",
    [
        [[0.0, 0.0], [3.0, 0.0], [0.0, 6.0]],  # θ̄ = (1, 2): (√5 + √8 + √17) / 3
        REPLICAS,
    ],
)
def test_consensus_distance_on_the_virtual_cluster_matches_the_hand_value(replicas):
    cfg = RunConfig(strategy="gossip", workers=len(replicas), dataset="synthetic", out="unused")
    distances = run_ranks(cfg, _measure, replicas)
    expected = _hand_distance(replicas)
    assert distances == [pytest.approx(expected, rel=1e-6)] * len(replicas)
    if len(replicas) == 3:
        assert expected == pytest.approx((math.sqrt(5) + math.sqrt(8) + math.sqrt(17)) / 3)


# ---------------------------------------------------------------------------- whole runs
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
    model = nn.Linear(3, 2)  # 8 values
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rank, results = ctx.rank, []
    for variant in VARIANTS:
        # One job, one set of gossip groups, one strategy after the other: each finish
        # returns only once every worker's serving task has ended.
        steps = ROUNDS * variant.get("gossip_every", 1)
        cfg = ctx.cfg.replace(consensus_every_steps=steps // 2, **variant)
        start = [float((rank + 1) * (i - 3) + 10 * rank) for i in range(8)]
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
@pytest.mark.parametrize("compress", ["none", "int8"])
def test_consensus_distance_falls_to_zero_for_every_schedule_and_variant(tmp_path, compress):
    """Exact gossip down to 1e-4 of where it started; int8 (lossy) by orders of magnitude, to
    its rounding floor (1e-2). Push-sum keeps Σ w_i = W exactly (the weights travel exact) and,
    exact, Σ w_i θ_i = Σ θ_i(0): the consensus is the average."""
    cfg = RunConfig(
        strategy="gossip", workers=4, dataset="synthetic", out=str(tmp_path), compress=compress
    )
    ranks = run_ranks(cfg, _consensus)
    floor = 1e-4 if compress == "none" else 1e-2
    for k, variant in enumerate(VARIANTS):
        runs = [r[k] for r in ranks]
        report = runs[0]["report"]
        steps = ROUNDS * variant.get("gossip_every", 1)
        assert report["gossip_rounds"] == ROUNDS, variant
        assert [s for s, _ in report["consensus_history"]] == [steps // 2, steps]
        assert runs[0]["initial"] > 10
        assert report["final_consensus_distance"] < floor * runs[0]["initial"], variant
        served = sum(r["report"]["fetches_served"] + r["report"]["pushes_received"] for r in runs)
        assert served == 4 * ROUNDS, variant  # every message was served exactly once
        if variant.get("gossip_push_sum"):
            weights = [r["report"]["push_sum_weight"] for r in runs]
            assert sum(weights) == pytest.approx(4.0, abs=1e-12)
            mean0 = [sum(r["start"][i] for r in runs) / 4 for i in range(8)]
            if compress == "none":
                for r in runs:
                    assert r["theta"] == pytest.approx(mean0, abs=1e-4)
