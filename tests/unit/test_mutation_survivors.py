"""Tests that kill the mutants ``make mutation`` found alive (benchmarks/results/mutation.md).

Each test checks behaviour against values worked out independently (by hand, or by the
single-process references of :mod:`tests.reference`), never against the code under test.

``local_sgd`` and ``diloco`` had no unit test at all: they average over the workers' group with
a blocking all-reduce, which :class:`tests.support.LocalSgdJob` fakes for W threads of one
process (each contributes its vector and gets the sum, as ``dist.all_reduce`` would), so the
strategies run unchanged and are compared step by step with :func:`tests.reference.local_sgd`
and :func:`tests.reference.diloco`.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.serialization
from torch import nn

from cloudburst import checkpoint
from cloudburst.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model_buffers,
    load_model_into,
    model_buffers_bytes,
    save_checkpoint,
    save_model,
)
from cloudburst.comm import link
from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.flat import adopt_flat, flatten_params, split_shards
from cloudburst.comm.link import EmulatedWork, LinkEmulator, Topology
from cloudburst.comm.messages import Header, Kind, Status
from cloudburst.strategies.asgd.server import MAX_PUSH_SAMPLES, request_problem
from cloudburst.strategies.asgd.shard import (
    PushResult,
    ShardState,
    all_finite,
    overlapped_push_fetch,
    shard_checkpoint_path,
)
from cloudburst.strategies.asgd.summary import mean_staleness
from cloudburst.strategies.daso import DasoSchedule
from cloudburst.strategies.diloco import DilocoStrategy
from cloudburst.strategies.local_sgd import LocalSgdStrategy
from tests import reference as ref
from tests.fakes import WorkerSide, flush, ps_job
from tests.support import BATCH, LocalSgdCtx, LocalSgdJob, survivor_cfg

# ---------------------------------------------------------------------------- local SGD, DiLoCo


def _assert_runs_equal(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]):
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert len(g) == len(e)
        for a, b in zip(g, e, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _averaged_at(replicas: ref.Replicas, steps: int, sync_steps: set[int]):
    """Local SGD by hand: every worker steps; after each step in ``sync_steps`` every replica
    becomes the mean of all of them. θ of each worker after each step."""
    history: list[list[torch.Tensor]] = [[] for _ in replicas.models]
    for step in range(1, steps + 1):
        for w in range(len(replicas.models)):
            replicas.step(w, step)
        if step in sync_steps:
            mean = ref.mean([ref.flat(m) for m in replicas.models])
            for m in replicas.models:
                ref.set_flat(m, mean)
        for w, m in enumerate(replicas.models):
            history[w].append(ref.flat(m))
    return history


def test_local_sgd_strategy_follows_the_reference_with_a_final_average(monkeypatch):
    expected = ref.local_sgd(*_reference_args(2), steps=7, period=3)
    job = LocalSgdJob(
        survivor_cfg("local_sgd", 2, period=3), ref.Replicas(2, ref.sgd()), monkeypatch
    )
    got = job.run(7)
    final = job.finish()  # step 7 is not a multiple of 3: finish averages once more
    _assert_runs_equal([h[:-1] for h in got], [h[:-1] for h in expected])
    _assert_runs_equal([[f] for f in final], [[h[-1]] for h in expected])
    assert not torch.equal(got[0][-1], got[1][-1])  # the replicas differed before finish
    assert [s.averages for s in job.strategies] == [3, 3]  # after steps 3 and 6, and finish
    assert [s.report()["averages"] for s in job.strategies] == [3, 3]
    assert len(job.group.calls) == 6
    # each average: a ring all-reduce of 75 fp32 values over 2 workers, 2·(2−1)/2·300 bytes
    assert [s.report()["sent_bytes"] for s in job.strategies] == [3 * 300, 3 * 300]


def _reference_args(workers: int):
    replicas = ref.Replicas(workers, ref.sgd())
    return replicas.models, replicas.step


def test_local_sgd_finish_does_not_average_again_after_a_full_period(monkeypatch):
    job = LocalSgdJob(
        survivor_cfg("local_sgd", 2, period=3), ref.Replicas(2, ref.sgd()), monkeypatch
    )
    job.run(6)
    job.finish()
    assert [s.averages for s in job.strategies] == [2, 2]
    assert len(job.group.calls) == 4


def test_post_local_sgd_averages_every_step_of_its_warm_up(monkeypatch):
    expected = _averaged_at(ref.Replicas(2, ref.sgd()), steps=8, sync_steps={1, 2, 3, 6, 8})
    cfg = survivor_cfg("local_sgd", 2, period=3, local_sgd_warmup_steps=3)
    job = LocalSgdJob(cfg, ref.Replicas(2, ref.sgd()), monkeypatch)
    got = job.run(8)
    final = job.finish()  # step 8: not due, so finish averages
    _assert_runs_equal([h[:-1] for h in got], [h[:-1] for h in expected])
    _assert_runs_equal([[f] for f in final], [[h[-1]] for h in expected])
    assert [s.averages for s in job.strategies] == [5, 5]


def test_post_local_sgd_warm_up_ends_at_its_last_step(monkeypatch):
    # warm-up 2, period 3: averages after steps 1, 2 and 3, none after 4
    cfg = survivor_cfg("local_sgd", 2, period=3, local_sgd_warmup_steps=2)
    job = LocalSgdJob(cfg, ref.Replicas(2, ref.sgd()), monkeypatch)
    job.run(4)
    assert [s.averages for s in job.strategies] == [3, 3]


def test_local_sgd_with_one_worker_never_averages(monkeypatch):
    job = LocalSgdJob(
        survivor_cfg("local_sgd", 1, period=2), ref.Replicas(1, ref.sgd()), monkeypatch
    )
    job.run(3)
    job.finish()
    assert job.group.calls == []
    assert job.strategies[0].averages == 0


def test_local_sgd_global_params_are_the_replica_and_the_samples_of_all_workers(monkeypatch):
    cfg = survivor_cfg("local_sgd", 2, period=2, batch_size=16)
    job = LocalSgdJob(cfg, ref.Replicas(2, ref.sgd()), monkeypatch)
    job.run(3)
    theta, samples = job.strategies[1].global_params()
    assert samples == 3 * 16 * 2
    assert torch.equal(theta, ref.flat(job.replicas.models[1]))


def test_local_sgd_average_is_counted_and_sent_over_the_link_when_it_spans_nodes(monkeypatch):
    link = object()
    job = LocalSgdJob(
        survivor_cfg("local_sgd", 2, period=1),
        ref.Replicas(2, ref.sgd()),
        monkeypatch,
        topology=Topology((0, 1)),
        link=link,
    )
    job.run(1)
    assert sorted(job.group.calls, key=lambda c: c[0]) == [(0, link, True), (1, link, True)]


@pytest.mark.parametrize("topology", [None, Topology((0, 0, 1))])
def test_local_sgd_average_within_one_node_does_not_span_nodes(monkeypatch, topology):
    job = LocalSgdJob(
        survivor_cfg("local_sgd", 2, period=1),
        ref.Replicas(2, ref.sgd()),
        monkeypatch,
        topology=topology,
    )
    job.run(1)
    assert [c[2] for c in job.group.calls] == [False, False]


def test_local_sgd_state_dict_round_trip_keeps_the_average_count(monkeypatch):
    job = LocalSgdJob(
        survivor_cfg("local_sgd", 2, period=2), ref.Replicas(2, ref.sgd()), monkeypatch
    )
    job.run(4)
    state = job.strategies[0].state_dict()
    assert state["averages"] == 2 and state["local_steps"] == 4
    fresh = LocalSgdStrategy(LocalSgdCtx(job.cfg, 0))
    fresh.wrap(ref.tiny_model(), None)
    fresh.load_state_dict({**state, "averages": 2.0})
    assert fresh.averages == 2 and type(fresh.averages) is int
    assert fresh.local_steps == 4


@pytest.mark.parametrize(
    "workers, momentum, nesterov", [(2, 0.9, True), (2, 0.5, False), (1, 0.9, True)]
)
def test_diloco_strategy_follows_the_reference(monkeypatch, workers, momentum, nesterov):
    kw = dict(diloco_outer_lr=0.7, diloco_outer_momentum=momentum, diloco_nesterov=nesterov)
    expected = ref.diloco(*_reference_args(workers), steps=7, period=3, outer_lr=0.7,
                          outer_momentum=momentum, nesterov=nesterov)  # fmt: skip
    cfg = survivor_cfg("diloco", workers, period=3, **kw)
    job = LocalSgdJob(cfg, ref.Replicas(workers, ref.sgd()), monkeypatch)
    got = job.run(7)
    final = job.finish()
    _assert_runs_equal([h[:-1] for h in got], [h[:-1] for h in expected])
    _assert_runs_equal([[f] for f in final], [[h[-1]] for h in expected])
    assert [s.averages for s in job.strategies] == [3] * workers


def test_diloco_without_momentum_is_local_sgd_even_with_nesterov_asked_for(monkeypatch):
    # Nesterov needs momentum (torch refuses it without): with μ = 0 it is simply left off.
    expected = ref.local_sgd(*_reference_args(2), steps=5, period=2)
    cfg = survivor_cfg("diloco", 2, period=2, diloco_outer_lr=1.0, diloco_outer_momentum=0.0)
    job = LocalSgdJob(cfg, ref.Replicas(2, ref.sgd()), monkeypatch)
    got = job.run(5)
    final = job.finish()
    _assert_runs_equal([h[:-1] for h in got], [h[:-1] for h in expected])
    _assert_runs_equal([[f] for f in final], [[h[-1]] for h in expected])


def test_diloco_has_no_warm_up_and_finish_skips_a_full_period(monkeypatch):
    job = LocalSgdJob(survivor_cfg("diloco", 2, period=2), ref.Replicas(2, ref.sgd()), monkeypatch)
    job.run(1)
    assert [s.averages for s in job.strategies] == [0, 0]
    job.run(3)
    job.finish()
    assert [s.averages for s in job.strategies] == [2, 2]


def test_diloco_state_dict_round_trip_continues_the_same_run(monkeypatch):
    # One worker: DiLoCo still takes its outer steps (momentum included) without peers.
    kw = dict(period=2, diloco_outer_lr=0.7, diloco_outer_momentum=0.9)
    job = LocalSgdJob(survivor_cfg("diloco", 1, **kw), ref.Replicas(1, ref.sgd()), monkeypatch)
    job.run(5)  # two outer steps: the momentum buffer is not the last pseudo-gradient
    saved = job.strategies[0].state_dict()
    global_then = job.strategies[0].global_theta.detach().clone()
    buffer_then = saved["outer"]["state"][0]["momentum_buffer"].clone()
    assert saved["local_steps"] == 5 and saved["averages"] == 2
    assert torch.equal(saved["global_theta"], global_then)

    # A restarted worker: another replica object, restored from the model checkpoint (its θ
    # and optimizer) and from this state.
    replicas = ref.Replicas(1, ref.sgd(), seed=1)
    ref.set_flat(replicas.models[0], ref.flat(job.replicas.models[0]))
    # (a deep copy, as a checkpoint file is: torch would otherwise alias the momentum buffers)
    replicas.optimizers[0].load_state_dict(copy.deepcopy(job.replicas.optimizers[0].state_dict()))
    restored = LocalSgdJob(survivor_cfg("diloco", 1, **kw), replicas, monkeypatch)
    restored.strategies[0].load_state_dict(copy.deepcopy(saved))  # as read from its file
    restored.step = 5
    assert restored.strategies[0].local_steps == 5 and restored.strategies[0].averages == 2

    a = job.run(3)  # both on the restored job's group of one (the module's all-reduce)
    b = restored.run(3)
    _assert_runs_equal(a, b)
    # what was saved did not move with the run (copies, not the live tensors)
    assert torch.equal(saved["global_theta"], global_then)
    assert torch.equal(saved["outer"]["state"][0]["momentum_buffer"], buffer_then)


def test_diloco_loads_a_state_without_the_loop_counters(monkeypatch):
    job = LocalSgdJob(survivor_cfg("diloco", 1, period=1), ref.Replicas(1, ref.sgd()), monkeypatch)
    job.run(2)
    saved = job.strategies[0].state_dict()
    fresh = DilocoStrategy(LocalSgdCtx(job.cfg, 0))
    fresh.wrap(ref.tiny_model(seed=3), None)
    fresh.load_state_dict({"global_theta": saved["global_theta"], "outer": saved["outer"]})
    assert fresh.local_steps == 0
    assert torch.equal(fresh.global_theta.detach(), saved["global_theta"])
    assert fresh.state_dict()["averages"] == 0


# ---------------------------------------------------------------------------- checkpoint format
def test_a_checkpoint_is_written_into_new_nested_directories(tmp_path):
    path = tmp_path / "a" / "b" / "c.pt"
    save_checkpoint(path, "worker", {"x": torch.arange(3.0)})
    assert torch.equal(load_checkpoint(path, "worker")["x"], torch.arange(3.0))


def test_the_temporary_file_is_a_hidden_sibling_renamed_over_the_target(tmp_path, monkeypatch):
    renames = []
    replace = os.replace

    def recording_replace(src, dst):
        renames.append((Path(src), Path(dst)))
        replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", recording_replace)
    path = tmp_path / "c.pt"
    save_checkpoint(path, "worker", {"x": 1})
    [(src, dst)] = renames
    assert dst == path
    assert src.parent == path.parent  # the same file system: the rename is atomic
    assert src.name.startswith(".c.pt.")


def test_a_failed_write_leaves_no_temporary_file_and_raises_its_cause(tmp_path, monkeypatch):
    def failing_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="^disk full$"):
        save_checkpoint(tmp_path / "c.pt", "worker", {"x": 1})
    assert list(tmp_path.iterdir()) == []


class _RenameFailed(Exception):
    pass


def test_a_failed_rename_raises_its_cause_when_the_temporary_file_is_gone(tmp_path, monkeypatch):
    def failing_replace(src, dst):
        os.remove(src)
        raise _RenameFailed

    monkeypatch.setattr(checkpoint.os, "replace", failing_replace)
    with pytest.raises(_RenameFailed):
        save_checkpoint(tmp_path / "c.pt", "worker", {"x": 1})
    assert list(tmp_path.iterdir()) == []


_CALLS: list[tuple] = []


def _record_call(*args: Any) -> None:
    """What a malicious checkpoint would run on load."""
    _CALLS.append(args)


class _Exploit:
    def __reduce__(self):
        return (_record_call, ("ran",))


def test_code_in_a_checkpoint_never_runs_even_when_torch_defaults_to_unsafe_loads(
    tmp_path, monkeypatch
):
    # torch honours this variable only where the caller did not ask for weights_only itself
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    path = tmp_path / "evil.pt"
    torch.save({"format": checkpoint.FORMAT, "kind": "model", "payload": _Exploit()}, path)
    _CALLS.clear()
    with pytest.raises(CheckpointError, match="cannot be read safely"):
        load_checkpoint(path)
    assert _CALLS == []


@pytest.mark.parametrize(
    "error, reason",
    [
        (ValueError("first line\nsecond line"), "first line"),
        (ValueError("  "), "ValueError"),
        (EOFError(), "EOFError"),
        (RuntimeError("x" * 300), "x" * 200),
    ],
)
def test_an_unreadable_checkpoint_gives_the_first_line_of_its_cause(
    tmp_path, monkeypatch, error, reason
):
    path = tmp_path / "c.pt"
    path.write_bytes(b"anything")

    def failing_load(*args, **kwargs):
        raise error

    monkeypatch.setattr(checkpoint.torch, "load", failing_load)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value).endswith(f"not a cloudburst checkpoint): {reason}")


def test_a_checkpoint_of_another_kind_names_the_file_and_what_it_holds(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, "worker", {"x": 1})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, "server-shard")
    assert str(err.value) == f"checkpoint {str(path)!r} holds a 'worker', expected 'server-shard'"


def test_a_changed_payload_names_the_file(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, "worker", {"x": torch.zeros(2)})
    record = torch.load(path, weights_only=True)
    record["payload"]["x"][0] = 1.0
    torch.save(record, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value) == f"checkpoint {str(path)!r} fails its checksum (corrupt)"


# A worker checkpoint's shapes: nested dicts (int keys beside str keys), lists and tuples of
# numbers, strings and None, and tensors (empty ones included).
_NESTED = {
    "step": 7,
    "evals": [(1, 0.5), (2, 0.25)],
    "optimizer": {"state": {0: {"momentum": torch.arange(3.0)}}, "groups": [{"lr": 0.1}]},
    "mixed": {0: "zero", "one": None},
    "empty": torch.zeros(0),
}


def test_a_checkpoint_of_nested_lists_tuples_and_mixed_keys_round_trips(tmp_path):
    path = tmp_path / "w.pt"
    save_checkpoint(path, "worker", _NESTED)
    loaded = load_checkpoint(path, "worker")
    assert loaded["evals"] == [(1, 0.5), (2, 0.25)] and loaded["mixed"] == {0: "zero", "one": None}
    assert torch.equal(loaded["optimizer"]["state"][0]["momentum"], torch.arange(3.0))
    assert loaded["empty"].numel() == 0


def _tampered(record: dict) -> None:
    record["payload"]["evals"][1] = (2, 0.75)


def _renamed(record: dict) -> None:
    record["payload"]["mixed"] = {0: "zero", "two": None}


def _retyped(record: dict) -> None:
    record["payload"]["evals"][0] = [1, 0.5]  # a list where a tuple was


@pytest.mark.parametrize("change", [_tampered, _renamed, _retyped])
def test_the_checksum_covers_list_items_keys_and_sequence_types(tmp_path, change):
    path = tmp_path / "w.pt"
    save_checkpoint(path, "worker", _NESTED)
    record = torch.load(path, weights_only=True)
    change(record)
    torch.save(record, path)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load_checkpoint(path)


def test_a_model_is_loaded_only_from_a_model_checkpoint(tmp_path):
    path = tmp_path / "w.pt"
    save_checkpoint(path, "worker", {"state_dict": nn.Linear(2, 2).state_dict(), "meta": {}})
    with pytest.raises(CheckpointError, match="holds a 'worker', expected 'model'"):
        load_model_into(path, nn.Linear(2, 2))


def test_a_model_that_does_not_fit_names_the_file_and_the_first_line_of_the_cause(tmp_path):
    path = tmp_path / "m.pt"
    save_model(path, nn.Linear(2, 3), {})
    with pytest.raises(CheckpointError) as err:
        load_model_into(path, nn.Linear(4, 3))
    assert str(err.value) == (
        f"checkpoint {str(path)!r} does not fit this model: "
        "Error(s) in loading state_dict for Linear:"
    )


def test_a_model_checkpoint_without_meta_gives_empty_meta(tmp_path):
    path = tmp_path / "m.pt"
    model = nn.Linear(2, 2)
    save_checkpoint(path, "model", {"state_dict": model.state_dict()})
    assert load_model_into(path, nn.Linear(2, 2)) == {}


def test_a_checkpoint_written_from_cuda_tensors_loads_on_the_cpu(tmp_path, monkeypatch):
    path = tmp_path / "w.pt"
    # what torch.save records for tensors on a GPU, without needing one
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    save_checkpoint(path, "worker", {"optimizer": {"buf": torch.arange(3.0)}})
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(path, "worker")["optimizer"]["buf"], torch.arange(3.0))


def _batch_norm(mean: list[float], var: list[float], batches: int) -> nn.BatchNorm1d:
    bn = nn.BatchNorm1d(len(mean))
    bn.running_mean.copy_(torch.tensor(mean))
    bn.running_var.copy_(torch.tensor(var))
    bn.num_batches_tracked.fill_(batches)
    return bn


def test_model_buffers_round_trip_and_leave_the_parameters_alone():
    source = _batch_norm([1.0, 2.0], [3.0, 4.0], 7)
    target = nn.BatchNorm1d(2)
    with torch.no_grad():
        target.weight.fill_(5.0)
    load_model_buffers(target, model_buffers_bytes(source))
    assert target.running_mean.tolist() == [1.0, 2.0]
    assert target.running_var.tolist() == [3.0, 4.0]
    assert target.num_batches_tracked.item() == 7
    assert target.weight.tolist() == [5.0, 5.0]


def test_model_buffers_of_another_shape_or_name_are_skipped():
    raw = model_buffers_bytes(_batch_norm([1.0, 2.0], [3.0, 4.0], 7))
    wider = nn.BatchNorm1d(3)
    load_model_buffers(wider, raw)
    assert wider.running_mean.tolist() == [0.0, 0.0, 0.0]  # shape (2,) does not fit (3,)
    assert wider.num_batches_tracked.item() == 7  # a scalar fits
    nested = nn.Sequential(nn.BatchNorm1d(2))  # its buffers are named "0.running_mean", ...
    load_model_buffers(nested, raw)
    assert nested[0].running_mean.tolist() == [0.0, 0.0]
    load_model_buffers(nn.Linear(2, 2), raw)  # no buffers at all


def test_model_buffers_serialised_on_a_gpu_load_on_the_cpu(monkeypatch):
    # what torch.save records for tensors on a GPU, without needing one
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    raw = model_buffers_bytes(_batch_norm([1.0, 2.0], [3.0, 4.0], 7))
    monkeypatch.undo()
    target = nn.BatchNorm1d(2)
    load_model_buffers(target, raw)
    assert target.running_mean.tolist() == [1.0, 2.0]


def test_code_in_model_buffers_never_runs(monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    buf = io.BytesIO()
    torch.save({"running_mean": _Exploit()}, buf)
    _CALLS.clear()
    with pytest.raises(pickle.UnpicklingError):
        load_model_buffers(nn.BatchNorm1d(2), buf.getvalue())
    assert _CALLS == []


def test_a_shard_checkpoint_lives_in_the_run_directory_checkpoints():
    assert shard_checkpoint_path("runs/x", 3) == Path("runs/x/checkpoints/server3.pt")


# ---------------------------------------------------------------------------- flatten / split
def test_split_shards_refuses_a_tensor_that_is_not_a_vector_even_when_the_bounds_fit():
    with pytest.raises(ValueError, match="^bounds end at 6, tensor has 6$"):
        split_shards(torch.zeros(2, 3), [(0, 3), (3, 6)])
    with pytest.raises(ValueError, match="^bounds end at 0, tensor has 6$"):
        split_shards(torch.zeros(2, 3), [])


def test_split_shards_names_where_the_bounds_end():
    with pytest.raises(ValueError, match="^bounds end at 9, tensor has 10$"):
        split_shards(torch.zeros(10), [(0, 3), (3, 6), (6, 9)])


def test_flatten_params_of_a_list_with_non_contiguous_and_half_precision_parameters():
    transposed = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    half = torch.tensor([7.0, 8.0], dtype=torch.float16)
    flat = flatten_params([transposed, half])
    assert flat.dtype == torch.float32
    assert flat.tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0, 7.0, 8.0]
    only_half = flatten_params([half])
    assert only_half.dtype == torch.float32 and only_half.tolist() == [7.0, 8.0]


def test_flatten_params_writes_into_the_buffer_given():
    out = torch.zeros(5)
    result = flatten_params([torch.ones(2), torch.full((3,), 2.0)], out=out)
    assert result.data_ptr() == out.data_ptr()
    assert out.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]


def test_adopt_flat_makes_the_same_parameters_views_of_the_vector():
    model = nn.Linear(2, 2)
    params = list(model.parameters())
    flat = torch.arange(6.0)
    adopt_flat(model, flat)
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))
    assert model.weight.tolist() == [[0.0, 1.0], [2.0, 3.0]] and model.bias.tolist() == [4.0, 5.0]
    flat[0] = 10.0  # no copy: the parameter sees it
    assert model.weight[0, 0].item() == 10.0


def test_adopt_flat_refuses_a_vector_of_another_size():
    with pytest.raises(ValueError, match="^flat vector has 5 elements, model has 6$"):
        adopt_flat(nn.Linear(2, 2), torch.zeros(5))


def test_adopt_flat_copies_into_parameters_of_another_dtype():
    params = list(nn.Linear(2, 2).half().parameters())
    flat = torch.arange(6.0)
    adopt_flat(params, flat)
    assert [p.dtype for p in params] == [torch.float16, torch.float16]
    assert params[0].tolist() == [[0.0, 1.0], [2.0, 3.0]] and params[1].tolist() == [4.0, 5.0]
    flat[0] = 10.0  # a copy: the parameter keeps its value
    assert params[0][0, 0].item() == 0.0


# ---------------------------------------------------------------------------- the link model
def test_a_contiguous_topology_may_have_one_node_or_one_rank_per_node():
    assert Topology.contiguous(4, 1).node_of == (0, 0, 0, 0)
    assert Topology.contiguous(3, 3).node_of == (0, 1, 2)
    for nodes in (0, 4):
        with pytest.raises(ValueError, match=f"cannot place 3 ranks on {nodes} nodes"):
            Topology.contiguous(3, nodes)


def test_a_fresh_link_is_free_from_any_start_time():
    assert LinkEmulator(LinkSpec(1.0, 0.0)).reserve(2.0, start=0.25) == 2.25


class _Clock:
    """``time`` for the link module: ``sleep`` records and advances ``now``."""

    def __init__(self, now: float):
        self.now, self.sleeps = now, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class _Work:
    def __init__(self, done: bool):
        self.done, self.waited = done, False

    def wait(self) -> None:
        self.waited = True

    def is_completed(self) -> bool:
        return self.done


def test_a_deadline_that_is_now_does_not_sleep(monkeypatch):
    clock = _Clock(50.0)
    monkeypatch.setattr(link, "time", clock)
    assert LinkEmulator.wait_until(50.0) == 0.0
    assert clock.sleeps == []
    assert LinkEmulator.wait_until(50.5) == 0.5 and clock.sleeps == [0.5]


def test_an_emulated_work_waits_for_its_collective_then_for_the_link(monkeypatch):
    clock = _Clock(10.0)
    monkeypatch.setattr(link, "time", clock)
    work = _Work(done=False)
    assert EmulatedWork(work, deadline=12.0).wait() is True
    assert work.waited and clock.sleeps == [2.0]
    assert EmulatedWork(None, deadline=13.0).wait() is True  # no collective: the link only
    assert clock.sleeps == [2.0, 1.0]


def test_an_emulated_work_is_complete_when_its_collective_and_the_link_are(monkeypatch):
    monkeypatch.setattr(link, "time", _Clock(10.0))
    assert not EmulatedWork(_Work(done=False), deadline=9.0).is_completed()
    assert not EmulatedWork(_Work(done=True), deadline=11.0).is_completed()
    assert EmulatedWork(_Work(done=True), deadline=9.0).is_completed()
    assert EmulatedWork(None, deadline=9.0).is_completed()


# ---------------------------------------------------------------------------- server shard maths
def test_a_push_whose_sum_overflows_is_finite_and_applied():
    big = torch.tensor([3e38, 3e38])  # finite, but its sum is not
    assert all_finite(big)
    assert not all_finite(torch.tensor([3e38, float("inf")]))
    shard = ShardState(torch.zeros(2))
    assert shard.apply_push(big, 0) == PushResult(Status.OK, 0)
    assert torch.equal(shard.theta, big)


def test_the_sgd_rule_has_no_momentum_unless_asked():
    shard = ShardState(torch.zeros(3), rule="sgd", lr=0.5)
    shard.apply_push(torch.tensor([1.0, 2.0, 3.0]), 0)
    shard.apply_push(torch.tensor([4.0, 0.0, -2.0]), 1)
    assert shard.theta.tolist() == [2.5, 1.0, 0.5]  # 0.5·(Δ1 + Δ2)


def test_the_sgd_rule_scales_stale_pushes_only_when_asked():
    shard = ShardState(torch.zeros(2), rule="sgd", lr=1.0)
    for _ in range(3):
        shard.apply_push(torch.ones(2), 0)  # staleness 0, 1, 2
    assert shard.theta.tolist() == [3.0, 3.0]


def test_a_half_precision_theta_is_held_in_fp32():
    shard = ShardState(torch.tensor([1.5, 2.5], dtype=torch.float16))
    assert shard.theta.dtype == torch.float32 and shard.theta.tolist() == [1.5, 2.5]


def test_a_fresh_shard_counts_nothing_and_a_push_without_samples_counts_none():
    shard = ShardState(torch.zeros(2))
    assert shard.stats() == {
        "version": 0,
        "samples": 0,
        "pushes_applied": 0,
        "staleness_sum_versions": 0,
        "staleness_max_versions": 0,
        "dropped_stale": 0,
        "rejected_nonfinite": 0,
        "refused_pushes": 0,
        "staleness_compensation": "none",
        "staleness_histogram_versions": {},
        "push_scale_histogram": {},
        "compensation_clamped": 0,
    }
    shard.apply_push(torch.ones(2), 0)
    stats = shard.stats()
    assert stats["samples"] == 0 and stats["staleness_max_versions"] == 0
    assert stats["staleness_histogram_versions"] == {"0": 1}


def test_rejected_and_dropped_pushes_report_their_staleness_and_are_all_counted():
    shard = ShardState(torch.zeros(2), max_staleness=1)
    for version in range(3):
        shard.apply_push(torch.ones(2), version)
    assert shard.apply_push(torch.tensor([math.nan, 0.0]), 1) == PushResult(Status.REJECTED, 2)
    assert shard.apply_push(torch.ones(2), 0) == PushResult(Status.STALE_DROPPED, 3)
    assert shard.apply_push(torch.ones(2), 1) == PushResult(Status.STALE_DROPPED, 2)
    assert (shard.dropped_stale, shard.rejected_nonfinite, shard.version) == (2, 1, 3)


def test_a_state_without_optimizer_state_loads_into_any_rule_and_back():
    add = ShardState(torch.zeros(2))
    add.apply_push(torch.ones(2), 0)
    add_state = add.state_dict()
    assert add_state["optimizer"] == {}
    sgd = ShardState(torch.zeros(2), rule="sgd", lr=1.0)
    sgd.load_state_dict(add_state)
    assert sgd.theta.tolist() == [1.0, 1.0] and sgd.version == 1
    sgd.apply_push(torch.ones(2), 1)
    again = ShardState(torch.zeros(2))
    again.load_state_dict(sgd.state_dict())
    assert again.theta.tolist() == [2.0, 2.0] and again.version == 2


@pytest.mark.parametrize(
    "strategy, rule, overlapped",
    [
        ("asgd", "add", True),
        ("asgd", "sgd", False),
        ("asgd", "adagrad", False),
        ("easgd", "add", True),
    ],
)
def test_only_the_add_and_elastic_rules_reply_before_applying(strategy, rule, overlapped):
    assert overlapped_push_fetch(survivor_cfg(strategy, 2, server_rule=rule)) is overlapped


def _problem(h: Header) -> str | None:
    return request_problem(
        h, 1, shard=0, numel=4, version=3, awaiting_init=False, warm_start_rank=1
    )


def test_a_push_of_exactly_the_largest_sample_count_is_accepted():
    push = dict(shard=0, version=3, numel=4)
    assert _problem(Header(Kind.PUSH, samples=MAX_PUSH_SAMPLES, **push)) is None
    assert _problem(Header(Kind.PUSH, samples=MAX_PUSH_SAMPLES + 1, **push)) is not None


def test_a_second_init_is_refused_with_its_reason():
    assert _problem(Header(Kind.INIT, shard=0, numel=4)) == (
        "INIT while no warm start is awaited (θ is seeded once)"
    )


def test_mean_staleness_counts_missing_fields_as_zero_and_nothing_as_nan():
    assert mean_staleness([{"pushes_applied": 2, "staleness_sum_versions": 3}, {}]) == 1.5
    two = [{"pushes_applied": 2, "staleness_sum_versions": 4}, {"pushes_applied": 2}]
    assert mean_staleness(two) == 1
    assert math.isnan(mean_staleness([{"pushes_applied": 0, "staleness_sum_versions": 0}]))
    assert math.isnan(mean_staleness([]))


# ---------------------------------------------------------------------------- DASO schedule
def _cycling(**kw) -> DasoSchedule:
    """A schedule that is in its cycling phase from the first epoch on."""
    return DasoSchedule(total_epochs=20, warmup_epochs=0, cooldown_epochs=0, **kw)


def test_blocking_asks_about_the_position_given_not_the_current_epoch():
    schedule = DasoSchedule(total_epochs=20, warmup_epochs=2, cooldown_epochs=2, epoch=5)
    assert not schedule.blocking()
    assert schedule.blocking(0.5) and schedule.blocking(19.0)


def test_a_schedule_blocking_every_batch_never_adapts():
    schedule = _cycling(global_skip=0, patience=1)
    assert [schedule.end_epoch(1.0) for _ in range(4)] == [None] * 4
    assert schedule.global_skip == 0


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


# ---------------------------------------------------------------------------- asgd, easgd workers
class _WireWorkerSide(WorkerSide):
    """A worker's end of :mod:`tests.fakes` as the wire treats it: every header goes through
    its wire encoding, and a payload travels on the stream its ``reply`` flag names (gloo
    matches tags): a request's payload sent as a reply, or a reply awaited as a request, never
    arrives."""

    def send(self, k: int, header: Header, payload=None, final: bool = False) -> None:
        super().send(k, Header.from_tensor(header.to_tensor()), payload, final)

    def isend_payload(self, k: int, payload: torch.Tensor, reply: bool, prepare=None):
        if prepare is not None:
            prepare(0, payload.numel())
        if reply:
            raise AssertionError("a request's payload sent on the reply stream never arrives")
        return super().isend_payload(k, payload, reply, prepare)

    def irecv_payload(self, k: int, out: torch.Tensor, reply: bool):
        if not reply:
            raise AssertionError("a reply awaited on the request stream never arrives")
        return super().irecv_payload(k, out, reply)


def _ps(strategy: str, workers: int, **kw):
    """A started parameter-server job over the fake network, and its replicas."""
    cfg = survivor_cfg(strategy, workers, **kw)
    replicas = ref.Replicas(workers, ref.sgd())
    job = ps_job(cfg, replicas.models)
    for w in job.workers:
        w.transport = _WireWorkerSide(w.transport.net, w.transport.rank, w.stats)
        w.start()
    return job, replicas


def _steps(job, replicas: ref.Replicas, worker: int, steps: int = 1) -> None:
    """``steps`` local steps of one worker, each followed by its strategy's ``after_step``."""
    strategy = job.workers[worker]
    for _ in range(steps):
        replicas.step(worker, strategy.local_steps + 1)
        strategy.after_step(BATCH)


def test_asgd_counts_the_samples_of_every_step_and_publishes_the_fetched_theta():
    job, replicas = _ps("asgd", 1, servers=1, n_sync=2)
    worker, shard = job.workers[0], job.loops[0].shard
    _steps(job, replicas, 0)
    assert worker.global_params() is None  # no round this step
    _steps(job, replicas, 0)  # push and fetch
    assert shard.samples == 2 * BATCH and worker.global_samples == 2 * BATCH
    theta, samples = worker.global_params()
    assert samples == 2 * BATCH and torch.equal(theta, job.server_theta)
    _steps(job, replicas, 0, 3)
    assert shard.samples == 4 * BATCH and worker.local_steps == 5
    flush(worker)
    assert shard.samples == 5 * BATCH
    assert worker.state_dict()["local_steps"] == 5


@pytest.mark.parametrize("servers", [1, 2])
def test_asgd_reads_the_servers_theta_between_rounds_and_leaves_the_replica_alone(servers):
    job, replicas = _ps("asgd", 2, servers=servers, n_sync=2)
    w0, w1 = job.workers
    _steps(job, replicas, 1)  # w1: one step, no round
    _steps(job, replicas, 0, 2)  # w0 pushes two steps' samples
    replica, reference = ref.flat(replicas.models[1]), w1.reference.clone()
    versions = list(w1.versions)
    theta, samples = w1.fetch_global_params()
    assert torch.equal(theta, job.server_theta) and samples == 2 * BATCH
    assert torch.equal(ref.flat(replicas.models[1]), replica)
    assert torch.equal(w1.reference, reference) and w1.versions == versions
    fresh, samples = w0.fetch_global_params()  # w0 fetched this step: nothing to ask
    assert torch.equal(fresh, job.server_theta) and samples == 2 * BATCH


def test_asgd_worker_rebuilds_a_scaled_stale_push_as_the_server_applies_it():
    job, replicas = _ps("asgd", 2, servers=1, n_sync=1, staleness_scaling=True, server_lr=1.0)
    _steps(job, replicas, 0, 2)  # w0 pushes at versions 0 and 1
    _steps(job, replicas, 1)  # w1 pushes against version 0 at version 2: α = 1/2
    w1 = job.workers[1]
    assert w1.last_staleness == 2
    assert torch.equal(w1.reference, job.server_theta)
    assert torch.equal(ref.flat(replicas.models[1]), job.server_theta)


def test_asgd_sums_the_staleness_of_its_pushes():
    job, replicas = _ps("asgd", 2, servers=1, n_sync=1)
    for worker in (0, 1, 0, 1):  # staleness: w0 0, w1 1, w0 1, w1 1
        _steps(job, replicas, worker)
    report = [w.report() for w in job.workers]
    counts = [(r["staleness_sum_versions"], r["staleness_max_versions"]) for r in report]
    assert [(*c, r["pushes"]) for c, r in zip(counts, report, strict=True)] == [
        (1, 1, 2),
        (2, 1, 2),
    ]


def test_asgd_counts_each_dropped_push():
    job, replicas = _ps("asgd", 2, servers=1, n_sync=1, max_staleness=0)
    for worker in (0, 1, 0, 1):  # both of w1's pushes are one version stale
        _steps(job, replicas, worker)
    w1 = job.workers[1]
    assert (w1.pushes, w1.pushes_dropped, w1.report()["pushes_dropped_stale"]) == (2, 2, 2)
    assert job.workers[0].pushes_dropped == 0


def test_asgd_restarts_from_the_servers_theta_after_each_rejected_push(caplog):
    job, replicas = _ps("asgd", 1, servers=1, n_push=1, n_fetch=4)
    worker, model = job.workers[0], replicas.models[0]
    with caplog.at_level(logging.WARNING, logger="cloudburst.strategies.asgd.worker"):
        for step in (1, 2):
            replicas.step(0, step)
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan
            worker.after_step(BATCH)
            assert torch.equal(ref.flat(model), job.server_theta)
    assert worker.pushes_rejected == 2
    messages = [
        r.getMessage() for r in caplog.records if r.name == "cloudburst.strategies.asgd.worker"
    ]
    assert messages == ["the servers rejected this worker's push; re-fetching θ"] * 2


def test_easgd_counts_samples_and_steps_and_publishes_nothing_between_fetches():
    job, replicas = _ps("easgd", 1, servers=1, easgd_tau=2)
    worker, shard = job.workers[0], job.loops[0].shard
    _steps(job, replicas, 0)
    assert worker.global_params() is None
    _steps(job, replicas, 0, 3)
    assert shard.samples == 4 * BATCH and worker.global_samples == 4 * BATCH
    assert (worker.local_steps, worker.pushes) == (4, 2)


def test_easgd_leaves_a_dropped_replica_alone_and_resets_a_rejected_one_to_the_centre():
    job, replicas = _ps("easgd", 2, servers=1, easgd_tau=1, max_staleness=0)
    w1, model = job.workers[1], replicas.models[1]
    _steps(job, replicas, 0)  # the centre moves to version 1
    replicas.step(1, 1)
    before, centre = ref.flat(model), job.server_theta.clone()
    w1.after_step(BATCH)  # against version 0: dropped
    assert w1.pushes_dropped == 1
    assert torch.equal(ref.flat(model), before) and torch.equal(job.server_theta, centre)
    replicas.step(1, 2)
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    w1.after_step(BATCH)  # against version 1, not finite: rejected
    assert w1.pushes_rejected == 1
    assert torch.equal(ref.flat(model), job.server_theta) and torch.equal(job.server_theta, centre)
