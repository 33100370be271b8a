"""Asynchronous DiLoCo: its settings, Dynamic Local Updates' H_i, and jobs on the virtual
cluster: one worker is synchronous DiLoCo; with a straggler the workers size H_i from their
measured speeds and push as often. (The shard rule: test_staleness_compensation.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cloudburst.config import ConfigError, RunConfig, Straggler
from cloudburst.strategies.asgd.shard import make_shard, overlapped_push_fetch
from cloudburst.strategies.async_diloco import (
    STALE_ROUNDS,
    AsyncDilocoStrategy,
    dylu_inner_steps,
    fastest_fresh,
)
from tests.reference import (
    BATCH,
    LR,
    MOMENTUM,
    SEED,
    assert_params_differ,
    assert_same_params,
    parity_diloco,
    trained,
)
from tests.support import FakeNamespace, final_record, rank_events, run_sim, sim_cfg


def _cfg(out, workers: int, steps: int, model: str = "cnn", lr: float = LR, **kw) -> RunConfig:
    return RunConfig(strategy="async_diloco", workers=workers, steps=steps, dataset="synthetic",
                     model=model, batch_size=BATCH, lr=lr, momentum=MOMENTUM, seed=SEED,
                     eval_every_s=1000.0, out=str(out), **kw)  # fmt: skip


ADAM = dict(model="mlp", optimizer="adam", lr=0.003, push_log_every=1)  # every push logged


def test_settings_defaults_and_refusals():
    cfg = RunConfig(strategy="async_diloco", workers=3)
    settings = cfg.async_diloco
    assert (cfg.job.servers, settings.dn_period_value(cfg), settings.dylu) == (1, 3, False)
    shard = make_shard(cfg, torch.zeros(4))
    assert (shard.rule, shard.lr, shard.server_rule.period) == ("dn", cfg.diloco.outer_lr, 3)
    assert shard.server_rule.momentum == cfg.diloco.outer_momentum
    assert not overlapped_push_fetch(cfg)  # the outer state is the shard's: reply after apply
    refused = [
        (dict(n_sync=4), "^n_sync: async_diloco pushes every H"),
        (dict(server_rule="sgd"), "^server_rule: async_diloco's shards run Delayed Nesterov"),
        (dict(diloco_nesterov=False), "^diloco_nesterov: "),
        (dict(servers=0), "^servers: "),
    ]
    for kw, message in refused:
        with pytest.raises(ConfigError, match=message) as e:
            RunConfig(strategy="async_diloco", workers=2, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^dylu: .* async_diloco only, not 'diloco'"):
        RunConfig(strategy="diloco", workers=2, dylu=True)


def test_dylu_rule_scales_h_by_speed_over_the_fastest_rounding_half_up():
    # speeds 1, 1/3, 1, 1/2 of the fastest at H = 8: H·speed = 8, 2.67, 8, 4
    assert [dylu_inner_steps(8, s, 6.0) for s in (6.0, 2.0, 6.0, 3.0)] == [8, 3, 8, 4]
    assert dylu_inner_steps(8, 5.0, 6.0) == 7  # 6.67
    assert dylu_inner_steps(4, 3.0, 8.0) == 2  # 1.5 rounds half up
    assert dylu_inner_steps(2, 1.0, 10.0) == 1  # at least one inner step


def _reader(store, clock):
    """Worker 0 of 3's DyLU state at H = 8 and 2 steps/s, enough for _next_inner_steps."""
    ctx = FakeNamespace(store=store, worker_index=0, worker_ranks=[0, 1, 2],
                        comm=SimpleNamespace(now=lambda: clock[0]))  # fmt: skip
    cfg = SimpleNamespace(local_sgd=SimpleNamespace(period=8), job=SimpleNamespace(workers=3))
    return SimpleNamespace(ctx=ctx, cfg=cfg, inner_steps=8, _published=0, _seen={},
                           measured_speed=lambda: 2.0)  # fmt: skip


def test_fastest_fresh_leaves_out_a_speed_not_renewed_within_stale_rounds_of_its_rounds():
    # worker 1 at 4 steps/s with H = 8: a round lasts ≤ 2 s, so its speed is stale after 8 s
    seen = {1: ("4.0 7", 10.0), 2: ("1.0 3", 0.0)}
    assert fastest_fresh(2.0, seen, now=10.0 + STALE_ROUNDS * 8 / 4.0, period=8) == 4.0
    assert fastest_fresh(2.0, seen, now=10.0 + STALE_ROUNDS * 8 / 4.0 + 0.01, period=8) == 2.0
    assert fastest_fresh(0.5, {2: ("1.0 3", 0.0)}, now=32.0, period=8) == 1.0  # 4·8/1 s: fresh
    assert fastest_fresh(0.5, {2: ("1.0 3", 0.0)}, now=32.5, period=8) == 0.5


def test_a_dead_workers_published_speed_stops_shrinking_the_live_workers_h():
    store, clock = dist.HashStore(), [0.0]
    me = _reader(store, clock)  # 2 steps/s
    store.set("async_diloco/speed/1", "8.0 1")  # a worker 4x faster, which then dies
    store.set("async_diloco/speed/2", "2.0 1")
    assert AsyncDilocoStrategy._next_inner_steps(me) == 2  # 8 · 2/8
    assert store.get("async_diloco/speed/0") == b"2.0 1"  # published with its sequence number
    clock[0] = STALE_ROUNDS * 8 / 8.0  # worker 1 silent for 4 of its rounds: still counted
    store.set("async_diloco/speed/2", "2.0 2")
    assert AsyncDilocoStrategy._next_inner_steps(me) == 2
    clock[0] += 0.5  # ... and past them: gone, the fastest live worker is as fast as me
    assert AsyncDilocoStrategy._next_inner_steps(me) == 8
    store.set("async_diloco/speed/1", "8.0 1")  # the same publication again is not a renewal
    assert AsyncDilocoStrategy._next_inner_steps(me) == 8
    store.set("async_diloco/speed/1", "8.0 2")  # renewed (it rejoined): counted again
    assert AsyncDilocoStrategy._next_inner_steps(me) == 2


def test_one_worker_is_synchronous_diloco_with_nesterov(tmp_path):
    run_sim(_cfg(tmp_path, 1, 22, period=5, diloco_outer_lr=0.5, diloco_outer_momentum=0.5))
    expected, outer_steps = parity_diloco(22, 1, 5, 0.5, 0.5, nesterov=True)
    assert outer_steps == 5
    assert_same_params(trained(tmp_path), expected)
    assert_params_differ(expected, parity_diloco(22, 1, 5, 0.5, 0.5, nesterov=False)[0])


def test_with_a_straggler_dylu_measures_the_speeds_and_evens_the_pushes(tmp_path):
    """W = 3, worker 2 2x slower, H = 8, 48 steps each; every push logged by the shard."""
    runs = {}
    for dylu in (False, True):
        out = tmp_path / str(dylu)
        cfg = _cfg(out, 3, 48, period=8, stragglers=[Straggler(2, 2.0)], dylu=dylu, **ADAM)
        summary = run_sim(cfg)
        workers = [final_record(out, rank) for rank in (1, 2, 3)]  # rank 0 is the shard
        rounds = [w["inner_steps_rounds"] for w in workers]
        assert [sum(h * n for h, n in r) for r in rounds] == [48, 48, 48]  # every step
        assert summary["shard_versions"] == [sum(n for r in rounds for _, n in r)]
        assert summary["final_test_accuracy"] >= 0.9
        pushes = rank_events(out, 0, "push")
        end = max(p["time_s"] for p in pushes if p["worker"] != 3)  # while the fast ones train
        by_worker = [
            sum(p["worker"] == r and p["time_s"] <= end for p in pushes) for r in (1, 2, 3)
        ]
        runs[dylu] = rounds, [w["measured_steps_per_s"] for w in workers], by_worker
    assert runs[False][0] == [[[8, 6]], [[8, 6]], [[8, 6]]]
    assert runs[False][2] == [6, 6, 3]  # the slow worker pushes half as often
    rounds, speeds, by_worker = runs[True]
    # measured on the virtual clock: exactly the modelled speeds
    assert speeds == pytest.approx([100.0, 100.0, 50.0], rel=1e-9)
    # first round H (nothing measured); then the slow worker H·50/100 = 4, the fast ones H;
    # once the fast workers' speeds go stale (4·8/100 s after their last) the slow one runs H
    assert rounds == [[[8, 6]], [[8, 6]], [[8, 1], [4, 8], [8, 1]]]
    assert by_worker == [6, 6, 5]  # within one of each other (without DyLU: 6, 6, 3)


def test_the_last_round_is_pushed_at_the_last_step_not_after_the_evaluator_waits(tmp_path):
    # 30 steps at H = 8: a last round of 6; worker 0 (the evaluator) evaluates until the 2x
    # slower worker 1 is done, but pushes first (or its push would be far staler).
    summary = run_sim(_cfg(tmp_path, 2, 30, period=8, stragglers=[Straggler(1, 2.0)], **ADAM))
    assert final_record(tmp_path, 1)["inner_steps_rounds"] == [[8, 3], [6, 1]]
    pushes = rank_events(tmp_path, 0, "push")
    assert summary["shard_versions"] == [len(pushes)] == [8]
    last = [p for p in pushes if p["worker"] == 1][-1]
    assert last["time_s"] == pytest.approx(0.30, abs=0.01)  # its 30 steps of 0.01 s
    assert last["staleness_versions"] <= 1


def test_compressed_pushes_travel_as_asgds_with_error_feedback(tmp_path):
    runs = {}
    for compress in ("none", "int8"):
        cfg = _cfg(tmp_path / compress, 3, 48, period=4, compress=compress, **ADAM)
        runs[compress] = run_sim(cfg)
    assert runs["int8"]["shard_versions"] == runs["none"]["shard_versions"] == [36]
    assert runs["int8"]["sent_bytes"] < 0.3 * runs["none"]["sent_bytes"]
    assert runs["int8"]["final_test_accuracy"] >= 0.9


def test_without_momentum_it_is_asgd_with_n_sync_h_averaging_the_pushes(tmp_path):
    # Delayed Nesterov with β = 0, η = 1 adds Δ/N (N = W) per push: asgd's add rule, n_sync H
    slow = [Straggler(2, 1.5)]
    run_sim(_cfg(tmp_path / "a", 3, 20, period=4, diloco_outer_lr=1.0, diloco_outer_momentum=0.0,
                 stragglers=slow))  # fmt: skip
    run_sim(sim_cfg(tmp_path / "b", "asgd", 3, 20, n_sync=4, stragglers=slow))
    assert_same_params(trained(tmp_path / "a"), trained(tmp_path / "b"))
