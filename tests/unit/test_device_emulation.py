"""The emulated device's padding, spread over per-layer forward and backward hooks
(cloudburst.comm.device_emulation), on a fake clock: no sleeps, no processes."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cloudburst.comm.device_emulation import FORWARD_SHARE, DeviceEmulator, padding_s
from tests.support import FakeTime


def mlp(widths: list[int]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def step(model: nn.Module, emulator: DeviceEmulator, clock: FakeTime, compute_s: float) -> None:
    """One step whose real compute took ``compute_s``: forward, backward, then end_step with
    the step's busy time as the loop measures it (compute + the hooks' sleeps)."""
    t0 = clock.perf_counter()
    emulator.begin_step()
    model(torch.randn(4, model[0].in_features)).square().mean().backward()
    emulator.end_step(compute_s + clock.perf_counter() - t0)


def test_padding_is_max_of_compute_and_minimum_times_factor_less_compute() -> None:
    assert padding_s(0.1, 0.5, 1.0) == pytest.approx(0.4)
    assert padding_s(0.7, 0.5, 1.0) == 0.0  # slower than the device: nothing added
    assert padding_s(0.2, 0.0, 2.5) == pytest.approx(0.3)  # a straggler: (f-1) x compute
    assert padding_s(0.2, 0.5, 2.0) == pytest.approx(0.8)  # both: 0.5 x 2 - 0.2
    with pytest.raises(ValueError, match="no trainable parameters"):
        DeviceEmulator(nn.ReLU(), 1.0, 1.0, lambda s: None, lambda: 0.0)


def test_hooks_sleep_the_planned_padding_by_parameter_share_forward_one_third() -> None:
    model, clock = mlp([8, 16, 4]), FakeTime(0.0)
    emulator = DeviceEmulator(model, 0.9, 1.0, clock.sleep, clock.perf_counter)
    plan = emulator.begin_step()  # no step seen yet: plan the whole minimum
    model(torch.randn(3, 8)).sum().backward()
    fwd, bwd = 0.9 * FORWARD_SHARE, 0.9 * (1 - FORWARD_SHARE)
    assert (plan.slept_forward_s, plan.slept_backward_s) == pytest.approx((fwd, bwd))
    n0, n2 = 8 * 16 + 16, 16 * 4 + 4  # parameters of layers 0 and 2
    # Forward: layer 0, then 2; backward: layer 2 first (the output side), then 0.
    assert plan.events == [("forward", "0"), ("forward", "2"), ("backward", "2"), ("backward", "0")]
    expected = [fwd * n0, fwd * n2, bwd * n2, bwd * n0]
    assert clock.sleeps == pytest.approx([s / (n0 + n2) for s in expected])


def test_every_step_totals_the_device_time_and_overshoot_is_repaid() -> None:
    """Over any number of steps the sleeps equal the sum of each step's padding, less the
    debt still open (at most the last step's overshoot), whatever the computes were."""
    model, clock = mlp([6, 12, 12, 3]), FakeTime(0.0)
    emulator = DeviceEmulator(model, 0.5, 1.5, clock.sleep, clock.perf_counter)
    rng = random.Random(0)
    owed = 0.0
    for _ in range(40):
        compute_s = rng.choice([0.01, 0.1, 0.3, 0.6])
        step(model, emulator, clock, compute_s)
        owed += padding_s(compute_s, 0.5, 1.5)
        assert sum(clock.sleeps) == pytest.approx(owed + emulator.debt_s)
        last = emulator.last  # the step's own account (what an instrumented run records)
        assert last.compute_s == pytest.approx(compute_s)
        assert last.slept_s + last.remainder_s == pytest.approx(
            padding_s(compute_s, 0.5, 1.5) - last.debt_before_s + last.debt_after_s
        )
        assert emulator.debt_s <= padding_s(0.01, 0.5, 1.5) + 1e-12
    # A step of exactly predicted compute and no debt needs no remainder after the hooks.
    for compute_s in (0.6, 0.1, 0.1):
        step(model, emulator, clock, compute_s)
    assert emulator.last_remainder_s == 0.0 and emulator.debt_s == 0.0
    assert emulator.last.slept_s == pytest.approx(padding_s(0.1, 0.5, 1.5))


def test_a_step_slower_than_predicted_is_padded_at_its_end() -> None:
    model, clock = mlp([4, 4, 2]), FakeTime(0.0)
    emulator = DeviceEmulator(model, 0.0, 2.0, clock.sleep, clock.perf_counter)  # a 2x straggler
    step(model, emulator, clock, 0.2)  # nothing predicted yet: all 0.2 s at the end
    assert emulator.last.slept_s == 0.0 and emulator.last_remainder_s == pytest.approx(0.2)
    step(model, emulator, clock, 0.3)  # 0.2 s in the hooks, 0.1 s more at the end
    assert (emulator.last.slept_s, emulator.last_remainder_s) == pytest.approx((0.2, 0.1))


def test_no_sleep_outside_a_step_nor_beyond_a_phase_budget() -> None:
    model, clock = mlp([4, 4, 2]), FakeTime(0.0)
    emulator = DeviceEmulator(model, 1.0, 1.0, clock.sleep, clock.perf_counter)
    with torch.no_grad():
        model(torch.randn(2, 4))  # an evaluation: not a training step
    model(torch.randn(2, 4)).sum().backward()
    assert clock.sleeps == []
    plan = emulator.begin_step()
    for _ in range(3):  # the layers run three times in this "step"
        model(torch.randn(2, 4)).sum().backward()
    assert plan.slept_forward_s == pytest.approx(plan.forward_s)
    assert plan.slept_backward_s == pytest.approx(plan.backward_s)


@pytest.fixture
def gloo_group():
    """A world-size-1 gloo group in this process (DDP runs its buckets and hooks as usual)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_ddp_buckets_start_while_earlier_layers_backward_is_still_emulated(gloo_group) -> None:
    """DDP's comm hook runs for the bucket of the last layers after only their backward
    shares were slept, and for each earlier bucket later: the all-reduces overlap with the
    emulated backward of the layers before them (as on a device)."""
    model, clock = mlp([64, 1024, 1024, 256, 8]), FakeTime(0.0)
    emulator = DeviceEmulator(model, 1.0, 1.0, clock.sleep, clock.perf_counter)
    ddp = DistributedDataParallel(model, process_group=gloo_group, bucket_cap_mb=1)
    backward_done_at_launch: list[int] = []

    def hook(state, bucket):
        backward = [name for phase, name in emulator.plan.events if phase == "backward"]
        backward_done_at_launch.append(len(backward))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    layers = 4
    for iteration in range(3):
        backward_done_at_launch.clear()
        t0 = clock.perf_counter()
        emulator.begin_step()
        ddp(torch.randn(4, 64)).square().mean().backward()
        emulator.end_step(clock.perf_counter() - t0)  # no compute on the fake clock: all padding
        if iteration == 0:
            continue  # DDP's first iteration has one bucket; it rebuilds them after it
        # Several buckets (DDP's own sizes: the last two layers, then one layer each).
        assert len(backward_done_at_launch) >= 2
        assert backward_done_at_launch[0] < layers  # the first all-reduce starts mid-backward
        assert backward_done_at_launch == sorted(set(backward_done_at_launch))
        assert backward_done_at_launch[-1] == layers
