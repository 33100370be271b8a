"""Gossip without processes: the peer schedules (who), the mixing rules (weights; also into a
CUDA replica, skipped without one), and the transport's thread-safe pieces (snapshot, mailbox,
request validation)."""

import math
import random
import threading
from collections import Counter

import pytest
import torch

from cloudburst.comm.gossip import Mailbox, Snapshot, check_request, decode_weight, encode_weight
from cloudburst.comm.messages import Header, Kind
from cloudburst.strategies.gossip import (
    PeerSchedule,
    pull_average,
    push_fold,
    push_sum_fold,
    push_sum_split,
)

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


def test_exact_peers_of_the_ring_and_the_exponential_graph():
    graph = PeerSchedule("ring", 5)
    assert [graph.peer(i, r) for r in (0, 7) for i in range(5)] == [1, 2, 3, 4, 0] * 2
    assert [PeerSchedule("ring", 3).peer(i, 5) for i in range(3)] == [1, 2, 0]
    # exponential: i + 2^(r mod ⌈log2 W⌉) mod W; W = 3 and 4 both have two exponents (1, 2).
    assert [PeerSchedule("exponential", 3).peer(2, r) for r in range(4)] == [0, 1, 0, 1]
    assert [PeerSchedule("exponential", 4).peer(3, r) for r in range(4)] == [0, 1, 0, 1]
    assert [PeerSchedule("exponential", 2).peer(1, r) for r in range(3)] == [0, 0, 0]


def test_random_is_uniform_over_the_others_and_depends_on_seed_worker_round():
    # j = Random("gossip:seed:i:r").randrange(W − 1), skipping i itself; the seed defaults to 0.
    default, seeded = PeerSchedule("random", 5), PeerSchedule("random", 5, seed=0)
    for i in range(5):
        for r in range(30):
            j = random.Random(f"gossip:0:{i}:{r}").randrange(4)
            assert default.peer(i, r) == seeded.peer(i, r) == (j + 1 if j >= i else j)
    graph = PeerSchedule("random", 5, seed=0)
    counts = Counter(graph.peer(2, r) for r in range(4000))
    assert set(counts) == {0, 1, 3, 4}
    assert all(abs(c / 4000 - 0.25) < 0.03 for c in counts.values())
    seq = [graph.peer(0, r) for r in range(50)]
    assert seq != [PeerSchedule("random", 5, seed=1).peer(0, r) for r in range(50)]
    assert seq != [graph.peer(1, r) for r in range(50)]


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
def test_pull_average_is_the_midpoint_in_place_keeping_the_step_past_own_boundary():
    a = torch.tensor([1.0, -3.0, 0.5])
    out = pull_average(a, torch.tensor([2.0, 5.0, 0.25]))
    assert out is a and a.tolist() == [1.5, 1.0, 0.375]
    # θ_i = θ_i^b + step: (θ_i^b + θ_j)/2 + step, computed in place.
    boundary, step = torch.tensor([1.0, -3.0]), torch.tensor([0.25, 0.5])
    own = boundary + step
    out = pull_average(own, torch.tensor([3.0, 5.0]), boundary)
    assert out is own and own.tolist() == [2.25, 1.5]


def test_push_fold_averages_own_and_everything_received_keeping_the_step_past_the_boundary():
    own = torch.tensor([1.0, 2.0])
    received = torch.tensor([3.0, 4.0]) + torch.tensor([5.0, 9.0])
    assert push_fold(own, received, 2).tolist() == [3.0, 5.0]
    assert push_fold(torch.tensor([7.0]), torch.zeros(1), 0).tolist() == [7.0]
    # one message: (θ_j + θ_received) / (1 + 1), in place
    own = torch.tensor([1.0, -2.0, 0.5])
    out = push_fold(own, torch.tensor([3.0, 4.0, 0.25]), 1)
    assert out is own and own.tolist() == [2.0, 1.0, 0.375]
    # with the boundary: (θ^b + received) / (1 + n) + (θ − θ^b)
    boundary = torch.tensor([1.0, 2.0])
    own = boundary + torch.tensor([0.5, -0.25])
    assert push_fold(own, torch.tensor([3.0, 4.0]), 1, boundary).tolist() == [2.5, 2.75]
    own = boundary + torch.tensor([0.5, -0.25])
    assert push_fold(own, received, 2, boundary).tolist() == pytest.approx([3.5, 4.75])
    assert push_fold(torch.tensor([7.0]), torch.zeros(1), 0, torch.ones(1)).tolist() == [7.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_folds_of_host_messages_into_a_cuda_replica():
    """The pulled θ_j and the mailbox's sums arrive in host memory while θ is on the GPU: each
    fold moves them to θ's device, with the values the CPU gives."""
    own, peer = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([3.0, 6.0, 0.0])
    out = pull_average(own.cuda(), peer)
    assert out.device.type == "cuda" and out.cpu().tolist() == [2.0, 4.0, 2.0]
    boundary = torch.tensor([1.0, 0.0, 2.0])  # θ_i + (θ_j − θ_i^b) / 2
    assert pull_average(own.cuda(), peer, boundary.cuda()).cpu().tolist() == [2.0, 5.0, 3.0]
    received = torch.tensor([7.0, 10.0, 12.0])  # 3 messages
    out = push_fold(own.cuda(), received, 3)
    assert out.device.type == "cuda" and out.cpu().tolist() == [2.0, 3.0, 4.0]  # (θ + Σ)/(1 + n)
    boundary = torch.tensor([1.0, 2.0, 0.0])  # θ^b: the local step since is kept in full
    out = push_fold(own.cuda(), received, 3, boundary.cuda())
    assert out.cpu().tolist() == [2.0, 3.0, 7.0]  # (θ^b + Σ) / (1 + n) + (θ − θ^b)
    numerators, weight_sum = torch.tensor([3.0, 0.0]), 0.5  # Σ θ_j·w_j, Σ w_j
    out, weight = push_sum_fold(torch.tensor([2.0, 4.0]).cuda(), 0.5, numerators, weight_sum)
    assert out.device.type == "cuda" and weight == 1.0
    assert out.cpu().tolist() == [4.0, 2.0]  # (θ·w + Σ numerators) / (w + Σ w)


@pytest.mark.parametrize("full_step", [True, False])
def test_stale_pulls_keep_every_step_in_the_mean_only_with_the_boundary(full_step):
    """What the serving thread gives a puller is the peer's θ at its last step boundary, one
    step older than the puller's own θ. Four workers in step on the exponential graph (each
    round a permutation: every worker pulled from once): averaging the boundaries keeps every
    local step in the replicas' mean; averaging the post-step θ_i with the peer's boundary
    keeps half of it (the learning rate of the mean halved: 90.3 % vs sync's 93.0 % at the
    defaults, docs/algorithms.md#gossip)."""
    graph = PeerSchedule("exponential", 4)
    gen = torch.Generator().manual_seed(0)
    published = [torch.randn(5, generator=gen) for _ in range(4)]
    moved = torch.zeros(5)
    for r in range(6):
        steps = [torch.randn(5, generator=gen) for _ in range(4)]
        moved += sum(steps)
        new = [
            pull_average(published[i] + steps[i], published[graph.peer(i, r)],
                         published[i] if full_step else None)
            for i in range(4)
        ]  # fmt: skip
        before = sum(published)
        published = new
        expected = before + (sum(steps) if full_step else sum(steps) / 2)
        assert torch.allclose(sum(published), expected, atol=1e-5)


def test_push_sum_keeps_the_weighted_sum_and_debiases():
    # Worker 0 (θ=2, w=1) sends half to worker 1 (θ=6, w=1): 1 keeps θ·w = 6 + 1, w = 1.5.
    kept, sent = push_sum_split(1.0)
    assert (kept, sent) == (0.5, 0.5)
    theta1, w1 = push_sum_fold(torch.tensor([6.0]), 1.0, torch.tensor([2.0]) * sent, sent)
    assert w1 == 1.5 and theta1.item() == pytest.approx(7.0 / 1.5)
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
