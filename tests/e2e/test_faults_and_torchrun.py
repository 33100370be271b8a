"""Workers killed or hung mid-run, and jobs started by the user's own torchrun launches."""

import subprocess
import sys

import pytest

from tests.e2e.instrumented import launch_pair
from tests.support import REPO, cli, cli_env, free_port, rank_events, read_summary

pytestmark = pytest.mark.e2e


def test_killed_and_hung_asgd_workers_are_lost_and_the_others_finish(tmp_path):
    # Three workers: rank 2 is SIGKILLed after step 30, rank 3 SIGSTOPped after step 10
    # (hung: it holds its connections but says nothing, heartbeats included).
    out = tmp_path / "faults"
    proc = cli(
        "train", "--strategy", "asgd", "--servers", "1", "--workers", "3", "--n-sync", "2",
        "--dataset", "synthetic", "--model", "mlp", "--batch-size", "64", "--steps", "100",
        "--min-step-time-s", "0.01", "--heartbeat-timeout-s", "2", "--checkpoint-every", "20",
        "--no-progress", "--inject-fault", "kill:2@30", "--inject-fault", "stop:3@10",
        "--out", str(out),
    )  # fmt: skip
    s = read_summary(out)
    assert s["lost_workers"] == [2, 3] and s["final_test_accuracy"] > 0.5
    assert "lost workers: [2, 3]" in proc.stderr
    assert [(e["kind"], e["step"]) for e in rank_events(out, 2, "fault")] == [("kill", 30)]
    assert [(e["kind"], e["step"]) for e in rank_events(out, 3, "fault")] == [("stop", 10)]
    assert [e["step"] for e in rank_events(out, 1, "step")][-1] == 100  # the survivor
    assert s["samples"] == 100 * 64  # lost workers report nothing
    # ... but what they pushed before (their push after the fault's step included) counts.
    assert s["samples_applied"] == (100 + 30 + 10) * 64
    assert rank_events(out, 0, "final")[-1]["lost_workers"] == [2, 3]
    assert (out / "checkpoints" / "server0.pt").is_file()


def test_two_torchrun_launches_on_localhost(tmp_path):
    # asgd: 3 workers and a server over 2 launches of 2 ranks (DASO's: test_daso_multinode.py)
    out = tmp_path / "run"
    args = ["--strategy", "asgd", "--workers", "3", "--servers", "1", "--n-sync", "3",
            "--steps", "60", "--dataset", "synthetic", "--model", "mlp"]  # fmt: skip
    launch_pair([*args, "--out", str(out)], tmp_path / "logs")
    s = read_summary(out)
    assert s["workers"] == 3 and s["lost_workers"] == []
    assert s["samples"] == 3 * 60 * 64
    assert s["final_test_accuracy"] > 0.3
    for rank in range(1, 4):  # every rank of both launches trained
        assert rank_events(out, rank, "start")[0]["world_size"] == 4
        assert [e["step"] for e in rank_events(out, rank, "step")][-1] == 60


def test_python_api_example_under_torchrun(tmp_path):
    # asgd: servers and workers in one launch. The README's sync command is parsed by
    # test_readme.py; a lockstep Job under torchrun runs there (README.md's block) and
    # sync's hooks in tests/dist/test_api_hooks.py.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           "--master-port", str(free_port()), str(REPO / "examples" / "own_loop.py"),
           "--strategy", "asgd", "--servers", "1", "--n-sync", "5", "--steps", "40",
           "--out", str(tmp_path / "asgd")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=cli_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = sorted(line for line in proc.stdout.splitlines() if line.startswith("worker "))
    assert [line.split(":")[0] for line in reports] == ["worker 0", "worker 1"]
    assert all("sent 0 bytes" not in line for line in reports)  # every worker communicated
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("final global model")]
    assert float(line.rsplit(" ", 1)[1]) > 0.5
