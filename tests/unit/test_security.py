"""Hostile input and shared machines, without processes: config files never name code to run,
runs write only into their own directories and never through links, the rejoin board bounds
what it reads, checkpoints carry the run's identity, images have a maximum size; and the job
secret's rules (cloudburst.comm.auth): where it comes from, which files are refused, how it
reaches a local job's ranks, and the MACs that bind every field they cover."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

from cloudburst.cli import build_config
from cloudburst.comm import auth
from cloudburst.comm.liveness import RejoinBoard
from cloudburst.config import ConfigError, RunConfig
from cloudburst.data.datasets import DatasetError, _check_image_size, _decode_image
from cloudburst.records import rundir
from cloudburst.records.checkpoint import CheckpointError, save_checkpoint
from cloudburst.records.metrics import MetricsWriter, write_json_atomic
from cloudburst.records.resilience import identity, load_shard_state
from cloudburst.strategies.asgd.serving import RequestServing


def _args(**flags) -> argparse.Namespace:
    return argparse.Namespace(command="train", **flags)


@pytest.fixture
def marker_module(tmp_path, monkeypatch):
    """An importable module that leaves a marker file behind when it is imported."""
    marker = tmp_path / "imported"
    (tmp_path / "cbevilmod.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\ndef net(**kw):\n    raise SystemExit(1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("cbevilmod", None)


# ------------------------------------------------------------------- code named in files
def test_a_config_file_naming_a_factory_needs_trust_and_imports_nothing(tmp_path, marker_module):
    toml = tmp_path / "run.toml"
    toml.write_text('model = "cbevilmod:net"\nworkers = 2\n')
    with pytest.raises(ConfigError, match=r"^model: --config .*run\.toml names the factory"):
        build_config(_args(config=str(toml), out=str(tmp_path / "o")))
    assert not marker_module.exists() and "cbevilmod" not in sys.modules
    # accepted when the user names it again, or trusts the file
    repeated = build_config(_args(config=str(toml), model="cbevilmod:net", out=str(tmp_path)))
    trusted = build_config(_args(config=str(toml), trust_config=True, out=str(tmp_path)))
    assert repeated.model.model == trusted.model.model == "cbevilmod:net"
    # Accepting the config imports nothing: the model is built later, by preflight.
    assert not marker_module.exists()
    toml.write_text('model = "mlp"\n')  # a built-in model needs no trust
    assert build_config(_args(config=str(toml), out=str(tmp_path))).model.model == "mlp"


def test_a_resumed_config_json_naming_a_factory_is_refused(tmp_path, marker_module):
    run = tmp_path / "run"
    run.mkdir()
    cfg = RunConfig(model="cbevilmod:net", out=str(run)).to_dict()
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"^model: --resume .* names the factory 'cbevilmod"):
        build_config(_args(resume=str(run)))
    assert build_config(_args(resume=str(run), trust_config=True)).model.model == "cbevilmod:net"
    assert not marker_module.exists()


# ------------------------------------------------------------------- output directories
def test_a_foreign_directory_is_refused_untouched_and_overwrite_removes_only_run_files(tmp_path):
    out = tmp_path / "project"
    (out / "metrics").mkdir(parents=True)
    (out / "metrics" / "notes.md").write_text("keep")
    (out / "metrics" / "rank3.jsonl").write_text("{}\n")  # a run's: the user's until --overwrite
    (out / "data.bin").write_bytes(b"keep")
    with pytest.raises(ConfigError, match=r"^out: .* is not empty and is not a cloudburst run"):
        rundir.prepare_run_dir(out, resume=False, overwrite=False)
    assert (out / "metrics" / "rank3.jsonl").read_text() == "{}\n"
    assert sorted(p.name for p in out.iterdir()) == ["data.bin", "metrics"]
    rundir.prepare_run_dir(out, resume=False, overwrite=True)
    assert (out / "metrics" / "notes.md").read_text() == "keep"
    assert (out / "data.bin").read_bytes() == b"keep"
    assert not (out / "metrics" / "rank3.jsonl").exists()
    assert rundir.run_nonce(out) is not None


def test_a_resumed_run_keeps_its_files_and_identity_and_a_new_one_removes_only_run_files(tmp_path):
    out = tmp_path / "run"
    rundir.prepare_run_dir(out, resume=False, overwrite=False)
    first = rundir.run_nonce(out)
    (out / "metrics" / "rank0.jsonl").write_text("{}\n")
    (out / "checkpoints" / ".worker0-step00000005.pt.tmpxyz").write_text("torn")
    rundir.prepare_run_dir(out, resume=True, overwrite=False)
    assert (out / "metrics" / "rank0.jsonl").exists()
    assert not (out / "checkpoints" / ".worker0-step00000005.pt.tmpxyz").exists()
    assert rundir.run_nonce(out) == first
    old = ["summary.json", "model.pt", "metrics/rank0.jsonl", "checkpoints/worker1-step00000010.pt",
           "checkpoints/server0.pt", "checkpoints/.server0.pt.abc123"]  # fmt: skip
    # (the last: a killed atomic write's temporary file)
    for name in old:
        (out / name).write_text("old")
    (out / "metrics" / "plot-notes.txt").write_text("user")
    (out / "README").write_text("user")
    rundir.prepare_run_dir(out, resume=False, overwrite=False)
    assert [name for name in old if (out / name).exists()] == []
    assert (out / "metrics" / "plot-notes.txt").exists() and (out / "README").exists()
    assert rundir.run_nonce(out) not in (None, first)  # a new run, a new identity


def test_out_naming_a_file_or_holding_a_symlinked_subdirectory_is_refused_in_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"^out: '.*/file' is a file, not a directory"):
        rundir.check_run_dir(f, resume=False, overwrite=True)
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "metrics").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=r"metrics' is a symbolic link"):
        rundir.check_run_dir(out, resume=False, overwrite=True)


def test_files_are_never_written_through_symlinks(tmp_path):
    out, target = tmp_path / "run", tmp_path / "target.txt"
    rundir.prepare_run_dir(out, resume=False, overwrite=False)
    target.write_text("precious")
    (out / "config.json").symlink_to(target)
    write_json_atomic(out / "config.json", {"a": 1})
    assert target.read_text() == "precious"
    assert not (out / "config.json").is_symlink()
    assert json.loads((out / "config.json").read_text()) == {"a": 1}
    (out / "metrics" / "rank0.jsonl").symlink_to(target)
    with pytest.raises(OSError):
        MetricsWriter(out, 0, "worker")
    assert target.read_text() == "precious"


def test_default_directories_are_unique_and_agreed_under_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    names = {rundir.default_out("sync") for _ in range(20)}
    assert len(names) == 20 and all(n.startswith("runs/sync-") for n in names)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/42")
    assert rundir.default_out("asgd") == "runs/asgd-job_42"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(ConfigError, match="pass --out DIR"):
        rundir.default_out("asgd")


# ------------------------------------------------------------------- rejoin board
class WaitRecordingStore(dist.HashStore):
    """dist.HashStore that records the first key of each wait."""

    def __init__(self):
        super().__init__()
        self.waits: list[str] = []

    def wait(self, keys, timeout):
        self.waits.append(keys[0])
        super().wait(keys, timeout)


def test_an_inflated_rejoin_counter_is_read_a_bounded_number_of_times():
    store = WaitRecordingStore()
    board = RejoinBoard(store, timeout_s=0.001, secret=b"s" * 32)
    store.add(RejoinBoard.COUNT, (1 << 39) - 1)  # far beyond any real number of restarts
    RejoinBoard(store, timeout_s=0.001, secret=b"s" * 32).announce(rank=3, incarnation=1)
    store.waits.clear()
    assert board.poll() == []  # the real announcement lies beyond the bound
    assert len(store.waits) == RejoinBoard.MAX_PER_READ == 1024
    assert store.waits[0] == "rejoin/1" and store.waits[-1] == "rejoin/1024"


def test_malformed_rejoin_announcements_are_ignored():
    store = dist.HashStore()
    board = RejoinBoard(store, timeout_s=0.05, secret=b"s" * 32)
    wrong = [{"rank": "3"}, {"rank": -1}, {"late": "no"}]  # a field of the wrong type or range
    fields = [json.dumps({"rank": 2, "incarnation": 1, "late": False, **w}).encode() for w in wrong]
    for value in [b"[1, 2]", *fields, b"x" * 10_000]:
        number = store.add(RejoinBoard.COUNT, 1)
        store.set(f"rejoin/{number}", value)
    RejoinBoard(store, timeout_s=0.05, secret=b"s" * 32).announce(rank=2, incarnation=1)
    assert board.poll() == [(2, 1)]


# ------------------------------------------------------------------- checkpoints
def test_a_shard_checkpoint_of_another_run_is_refused(tmp_path):
    out = tmp_path / "run"
    rundir.prepare_run_dir(out, resume=False, overwrite=False)
    cfg = RunConfig(strategy="asgd", servers=1, out=str(out))
    path = out / "checkpoints" / "server0.pt"
    same_settings_other_run = {**identity(cfg), "run": "0123456789abcdef"}
    save_checkpoint(path, "server-shard", {"identity": same_settings_other_run, "version": 3})
    with pytest.raises(CheckpointError, match=r"belongs to another run: its run is '0123"):
        load_shard_state(path, cfg)
    save_checkpoint(path, "server-shard", {"version": 3})  # written without an identity
    with pytest.raises(CheckpointError, match="carries no run identity"):
        load_shard_state(path, cfg)
    save_checkpoint(path, "server-shard", {"identity": identity(cfg), "version": 3})
    assert load_shard_state(path, cfg)["version"] == 3


# ------------------------------------------------------------------- images
def test_images_beyond_the_size_and_aspect_limits_are_refused(tmp_path):
    with pytest.raises(DatasetError, match="outside 1..64000000 pixels"):
        _check_image_size("x.png", 60_000_000, 2)
    with pytest.raises(DatasetError, match=r"aspect ratio above 16:1"):
        _check_image_size("x.png", 60_000, 2)
    thin = tmp_path / "thin.png"
    Image.fromarray(np.zeros((2, 400, 3), dtype=np.uint8)).save(thin)
    with pytest.raises(DatasetError, match=r"thin\.png: image of 400x2 pixels has an aspect"):
        _decode_image(str(thin), 32)
    ok = tmp_path / "ok.png"
    Image.fromarray(np.full((40, 64, 3), 7, dtype=np.uint8)).save(ok)
    decoded = _decode_image(str(ok), 32)
    assert decoded.shape == (32, 32, 3) and int(decoded.max()) == 7
    assert torch.from_numpy(decoded).dtype == torch.uint8


def test_forged_or_replayed_rejoin_announcements_are_ignored():
    """An announcement takes a worker's route away for a new group: only a real restart's
    (1..max_restarts, each once, in order) is admitted."""
    restarts = SimpleNamespace(faults=SimpleNamespace(max_restarts=2))
    server = SimpleNamespace(workers={1, 2}, _incarnations={}, cfg=restarts)
    for rank, incarnation in [(1, 0), (1, 3), (5, 1), (2, -1)]:
        assert RequestServing._admit(server, rank, incarnation) is None  # ignored, nothing touched
    assert server._incarnations == {}
    with pytest.raises(AttributeError):  # a real restart: it goes on to build its group (not faked)
        RequestServing._admit(server, 1, 1)
    assert server._incarnations == {}  # recorded once its group is built and authenticated
    server._incarnations[1] = 1
    assert RequestServing._admit(server, 1, 1) is None  # a replay of the same restart
    no_restarts = SimpleNamespace(
        workers={1}, _incarnations={}, cfg=SimpleNamespace(faults=SimpleNamespace(max_restarts=0))
    )
    assert RequestServing._admit(no_restarts, 1, 1) is None and no_restarts._incarnations == {}


# ------------------------------------------------------------------- the job secret
SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(autouse=True)
def no_secret(monkeypatch):
    """Each test starts with no secret installed and none in the environment."""
    monkeypatch.delenv(auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(auth.ENV_SECRET_FILE, raising=False)
    auth.install(None)
    yield
    auth.install(None)


def _secret_file(tmp_path, data: bytes = SECRET + b"\n", mode: int = 0o600):
    path = tmp_path / "job.secret"
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o604, 0o620, 0o644])
def test_a_secret_file_is_read_only_if_no_one_else_can_read_or_write_it(tmp_path, mode):
    path = _secret_file(tmp_path, mode=mode)
    if mode & 0o077:
        with pytest.raises(auth.SecretError, match=rf"is open to others \(mode {mode:04o}\)"):
            auth.read_secret_file(path)
    else:
        assert auth.read_secret_file(path) == SECRET  # the newline is dropped


def test_a_secret_file_that_is_short_large_missing_or_not_a_file_is_refused(tmp_path):
    with pytest.raises(auth.SecretError, match="holds 8 bytes, a job secret needs 16"):
        auth.read_secret_file(_secret_file(tmp_path, b"short!!!\n"))
    big = auth.MAX_SECRET_FILE_BYTES + 1
    with pytest.raises(auth.SecretError, match="larger than 4096 bytes"):
        auth.read_secret_file(_secret_file(tmp_path, b"x" * big))
    with pytest.raises(auth.SecretError, match="cannot open it"):
        auth.read_secret_file(tmp_path / "missing")
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    with pytest.raises(auth.SecretError, match="not a regular file"):
        auth.read_secret_file(folder)


def test_the_environment_names_the_secret_or_its_file(tmp_path, monkeypatch):
    assert auth.job_secret() is None
    with pytest.raises(ConfigError, match=auth.ENV_SECRET_FILE):  # one line from the CLI, exit 2
        auth.require_secret("rejoining")
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(_secret_file(tmp_path)))
    auth.install(None)  # read the environment again
    assert auth.job_secret() == SECRET == auth.require_secret("rejoining")
    monkeypatch.setenv(auth.ENV_SECRET, "another secret of enough bytes")
    auth.install(None)
    with pytest.raises(auth.SecretError, match="set one"):
        auth.job_secret()
    monkeypatch.delenv(auth.ENV_SECRET_FILE)
    auth.install(None)
    assert auth.job_secret() == b"another secret of enough bytes"
    monkeypatch.setenv(auth.ENV_SECRET, "too short")
    auth.install(None)
    with pytest.raises(auth.SecretError, match="holds 9 bytes"):
        auth.job_secret()


def _entry(value: int) -> tuple[int, bytes | None]:
    return value, auth.job_secret()


def test_a_local_job_hands_each_rank_a_fresh_secret_with_its_entry_point():
    wrapped = auth.with_job_secret(_entry)
    other = auth.with_job_secret(_entry)
    assert wrapped._secret != other._secret and len(wrapped._secret) == auth.SECRET_BYTES
    shown = repr(wrapped).lower().replace("withjobsecret", "")
    assert wrapped.__name__ == "_entry" and "secret" not in shown
    assert wrapped._secret.hex() not in repr(wrapped)
    rank_side = pickle.loads(pickle.dumps(wrapped))  # as the forkserver hands it to a rank
    assert auth.job_secret() is None
    assert rank_side(7) == (7, wrapped._secret)  # installed before the entry point runs
    assert auth.job_secret() == wrapped._secret


def test_a_mac_binds_every_field_and_their_boundaries():
    fields = ("rejoin", "run1", 4, 3, 1, False)  # run, announcement number, rank, restart, late
    signature = auth.sign(SECRET, *fields)
    assert auth.verify(SECRET, signature, *fields)
    for i, other in [(1, "run2"), (2, 5), (3, 2), (4, 2), (5, True)]:
        assert not auth.verify(SECRET, signature, *fields[:i], other, *fields[i + 1 :])
    assert not auth.verify(SECRET[::-1], signature, *fields)
    assert auth.sign(SECRET, "ab", "c") != auth.sign(SECRET, "a", "bc")
    for bad in (None, 3, "", signature[:-2], signature.upper() + "0"):
        assert not auth.verify(SECRET, bad, *fields)
