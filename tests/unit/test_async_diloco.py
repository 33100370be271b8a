"""Asynchronous DiLoCo (--strategy async_diloco; docs/algorithms.md#async_diloco): its
settings, Dynamic Local Updates' H_i, and whole jobs on the virtual cluster — one worker equals
synchronous DiLoCo's independent reference (Delayed Nesterov with N = 1 is Nesterov SGD),
several with a straggler push as DyLU says and learn. (The Delayed Nesterov shard rule against
tests/reference.py: tests/unit/test_staleness_compensation.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from cloudburst.config import ConfigError, RunConfig, Straggler
from cloudburst.config.simulation import SimulationConfig
from cloudburst.shard import make_shard, overlapped_push_fetch
from cloudburst.sim.run import simulate
from tests.dist.simulate import (
    BATCH,
    LR,
    MOMENTUM,
    SEED,
    assert_params_differ,
    assert_same_params,
    diloco,
    trained,
)


def _cfg(out, workers: int, steps: int, **kw) -> RunConfig:
    return RunConfig(
        strategy="async_diloco",
        workers=workers,
        steps=steps,
        dataset="synthetic",
        model=kw.pop("model", "cnn"),
        batch_size=BATCH,
        lr=kw.pop("lr", LR),
        momentum=MOMENTUM,
        seed=SEED,
        eval_every_s=1000.0,
        out=str(out),
        **kw,
    )


def test_settings_defaults_and_refusals():
    cfg = RunConfig(strategy="async_diloco", workers=3)
    assert (cfg.servers, cfg.dn_period_value, cfg.inner_steps(2)) == (1, 3, cfg.period)
    shard = make_shard(cfg, torch.zeros(4))
    assert (shard.rule, shard.lr, shard.optimizer.period) == ("dn", cfg.diloco_outer_lr, 3)
    assert shard.optimizer.beta == cfg.diloco_outer_momentum
    assert not overlapped_push_fetch(cfg)  # the outer state is the shard's: reply after apply
    refused = [
        (dict(n_sync=4), "^n_sync: async_diloco pushes every H"),
        (dict(server_rule="sgd"), "^server_rule: async_diloco's shards run Delayed Nesterov"),
        (dict(diloco_nesterov=False), "^diloco_nesterov: "),
        (dict(dn_period=0), "^dn_period: 0 is not allowed"),
        (dict(dn_c=1.5), "^dn_c: 1.5 is not allowed"),
        (dict(servers=0), "^servers: "),
    ]
    for kw, message in refused:
        with pytest.raises(ConfigError, match=message) as e:
            RunConfig(strategy="async_diloco", workers=2, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^dylu: .* async_diloco only, not 'diloco'"):
        RunConfig(strategy="diloco", workers=2, dylu=True)


def test_dylu_sizes_each_workers_inner_steps_by_its_speed():
    slow = [Straggler(3, 2.0), Straggler(1, 3.0)]
    cfg = RunConfig(strategy="async_diloco", workers=4, period=8, stragglers=slow, dylu=True)
    # speeds 1, 1/3, 1, 1/2 of the fastest: H·speed = 8, 2.67, 8, 4
    assert [cfg.inner_steps(w) for w in range(4)] == [8, 3, 8, 4]
    fixed = RunConfig(strategy="async_diloco", workers=4, period=8, stragglers=slow)
    assert [fixed.inner_steps(w) for w in range(4)] == [8, 8, 8, 8]
    tiny = RunConfig(
        strategy="async_diloco", workers=2, period=2, dylu=True, stragglers=[Straggler(1, 10.0)]
    )
    assert tiny.inner_steps(1) == 1  # at least one inner step


def test_one_worker_is_synchronous_diloco_with_nesterov(tmp_path):
    kw = dict(period=5, diloco_outer_lr=0.5, diloco_outer_momentum=0.5)
    simulate(_cfg(tmp_path, 1, 22, **kw), SimulationConfig(step_time_s=0.01))
    expected, outer_steps = diloco(22, 1, 5, 0.5, 0.5, nesterov=True)
    assert outer_steps == 5
    assert_same_params(trained(tmp_path), expected)
    assert_params_differ(expected, diloco(22, 1, 5, 0.5, 0.5, nesterov=False)[0])


def test_with_a_straggler_dylu_evens_the_pushes_and_the_job_learns(tmp_path):
    steps, period = 48, 8
    stragglers = [Straggler(2, 4.0)]
    runs = {}
    for dylu in (False, True):
        cfg = _cfg(
            tmp_path / str(dylu),
            3,
            steps,
            model="mlp",
            period=period,
            optimizer="adam",
            lr=0.003,
            stragglers=stragglers,
            dylu=dylu,
        )
        summary = simulate(cfg, SimulationConfig(step_time_s=0.01))
        h = [cfg.inner_steps(w) for w in range(3)]
        # every worker pushes after each H_i inner steps, and once more for a remainder
        assert summary["shard_versions"] == [sum(math.ceil(steps / x) for x in h)]
        assert summary["final_test_accuracy"] >= 0.9
        runs[dylu] = (h, summary)
    assert runs[False][0] == [8, 8, 8] and runs[True][0] == [8, 8, 2]
    # the 4x slower worker now pushes as often (per unit of time) as the others
    assert runs[True][1]["shard_versions"][0] == 6 + 6 + 24
    assert runs[True][1]["staleness_quantiles_versions"]["max"] >= 1


def test_compressed_pushes_travel_as_asgds_with_error_feedback(tmp_path, monkeypatch):
    # (the --compress check and the transport's list of message strategies name
    # async_diloco once the patch in the issue-28 report is applied; until then, here)
    from cloudburst.comm import quantise
    from cloudburst.config import components

    if "async_diloco" not in quantise.MESSAGE_STRATEGIES:
        monkeypatch.setattr(
            quantise, "MESSAGE_STRATEGIES", (*quantise.MESSAGE_STRATEGIES, "async_diloco")
        )
    monkeypatch.setitem(components.COMPRESSIBLE, "async_diloco", ("none", "bf16", "fp8", "int8"))
    runs = {}
    for compress in ("none", "int8"):
        cfg = _cfg(
            tmp_path / compress,
            3,
            48,
            model="mlp",
            period=4,
            optimizer="adam",
            lr=0.003,
            compress=compress,
        )
        runs[compress] = simulate(cfg, SimulationConfig(step_time_s=0.01))
    assert runs["int8"]["shard_versions"] == runs["none"]["shard_versions"] == [36]
    assert runs["int8"]["sent_bytes"] < 0.3 * runs["none"]["sent_bytes"]
    assert runs["int8"]["final_test_accuracy"] >= 0.9


def test_without_momentum_it_is_asgd_with_n_sync_h_averaging_the_pushes(tmp_path):
    # Delayed Nesterov with β = 0 and η = 1 adds Δ/N per push: asgd's add rule with λ = 1/W
    # (N = W) and n_sync = H, the same pushes in the same order on the virtual cluster.
    steps, period = 20, 4
    simulate(
        _cfg(tmp_path / "a", 3, steps, period=period, diloco_outer_lr=1.0,
             diloco_outer_momentum=0.0, stragglers=[Straggler(2, 1.5)]),
        SimulationConfig(step_time_s=0.01),
    )  # fmt: skip
    cfg = RunConfig(
        strategy="asgd", workers=3, steps=steps, dataset="synthetic", model="cnn",
        batch_size=BATCH, lr=LR, momentum=MOMENTUM, seed=SEED, eval_every_s=1000.0,
        out=str(tmp_path / "b"), n_sync=period, stragglers=[Straggler(2, 1.5)],
    )  # fmt: skip
    simulate(cfg, SimulationConfig(step_time_s=0.01))
    assert_same_params(trained(tmp_path / "a"), trained(tmp_path / "b"))
