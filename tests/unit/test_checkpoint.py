import pickle

import pytest
import torch

from cloudburst.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model_into,
    save_checkpoint,
    save_model,
)
from cloudburst.models import build_model


def test_round_trip(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, "server-shard", {"theta": torch.arange(5.0), "version": 3})
    payload = load_checkpoint(path, "server-shard")
    assert payload["version"] == 3 and torch.equal(payload["theta"], torch.arange(5.0))
    assert not list(tmp_path.glob(".c.pt.*")), "temporary file left behind"


def test_model_round_trip_and_wrong_model(tmp_path):
    model = build_model("mlp", 40, 10, seed=3)
    save_model(tmp_path / "m.pt", model, {"note": "x"})
    other = build_model("mlp", 40, 10, seed=4)
    assert load_model_into(tmp_path / "m.pt", other) == {"note": "x"}
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_model_into(tmp_path / "m.pt", build_model("cnn", 40, 10, seed=0))


def test_truncated_corrupt_foreign_and_wrong_kind(tmp_path):
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
    with pytest.raises(CheckpointError, match="expected 'server-shard'"):
        load_checkpoint(good, "server-shard")


def test_checksum_catches_changed_payload(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, "model", {"x": torch.zeros(4)})
    record = torch.load(path, weights_only=True)
    record["payload"]["x"][0] = 1.0
    torch.save(record, path)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/cloudburst-pwned-marker",))


def test_code_in_a_checkpoint_never_runs(tmp_path):
    import os

    marker = "/tmp/cloudburst-pwned-marker"
    if os.path.exists(marker):
        os.remove(marker)
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"format": "cloudburst-checkpoint-v1", "payload": _Exploit()}, f)
    torch.save(
        {"format": "cloudburst-checkpoint-v1", "kind": "model", "payload": _Exploit()},
        tmp_path / "evil2.pt",
    )
    for p in (path, tmp_path / "evil2.pt"):
        with pytest.raises(CheckpointError, match="cannot be read safely"):
            load_checkpoint(p)
    assert not os.path.exists(marker)
