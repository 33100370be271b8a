"""DASO's pieces without processes: the merge formula and the B/S schedule."""

import pytest
import torch

from cloudburst.strategies.daso import COOLDOWN, CYCLING, WARMUP, DasoSchedule, daso_merge


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
    """A schedule that is in its cycling phase from the first epoch on (B, S and the rest are
    the class's defaults unless given, unlike :func:`_schedule`'s pinned ones)."""
    return DasoSchedule(total_epochs=20, warmup_epochs=0, cooldown_epochs=0, **kw)


# A scripted epoch-loss sequence and the schedule it must produce: (loss, phase of that
# epoch, change made at its end, B and S after it).
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


def test_a_loss_exactly_at_the_stability_threshold_is_no_improvement():
    schedule = _cycling(stability_level=0.5, patience=1)
    assert schedule.end_epoch(2.0) is None
    assert schedule.end_epoch(1.0) == "reduce"  # 1.0 = 2.0 · (1 − 0.5): not below it


def test_b_and_s_are_divided_in_whole_batches():
    schedule = _cycling(global_skip=5, batches_to_wait=3, patience=1, reduction_factor=2)
    schedule.end_epoch(1.0)
    assert schedule.end_epoch(1.0) == "reduce"
    assert (schedule.global_skip, schedule.batches_to_wait) == (2, 1)
    assert type(schedule.global_skip) is int and type(schedule.batches_to_wait) is int


@pytest.mark.parametrize("max_skips, wait", [(4, 1), (6, 1), (12, 3)])
def test_a_reset_waits_a_quarter_of_the_largest_skip_in_whole_batches(max_skips, wait):
    schedule = _cycling(global_skip=1, batches_to_wait=1, max_global_skips=max_skips, patience=1)
    schedule.end_epoch(1.0)
    assert schedule.end_epoch(1.0) == "reset"
    assert (schedule.global_skip, schedule.batches_to_wait) == (max_skips, wait)
    assert type(schedule.batches_to_wait) is int
