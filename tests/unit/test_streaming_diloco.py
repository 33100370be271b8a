"""The local SGD family's workers over a fake all-reduce (:class:`tests.support.LocalSgdJob`):
local SGD and DiLoCo against :mod:`tests.reference` step by step; streaming DiLoCo's split,
schedule, outer step and mixing by hand and against the reference (gloo: tests/dist)."""

from __future__ import annotations

import warnings

import pytest
import torch

from cloudburst.comm.link import Topology
from cloudburst.strategies.diloco import DilocoStrategy
from cloudburst.strategies.local_sgd import LocalSgdStrategy, split_fragments
from tests import reference as ref
from tests.reference import (
    assert_params_differ,
    assert_same_params,
    fragment_ranges,
    parity_diloco,
    parity_streaming_diloco,
    trained,
)
from tests.support import (
    BATCH,
    LocalSgdCtx,
    LocalSgdJob,
    one_diloco_worker,
    run_sim,
    sim_cfg,
    survivor_cfg,
)

# tiny_model's tensors: 40, 8, 24, 3 values; two fragments: [40] and [8, 24, 3]
FRAGMENT_0 = slice(0, 40)
FRAGMENT_1 = slice(40, 75)


# ---------------------------------------------------------------------------- local SGD
def _reference_args(workers: int):
    replicas = ref.Replicas(workers, ref.sgd())
    return replicas.models, replicas.step


def _job(monkeypatch, strategy: str, workers: int, ctx=None, **kw) -> LocalSgdJob:
    """W ``strategy`` workers (``kw``: their config, ``ctx``: their context's) on fresh replicas."""
    return LocalSgdJob(survivor_cfg(strategy, workers, **kw), ref.Replicas(workers, ref.sgd()),
                       monkeypatch, **(ctx or {}))  # fmt: skip


def _follows(job: LocalSgdJob, steps: int, expected: list[list[torch.Tensor]]):
    """``steps`` steps and the finish of ``job`` follow ``expected`` (the last entry: after
    finish); θ of each worker after each step."""
    got = job.run(steps)
    ended = [h[:-1] + [final] for h, final in zip(got, job.finish(), strict=True)]
    for run, want in zip(ended, expected, strict=True):
        for a, b in zip(run, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    return got


@pytest.mark.parametrize("steps, warmup, averages", [(7, 0, 3), (8, 3, 5)])
def test_local_sgd_follows_the_reference_with_a_final_average(monkeypatch, steps, warmup, averages):
    """Averages after every 3rd step, after each step of a post-local SGD warm-up, and in
    finish when the last step took none: after 3, 6 and finish; after 1, 2, 3, 6 and finish."""
    expected = ref.local_sgd(*_reference_args(2), steps=steps, period=3, warmup_steps=warmup)
    job = _job(monkeypatch, "local_sgd", 2, period=3, local_sgd_warmup_steps=warmup)
    got = _follows(job, steps, expected)
    assert not torch.equal(got[0][-1], got[1][-1])  # the replicas differed before finish
    assert [s.averages for s in job.strategies] == [averages] * 2
    assert [s.report()["averages"] for s in job.strategies] == [averages] * 2
    assert len(job.group.calls) == 2 * averages
    # each average: a ring all-reduce of 75 fp32 values over 2 workers, 2·(2−1)/2·300 bytes
    assert [s.report()["sent_bytes"] for s in job.strategies] == [averages * 300] * 2


@pytest.mark.parametrize(
    "strategy, workers, kw, steps, finish, averages",
    [
        ("local_sgd", 2, dict(period=3), 6, True, 2),  # finish after a full period: no average
        ("local_sgd", 2, dict(period=3, local_sgd_warmup_steps=2), 4, False, 3),  # 1, 2, 3; not 4
        ("local_sgd", 1, dict(period=2), 3, True, 0),  # one worker never averages
        ("diloco", 2, dict(period=2), 1, False, 0),  # no warm-up
        ("diloco", 2, dict(period=2), 4, True, 2),  # finish after a full period: no average
    ],
)
def test_the_averages_a_run_takes(monkeypatch, strategy, workers, kw, steps, finish, averages):
    job = _job(monkeypatch, strategy, workers, **kw)
    job.run(steps)
    if finish:
        job.finish()
    assert [s.averages for s in job.strategies] == [averages] * workers
    assert len(job.group.calls) == averages * workers


def test_local_sgd_global_params_are_the_replica_and_the_samples_of_all_workers(monkeypatch):
    job = _job(monkeypatch, "local_sgd", 2, period=2, batch_size=16)
    job.run(3)
    theta, samples = job.strategies[1].global_params()
    assert samples == 3 * 16 * 2
    assert torch.equal(theta, ref.flat(job.replicas.models[1]))


@pytest.mark.parametrize(
    "topology, spans", [(Topology((0, 1)), True), (None, False), (Topology((0, 0, 1)), False)]
)
def test_local_sgd_average_spans_nodes_on_the_link_when_its_workers_do(
    monkeypatch, topology, spans
):
    link = object()
    job = _job(monkeypatch, "local_sgd", 2, ctx=dict(topology=topology, link=link), period=1)
    job.run(1)
    calls = sorted(job.group.calls, key=lambda c: c[0])
    assert [(rank, across) for rank, _, across in calls] == [(0, spans), (1, spans)]
    assert not spans or all(c[1] is link for c in calls)  # the link carries what spans nodes


def test_local_sgd_state_dict_round_trip_keeps_the_average_count(monkeypatch):
    job = _job(monkeypatch, "local_sgd", 2, period=2)
    job.run(4)
    state = job.strategies[0].state_dict()
    assert state["averages"] == 2 and state["local_steps"] == 4
    fresh = LocalSgdStrategy(LocalSgdCtx(job.cfg, 0))
    fresh.wrap(ref.tiny_model(), None)
    fresh.load_state_dict({**state, "averages": 2.0})
    assert (fresh.averages, type(fresh.averages), fresh.local_steps) == (2, int, 4)


# ---------------------------------------------------------------------------- DiLoCo
@pytest.mark.parametrize(
    "workers, momentum, nesterov", [(2, 0.9, True), (2, 0.5, False), (1, 0.9, True)]
)
def test_diloco_strategy_follows_the_reference(monkeypatch, workers, momentum, nesterov):
    kw = dict(diloco_outer_lr=0.7, diloco_outer_momentum=momentum, diloco_nesterov=nesterov)
    expected = ref.diloco(*_reference_args(workers), steps=7, period=3, outer_lr=0.7,
                          outer_momentum=momentum, nesterov=nesterov)  # fmt: skip
    job = _job(monkeypatch, "diloco", workers, period=3, **kw)
    _follows(job, 7, expected)
    assert [s.averages for s in job.strategies] == [3] * workers


def test_diloco_without_momentum_is_local_sgd_even_with_nesterov_asked_for(monkeypatch):
    # Nesterov needs momentum (torch refuses it without): with μ = 0 it is simply left off.
    expected = ref.local_sgd(*_reference_args(2), steps=5, period=2)
    kw = dict(period=2, diloco_outer_lr=1.0, diloco_outer_momentum=0.0)
    _follows(_job(monkeypatch, "diloco", 2, **kw), 5, expected)


def test_diloco_loads_a_state_without_the_loop_counters(monkeypatch):
    job = _job(monkeypatch, "diloco", 1, period=1)
    job.run(2)
    saved = job.strategies[0].state_dict()
    fresh = DilocoStrategy(LocalSgdCtx(job.cfg, 0))
    fresh.wrap(ref.tiny_model(seed=3), None)
    fresh.load_state_dict({"global_theta": saved["global_theta"], "outer": saved["outer"]})
    assert fresh.local_steps == 0 and fresh.state_dict()["averages"] == 0
    assert torch.equal(fresh.global_theta.detach(), saved["global_theta"])


# ---------------------------------------------------------------------------- the split
def _sizes(parts: list[list[torch.Tensor]]) -> list[int]:
    return [sum(p.numel() for p in part) for part in parts]


@pytest.mark.parametrize(
    "sizes, fragments, expected",
    [
        ((10, 10, 100, 10, 70), 1, [200]),
        ((10, 10, 100, 10, 70), 2, [120, 80]),  # the boundary nearest 100
        ((10, 10, 100, 10, 70), 5, [10, 10, 100, 10, 70]),
        ((1000, 1, 1), 3, [1000, 1, 1]),  # never an empty fragment, even where the balance would
        ((2, 2, 2, 2), 2, [4, 4]),  # the half-way target 4 is exactly the boundary after tensor 2
        ((2, 2, 2), 2, [2, 4]),  # target 3 lies between boundaries 2 and 4: the earlier wins
        ((1,) * 6, 3, [2, 2, 2]),  # every cut aims at its own share: 1/3 and 2/3
        ((5, 5, 20, 20, 30, 20), 4, [30, 20, 30, 20]),  # targets 25, 50, 75 meet ends 30, 50, 80
    ],
)
def test_fragments_are_runs_of_whole_tensors_balanced_by_element_count(sizes, fragments, expected):
    assert _sizes(split_fragments([torch.zeros(n) for n in sizes], fragments)) == expected


def test_the_split_refuses_more_fragments_than_tensors_and_agrees_with_the_reference():
    with pytest.raises(ValueError, match="fragments: 6 is not allowed .* 5 parameter tensors"):
        split_fragments([torch.zeros(n) for n in (10, 10, 100, 10, 70)], 6)
    # the reference's own split (written from the docs) agrees on the tiny model
    model = ref.tiny_model()
    assert fragment_ranges(model, 2) == [(0, 40), (40, 75)]
    assert _sizes(split_fragments(list(model.parameters()), 2)) == [40, 35]


# ---------------------------------------------------------------------------- one worker, scripted


def test_each_fragment_is_sent_at_its_offset_and_applied_tau_steps_later(monkeypatch):
    # H = 4, F = 2, τ = 1: fragment 0 is sent after steps 2, 6, 10, fragment 1 after 4, 8, each
    # applied a step later; at lr 1, μ = 0, α = 0, one worker, it becomes what was sent.
    kw = dict(period=4, fragments=2, fragment_delay=1, diloco_outer_lr=1.0)
    strategy, replicas, recorder = one_diloco_worker(monkeypatch, diloco_outer_momentum=0.0, **kw)
    sent: dict[int, torch.Tensor] = {}
    for step in range(1, 11):
        replicas.step(0, step)
        before = ref.flat(replicas.models[0])
        strategy.after_step(BATCH)
        after = ref.flat(replicas.models[0])
        due = {2: 40, 6: 40, 10: 40, 4: 35, 8: 35}.get(step)  # the fragment's size
        assert [c for c in recorder.calls if c[0] == step] == ([(step, due, True)] if due else [])
        sent[step] = before
        # a fragment in flight blocks checkpoints; none in flight lets them through
        assert strategy.checkpoint_ready() == (step in (1, 3, 5, 7, 9))
        applied = {3: FRAGMENT_0, 7: FRAGMENT_0, 5: FRAGMENT_1, 9: FRAGMENT_1}.get(step)
        if applied is None:
            assert torch.equal(after, before)  # nothing applied: the replica untouched
            continue
        other = FRAGMENT_1 if applied == FRAGMENT_0 else FRAGMENT_0
        torch.testing.assert_close(after[applied], sent[step - 1][applied], rtol=0, atol=1e-6)
        assert torch.equal(after[other], before[other])
    assert strategy.averages == 5
    # finish: fragment 0 (in flight since step 10) is applied at once, which puts θ_global
    # in the replica (α = 0); fragment 1 moved since step 9 and gets one more outer step
    strategy.finish()
    assert [c[1:] for c in recorder.calls[5:]] == [(35, False)]
    assert strategy.averages == 6


def _plain_worker(monkeypatch, **kw):
    """One streaming DiLoCo worker whose outer step is plain averaging (lr 1, no momentum)."""
    return one_diloco_worker(monkeypatch, diloco_outer_lr=1.0, diloco_outer_momentum=0.0, **kw)


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
    strategy, replicas, recorder = _plain_worker(
        monkeypatch, period=period, fragments=3, fragment_delay=0
    )
    for step in range(1, 2 * period + 1):
        replicas.step(0, step)
        strategy.after_step(BATCH)
    sizes = (40, 8, 27)
    expected = sorted(
        (t, sizes[k])
        for k, offset in enumerate(offsets)
        for t in range(1, 2 * period + 1)
        if t % period == offset
    )
    sends = [(step, numel) for step, numel, _ in recorder.calls]
    assert sends == expected
    assert sorted(n for _, n in sends) == [8, 8, 27, 27, 40, 40]  # each fragment twice


@pytest.mark.parametrize("fragments", [1, 2, 3])
def test_sending_fragments_never_resizes_a_buffer_in_use(monkeypatch, fragments):
    # torch warns whenever it resizes an ``out`` tensor: with every warning an error, a run and
    # its finish show that no fragment's send buffer (a vector of its own size) is resized.
    kw = dict(period=6, fragments=fragments, fragment_delay=1)
    strategy, replicas, recorder = _plain_worker(monkeypatch, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(1, 8):
            replicas.step(0, step)
            strategy.after_step(BATCH)
        strategy.finish()
    assert sum(n for _, n, _ in recorder.calls) >= 75


@pytest.mark.parametrize("alpha", [0.25, 1.0])
def test_alpha_mixes_the_local_fragment_with_the_new_global_one(monkeypatch, alpha):
    # θ_fragment ← α·θ_local + (1 − α)·θ_global (the paper's mixing; torchft's lerp): α = 1
    # keeps the replica's own θ bit for bit, while θ_global still takes the outer step.
    kw = dict(period=2, fragments=1, fragment_delay=1, fragment_alpha=alpha)
    strategy, replicas, _ = _plain_worker(monkeypatch, **kw)
    for step in (1, 2):  # θ after step 2 is sent
        replicas.step(0, step)
        strategy.after_step(BATCH)
    sent = ref.flat(replicas.models[0])
    replicas.step(0, 3)
    local = ref.flat(replicas.models[0])
    assert not torch.equal(local, sent)
    strategy.after_step(BATCH)  # ... and applied now
    mixed = ref.flat(replicas.models[0])
    if alpha == 1.0:
        assert torch.equal(mixed, local)
    torch.testing.assert_close(mixed, alpha * local + (1 - alpha) * sent, rtol=0, atol=1e-6)
    torch.testing.assert_close(strategy.global_theta.detach(), sent, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- two workers
def test_with_outer_lr_1_no_momentum_and_alpha_0_each_fragment_becomes_its_average(monkeypatch):
    # The outer step at lr 1, μ = 0 sets θ_global to the replicas' mean, α = 0 puts it in every
    # replica: local SGD one fragment at a time (0 after steps 2, 6; 1 after 4, 8; both at the end).
    kw = dict(period=4, fragments=2, diloco_outer_lr=1.0, diloco_outer_momentum=0.0)
    settings = dict(delay=0, alpha=0.0, outer_lr=1.0, outer_momentum=0.0, nesterov=True)
    expected, _ = ref.streaming_diloco(*_reference_args(2), 9, 4, 2, **settings)
    job = _job(monkeypatch, "diloco", 2, **kw)
    got = _follows(job, 9, expected)
    assert not torch.equal(got[0][-1], got[1][-1])  # step 9 was local
    assert torch.equal(*(ref.flat(m) for m in job.replicas.models))


# ---------------------------------------------------------------------------- whole runs
def test_one_fragment_without_delay_is_diloco(tmp_path):
    """F = 1, τ = 0 (the defaults) on the simulator is DiLoCo with Nesterov, as the reference."""
    kw = dict(period=5, diloco_outer_lr=0.5, diloco_outer_momentum=0.5, nodes=2)
    run_sim(sim_cfg(tmp_path, "diloco", 2, 22, **kw))
    expected, _ = parity_diloco(22, 2, period=5, outer_lr=0.5, outer_momentum=0.5, nesterov=True)
    assert_same_params(trained(tmp_path), expected)


def test_streaming_diloco_on_the_simulator_matches_the_reference(tmp_path):
    settings = dict(period=6, fragments=2, delay=1, alpha=0.5, outer_lr=0.7)
    settings |= dict(outer_momentum=0.9, nesterov=True)
    kw = dict(period=6, fragments=2, fragment_delay=1, fragment_alpha=0.5)
    kw |= dict(diloco_outer_lr=0.7, diloco_outer_momentum=0.9, optimizer="sgd")
    summary = run_sim(sim_cfg(tmp_path, "diloco", 2, 20, nodes=2, **kw))
    expected, syncs = parity_streaming_diloco(20, 2, **settings)
    assert syncs == 6 + 2  # 3 per fragment in 20 steps, then both once more at the end
    assert_same_params(trained(tmp_path), expected)
    cnn_numel = sum(p.numel() for p in trained(tmp_path).parameters())
    # each fragment synced 4 times, an fp32 ring all-reduce of 2 ranks each: 4 θ per worker
    assert summary["sent_bytes"] == 2 * 4 * (4 * cnn_numel)
    unmixed, _ = parity_streaming_diloco(20, 2, **{**settings, "alpha": 0.0})
    assert_params_differ(expected, unmixed)
