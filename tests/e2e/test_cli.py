"""The CLI as a user runs it: summaries, plots, warm starts, bad input."""

import json

import pytest

from tests.helpers import cli, read_summary

pytestmark = pytest.mark.e2e

FAST = ["--dataset", "synthetic", "--model", "mlp", "--no-progress", "--eval-every-s", "0.2"]
SUMMARY_FIELDS = {
    "strategy",
    "workers",
    "servers",
    "final_test_accuracy",
    "wall_time_s",
    "time_to_target_s",
    "samples",
    "bytes_sent",
    "bytes_received",
    "mean_staleness",
    "max_staleness",
    "lost_workers",
}


def test_invalid_config_is_one_line_exit_2_and_launches_nothing(tmp_path):
    out = tmp_path / "never"
    for args, field in [
        (["--workers", "0"], "workers"),
        (["--lr", "-1"], "lr"),
        (["--strategy", "asgd", "--servers", "0"], "servers"),
        (["--straggler", "9:2"], "straggler"),
    ]:
        proc = cli("train", *args, "--out", str(out), check=False)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and field in lines[0] and "Traceback" not in proc.stderr
        assert not out.exists()
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = 'many'\n")
    proc = cli("train", "--config", str(bad), check=False)
    assert proc.returncode == 2 and "workers" in proc.stderr


def test_sync_and_asgd_runs_write_summary_metrics_and_plot(tmp_path):
    runs = []
    for strategy, extra in [("sync", []), ("asgd", ["--servers", "2", "--n-sync", "4"])]:
        out = tmp_path / strategy
        proc = cli(
            "train",
            "--strategy",
            strategy,
            "--workers",
            "2",
            "--steps",
            "150",
            "--target-accuracy",
            "0.5",
            "--out",
            str(out),
            *extra,
            *FAST,
        )
        assert strategy in proc.stdout  # the summary table
        s = read_summary(out)
        assert SUMMARY_FIELDS <= set(s)
        assert s["final_test_accuracy"] > 0.5 and s["time_to_target_s"] is not None
        assert s["samples"] == 2 * 150 * 64 and s["bytes_sent"] > 0 and s["lost_workers"] == []
        config = json.loads((out / "config.json").read_text())
        assert config["strategy"] == strategy
        for rank_file in (out / "metrics").glob("rank*.jsonl"):
            events = {json.loads(line)["event"] for line in rank_file.read_text().splitlines()}
            assert "start" in events and "final" in events
        steps = [
            json.loads(x)
            for x in (out / "metrics" / f"rank{s['servers']}.jsonl").read_text().splitlines()
            if '"step"' in x
        ]
        assert {
            "step",
            "time_s",
            "samples",
            "loss",
            "staleness",
            "bytes_sent",
            "bytes_received",
            "comm_wait_s",
        } <= set(steps[-1])
        runs.append(str(out))
    s = read_summary(tmp_path / "asgd")
    assert s["mean_staleness"] is not None and s["max_staleness"] >= 0
    png = tmp_path / "curves.png"
    cli("plot", *runs, "-o", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = cli("plot", str(tmp_path / "nope"), check=False)
    assert proc.returncode == 2 and "not a run directory" in proc.stderr


def test_warm_start_and_init_from(tmp_path):
    warm = tmp_path / "warm"
    cli(
        "train",
        "--strategy",
        "asgd",
        "--workers",
        "2",
        "--servers",
        "1",
        "--n-sync",
        "5",
        "--warm-start-steps",
        "30",
        "--steps",
        "20",
        "--out",
        str(warm),
        *FAST,
    )
    s = read_summary(warm)
    assert s["samples"] == 2 * 20 * 64  # the warm-up steps are not counted as training
    metrics = (warm / "metrics" / "rank1.jsonl").read_text()
    assert '"warmup"' in metrics
    again = tmp_path / "again"
    cli(
        "train",
        "--strategy",
        "asgd",
        "--workers",
        "2",
        "--servers",
        "1",
        "--steps",
        "1",
        "--lr",
        "1e-9",
        "--init-from",
        str(warm / "model.pt"),
        "--out",
        str(again),
        *FAST,
    )
    # Starting from the warm model with a negligible learning rate keeps its accuracy.
    assert abs(read_summary(again)["final_test_accuracy"] - s["final_test_accuracy"]) < 0.02
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    proc = cli("train", "--init-from", str(bad), "--out", str(tmp_path / "x"), *FAST, check=False)
    assert proc.returncode == 2 and "checkpoint" in proc.stderr
