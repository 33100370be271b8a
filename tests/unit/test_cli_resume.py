"""``--resume DIR``: the config comes from DIR, and what would change the run is refused."""

import json

import pytest

from cloudburst.cli import resume_config
from cloudburst.config import ConfigError, RunConfig


def _run_dir(tmp_path):
    cfg = RunConfig(strategy="local_sgd", workers=2, steps=50, out=str(tmp_path), period=4)
    (tmp_path / "config.json").write_text(cfg.to_json())
    return cfg


def test_resume_takes_the_runs_config_and_allowed_overrides(tmp_path):
    _run_dir(tmp_path)
    cfg = resume_config(str(tmp_path), {"steps": 80, "max_restarts": 2}, has_toml=False)
    assert cfg.faults.resume and cfg.output.out == str(tmp_path) and cfg.local_sgd.period == 4
    assert (cfg.training.steps, cfg.faults.max_restarts, cfg.job.strategy) == (80, 2, "local_sgd")


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"strategy": "sync"}, "strategy cannot change"),
        ({"workers": 3}, "workers cannot change"),
        ({"seed": 1}, "seed cannot change"),
        ({"out": "/elsewhere"}, "drop --out"),
    ],
)
def test_resume_refuses_changes_to_the_runs_identity(tmp_path, flags, message):
    _run_dir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        resume_config(str(tmp_path), flags, has_toml=False)


def test_resume_of_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(ConfigError, match="not a cloudburst run directory"):
        resume_config(str(tmp_path), {}, has_toml=False)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resume_config(str(tmp_path), {}, has_toml=False)
    (tmp_path / "config.json").write_text(json.dumps({"strategy": "x"}))
    with pytest.raises(ConfigError, match="strategy"):
        resume_config(str(tmp_path), {}, has_toml=False)
    _run_dir(tmp_path)
    with pytest.raises(ConfigError, match="not --config"):
        resume_config(str(tmp_path), {}, has_toml=True)
