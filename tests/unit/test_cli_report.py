"""What the CLI says after a job whose ranks failed: each rank's error in one line, the logs,
and a failure (exit 1) when every worker was lost — an untrained model is not a result."""

import json

import pytest

from cloudburst import cli, launch
from cloudburst.config import RunConfig
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
