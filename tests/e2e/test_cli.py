"""The CLI as a user runs it: a config file with flag overrides, what a run writes (summary,
metrics, logs, plot), stragglers, a replica gone bad, warm starts, the demo, bad input.

Most tests read one shared asgd run (``asgd_run``), each checking another part of it."""

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from cloudburst.models import MLP
from cloudburst.records.checkpoint import save_model
from tests.datagen import write_cifar10
from tests.e2e.instrumented import POISON_ENV, RECORD_ENV
from tests.support import (
    REPO,
    cli,
    cli_env,
    final_record,
    rank_events,
    rank_logs,
    read_summary,
    refused,
    saved_state,
)

pytestmark = pytest.mark.e2e

FAST = ["--dataset", "synthetic", "--model", "mlp", "--no-progress", "--eval-every-s", "0.2"]
SUMMARY_FIELDS = set(
    """strategy workers servers final_test_accuracy wall_time_s time_to_target_s samples
    sent_bytes received_bytes comm_wait_s mean_staleness_versions max_staleness_versions
    pushes_rejected lost_workers device backend config""".split()
)
STEP_FIELDS = set(
    "step time_s samples loss staleness_versions sent_bytes received_bytes comm_wait_s".split()
)


def test_bad_input_is_one_line_exit_2_before_launch_and_touches_nothing(
    tmp_path, monkeypatch, capsys
):
    """Through the real entry point main(), in this process (each message is unit-tested): a
    flag, a model file of another model, a pickle that would run code, a model that does not
    fit the data, a device that is not there, an output directory of the user's."""
    other_model = tmp_path / "mlp.pt"
    save_model(other_model, MLP(40, 10), {})
    cifar = write_cifar10(tmp_path / "c", per_batch=30, test=10)
    evil = tmp_path / "evil" / "cifar-10-batches-py"
    shutil.copytree(cifar, evil)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (evil / "test_batch").write_bytes(pickle.dumps(Exploit()))
    project, never = tmp_path / "project", tmp_path / "never"
    (project / "metrics").mkdir(parents=True)
    (project / "metrics" / "results.csv").write_text("mine")
    taken = f"out: {str(project)!r} is not empty"
    cases = [
        (["--workers", "0"], never, "workers: 0"),
        (["--init-from", str(other_model), "--dataset", "synthetic"], never, "does not fit"),
        (["--dataset", f"cifar10:{evil}"], never, "refuses to unpickle"),
        (["--dataset", f"cifar10:{cifar}", "--model", "cnn"], never, "1-D"),
        (["--dataset", "synthetic", "--steps", "5"], project, taken),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], never, "device"))
    for args, out, words in cases:
        proc = refused(["train", *args, "--out", str(out)], monkeypatch, capsys)
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert lines[0].startswith("cloudburst: invalid config: ") and words in lines[0], lines
        assert not never.exists()
    assert [p.name for p in project.rglob("*")] == ["metrics", "results.csv"]
    assert not marker.exists()


# A config file; the flags given with it override its values.
CONFIG = """\
strategy = "asgd"
workers = 2
servers = 1
n_sync = 4
steps = 400
lr = 0.01
dataset = "synthetic"
"""
STEPS = 120
STRAGGLER_RANK, SLOW_RANK = 2, 1  # --straggler 1:3 names worker 1; slow:1:2 names rank 1


@pytest.fixture(scope="module")
def asgd_run(tmp_path_factory):
    """One asgd run exercising what a user sees of it: ``--config`` with overrides, no
    ``--no-progress``, a warm start, a straggler and a slow worker (recorded), and worker 1's
    replica set to NaN in its 8th step: that step's update is skipped, and the push that ends
    the step (n_sync = 4) carries NaN, which the server rejects."""
    tmp = tmp_path_factory.mktemp("asgd")
    (tmp / "run.toml").write_text(CONFIG)
    out, record = tmp / "run", tmp / "record"
    proc = cli(
        "train", "--config", str(tmp / "run.toml"), "--lr", "0.05", "--steps", str(STEPS),
        "--model", "tests.e2e.instrumented:mlp", "--straggler", "1:3", "--inject-fault",
        "slow:1:2", "--min-step-time-s", "0.002", "--push-log-every", "1",
        "--target-accuracy", "0.5", "--eval-every-s", "0.2", "--warm-start-steps", "30",
        "--out", str(out),
        env={RECORD_ENV: str(record), POISON_ENV: f"{STRAGGLER_RANK}:8"},
    )  # fmt: skip
    return out, record, proc


def test_config_file_with_flag_overrides(asgd_run):
    out, _, proc = asgd_run
    config = json.loads((out / "config.json").read_text())
    assert config["lr"] == 0.05 and config["steps"] == STEPS  # the flags
    assert config["servers"] == 1 and config["n_fetch"] == config["n_push"] == 4  # the file
    assert read_summary(out)["config"] == config
    assert final_record(out, 1)["steps"] == STEPS
    # No --no-progress: a progress bar on stderr; the summary table on stdout.
    assert "asgd W=2" in proc.stderr
    assert proc.stdout.splitlines()[0].split()[:3] == ["strategy", "W", "S"]
    assert proc.stdout.splitlines()[1].split()[:3] == ["asgd", "2", "1"]


def test_summary_metrics_and_logs(asgd_run):
    out, _, _ = asgd_run
    s = read_summary(out)
    assert SUMMARY_FIELDS <= set(s)
    assert s["samples"] == 2 * STEPS * 64 and s["lost_workers"] == []
    assert s["device"] == "cpu" and s["backend"] == "gloo"
    for rank in range(3):  # (rank 0 evaluates the final model after its final record)
        events = [r["event"] for r in rank_events(out, rank)]
        assert events[0] == "start" and events.count("final") == 1
    for rank in (1, 2):
        steps = rank_events(out, rank, "step")
        assert STEP_FIELDS <= set(steps[-1]) and [r["step"] for r in steps][-1] == STEPS
    finals = [final_record(out, r) for r in range(3)]
    assert s["sent_bytes"] == sum(f["sent_bytes"] for f in finals) > 0
    assert s["comm_wait_s"] == pytest.approx(sum(f["comm_wait_s"] for f in finals))
    # Staleness: every push is in the server's records (--push-log-every 1).
    pushes = rank_events(out, 0, "push")
    assert len(pushes) == 2 * STEPS // 4
    applied = [p["staleness_versions"] for p in pushes if p["status"] == "OK"]
    assert s["max_staleness_versions"] == max(applied)
    assert s["mean_staleness_versions"] == pytest.approx(sum(applied) / len(applied))
    assert s["samples_applied"] == pushes[-1]["samples"]
    # The time to target: the first evaluation of the global model at 50 % or more.
    evals = sorted(
        (e["time_s"], e["test_accuracy"]) for r in range(3) for e in rank_events(out, r, "eval")
    )
    assert s["time_to_target_s"] == next(t for t, acc in evals if acc >= 0.5)
    [final_eval] = [e for e in rank_events(out, 0, "eval") if e.get("final")]
    assert s["final_test_accuracy"] == final_eval["test_accuracy"] > 0.5
    # logs/: each rank's own log lines, under its agent's directory.
    logs = rank_logs(out)
    for rank, role in [(0, "server"), (1, "worker"), (2, "worker")]:
        assert f"rank{rank} {role}]" in logs


def test_a_replica_gone_bad_is_skipped_then_rejected_and_refetched(asgd_run):
    out, _, _ = asgd_run
    s = read_summary(out)
    assert s["steps_skipped_nonfinite"] == 1 and s["pushes_rejected"] == 1
    assert final_record(out, STRAGGLER_RANK)["steps_skipped_nonfinite"] == 1
    assert final_record(out, STRAGGLER_RANK)["pushes_rejected"] == 1
    bad = [(p["worker"], p["status"]) for p in rank_events(out, 0, "push") if p["status"] != "OK"]
    assert bad == [(STRAGGLER_RANK, "REJECTED")]
    assert final_record(out, 0)["rejected_nonfinite"] == 1
    assert "rejected a non-finite push from rank 2" in rank_logs(out)
    # The worker re-fetched θ and trained on: the model that came out of it is finite.
    assert all(torch.isfinite(v).all() for v in saved_state(out).values())


def test_straggler_and_slow_fault_sleep_in_proportion_to_compute(asgd_run):
    out, record, _ = asgd_run
    for rank, factor in {SLOW_RANK: 2.0, STRAGGLER_RANK: 3.0}.items():
        steps = [json.loads(x) for x in (record / f"rank{rank}.jsonl").read_text().splitlines()]
        # Worker 0 (rank 1) trains its 30 warm-start steps on the same emulated device first.
        assert len(steps) == STEPS + (30 if rank == 1 else 0)
        for call in steps:
            assert call["factor"] == factor and call["min_step_time_s"] == 0.002
            # The README's rule, max(compute, 2 ms)·FACTOR − compute: slept in the layers' hooks
            # and at the step's end, a step's overshoot repaid by the next
            padding = max(call["compute_s"], 0.002) * factor - call["compute_s"]
            assert call["hooks_s"] + call["remainder_s"] == pytest.approx(
                padding - call["debt_before_s"] + call["debt_after_s"], rel=1e-9, abs=1e-12
            )
        assert sum(c["hooks_s"] for c in steps) > 0  # the padding is spread over the layers
    assert not (record / "rank0.jsonl").exists()  # the server trains nothing


def test_plot_of_a_run_and_of_a_directory_that_is_not_one(asgd_run, tmp_path, monkeypatch, capsys):
    from cloudburst import forkserver
    from cloudburst.cli import main

    # The CLI's main() in this process (plotting is not about the process boundary; the
    # forkserver that this test process's spawns may use is left alone)
    monkeypatch.setattr(forkserver, "stop_forkserver", lambda: None)
    out, _, _ = asgd_run
    png = tmp_path / "curves.png"
    capsys.readouterr()
    assert main(["plot", str(out), "-o", str(png)]) == 0
    assert str(png) in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_warm_start(asgd_run):
    out, _, _ = asgd_run
    # Worker 0 (rank 1) trained alone first, uncounted (test_summary_metrics_and_logs' samples).
    assert [r["step"] for r in rank_events(out, 1, "warmup")] == [10, 20, 30]
    assert rank_events(out, 2, "warmup") == []
    # The servers started from its θ: the global model, before any push, is already far
    # better than chance (10 classes).
    first = rank_events(out, 1, "eval")[0]
    assert first["samples"] == 0 and first["test_accuracy"] > 0.3


def test_init_from_starts_every_rank_from_a_saved_model(asgd_run, tmp_path):
    start, _, _ = asgd_run
    again = tmp_path / "again"
    cli("train", "--strategy", "asgd", "--workers", "2", "--servers", "1", "--steps", "1",
        "--lr", "1e-9", "--init-from", str(start / "model.pt"), "--out", str(again),
        *FAST)  # fmt: skip
    # Every rank started from that model (the servers too): with a negligible learning rate,
    # one step later the model is still the same.
    before, after = saved_state(start), saved_state(again)
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=1e-6)


def test_demo_runs_sync_and_asgd_and_writes_a_table_and_curves(tmp_path):
    out = tmp_path / "demo"
    proc = cli("demo", "--epochs", "0.25", "--out", str(out))
    # MNIST-1D, 4 workers, 4000 samples: 15 batches of 64 an epoch, 4 steps in a quarter.
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if {"strategy", "samples"} <= set(line.split()))
    rows = {}
    for line in lines[header + 1 : header + 3]:  # a row per strategy, from its name on
        tokens = line.split()
        at = max(i for i, token in enumerate(tokens) if token in ("sync", "asgd"))
        rows[tokens[at]] = tokens[at:]
    assert rows["sync"][1:3] == ["4", "0"] and rows["asgd"][1:3] == ["4", "1"]
    assert str(4 * 4 * 64) in rows["sync"] and str(4 * 4 * 64) in rows["asgd"]
    for name, servers in [("sync", 0), ("asgd", 1)]:
        s = read_summary(out / name)
        assert (s["strategy"], s["workers"], s["servers"]) == (name, 4, servers)
        assert s["config"]["dataset"] == "mnist1d" and s["steps_per_worker"] == 4
    assert read_summary(out / "asgd")["config"]["server_lr"] == 0.25
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary_md = (out / "summary.md").read_text()
    assert "sync" in summary_md and "asgd" in summary_md


_FORKED_SERVER = """
import multiprocessing as mp, os, sys
import cloudburst.cli  # torch imported, as in the CLI when it starts its forkserver
from cloudburst.forkserver import forkserver_pid, start_forkserver, stop_forkserver
from tests.support import write_parent_pid

start_forkserver(fork=True)
server = forkserver_pid()
ctx = mp.get_context("forkserver")
p = ctx.Process(target=write_parent_pid, args=(sys.argv[1],))
p.start()
p.join(60)
same_argv = open(f"/proc/{server}/cmdline").read() == open("/proc/self/cmdline").read()
stop_forkserver()
print(server, p.exitcode, same_argv, os.path.exists(f"/proc/{server}"))
"""


def test_the_cli_forks_its_forkserver_from_itself_and_ranks_come_from_it(tmp_path):
    """The CLI's forkserver is a fork of the CLI (the same command line: torch is not imported
    a second time), a process started in the forkserver context is its child, and
    stop_forkserver leaves no server behind."""
    cmd = [sys.executable, "-c", _FORKED_SERVER, str(tmp_path / "ppid")]
    out = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    server, exitcode, same_argv, alive = out.stdout.split()
    assert exitcode == "0" and same_argv == "True" and alive == "False"
    assert (tmp_path / "ppid").read_text() == server


def test_a_cli_call_forked_from_the_zygote_matches_a_fresh_interpreter(tmp_path, monkeypatch):
    """tests.support.cli forks its jobs from a zygote that imported the CLI once: for the same
    command (a refused resume, and the help of train) it must give what a fresh
    ``python -m cloudburst`` gives: exit code, stdout and stderr, byte for byte."""
    from tests import support

    missing = str(tmp_path / "nothing-here")
    calls = [("train", "--resume", missing), ("train", "--help")]
    forked = [cli(*args, check=False) for args in calls]
    assert support._zygote is not None and not support._zygote_failed
    runs = support._zygote.runs
    monkeypatch.setenv("CLOUDBURST_TEST_FRESH_CLI", "1")
    fresh = [cli(*args, check=False) for args in calls]
    assert support._zygote.runs == runs  # those ran in fresh interpreters
    assert runs >= len(calls)
    for a, b in zip(forked, fresh, strict=True):
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)
    assert forked[0].returncode != 0 and missing in forked[0].stderr
