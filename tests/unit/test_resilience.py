"""Fault specs, the injector, and the worker-checkpoint bookkeeping (no processes)."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from cloudburst.config import ConfigError, RunConfig
from cloudburst.config.faults import Fault, FaultError, FaultInjector, parse_faults
from cloudburst.records.checkpoint import CheckpointError
from cloudburst.records.resilience import (
    KEEP,
    agree_on_step,
    check_resumable,
    clear_worker_checkpoints,
    load_worker_state,
    save_worker_state,
    valid_steps,
    worker_checkpoint_path,
    worker_steps,
)


def test_fault_specs_parse_and_bad_ones_are_one_line():
    assert Fault.parse("kill:2@15") == Fault("kill", 2, step=15)
    assert Fault.parse("stop:1@3") == Fault("stop", 1, step=3)
    assert Fault.parse("nan:1@7") == Fault("nan", 1, step=7)
    assert Fault.parse("slow:3:2.5") == Fault("slow", 3, factor=2.5)
    forms = "is not one of kill:RANK@STEP, stop:RANK@STEP, nan:RANK@STEP, slow:RANK:FACTOR"
    for bad, why in [
        ("kill:2", forms),
        ("kill:x@3", forms),
        ("boom:1@2", forms),
        ("slow:1:abc", forms),
        ("", forms),
        ("slow:1:0.5", ": FACTOR must be a number >= 1"),
        ("nan:1@0", ": STEP counts from 1"),
    ]:
        with pytest.raises(FaultError) as err:
            Fault.parse(bad)
        assert str(err.value).startswith(f"{bad!r}{'' if why[0] == ':' else ' '}{why}"), err.value
    with pytest.raises(FaultError, match=r"rank 0 is a parameter server; .* \(ranks 1\.\.2\)"):
        parse_faults(["kill:0@5"], servers=1, world_size=3)
    with pytest.raises(FaultError, match=r"rank 5 does not exist \(the job has 2 ranks\)"):
        parse_faults(["kill:5@5"], servers=0, world_size=2)


def test_config_validates_faults_and_accepts_one_string():
    cfg = RunConfig(workers=2, steps=10, inject_fault="nan:1@3")
    assert cfg.faults.inject_fault == ["nan:1@3"]
    with pytest.raises(ConfigError, match="inject_fault: rank 7 does not exist"):
        RunConfig(workers=2, steps=10, inject_fault=["kill:7@3"])


def test_injector_fires_for_its_rank_once_and_never_after_a_restart(monkeypatch):
    faults = parse_faults(["nan:1@3", "kill:1@5", "slow:1:2", "kill:0@2"], 0, 2)
    inj = FaultInjector(faults, rank=1)
    assert inj.slow_factor == 2.0
    assert [inj.corrupt_loss(s) for s in (1, 2, 3, 4)] == [False, False, True, False]
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(sig))
    inj.after_step(4)
    inj.after_step(5)
    assert killed == [signal.SIGKILL]
    inactive = FaultInjector(faults, rank=1, active=False)  # a restart or a resume
    assert not inactive.corrupt_loss(3)
    inactive.after_step(5)
    assert killed == [signal.SIGKILL] and inactive.slow_factor == 2.0  # slowness stays


def _cfg(tmp_path, **kw):
    return RunConfig(**{"workers": 2, "steps": 100, "out": str(tmp_path), **kw})


def test_worker_checkpoints_round_trip_keep_the_last_two_and_clear_per_worker(tmp_path):
    cfg = _cfg(tmp_path)
    save_worker_state(cfg, 0, 10, {"x": 1})
    for step in (10, 20, 30):
        save_worker_state(cfg, 1, step, {"model": {"w": torch.full((3,), float(step))}})
    assert worker_steps(tmp_path, 1) == [20, 30] and KEEP == 2
    state = load_worker_state(cfg, 1, 30)
    assert state["step"] == 30 and torch.equal(state["model"]["w"], torch.full((3,), 30.0))
    clear_worker_checkpoints(tmp_path, 1)
    assert worker_steps(tmp_path, 1) == [] and worker_steps(tmp_path, 0) == [10]


def test_corrupt_checkpoints_are_skipped_by_ranks_and_refused_by_the_cli(tmp_path):
    cfg = _cfg(tmp_path)
    for w in (0, 1):
        for step in (10, 20):
            save_worker_state(cfg, w, step, {"x": 1})
    path = worker_checkpoint_path(tmp_path, 1, 20)
    path.write_bytes(path.read_bytes()[:50])  # killed while writing (a torn file)
    assert valid_steps(cfg, 1, strict=False) == [10]
    with pytest.raises(CheckpointError, match="cannot be read safely"):
        valid_steps(cfg, 1, strict=True)
    with pytest.raises(CheckpointError) as err:
        check_resumable(cfg)
    assert str(err.value).startswith(f"checkpoint {str(path)!r} cannot be read safely")
    path.unlink()
    assert check_resumable(cfg) == "resuming every worker from step 10"


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    save_worker_state(_cfg(tmp_path), 0, 10, {"x": 1})
    other = _cfg(tmp_path, strategy="local_sgd")
    with pytest.raises(CheckpointError, match="its strategy is 'sync'"):
        load_worker_state(other, 0, 10)
    with pytest.raises(CheckpointError, match="no checkpoints"):
        check_resumable(_cfg(tmp_path / "empty"))


def test_lockstep_workers_agree_on_the_latest_common_step():
    store = dist.HashStore()
    store.set("resume/steps/1", "[10, 20]")  # worker 1 published first; worker 0 reads both
    assert agree_on_step(store, 0, 2, [20, 30], timeout_s=5) == 20
    store.set("resume/steps/1", "[]")
    assert agree_on_step(store, 0, 2, [10], timeout_s=5) == 0  # no common step
