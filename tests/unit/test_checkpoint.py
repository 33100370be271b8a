"""The checkpoint format (:mod:`cloudburst.records.checkpoint`): atomic writes, loads that never run
code, the checksum, the record's kind, one-line errors naming the file, model buffers, and
where a server shard's checkpoint lives."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.serialization
from torch import nn

from cloudburst.models import build_model
from cloudburst.records import checkpoint
from cloudburst.records.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model_buffers,
    load_model_into,
    model_buffers_bytes,
    save_checkpoint,
    save_model,
)
from cloudburst.records.resilience import shard_checkpoint_path


def test_model_round_trip(tmp_path):
    model = build_model("mlp", 40, 10, seed=3)
    save_model(tmp_path / "m.pt", model, {"note": "x"})
    other = build_model("mlp", 40, 10, seed=4)
    assert load_model_into(tmp_path / "m.pt", other) == {"note": "x"}
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    # a model checkpoint without meta gives empty meta
    save_checkpoint(tmp_path / "m.pt", "model", {"state_dict": nn.Linear(2, 2).state_dict()})
    assert load_model_into(tmp_path / "m.pt", nn.Linear(2, 2)) == {}


def test_truncated_corrupt_foreign_and_missing(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint(good, "model", {"state_dict": {"w": torch.ones(100)}})
    data = good.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    torch.save({"w": torch.ones(3)}, tmp_path / "foreign.pt")
    for name, why in [
        ("trunc.pt", "cannot be read safely (truncated, corrupt or not a cloudburst checkpoint)"),
        ("garbage.pt", "cannot be read safely (truncated, corrupt or not a cloudburst checkpoint)"),
        ("foreign.pt", "is not a cloudburst-checkpoint-v1 file"),
        ("missing.pt", "does not exist"),
    ]:
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(tmp_path / name)
        message = str(err.value)
        assert message.startswith(f"checkpoint {str(tmp_path / name)!r} {why}"), message
        assert "\n" not in message, message


def test_a_checkpoint_is_a_hidden_sibling_renamed_over_the_target_in_new_nested_dirs(
    tmp_path, monkeypatch
):
    renames = []
    replace = os.replace
    record = lambda src, dst: renames.append((Path(src), Path(dst))) or replace(src, dst)  # noqa: E731
    monkeypatch.setattr(checkpoint.os, "replace", record)
    path = tmp_path / "a" / "b" / "c.pt"
    save_checkpoint(path, "server-shard", {"theta": torch.arange(5.0), "version": 3})
    [(src, dst)] = renames
    assert dst == path and src.name.startswith(".c.pt.")
    assert src.parent == path.parent  # the same file system: the rename is atomic
    payload = load_checkpoint(path, "server-shard")
    assert payload["version"] == 3 and torch.equal(payload["theta"], torch.arange(5.0))
    assert not list(path.parent.glob(".c.pt.*")), "temporary file left behind"
    assert shard_checkpoint_path("runs/x", 3) == Path("runs/x/checkpoints/server3.pt")


class _RenameFailed(Exception):
    """Not an OSError: whatever os.replace raises propagates unchanged."""


@pytest.mark.parametrize("call", ["fsync", "replace"])
def test_a_failed_write_or_rename_leaves_no_temporary_file_and_raises_its_cause(
    tmp_path, monkeypatch, call
):
    """A failed fsync, or a failed rename whose temporary file is already gone."""

    error = _RenameFailed if call == "replace" else OSError

    def failing(*args) -> None:
        if call == "replace":
            os.remove(args[0])
        raise error(f"{call} failed")

    monkeypatch.setattr(checkpoint.os, call, failing)
    with pytest.raises(error, match=f"^{call} failed$"):
        save_checkpoint(tmp_path / "c.pt", "worker", {"x": 1})
    assert list(tmp_path.iterdir()) == []


_CALLS: list[tuple] = []


def _record_call(*args: Any) -> None:
    """What a malicious checkpoint would run on load."""
    _CALLS.append(args)


class _RecordedExploit:
    def __reduce__(self):
        return (_record_call, ("ran",))


def _pickled(obj: Any, path: Path) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))  # not torch's zip format: a plain pickle


@pytest.mark.parametrize("write", [torch.save, _pickled])
def test_code_in_a_checkpoint_never_runs_even_when_torch_defaults_to_unsafe_loads(
    tmp_path, monkeypatch, write
):
    # torch honours this variable only where the caller did not ask for weights_only itself
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    path = tmp_path / "evil.pt"
    write({"format": checkpoint.FORMAT, "kind": "model", "payload": _RecordedExploit()}, path)
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


def test_a_checkpoint_of_another_kind_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, "worker", {"x": 1})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, "server-shard")
    assert str(err.value) == f"checkpoint {str(path)!r} holds a 'worker', expected 'server-shard'"


# A worker checkpoint's shapes: nested dicts (int keys beside str keys), lists and tuples of
# numbers, strings and None, and tensors (empty ones included).
_NESTED = {
    "step": 7,
    "evals": [(1, 0.5), (2, 0.25)],
    "optimizer": {"state": {0: {"momentum": torch.arange(3.0)}}, "groups": [{"lr": 0.1}]},
    "mixed": {0: "zero", "one": None},
    "empty": torch.zeros(0),
    "theta": torch.arange(3.0),
}


def test_a_checkpoint_of_nested_lists_tuples_and_mixed_keys_round_trips(tmp_path):
    path = tmp_path / "w.pt"
    save_checkpoint(path, "worker", _NESTED)
    loaded = load_checkpoint(path, "worker")
    assert loaded["evals"] == [(1, 0.5), (2, 0.25)] and loaded["mixed"] == {0: "zero", "one": None}
    assert torch.equal(loaded["optimizer"]["state"][0]["momentum"], torch.arange(3.0))
    assert loaded["empty"].numel() == 0


@pytest.mark.parametrize(
    "key, changed",
    [
        ("evals", [(1, 0.5), (2, 0.75)]),  # a list item
        ("mixed", {0: "zero", "two": None}),  # a key
        ("evals", [[1, 0.5], (2, 0.25)]),  # a list where a tuple was
        ("theta", torch.tensor([0.0, 1.0, 5.0])),  # a value in a tensor
    ],
)
def test_the_checksum_covers_list_items_keys_sequence_types_and_tensors(tmp_path, key, changed):
    path = tmp_path / "w.pt"
    save_checkpoint(path, "worker", _NESTED)
    record = torch.load(path, weights_only=True)
    record["payload"][key] = changed
    torch.save(record, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value) == f"checkpoint {str(path)!r} fails its checksum (corrupt)"


def test_a_model_is_loaded_only_from_a_model_checkpoint_that_fits(tmp_path):
    path = tmp_path / "m.pt"
    save_checkpoint(path, "worker", {"state_dict": nn.Linear(2, 2).state_dict(), "meta": {}})
    with pytest.raises(CheckpointError, match="holds a 'worker', expected 'model'"):
        load_model_into(path, nn.Linear(2, 2))
    save_model(path, nn.Linear(2, 3), {})  # one that does not fit: the file, the cause's first line
    with pytest.raises(CheckpointError) as err:
        load_model_into(path, nn.Linear(4, 3))
    assert str(err.value) == (
        f"checkpoint {str(path)!r} does not fit this model: "
        "Error(s) in loading state_dict for Linear:"
    )


def test_a_checkpoint_and_model_buffers_written_from_cuda_tensors_load_on_the_cpu(
    tmp_path, monkeypatch
):
    path = tmp_path / "w.pt"
    # what torch.save records for tensors on a GPU, without needing one
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    save_checkpoint(path, "worker", {"optimizer": {"buf": torch.arange(3.0)}})
    raw = model_buffers_bytes(_batch_norm([1.0, 2.0], [3.0, 4.0], 7))
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(path, "worker")["optimizer"]["buf"], torch.arange(3.0))
    target = nn.BatchNorm1d(2)
    load_model_buffers(target, raw)
    assert target.running_mean.tolist() == [1.0, 2.0]


def _batch_norm(mean: list[float], var: list[float], batches: int) -> nn.BatchNorm1d:
    bn = nn.BatchNorm1d(len(mean))
    bn.running_mean.copy_(torch.tensor(mean))
    bn.running_var.copy_(torch.tensor(var))
    bn.num_batches_tracked.fill_(batches)
    return bn


def test_model_buffers_round_trip_leave_the_parameters_alone_and_skip_what_does_not_fit():
    source = _batch_norm([1.0, 2.0], [3.0, 4.0], 7)
    target = nn.BatchNorm1d(2)
    with torch.no_grad():
        target.weight.fill_(5.0)
    load_model_buffers(target, model_buffers_bytes(source))
    assert target.running_mean.tolist() == [1.0, 2.0]
    assert target.running_var.tolist() == [3.0, 4.0]
    assert target.num_batches_tracked.item() == 7
    assert target.weight.tolist() == [5.0, 5.0]
    # buffers of another shape or name are skipped
    raw = model_buffers_bytes(source)
    wider = nn.BatchNorm1d(3)
    load_model_buffers(wider, raw)
    assert wider.running_mean.tolist() == [0.0, 0.0, 0.0]  # shape (2,) does not fit (3,)
    assert wider.num_batches_tracked.item() == 7  # a scalar fits
    nested = nn.Sequential(nn.BatchNorm1d(2))  # its buffers are named "0.running_mean", ...
    load_model_buffers(nested, raw)
    assert nested[0].running_mean.tolist() == [0.0, 0.0]
    load_model_buffers(nn.Linear(2, 2), raw)  # no buffers at all


def test_code_in_model_buffers_never_runs(monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    buf = io.BytesIO()
    torch.save({"running_mean": _RecordedExploit()}, buf)
    _CALLS.clear()
    with pytest.raises(pickle.UnpicklingError):
        load_model_buffers(nn.BatchNorm1d(2), buf.getvalue())
    assert _CALLS == []
