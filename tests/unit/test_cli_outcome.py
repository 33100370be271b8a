"""What the CLI says after a job whose ranks failed: each rank's error in one line, the logs,
and a failure (exit 1) when every worker was lost — an untrained model is not a result; and
``--resume DIR``: the config comes from DIR, and what would change the run is refused."""

import json

import pytest

from cloudburst import cli, launch
from cloudburst.cli import resume_config
from cloudburst.config import ConfigError, RunConfig
from cloudburst.launch import failures

ERROR = "RuntimeError: unsupported operation: some elements of the input tensor overlap"


def _job(tmp_path, monkeypatch, lost):
    cfg = RunConfig(strategy="asgd", workers=2, servers=1, out=str(tmp_path))
    for rank in lost:  # torch's error file, as the agents leave it
        err = tmp_path / "logs" / f"agent{rank}" / "x" / "attempt_0" / "0" / "error.json"
        err.parent.mkdir(parents=True)
        err.write_text(json.dumps({"message": {"message": f"{ERROR}\nmore", "extraInfo": {}}}))
    summary = {"strategy": "asgd", "workers": 2, "lost_workers": lost}
    summary["failed_agents"] = [1] * len(lost)
    monkeypatch.setattr(launch, "run_local_job", lambda c: summary)
    monkeypatch.setattr(cli, "format_summary", lambda s: "table")
    return cfg


@pytest.mark.parametrize("lost, code", [([1], 0), ([1, 2], 1)])
def test_failed_ranks_are_reported_and_losing_every_worker_fails(
    tmp_path, monkeypatch, capsys, lost, code
):
    cfg = _job(tmp_path, monkeypatch, lost)
    assert cli.launch_and_report(cfg) == code
    err = capsys.readouterr().err
    assert err.count(f"a rank failed with: {ERROR}\n") == 1  # one line, said once
    assert f"logs in {tmp_path / 'logs'}" in err
    assert ("every worker was lost" in err) == (code == 1)


def test_rank_errors_skips_unreadable_files(tmp_path):
    (tmp_path / "logs" / "a").mkdir(parents=True)
    (tmp_path / "logs" / "a" / "error.json").write_text("{not json")
    (tmp_path / "logs" / "b").mkdir()
    (tmp_path / "logs" / "b" / "error.json").write_text(json.dumps({"message": "ValueError: x"}))
    assert failures.rank_errors(tmp_path) == ["ValueError: x"]


def test_a_finished_run_says_where_it_is_and_a_diverged_one_prints_no_table(
    tmp_path, monkeypatch, capsys
):
    cfg = _job(tmp_path, monkeypatch, [])
    assert cli.launch_and_report(cfg) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "table" and f"the run is in {tmp_path} " in err
    diverged = {"strategy": "asgd", "workers": 2, "failed": "the final model's test loss is nan"}
    monkeypatch.setattr(launch, "run_local_job", lambda c: diverged)
    assert cli.launch_and_report(cfg) == 1
    out, err = capsys.readouterr()
    assert out == "" and "test loss is nan" in err  # the numbers of a failed run are no result


# ----------------------------------------------------------------------------------- --resume DIR
def _run_dir(tmp_path):
    cfg = RunConfig(strategy="local_sgd", workers=2, steps=50, out=str(tmp_path), period=4)
    (tmp_path / "config.json").write_text(cfg.to_json())
    return cfg


def test_resume_takes_the_runs_config_and_allowed_overrides(tmp_path):
    _run_dir(tmp_path)
    cfg = resume_config(str(tmp_path), {"steps": 80, "max_restarts": 2}, has_toml=False)
    assert cfg.faults.resume and cfg.output.out == str(tmp_path) and cfg.local_sgd.period == 4
    assert (cfg.training.steps, cfg.faults.max_restarts, cfg.job.strategy) == (80, 2, "local_sgd")


# What --resume DIR finds in DIR ("run": a run's config.json; None: nothing) and is given.
@pytest.mark.parametrize(
    "saved, flags, has_toml, message",
    [
        ("run", {"strategy": "sync"}, False, "strategy cannot change"),
        ("run", {"workers": 3}, False, "workers cannot change"),
        ("run", {"seed": 1}, False, "seed cannot change"),
        ("run", {"out": "/elsewhere"}, False, "drop --out"),
        ("run", {}, True, "not --config"),
        (None, {}, False, "not a cloudburst run directory"),
        ("{not json", {}, False, "not valid JSON"),
        (json.dumps({"strategy": "x"}), {}, False, "strategy"),
    ],
)
def test_resume_refuses_what_is_not_a_run_and_changes_to_the_runs_identity(
    tmp_path, saved, flags, has_toml, message
):
    if saved == "run":
        _run_dir(tmp_path)
    elif saved is not None:
        (tmp_path / "config.json").write_text(saved)
    with pytest.raises(ConfigError, match=message):
        resume_config(str(tmp_path), flags, has_toml=has_toml)
