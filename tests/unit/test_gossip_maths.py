"""Gossip without processes: the peer schedules, the mixing rules (also into a CUDA replica),
the transport's thread-safe pieces; one worker's ``after_step`` against hand-computed values
(pulls, pushes, mailbox folds, consensus distance d = (1/W)·Σ_i ‖θ_i − θ̄‖₂) with its transport
and all-reduces faked; then every schedule and variant on the virtual cluster (``run_ranks``)."""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import cloudburst.strategies.gossip.worker as gossip_worker
from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.comm.gossip import Mailbox, Snapshot, check_request, decode_weight, encode_weight
from cloudburst.comm.link import LinkEmulator, Topology
from cloudburst.comm.messages import Header, Kind
from cloudburst.config import RunConfig
from cloudburst.sim.run import run_ranks
from cloudburst.strategies.gossip import (
    GossipStrategy,
    PeerSchedule,
    pull_average,
    push_fold,
    push_sum_fold,
    push_sum_split,
)
from tests.support import FakeNamespace

SCHEDULES = ["random", "ring", "exponential"]


# ---------------------------------------------------------------------------- graph
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_never_itself_always_a_worker_and_deterministic(schedule):
    for workers in range(2, 18):
        graph = PeerSchedule(schedule, workers, seed=3)
        again = PeerSchedule(schedule, workers, seed=3)
        for worker in range(workers):
            for r in range(60):
                peer = graph.peer(worker, r)
                assert 0 <= peer < workers and peer != worker
                assert again.peer(worker, r) == peer


def test_exact_peers_of_the_ring():
    graph = PeerSchedule("ring", 5)
    assert [graph.peer(i, r) for r in (0, 7) for i in range(5)] == [1, 2, 3, 4, 0] * 2
    assert [PeerSchedule("ring", 3).peer(i, 5) for i in range(3)] == [1, 2, 0]


def test_random_is_uniform_over_the_others_and_depends_on_seed_worker_round():
    # j = Random("gossip:seed:i:r").randrange(W − 1), skipping i itself; the seed defaults to 0.
    default, seeded = PeerSchedule("random", 5), PeerSchedule("random", 5, seed=0)
    for i in range(5):
        for r in range(30):
            j = random.Random(f"gossip:0:{i}:{r}").randrange(4)
            assert default.peer(i, r) == seeded.peer(i, r) == (j + 1 if j >= i else j)
    counts = Counter(seeded.peer(2, r) for r in range(4000))
    assert set(counts) == {0, 1, 3, 4}
    assert all(abs(c / 4000 - 0.25) < 0.03 for c in counts.values())
    seq = [seeded.peer(0, r) for r in range(50)]
    assert seq != [PeerSchedule("random", 5, seed=1).peer(0, r) for r in range(50)]


@pytest.mark.parametrize("workers", [2, 3, 4, 5, 8, 12, 16])
def test_exponential_graph_cycles_through_the_powers_of_two(workers):
    graph = PeerSchedule("exponential", workers)
    exponents = math.ceil(math.log2(workers))
    assert graph.exponents == exponents
    for i in range(workers):
        offsets = [(graph.peer(i, r) - i) % workers for r in range(2 * exponents)]
        assert offsets == [2**k for k in range(exponents)] * 2
    # One cycle of rounds connects every worker to every other (directed paths of hops 2^k).
    reach = {0}
    for r in range(exponents):
        reach |= {graph.peer(i, r) for i in reach}
    assert reach == set(range(workers))


def test_exponential_graph_with_push_sum_averages_exactly_in_log2_w_rounds():
    # SGP's property of the one-peer exponential graph: W = 2^m workers, synchronous rounds,
    # each keeps half and sends half to i + 2^(r mod m): after m rounds all hold the average.
    workers = 8
    graph = PeerSchedule("exponential", workers)
    theta = [torch.tensor([float(i), float(i * i)]) for i in range(workers)]
    weight = [1.0] * workers
    for r in range(graph.exponents):
        inbox = [[] for _ in range(workers)]
        for i in range(workers):
            weight[i], sent = push_sum_split(weight[i])
            inbox[graph.peer(i, r)].append((theta[i] * sent, sent))
        for j in range(workers):
            num, w = sum(n for n, _ in inbox[j]), sum(w for _, w in inbox[j])
            theta[j], weight[j] = push_sum_fold(theta[j], weight[j], num, w)
    mean = torch.tensor([3.5, sum(i * i for i in range(8)) / 8])
    for i in range(workers):
        assert torch.equal(theta[i], mean) and weight[i] == 1.0


def test_bad_schedules_and_workers_outside_the_job_are_refused():
    with pytest.raises(ValueError, match="gossip_schedule"):
        PeerSchedule("star", 4)
    with pytest.raises(ValueError, match="2 workers"):
        PeerSchedule("ring", 1)
    for schedule in SCHEDULES:  # the error names the valid range
        for worker in (5, 6, -1):
            with pytest.raises(ValueError, match=rf"^worker {worker} is not in 0\.\.4$"):
                PeerSchedule(schedule, 5).peer(worker, 0)


# ---------------------------------------------------------------------------- mixing
NO_CUDA = not torch.cuda.is_available()
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(NO_CUDA, reason="no CUDA")])
# Each fold's arguments (own θ first) and the θ it leaves in own, in place.
FOLDS = [
    (pull_average, ([1.0, -3.0, 0.5], [2.0, 5.0, 0.25]), [1.5, 1.0, 0.375]),  # the midpoint
    # with own θ^b = (1, −3) and a step of (0.25, 0.5) past it: (θ^b + θ_j)/2 + step
    (pull_average, ([1.25, -2.5], [3.0, 5.0], [1.0, -3.0]), [2.25, 1.5]),
    # push: (θ + Σ received) / (1 + n); nothing received: unchanged
    (push_fold, ([1.0, 2.0], [8.0, 13.0], 2), [3.0, 5.0]),
    (push_fold, ([1.0, -2.0, 0.5], [3.0, 4.0, 0.25], 1), [2.0, 1.0, 0.375]),
    (push_fold, ([7.0], [0.0], 0), [7.0]),
    # with θ^b = (1, 2) and a step of (0.5, −0.25): (θ^b + Σ received)/(1 + n) + (θ − θ^b)
    (push_fold, ([1.5, 1.75], [3.0, 4.0], 1, [1.0, 2.0]), [2.5, 2.75]),
    (push_fold, ([1.5, 1.75], [8.0, 13.0], 2, [1.0, 2.0]), pytest.approx([3.5, 4.75])),
    (push_fold, ([7.0], [0.0], 0, [1.0]), [7.0]),
]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("fold, args, expected", FOLDS)
def test_folds_average_in_place_keeping_the_step_past_the_boundary(fold, args, expected, device):
    """The message (θ_j, Σ received) arrives in host memory, θ and θ^b may be on the GPU."""
    own, message, *rest = [torch.tensor(a) if isinstance(a, list) else a for a in args]
    own = own.to(device)
    out = fold(own, message, *[r.to(device) if torch.is_tensor(r) else r for r in rest])
    assert out is own and own.cpu().tolist() == expected


@pytest.mark.parametrize("full_step", [True, False])
def test_stale_pulls_keep_every_step_in_the_mean_only_with_the_boundary(full_step):
    """A pull serves the peer's θ at its last step boundary: averaging the boundaries keeps every
    local step in the replicas' mean; averaging the post-step θ_i with the boundary, half."""
    graph = PeerSchedule("exponential", 4)
    gen = torch.Generator().manual_seed(0)
    published = [torch.randn(5, generator=gen) for _ in range(4)]
    for r in range(6):
        steps = [torch.randn(5, generator=gen) for _ in range(4)]
        new = [
            pull_average(published[i] + steps[i], published[graph.peer(i, r)],
                         published[i] if full_step else None)
            for i in range(4)
        ]  # fmt: skip
        expected = sum(published) + (sum(steps) if full_step else sum(steps) / 2)
        published = new
        assert torch.allclose(sum(published), expected, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_push_sum_keeps_the_weighted_sum_and_debiases(device):
    # Worker 0 (θ=2, w=1) sends half to worker 1 (θ=6, w=1, on ``device``): θ·w = 6 + 1, w = 1.5.
    kept, sent = push_sum_split(1.0)
    assert (kept, sent) == (0.5, 0.5)
    own = torch.tensor([6.0], device=device)
    theta1, w1 = push_sum_fold(own, 1.0, torch.tensor([2.0]) * sent, sent)
    assert theta1 is own and w1 == 1.5 and theta1.item() == pytest.approx(7.0 / 1.5)
    # The mass Σ θ_i w_i (2·0.5 + 7) and Σ w_i (2) are conserved: the average stays 4.
    assert 2.0 * kept + theta1.item() * w1 == pytest.approx(8.0) and kept + w1 == 2.0
    # Nothing received: unchanged.
    t, w = push_sum_fold(torch.tensor([1.0]), 0.25, torch.zeros(1), 0.0)
    assert t.item() == 1.0 and w == 0.25


# ---------------------------------------------------------------------------- transport parts
def test_weight_travels_exactly_in_an_int64():
    for w in [1.0, 0.5, 2.0**-60, 1 / 3, 123.456]:
        assert decode_weight(encode_weight(w)) == w
    h = Header(Kind.PUSH, shard=1, numel=3, aux=encode_weight(0.125))
    assert decode_weight(Header.from_tensor(h.to_tensor()).aux) == 0.125


def test_requests_are_validated():
    ok = Header(Kind.PUSH, shard=2, numel=10, aux=encode_weight(0.5))
    assert check_request(ok, 2, 10) is None
    assert check_request(Header(Kind.FETCH, shard=2), 2, 10) is None
    assert "names worker 3" in check_request(Header(Kind.FETCH, shard=3), 2, 10)
    assert "expected 10" in check_request(Header(Kind.PUSH, shard=2, numel=9), 2, 10)
    assert "expected 0" in check_request(Header(Kind.FETCH, shard=2, numel=4), 2, 10)
    assert "kind" in check_request(Header(Kind.INIT, shard=2), 2, 10)
    bad = Header(Kind.PUSH, shard=2, numel=10, aux=encode_weight(float("nan")))
    assert "weight" in check_request(bad, 2, 10)


def test_snapshot_never_hands_out_a_buffer_being_written():
    snap = Snapshot(4)
    snap.publish(torch.full((4,), 1.0), version=1)
    with snap.acquire() as (theta, version):
        held = theta.clone()
        for v in range(2, 6):  # the main thread publishes while a send is in progress
            snap.publish(torch.full((4,), float(v)), version=v)
        assert torch.equal(theta, held) and version == 1
    with snap.acquire() as (theta, version):
        assert theta.tolist() == [5.0] * 4 and version == 5


def test_snapshot_under_concurrent_publish_is_always_whole():
    snap = Snapshot(1000)
    snap.publish(torch.zeros(1000), 0)
    stop, overlapping = threading.Event(), threading.Event()
    torn, seen = [], set()

    def reader():
        while not stop.is_set():
            with snap.acquire() as (theta, version):
                if not bool((theta == float(version)).all()):
                    torn.append(version)
                seen.add(version)
            if version > 0:
                overlapping.set()

    t = threading.Thread(target=reader)
    t.start()
    for v in range(1, 2000):
        snap.publish(torch.full((1000,), float(v)), v)
        if v == 1000:  # the reader has read while publishing goes on (a liveness bound)
            assert overlapping.wait(timeout=60)
    stop.set()
    t.join()
    assert torn == [] and len(seen) > 1


def test_mailbox_sums_counts_and_weights_between_takes():
    box = Mailbox(2)
    box.deposit(torch.tensor([1.0, 2.0]), 0.5)
    box.deposit(torch.tensor([3.0, 4.0]), 0.25)
    acc, n, w = box.take()
    assert acc.tolist() == [4.0, 6.0] and n == 2 and w == 0.75
    box.deposit(torch.tensor([1.0, 1.0]), 1.0)
    assert acc.tolist() == [4.0, 6.0]  # still valid: deposits went to the other buffer
    acc, n, w = box.take()
    assert acc.tolist() == [1.0, 1.0] and n == 1 and w == 1.0
    acc, n, w = box.take()
    assert acc.tolist() == [0.0, 0.0] and n == 0 and w == 0.0


W = 4
ME = 1  # the driven worker's index (no servers: also its rank)


# ---------------------------------------------------------------------------- one worker, faked
class _Replica(nn.Module):
    def __init__(self, values, dtype=torch.float32):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor(values, dtype=dtype))


class _FakeTransport:
    """Pulls answered from ``replies`` ((θ_j, j's step), None: refused), pushes recorded; the
    mailbox is the real one, filled by the test."""

    def __init__(self):
        self.replies: list[tuple[torch.Tensor, int] | None] = []
        self.pulls: list[tuple[int, int]] = []  # (peer rank, our step)
        self.pushes: list[tuple[int, list[float], float, int]] = []  # (rank, θ, weight, step)
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
    model.theta.data.copy_(torch.tensor(values, dtype=model.theta.dtype))


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


@pytest.mark.parametrize("variant", ["pull", "push"])
def test_without_full_step_the_post_step_replica_is_averaged(variant):
    """(θ_i + θ_j) / 2, or (θ + Σ received) / (1 + n), of θ after the step: no boundary."""
    strategy, model, fake = _worker([0.0, 0.0], gossip_variant=variant, gossip_full_step=False)
    fake.replies = [(torch.tensor([5.0, 4.0]), 0)]
    for received in ([3.0, 6.0], [2.0, 3.0]) if variant == "push" else ():
        fake.mailbox.deposit(torch.tensor(received), 1.0)
    _set(model, [1.0, 3.0])
    strategy.after_step(8)
    assert _theta(model) == ([3.0, 3.5] if variant == "pull" else [2.0, 4.0])
    assert fake.pulls == ([(2, 1)] if variant == "pull" else [])
    assert fake.pushes == ([] if variant == "pull" else [(2, [2.0, 4.0], 1.0, 1)])


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
    # float64 θ (a rewrite through the fp32 flat vector would round it): a push leaves the
    # sender alone, a pull variant's step without a round changes nothing
    third = [1 / 3, 2 / 3]
    strategy, model, fake = _worker(third, torch.float64, gossip_variant=variant, gossip_every=3)
    for _ in range(2 if variant == "pull" else 6):
        strategy.after_step(8)
        assert _theta(model) == third
    assert fake.pulls == [] and len(fake.pushes) == (0 if variant == "pull" else 2)


# ---------------------------------------------------------------------------- consensus distance
# Four replicas of two values; worker 1 is driven, the others' θ are given.
REPLICAS = [[0.0, 0.0], [3.0, 0.0], [0.0, 6.0], [5.0, 2.0]]
# d = (1/W)·Σ_i ‖θ_i − θ̄‖₂: θ̄ = (2, 2); distances 2√2, √5, √20, 3 over 4 workers
DISTANCE = (2 * math.sqrt(2) + math.sqrt(5) + math.sqrt(20) + 3) / 4


class _OtherWorkers:
    """The consensus all-reduces: adds the others' θ, then their ‖θ_j − θ̄‖; calls recorded."""

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
    others = _OtherWorkers(REPLICAS)
    monkeypatch.setattr(gossip_worker, "all_reduce_sum", others.all_reduce_sum)
    strategy, model, _ = _worker([9.0, 9.0], spans=spans)
    _set(model, REPLICAS[ME])
    assert strategy.consensus_distance() == pytest.approx(DISTANCE, rel=1e-6)
    # two all-reduces over the workers' group, in measure_stats, on the link, spanning as they do
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
    strategy.after_step(8)
    assert strategy.step_info() == {"peer": 2} and others.calls == []
    strategy.after_step(8)
    info = strategy.step_info()
    assert info["consensus_step"] == 2 and info["consensus_distance"] == pytest.approx(DISTANCE)
    assert set(strategy.step_info()) == {"peer"}  # reported once
    assert strategy.consensus_history == [[2, pytest.approx(DISTANCE)]]


def _measure(ctx, replicas) -> float:
    model = _Replica(replicas[ctx.worker_index])
    strategy = GossipStrategy(ctx)
    strategy.wrap(model, None)  # gossip keeps no optimizer state
    return strategy.consensus_distance()


@pytest.mark.parametrize(
    "replicas, distance",
    [
        ([[0.0, 0.0], [3.0, 0.0], [0.0, 6.0]], (math.sqrt(5) + math.sqrt(8) + math.sqrt(17)) / 3),
        (REPLICAS, DISTANCE),
    ],
)
def test_consensus_distance_on_the_virtual_cluster_matches_the_hand_value(replicas, distance):
    cfg = RunConfig(strategy="gossip", workers=len(replicas), dataset="synthetic", out="unused")
    assert run_ranks(cfg, _measure, replicas) == [pytest.approx(distance, rel=1e-6)] * len(replicas)


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
    rank, results = ctx.rank, []
    for variant in VARIANTS:
        # one strategy after the other: each finish returns once every server has ended
        steps = ROUNDS * variant.get("gossip_every", 1)
        cfg = ctx.cfg.replace(consensus_every_steps=steps // 2, **variant)
        start = [float((rank + 1) * (i - 3) + 10 * rank) for i in range(8)]
        assign_flat(model, torch.tensor(start))
        strategy = GossipStrategy(dataclasses.replace(ctx, cfg=cfg))
        strategy.wrap(model, None)  # gossip keeps no optimizer state
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
    """Down to 1e-4 of where it started (int8: its rounding floor, 1e-2). Push-sum keeps
    Σ w_i = W exactly and, uncompressed, ends on the average."""
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
