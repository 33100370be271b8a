"""A worker killed mid-run, and jobs started by the user's own torchrun launches."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, free_port, read_summary

pytestmark = pytest.mark.e2e


def _events(path):
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def test_sigkilled_worker_does_not_stop_asgd(tmp_path):
    out = tmp_path / "kill"
    cmd = [
        sys.executable,
        "-m",
        "cloudburst",
        "train",
        "--strategy",
        "asgd",
        "--workers",
        "3",
        "--servers",
        "1",
        "--n-sync",
        "2",
        "--steps",
        "250",
        "--min-step-time-s",
        "0.02",
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--heartbeat-timeout-s",
        "2",
        "--checkpoint-every",
        "20",
        "--no-progress",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    victim = out / "metrics" / "rank3.jsonl"  # worker 2 (rank 0 is the server)
    deadline = time.monotonic() + 120
    pid = None
    while time.monotonic() < deadline:
        events = _events(victim)
        steps = [e["step"] for e in events if e["event"] == "step"]
        if steps and steps[-1] >= 30:
            pid = next(e["pid"] for e in events if e["event"] == "start")
            break
        time.sleep(0.1)
    assert pid is not None, "the victim never got going"
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    s = read_summary(out)
    assert s["lost_workers"] == [3]
    # the survivors trained to the end and their work reached the server
    for rank in (1, 2):
        steps = [
            e["step"]
            for e in _events(out / "metrics" / f"rank{rank}.jsonl")
            if e["event"] == "step"
        ]
        assert steps[-1] == 250
    assert s["samples"] == 2 * 250 * 64  # lost workers report nothing
    assert s["samples_applied"] >= 2 * 250 * 64
    assert (out / "checkpoints" / "server0.pt").is_file()
    assert "lost workers: [3]" in stderr


def _torchrun_pair(tmp_path, nproc: int, args: list[str]) -> None:
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "static",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "cloudburst",
            "train",
            *args,
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        )
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)


@pytest.mark.parametrize(
    "nproc, args",
    [
        (1, ["--strategy", "sync", "--workers", "2"]),
        (2, ["--strategy", "asgd", "--workers", "3", "--servers", "1", "--n-sync", "3"]),
    ],
)
def test_two_torchrun_launches_on_localhost(tmp_path, nproc, args):
    out = tmp_path / "run"
    _torchrun_pair(
        tmp_path,
        nproc,
        [*args, "--steps", "60", "--dataset", "synthetic", "--model", "mlp", "--out", str(out)],
    )
    s = read_summary(out)
    assert s["workers"] == int(args[3]) and s["lost_workers"] == []
    assert s["samples"] == s["workers"] * 60 * 64
    assert s["final_test_accuracy"] > 0.3


def test_python_api_example_under_torchrun(tmp_path):
    for args, nproc in [
        (["--strategy", "asgd", "--servers", "1", "--n-sync", "5"], 3),
        (["--strategy", "sync"], 2),
        (["--strategy", "daso", "--nodes", "2"], 4),
    ]:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(free_port()),
            str(REPO / "examples" / "own_loop.py"),
            *args,
            "--steps",
            "100",
            "--out",
            str(tmp_path / args[1]),
        ]
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("worker ") == nproc - (1 if args[1] == "asgd" else 0)
        if args[1] == "asgd":
            assert "final global model: test accuracy" in proc.stdout
