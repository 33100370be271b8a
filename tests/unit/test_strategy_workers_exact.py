"""Exact behaviour of the local SGD family's workers that the broader tests leave open:
Streaming DiLoCo's fragment schedule for fragment counts that do not divide the period (and
whose offsets are not symmetric), send buffers of each fragment's own size, α = 1 mixing, the
balanced split's tie-breaking and later targets, gossip's push fold of a single message and
the byte counts of DASO's merge broadcast.
Every expectation is worked out by hand from docs/algorithms.md."""

from __future__ import annotations

import warnings

import pytest
import torch

from cloudburst.sim.run import run_ranks
from cloudburst.strategies.gossip.worker import push_fold
from cloudburst.strategies.local_sgd import split_fragments
from tests import reference as ref
from tests.support import BATCH, daso_sync_cfg, daso_sync_drive, one_diloco_worker


def _sizes(parts: list[list[torch.Tensor]]) -> list[int]:
    return [sum(p.numel() for p in part) for part in parts]


# ---------------------------------------------------------------------------- the split
def test_the_split_breaks_a_tie_towards_the_earlier_boundary_counting_from_zero():
    # Four tensors of 2: the half-way target 4 is exactly the boundary after tensor 2.
    assert _sizes(split_fragments([torch.zeros(2) for _ in range(4)], 2)) == [4, 4]
    # Three tensors of 2, F = 2: target 3 lies between boundaries 2 and 4 (a tie): the
    # earlier boundary wins.
    assert _sizes(split_fragments([torch.zeros(2) for _ in range(3)], 2)) == [2, 4]


def test_the_split_aims_every_cut_at_its_own_share_of_the_elements():
    # Six equal tensors in three fragments: cuts at 1/3 and 2/3 of the elements.
    assert _sizes(split_fragments([torch.zeros(1) for _ in range(6)], 3)) == [2, 2, 2]
    # Unequal tensors (total 100) in four: targets 25, 50, 75 meet the ends 30, 50, 80.
    params = [torch.zeros(n) for n in (5, 5, 20, 20, 30, 20)]  # ends 5 10 30 50 80 100
    assert _sizes(split_fragments(params, 4)) == [30, 20, 30, 20]


# ---------------------------------------------------------------------------- the schedule
def _sends(monkeypatch, steps: int, **kw) -> list[tuple[int, int]]:
    strategy, replicas, recorder = one_diloco_worker(
        monkeypatch, diloco_outer_lr=1.0, diloco_outer_momentum=0.0, **kw
    )
    for step in range(1, steps + 1):
        replicas.step(0, step)
        strategy.after_step(BATCH)
    return [(step, numel) for step, numel, _ in recorder.calls]


@pytest.mark.parametrize(
    ("period", "offsets"),
    [
        # F = 3 on the tiny model: fragments of 40, 8 and 27 values. Fragment k is due after
        # the steps t with t mod H = ⌊(k+1)·H/F⌋ mod H.
        (4, (1, 2, 0)),  # ⌊4/3⌋ = 1, ⌊8/3⌋ = 2, 12/3 = 4 ≡ 0
        (6, (2, 4, 0)),
    ],
)
def test_each_of_three_fragments_is_sent_at_its_own_offset(monkeypatch, period, offsets):
    steps = 2 * period
    sizes = (40, 8, 27)
    expected = sorted(
        (t, sizes[k])
        for k, offset in enumerate(offsets)
        for t in range(1, steps + 1)
        if t % period == offset
    )
    sends = _sends(monkeypatch, steps, period=period, fragments=3, fragment_delay=0)
    assert sends == expected
    # every fragment is sent exactly twice in two periods
    assert sorted(n for _, n in sends) == [8, 8, 27, 27, 40, 40]


@pytest.mark.parametrize("fragments", [1, 2, 3])
def test_sending_fragments_never_resizes_a_buffer_in_use(monkeypatch, fragments):
    # Each fragment's send buffer is a vector of its own size (the whole model's persistent
    # buffer only with one fragment): torch warns whenever it must resize an ``out`` tensor,
    # so a run (and its finish) with every warning an error shows that none is resized.
    kw = dict(period=6, fragments=fragments, fragment_delay=1)
    strategy, replicas, recorder = one_diloco_worker(
        monkeypatch, diloco_outer_lr=1.0, diloco_outer_momentum=0.0, **kw
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(1, 8):
            replicas.step(0, step)
            strategy.after_step(BATCH)
        strategy.finish()
    assert sum(n for _, n, _ in recorder.calls) >= 75


def test_alpha_1_keeps_the_local_fragment_and_still_steps_the_global_one(monkeypatch):
    # θ_fragment ← α·θ_local + (1 − α)·θ_global with α = 1: the replica keeps its own θ.
    strategy, replicas, _ = one_diloco_worker(
        monkeypatch,
        diloco_outer_lr=1.0,
        diloco_outer_momentum=0.0,
        period=2,
        fragments=1,
        fragment_delay=1,
        fragment_alpha=1.0,
    )
    for step in (1, 2):
        replicas.step(0, step)
        strategy.after_step(BATCH)
    sent = ref.flat(replicas.models[0])
    replicas.step(0, 3)
    local = ref.flat(replicas.models[0])
    assert not torch.equal(local, sent)
    strategy.after_step(BATCH)  # fragment sent after step 2 is applied now
    assert torch.equal(ref.flat(replicas.models[0]), local)
    torch.testing.assert_close(strategy.global_theta.detach(), sent, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- gossip push
def test_push_fold_of_one_message_is_the_midpoint():
    # (θ_j + θ_received) / (1 + 1), in place
    own = torch.tensor([1.0, -2.0, 0.5])
    out = push_fold(own, torch.tensor([3.0, 4.0, 0.25]), 1)
    assert out is own and own.tolist() == [2.0, 1.0, 0.375]
    # with the boundary: (θ^b + received) / 2 + (θ − θ^b)
    boundary = torch.tensor([1.0, 2.0])
    own = boundary + torch.tensor([0.5, -0.25])
    assert push_fold(own, torch.tensor([3.0, 4.0]), 1, boundary).tolist() == [2.5, 2.75]


# ---------------------------------------------------------------------------- DASO's broadcast
def test_the_daso_merge_broadcast_is_counted_as_sent_by_its_sender_and_received_by_the_rest(
    tmp_path,
):
    # 2 nodes × 2, B = 3, S = 2: the sync started after step 3 by local rank 0 is merged
    # after step 5 (besides the traffic of every step, as at step 4) and broadcast over the
    # node from its sender: the sender counts its 3 fp32 values (12 bytes) as sent and
    # intra-node, the other rank of the node as received.
    cfg = daso_sync_cfg(
        tmp_path, workers=4, nodes=2, daso_global_skip=3, daso_batches_to_wait=2,
        daso_downcast="none",
    )  # fmt: skip

    def drive(ctx):
        seen = []

        def on_step(step, strategy, before, after):
            s = strategy.stats
            seen.append((s.sent_bytes, s.intra_node_bytes, s.received_bytes, s.inter_node_bytes))

        daso_sync_drive(ctx, 6, 1000, 6, on_step=on_step)
        # step 5 less step 4 (the same per-step traffic, without a sync or a merge)
        return tuple(a - 2 * b + c for a, b, c in zip(seen[4], seen[3], seen[2], strict=True))

    results = run_ranks(cfg, drive)
    assert results == [(12, 12, 0, 0), (0, 0, 12, 0), (12, 12, 0, 0), (0, 0, 12, 0)]
