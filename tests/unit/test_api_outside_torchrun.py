"""A ``cloudburst.Job`` made under plain ``python`` says how to start it, before touching
anything (no run directory, no process group)."""

from __future__ import annotations

import pytest

import cloudburst
from cloudburst.api import NotUnderTorchrun


def test_a_job_outside_torchrun_names_the_command_and_creates_nothing(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    cfg = cloudburst.RunConfig(strategy="asgd", workers=2, servers=1, steps=1, out=str(out))
    with pytest.raises(NotUnderTorchrun) as refused:
        cloudburst.Job(cfg)
    message = str(refused.value)
    assert "\n" not in message and "torchrun --standalone --nproc-per-node 3 SCRIPT" in message
    assert not out.exists()
