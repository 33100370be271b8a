"""DASO: the merge formula and the B/S schedule; its global syncs on the virtual cluster (a
3-parameter model at lr 0: only the syncs move θ): sender, group, dtype, merge, broadcast, bytes,
overlap, the link's charge, phases, and the reference's trajectory (over gloo: tests/dist)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import LinkEmulator
from cloudburst.sim.run import run_ranks
from cloudburst.strategies.daso import COOLDOWN, CYCLING, WARMUP, DasoSchedule, daso_merge
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


# ---------------------------------------------------------------------------- the schedule
@pytest.mark.parametrize("s", [0, 1, 2])
def test_merge_formula_on_scripted_values_for_two_and_three_nodes(s):
    local = torch.tensor([1.0, -2.0, 4.0])
    for thetas in (
        [[1.0, -2.0, 4.0], [3.0, 2.0, 0.0]],
        [[1.0, -2.0, 4.0], [3.0, 2.0, 0.0], [-1.0, 6.0, 8.0]],
    ):
        p = len(thetas)
        sent = torch.tensor(thetas).sum(0)
        got = daso_merge(local, sent, s, p)
        expected = [
            (2 * s * local[i].item() + sum(t[i] for t in thetas)) / (2 * s + p) for i in range(3)
        ]
        assert got.tolist() == pytest.approx(expected)
    # S = 0 is the plain average of what the nodes sent.
    assert daso_merge(local, torch.tensor([4.0, 0.0, 4.0]), 0, 2).tolist() == [2.0, 0.0, 2.0]


def _schedule(**kw) -> DasoSchedule:
    args = dict(total_epochs=20, warmup_epochs=2, cooldown_epochs=2, global_skip=4,
                batches_to_wait=1, max_global_skips=8, stability_level=0.05,
                patience=2)  # fmt: skip
    return DasoSchedule(**{**args, **kw})


def _cycling(**kw) -> DasoSchedule:
    """A schedule cycling from the first epoch, B, S and the rest the class's defaults."""
    return DasoSchedule(total_epochs=20, warmup_epochs=0, cooldown_epochs=0, **kw)


# Epoch losses and the schedule they make: (loss, phase, change at its end, B and S after).
SCRIPT = [
    (2.0, WARMUP, None, 4, 1),  # warm-up epochs never change B or S
    (1.9, WARMUP, None, 4, 1),
    (1.5, CYCLING, None, 4, 1),  # improving
    (1.2, CYCLING, None, 4, 1),
    (1.19, CYCLING, None, 4, 1),  # < 5 % better: bad epoch 1
    (1.18, CYCLING, "reduce", 2, 1),  # bad epoch 2: B and S halve (S floors at 1)
    (1.0, CYCLING, None, 2, 1),  # improving again
    (0.99, CYCLING, None, 2, 1),
    (0.99, CYCLING, "reduce", 1, 1),
    (0.98, CYCLING, None, 1, 1),
    (0.98, CYCLING, "reset", 8, 2),  # B is 1 and stable again: reset to max, S = B/4
    (0.5, CYCLING, None, 8, 2),
    (0.49, CYCLING, None, 8, 2),
    (0.49, CYCLING, "reduce", 4, 1),
    (0.3, CYCLING, None, 4, 1),
    (0.3, CYCLING, None, 4, 1),
    (0.3, CYCLING, "reduce", 2, 1),
    (0.3, CYCLING, None, 2, 1),
    (0.3, COOLDOWN, None, 2, 1),  # cool-down: blocking again, no more changes
    (0.3, COOLDOWN, None, 2, 1),
]


def test_schedule_transitions_on_a_scripted_loss_sequence():
    sched = _schedule()
    for epoch, (loss, phase, change, b, s) in enumerate(SCRIPT):
        assert sched.phase() == phase, epoch
        assert sched.blocking() == (phase != CYCLING)
        assert sched.end_epoch(loss) == change, epoch
        assert (sched.global_skip, sched.batches_to_wait) == (b, s), epoch


def test_schedule_checkpoint_resumes_the_same_trajectory(tmp_path):
    from cloudburst.records.checkpoint import load_checkpoint, save_checkpoint

    a = _schedule()
    for loss, *_ in SCRIPT[:9]:
        a.end_epoch(loss)
    save_checkpoint(tmp_path / "daso.pt", "daso-schedule", a.state_dict())
    b = _schedule(global_skip=7, batches_to_wait=3)  # different until loaded
    b.load_state_dict(load_checkpoint(tmp_path / "daso.pt", "daso-schedule"))
    assert b.state_dict() == a.state_dict()
    for loss, *_ in SCRIPT[9:]:
        assert a.end_epoch(loss) == b.end_epoch(loss)
        assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="unknown"):
        b.load_state_dict({"bogus": 1})


def test_a_fixed_schedule_and_one_blocking_every_batch_never_adapt():
    fixed = _schedule(adaptive=False)
    for loss, *_ in SCRIPT:
        assert fixed.end_epoch(loss) is None
    assert (fixed.global_skip, fixed.batches_to_wait) == (4, 1)
    every_batch = _schedule(global_skip=0, batches_to_wait=0, warmup_epochs=0)
    assert every_batch.phase() == CYCLING and every_batch.blocking()
    schedule = _cycling(global_skip=0, patience=1)
    assert [schedule.end_epoch(1.0) for _ in range(4)] == [None] * 4
    assert schedule.global_skip == 0


def test_phases_are_those_of_the_position_asked_about_counted_in_steps():
    sched = _schedule(total_epochs=4, warmup_epochs=0.5, cooldown_epochs=0.5)
    steps_per_epoch = 10  # a fractional warm-up and cool-down
    phases = [sched.phase(step / steps_per_epoch) for step in range(40)]
    assert phases == [WARMUP] * 5 + [CYCLING] * 30 + [COOLDOWN] * 5
    # blocking() asks about the position given, not the current epoch
    schedule = DasoSchedule(total_epochs=20, warmup_epochs=2, cooldown_epochs=2, epoch=5)
    assert not schedule.blocking()
    assert schedule.blocking(0.5) and schedule.blocking(19.0)


# Patience 1, two epochs' losses: the change after the second, then B and S (None: unchecked).
EPOCH_PAIRS = [
    (dict(stability_level=0.5), 2.0, "reduce", None),  # 1.0 = 2.0·(1 − 0.5): not below it
    (dict(global_skip=5, batches_to_wait=3, reduction_factor=2), 1.0, "reduce", (2, 1)),
    # B = 1 and stable: a reset to the largest skip, waiting a quarter of it
    (dict(global_skip=1, batches_to_wait=1, max_global_skips=4), 1.0, "reset", (4, 1)),
    (dict(global_skip=1, batches_to_wait=1, max_global_skips=6), 1.0, "reset", (6, 1)),
    (dict(global_skip=1, batches_to_wait=1, max_global_skips=12), 1.0, "reset", (12, 3)),
]


@pytest.mark.parametrize("kw, first, change, b_s", EPOCH_PAIRS)
def test_an_epoch_that_does_not_improve_enough_reduces_or_resets_b_and_s(kw, first, change, b_s):
    schedule = _cycling(patience=1, **kw)
    assert [schedule.end_epoch(first), schedule.end_epoch(1.0)] == [None, change]
    assert b_s is None or (schedule.global_skip, schedule.batches_to_wait) == b_s
    assert type(schedule.global_skip) is int and type(schedule.batches_to_wait) is int


# ---------------------------------------------------------------------------- the wire
def test_each_sync_is_sent_by_the_rotating_local_rank_over_its_global_group_in_its_dtype(tmp_path):
    """G = 3, P = 2, B = S = 1: the k-th sync is θ of local rank g = k mod 3 of each node over
    {g, g + 3}, fp32; the finish's blocking one bf16. Every rank counts 7 syncs and its bytes."""
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
    # local rank 0: two fp32 syncs and the bf16 one (3·4 + 3·4 + 3·2); the others two fp32
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
    """B = 3, S = 2, 2 nodes × 2: the sync of step 3 (local rank 0) is merged after step 5 and
    broadcast from its sender; step 6's (local rank 1) and the blocking one at the finish. In
    fp32 rank 2n + i then holds (2S·θ_2n + θ_0 + θ_2) / (2S + P); the broadcast's 12 bytes
    count as sent and intra-node on the sender, as received on the other rank."""
    extra = {"daso_downcast": "none"} if compress == "none" else {}
    cfg = daso_sync_cfg(
        tmp_path, workers=4, nodes=2, daso_global_skip=3, daso_batches_to_wait=2,
        compress=compress, **extra,
    )  # fmt: skip

    def drive(ctx):
        broadcasts, thetas, models, seen = [], [], [], []

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
            s = strategy.stats
            seen.append((s.sent_bytes, s.intra_node_bytes, s.received_bytes, s.inter_node_bytes))

        daso_sync_drive(ctx, 6, 1000, 6, on_step=on_step, record=record)
        merge_bytes = tuple(
            a - 2 * b + c for a, b, c in zip(seen[4], seen[3], seen[2], strict=True)
        )
        return broadcasts, thetas, merge_bytes

    results = run_ranks(cfg, drive)
    initial = [ref.flat(daso_sync_model(r)) for r in range(4)]
    for rank, (broadcasts, thetas, merge_bytes) in enumerate(results):
        node = rank // 2
        assert broadcasts == [(5, 2 * node), (6, 2 * node + 1), (6, 2 * node)], rank
        for step in range(1, 5):  # nothing merged before step 5: lr 0, θ as it started
            assert torch.equal(thetas[step - 1], initial[rank]), (rank, step)
        if compress == "none":
            want = (5 * initial[2 * node] + initial[2 * (1 - node)]) / 6
            torch.testing.assert_close(thetas[4], want, rtol=1e-6, atol=1e-6)
            assert merge_bytes == ((12, 12, 0, 0) if rank % 2 == 0 else (0, 0, 12, 0)), rank


# ---------------------------------------------------------------------------- the link
GBIT, LATENCY_MS = 1e6, 1e-6  # a link so fast that its emulated waits are nanoseconds


@pytest.mark.parametrize("compress", ["none", "int8"])
def test_the_emulated_link_charges_every_global_sync_its_time(tmp_path, compress):
    """2 nodes × 2, B = 2, S = 1, four steps and the finish: local rank 0 sends after step 2
    (fp32 or int8) and at the finish (bf16 or int8), local rank 1 after step 4. Each sync is
    charged on its sender: a ring all-reduce over P = 2, 2(P−1)·latency + 2(P−1)/P·bytes/bw; an
    int8 all-gather, (P−1)·latency + 260 bytes/bw (a 256-value block and its scale)."""
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
    """4 steps an epoch, warm-up 0.5 epochs, cool-down 1: steps 1–2 warm-up, 3–12 cycling,
    13–16 cool-down (by each step's start position), in the counts and the sync log."""
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
    # every rank ends on finish's average, and another S gives another trajectory
    assert all(r[-1] == runs[0][-1] for r in runs)
    other = daso_reference_run(wait + 1 if wait < 2 else 0)
    gap = max(
        (torch.tensor(runs[0][t]) - other[0][t]).abs().max().item() for t in range(DASO_REF_STEPS)
    )
    assert gap > 1e-3


def test_the_reference_itself_merges_late_with_the_weight_2s_and_rotates():
    # the reference's own semantics on scripted numbers (one parameter per rank, lr 0)
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
