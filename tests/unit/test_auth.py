"""The job secret's rules (cloudburst.comm.auth): where it comes from, which files are refused, how
it reaches a local job's ranks, and the MACs that bind every field they cover."""

import os
import pickle

import pytest

from cloudburst.comm import auth
from cloudburst.config import ConfigError

pytestmark = pytest.mark.unit

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
    signature = auth.sign(SECRET, "rejoin", "run1", 4, 3, 1, False)
    assert auth.verify(SECRET, signature, "rejoin", "run1", 4, 3, 1, False)
    for changed in (
        ("rejoin", "run2", 4, 3, 1, False),  # another run
        ("rejoin", "run1", 5, 3, 1, False),  # another announcement number
        ("rejoin", "run1", 4, 2, 1, False),  # another rank
        ("rejoin", "run1", 4, 3, 2, False),  # another restart
        ("rejoin", "run1", 4, 3, 1, True),  # late
    ):
        assert not auth.verify(SECRET, signature, *changed)
    assert not auth.verify(SECRET[::-1], signature, "rejoin", "run1", 4, 3, 1, False)
    assert auth.sign(SECRET, "ab", "c") != auth.sign(SECRET, "a", "bc")
    for bad in (None, 3, "", signature[:-2], signature.upper() + "0"):
        assert not auth.verify(SECRET, bad, "rejoin", "run1", 4, 3, 1, False)
