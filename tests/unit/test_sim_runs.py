"""Whole jobs on the virtual cluster, in this process: the strategies end with the parameters
of the single-process references (tests/reference.py), repeat exactly, and keep time as the
clock model says (stragglers, faults, free evaluation). Real gloo runs: tests/dist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloudburst.config import Straggler
from cloudburst.sim.run import SimulationFailed
from tests.reference import (
    asgd_one_worker,
    assert_params_differ,
    assert_same_params,
    easgd_one_worker,
    parity_diloco,
    parity_local_sgd,
    sync_sgd,
    trained,
)
from tests.support import STEP_S, rank_events, read_events, read_summary, run_sim, sim_cfg

STRATEGIES = ["sync", "asgd", "easgd", "local_sgd", "diloco", "gossip", "daso"]


# ---------------------------------------------------------------------------- parity
@pytest.mark.parametrize("workers", [2, 4])
def test_sync_on_the_simulator_is_sgd_on_the_workers_batches_together(tmp_path, workers):
    run_sim(sim_cfg(tmp_path, "sync", workers, 20))
    assert_same_params(trained(tmp_path), sync_sgd(20, workers=workers))


def test_local_sgd_with_warm_up_and_diloco_match_their_references(tmp_path):
    run_sim(sim_cfg(tmp_path / "l", "local_sgd", 2, 18, period=4, local_sgd_warmup_steps=8))
    expected, averages = parity_local_sgd(18, workers=2, period=4, warmup_steps=8)
    assert averages == 11
    assert_same_params(trained(tmp_path / "l"), expected)
    settings = dict(period=5, outer_lr=0.5, outer_momentum=0.5)
    kw = dict(period=5, diloco_outer_lr=0.5, diloco_outer_momentum=0.5, diloco_nesterov=False)
    run_sim(sim_cfg(tmp_path / "d", "diloco", 2, 22, **kw))
    expected, _ = parity_diloco(22, 2, nesterov=False, **settings)
    assert_same_params(trained(tmp_path / "d"), expected)
    assert_params_differ(expected, parity_diloco(22, 2, nesterov=True, **settings)[0])


def test_daso_blocking_every_batch_equals_sync_sgd(tmp_path):
    schedule = dict(daso_global_skip=0, daso_batches_to_wait=0, daso_warmup_epochs=0)
    schedule |= dict(daso_cooldown_epochs=0, daso_downcast="none")
    run_sim(sim_cfg(tmp_path, "daso", 4, 20, nodes=2, **schedule))
    assert_same_params(trained(tmp_path), sync_sgd(20, workers=4))


def test_asgd_and_easgd_with_one_worker_match_the_parameter_server_references(tmp_path):
    rules = dict(max_staleness=2, staleness_scaling=True, server_lr=0.5)
    run_sim(sim_cfg(tmp_path / "a", "asgd", 1, 24, servers=2, n_fetch=4, n_push=1, **rules))
    settings = dict(n_fetch=4, n_push=1, rule="add", lr=0.5, max_staleness=2, scaling=True)
    expected, server = asgd_one_worker(24, **settings)
    assert_same_params(trained(tmp_path / "a"), expected)
    assert server.dropped == 6
    run_sim(sim_cfg(tmp_path / "e", "easgd", 1, 20, easgd_tau=3, easgd_beta=0.5))
    assert_same_params(trained(tmp_path / "e"), easgd_one_worker(20, tau=3, alpha=0.5))


# ---------------------------------------------------------------------------- determinism
def _strip(summary: dict) -> dict:
    summary = {k: v for k, v in summary.items() if k not in ("simulator", "config")}
    return json.loads(json.dumps(summary))


def _metrics(out: Path) -> dict[str, list[dict]]:
    paths = sorted((out / "metrics").glob("rank*.jsonl"))
    return {
        p.name: [{k: v for k, v in r.items() if k != "wall"} for r in read_events(p)] for p in paths
    }


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_runs_with_one_seed_write_the_same_summary_and_metrics(tmp_path, strategy):
    # Jittered steps, a slow link, frequent evaluations: all that could reorder the events.
    kw = {"nodes": 2, "inter_node_link": "1,1", "eval_every_s": 0.05, "log_every_steps": 1}
    workers = 4
    runs = []
    for name in ("one", "two"):
        cfg = sim_cfg(tmp_path / name, strategy, workers, 12, **kw)
        summary = run_sim(cfg, step_time_jitter="lognormal:0.3", intra_node_link="100,0.01")
        runs.append((_strip(summary), _metrics(tmp_path / name)))
    assert runs[0] == runs[1]
    summary = runs[0][0]
    assert summary["simulated"] is True and summary["time_unit"] == "virtual seconds"
    assert summary["wall_time_s"] > 12 * STEP_S * 0.5  # virtual: the steps' modelled time


# ---------------------------------------------------------------------------- the clock
def _step_times(out: Path, rank: int) -> list[float]:
    return [r["time_s"] for r in rank_events(out, rank, "step")]


def test_a_2x_straggler_makes_every_sync_step_2T_but_leaves_asgd_workers_alone(tmp_path):
    slow, doubled = [Straggler(1, 2.0)], pytest.approx([2 * STEP_S * k for k in range(1, 11)])
    run_sim(sim_cfg(tmp_path / "sync", "sync", 2, 10, stragglers=slow, log_every_steps=1))
    assert _step_times(tmp_path / "sync", 0) == _step_times(tmp_path / "sync", 1) == doubled
    cfg = sim_cfg(tmp_path / "asgd", "asgd", 2, 10, stragglers=slow, log_every_steps=1)
    run_sim(cfg, server_apply_gbyte_per_s=1e6)  # a free server: only the workers' own time
    # Worker 0 (rank 1) keeps its own pace, worker 1 (rank 2) its doubled one.
    assert _step_times(tmp_path / "asgd", 1) == pytest.approx([STEP_S * k for k in range(1, 11)])
    assert _step_times(tmp_path / "asgd", 2) == doubled


def test_evaluating_costs_no_virtual_time(tmp_path):
    # asgd's evaluation fetches θ from the server between rounds: free in virtual time.
    ends = []
    for name, every in (("rare", 1000.0), ("often", STEP_S / 2)):
        cfg = sim_cfg(tmp_path / name, "asgd", 2, 16, n_push=4, n_fetch=4, eval_every_s=every)
        ends.append(run_sim(cfg)["wall_time_s"])
    assert ends[0] == pytest.approx(ends[1], abs=1e-12)
    assert_same_params(trained(tmp_path / "rare"), trained(tmp_path / "often"))
    assert len(rank_events(tmp_path / "often", 1, "eval")) >= 16


def test_a_killed_asgd_worker_is_lost_and_the_others_finish(tmp_path):
    cfg = sim_cfg(tmp_path, "asgd", 3, 20, inject_fault=["kill:2@5"], heartbeat_timeout_s=1.0)
    summary = run_sim(cfg)
    assert summary["lost_workers"] == [2]
    assert summary["final_test_accuracy"] >= 0.0
    assert len(_step_times(tmp_path, 2)) < 20  # the killed worker stopped after its 5th step


def test_a_killed_sync_worker_fails_the_job_at_once_with_a_partial_summary(tmp_path):
    cfg = sim_cfg(tmp_path, "sync", 2, 20, inject_fault=["kill:1@5"])
    with pytest.raises(SimulationFailed, match="rank 1 died at t=0.050s"):
        run_sim(cfg)
    assert "rank 1 died" in read_summary(tmp_path)["failed"]


def test_gossip_keeps_its_own_pace_beside_a_straggler_until_a_consensus_measurement(tmp_path):
    # Pulls from the 3x slower worker are served at once by its serving task: the fast worker
    # keeps its pace. The consensus distance is an all-reduce (waiting for the slowest worker):
    # after step 10 the fast worker waits for the slow one's step 10.
    slow = [Straggler(1, 3.0)]
    run_sim(sim_cfg(tmp_path, "gossip", 2, 12, stragglers=slow, consensus_every_steps=10,
                    log_every_steps=1))  # fmt: skip
    fast = [STEP_S * k for k in range(1, 10)] + [3 * STEP_S * 10 + STEP_S * k for k in (0, 1, 2)]
    assert _step_times(tmp_path, 0) == pytest.approx(fast)
    assert _step_times(tmp_path, 1) == pytest.approx([3 * STEP_S * k for k in range(1, 13)])


def test_warm_start_steps_take_their_modelled_time(tmp_path):
    # Worker 0 trains 5 steps alone before seeding the server: its first step after the warm
    # start ends at 6 T, as on a real device.
    cfg = sim_cfg(tmp_path, "asgd", 1, 10, warm_start_steps=5, log_every_steps=1)
    run_sim(cfg, server_apply_gbyte_per_s=1e6)
    assert _step_times(tmp_path, 1) == pytest.approx([STEP_S * (5 + k) for k in range(1, 11)])
