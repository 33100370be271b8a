"""DASO's global syncs as they cross the wire, on the virtual cluster (``run_ranks``; a
3-parameter linear model, lr 0, so that only the syncs move θ): the rotating sender, group and
dtype of each sync; when it is merged and broadcast over the node, and its bytes; that a
non-blocking sync does not hold its sender back; the emulated link's charge for each sync;
each step's phase; and with S > 0 the plain-PyTorch reference's trajectory (tests/reference.py;
tests/dist/test_daso.py runs the same ranks over gloo).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import LinkEmulator
from cloudburst.sim.run import run_ranks
from tests import reference as ref
from tests.support import (
    DASO_REF_STEPS,
    assert_follows_reference,
    daso_reference_cfg,
    daso_reference_drive,
    daso_reference_run,
    daso_sync_cfg,
    daso_sync_drive,
    daso_sync_model,
)

NUMEL = 3  # nn.Linear(2, 1)


# ---------------------------------------------------------------------------- the wire
def test_each_sync_is_sent_by_the_rotating_local_rank_over_its_global_group_in_its_dtype(tmp_path):
    """G = 3, P = 2, B = 1, S = 1, six steps and the finish: the k-th sync is sent by local
    rank k mod 3 of each node (0, 1, 2, 0, 1, 2, then the finish's blocking one by 0), over
    the group {g, g + 3}; the non-blocking ones in fp32 (daso_cycling_downcast none), the
    finish's blocking one in bf16 (daso_downcast bf16); each is the sender's θ of the moment.
    Seven syncs are counted on every rank, and each rank counts the bytes it sent."""
    cfg = daso_sync_cfg(
        tmp_path, workers=6, nodes=2, daso_downcast="bf16", daso_cycling_downcast="none"
    )
    wire: list[tuple[int, int, tuple[int, ...], torch.dtype, bool]] = []
    sent_is_theta: list[bool] = []

    def record(strategy, model):
        ctx = strategy.ctx
        real = ctx.comm.all_reduce

        def all_reduce(tensor, group=None, async_op=False):
            if group is ctx.groups["across"]:
                members = tuple(group.members)
                wire.append((strategy.local_steps, ctx.rank, members, tensor.dtype, async_op))
                sent_is_theta.append(torch.equal(tensor, ref.flat(model).to(tensor.dtype)))
            return real(tensor, group, async_op=async_op)

        ctx.comm.all_reduce = all_reduce

    def drive(ctx):
        s = daso_sync_drive(ctx, 6, 1000, 6, record=record)
        return s.syncs, s.report()["global_syncs"], s.report()["global_bytes"]

    counts = run_ranks(cfg, drive)
    # Bytes of θ each rank put on the global all-reduces: local rank 0 two fp32 syncs and
    # the bf16 one (3 · 4 + 3 · 4 + 3 · 2), local ranks 1 and 2 two fp32 syncs each.
    assert counts == [(7, 7, 30), (7, 7, 24), (7, 7, 24)] * 2
    assert all(sent_is_theta) and len(sent_is_theta) == 14
    got = sorted(wire)
    want = []
    for k, step in enumerate([1, 2, 3, 4, 5, 6, 6]):
        g = k % 3
        dtype = torch.bfloat16 if k == 6 else torch.float32
        for node in range(2):
            want.append((step, 3 * node + g, (g, g + 3), dtype, True))
    assert got == sorted(want)


# ---------------------------------------------------------------------------- overlap
@pytest.mark.parametrize("compress", ["none", "int8"])
def test_a_non_blocking_sync_does_not_hold_its_sender_when_it_starts(tmp_path, compress):
    """B = 2, S = 1 on 2 nodes × 2 across a 1 Gbit/s, 1 ms inter-node link: the syncs start
    after steps 2 and 4. Starting one costs no rank virtual time (the all-reduce overlaps the
    next step); the finish, which waits for the second and runs a blocking one, does."""
    extra = {} if compress != "none" else {"daso_downcast": "none"}
    cfg = daso_sync_cfg(
        tmp_path, workers=4, nodes=2, daso_global_skip=2, compress=compress,
        inter_node_link="1,1", **extra,
    )  # fmt: skip

    def drive(ctx):
        spent, ends = {}, []  # virtual seconds each after_step took; when the last ended

        def on_step(step, strategy, before, after):
            spent[step] = after - before
            ends.append(after)

        daso_sync_drive(ctx, 4, 1000, 4, on_step=on_step)
        return spent, ctx.comm.now() - ends[-1]

    for rank, (spent, finish) in enumerate(run_ranks(cfg, drive)):
        assert spent[2] == 0.0 and spent[4] == 0.0, rank  # the steps that start a sync
        assert finish >= 2e-3, rank  # at least the blocking sync's two latencies


# ---------------------------------------------------------------------------- the merge
@pytest.mark.parametrize("compress", ["none", "int8"])
def test_a_sync_is_merged_s_steps_after_it_started_and_broadcast_by_its_sender(tmp_path, compress):
    """B = 3, S = 2 on 2 nodes × 2, six steps and the finish: the sync started after step 3
    (by local rank 0) is merged after step 5 and broadcast over the node from its sender; the
    one started after step 6 (local rank 1) at the finish, then the finish's blocking one
    (local rank 0). Uncompressed (fp32), rank 2n + i holds after step 5 its node sender's
    merge (2S·θ_2n + θ_0 + θ_2) / (2S + P) = (5·θ_2n + θ_2(1−n)) / 6."""
    extra = {"daso_downcast": "none"} if compress == "none" else {}
    cfg = daso_sync_cfg(
        tmp_path, workers=4, nodes=2, daso_global_skip=3, daso_batches_to_wait=2,
        compress=compress, **extra,
    )  # fmt: skip

    def drive(ctx):
        broadcasts, thetas, models = [], [], []

        def record(strategy, model):
            real = ctx.comm.broadcast

            def broadcast(tensor, src, group=None):
                if group is ctx.groups["node"]:
                    broadcasts.append((strategy.local_steps, src))
                return real(tensor, src, group)

            ctx.comm.broadcast = broadcast
            models.append(model)

        def on_step(step, strategy, before, after):
            thetas.append(ref.flat(models[0]).clone())

        daso_sync_drive(ctx, 6, 1000, 6, on_step=on_step, record=record)
        return broadcasts, thetas

    results = run_ranks(cfg, drive)
    initial = [ref.flat(daso_sync_model(r)) for r in range(4)]
    for rank, (broadcasts, thetas) in enumerate(results):
        node = rank // 2
        assert broadcasts == [(5, 2 * node), (6, 2 * node + 1), (6, 2 * node)], rank
        for step in range(1, 5):  # nothing merged before step 5: lr 0, θ as it started
            assert torch.equal(thetas[step - 1], initial[rank]), (rank, step)
        if compress == "none":
            want = (5 * initial[2 * node] + initial[2 * (1 - node)]) / 6
            torch.testing.assert_close(thetas[4], want, rtol=1e-6, atol=1e-6)


def test_the_merge_broadcast_is_counted_as_sent_by_its_sender_and_received_by_the_rest(tmp_path):
    """2 nodes × 2, B = 3, S = 2: the sync started after step 3 by local rank 0 is merged after
    step 5 (besides the traffic of every step, as at step 4) and broadcast over the node from
    its sender: the sender counts its 3 fp32 values (12 bytes) as sent and intra-node, the
    other rank of the node as received."""
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


# ---------------------------------------------------------------------------- the link
GBIT, LATENCY_MS = 1e6, 1e-6  # a link so fast that its emulated waits are nanoseconds


@pytest.mark.parametrize("compress", ["none", "int8"])
def test_the_emulated_link_charges_every_global_sync_its_time(tmp_path, compress):
    """The real run's link emulator (given to the context as ``--link`` does): on 2 nodes
    × 2, B = 2, S = 1, four steps and the finish, local rank 0 of each node sends twice (the
    sync after step 2, fp32 (uncompressed) or int8; the finish's blocking one, bf16 or int8)
    and local rank 1 once (after step 4). Each sync is charged on its sender the link's time:
    a ring all-reduce over P = 2 of its bytes, 2(P−1)·latency + 2(P−1)/P·bytes/bandwidth; an
    int8 one the all-gather of one packed vector, (P−1)·latency + 260 bytes/bandwidth (3
    codes padded to a 256-value block, and its 4-byte scale)."""
    extra = {} if compress != "none" else {"daso_downcast": "bf16"}
    cfg = daso_sync_cfg(
        tmp_path, workers=4, nodes=2, daso_global_skip=2, compress=compress, **extra
    )
    bw, lat = GBIT * 1e9 / 8, LATENCY_MS / 1e3

    def drive(ctx):
        link = LinkEmulator(LinkSpec(GBIT, LATENCY_MS))
        s = daso_sync_drive(dataclasses.replace(ctx, link=link), 4, 1000, 4)
        return s.stats.emulated_link_s

    charged = run_ranks(cfg, drive)
    if compress == "none":
        fp32, bf16 = 2 * lat + NUMEL * 4 / bw, 2 * lat + NUMEL * 2 / bw
        want = [fp32 + bf16, fp32, fp32 + bf16, fp32]
    else:
        one = lat + 260 / bw
        want = [2 * one, one, 2 * one, one]
    assert charged == pytest.approx(want, rel=1e-9, abs=0.0)


# ---------------------------------------------------------------------------- phases
def test_phases_are_counted_per_step_from_where_the_step_started(tmp_path):
    """4 steps an epoch, 16 steps (4 epochs), warm-up 0.5 epochs, cool-down 1: steps 1–2
    are warm-up (blocking syncs), 3–12 cycling (B = 2, S = 1: syncs after 4, 6, 8, 10, 12),
    13–16 cool-down (blocking); the finish adds a blocking sync at step 16. The counts of
    steps per phase and the log of syncs (step, phase, B, S) follow each step's start
    position, not the middle of its epoch (which would call steps 1–2 cycling)."""
    cfg = daso_sync_cfg(
        tmp_path, workers=4, nodes=2, daso_global_skip=2, daso_warmup_epochs=0.5,
        daso_cooldown_epochs=1.0,
    )  # fmt: skip

    def drive(ctx):
        s = daso_sync_drive(ctx, 16, 4, 16)
        return s.report()["phase_steps"], s.sync_log

    results = run_ranks(cfg, drive)
    want_log = [(1, "warmup", 2, 0), (2, "warmup", 2, 0)]
    want_log += [(t, "cycling", 2, 1) for t in (4, 6, 8, 10, 12)]
    want_log += [(t, "cooldown", 2, 0) for t in (13, 14, 15, 16, 16)]
    for phase_steps, log in results:
        assert phase_steps == {"warmup": 2, "cycling": 10, "cooldown": 4}
        assert log == want_log


# ---------------------------------------------------------------------------- the reference
@pytest.mark.parametrize("wait", [2, 1, 0])
def test_daso_follows_the_reference_on_the_virtual_cluster(tmp_path, wait):
    """The merge S steps after each sync with the weight 2S, the rotating sender and the node
    broadcast follow the reference's trajectory."""
    runs = run_ranks(daso_reference_cfg(str(tmp_path), wait), daso_reference_drive)
    assert_follows_reference(runs, daso_reference_run(wait), DASO_REF_STEPS)
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
