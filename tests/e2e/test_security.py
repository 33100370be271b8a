"""Hostile input and shared machines, as a user meets them: no file left in a directory runs
code, the launcher signals only processes it started, and a local job listens on 127.0.0.1
only whatever the environment says. (A refused output directory: tests/e2e/test_cli.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloudburst.config import RunConfig
from cloudburst.records.metrics import read_jsonl
from tests.e2e.instrumented import QUIET, ip, two_namespaces
from tests.support import REPO, cli, read_summary, refused

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_run_directory_with_a_planted_module_never_runs_it(tmp_path, monkeypatch, capsys):
    """``cd shared_run && python -m cloudburst train --resume .``: the config.json there names
    ``evil:net`` and ``evil.py`` lies beside it. Without --trust-config the factory is refused;
    with it, the current directory is still not on the import path."""
    run = tmp_path / "shared_run"
    run.mkdir()
    marker = tmp_path / "PWNED"
    (run / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\ndef net(**kw): ...\n")
    cfg = RunConfig(model="evil:net", dataset="synthetic", steps=5, out=str(run))
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    # The refusal, through the CLI's main() in this process, in the run directory and with it
    # on the import path (where ``python -m`` puts it, before __main__ takes it off): refused
    # before anything is imported, or evil.py would run here. (The path itself: the
    # --trust-config run below, a real ``python -m cloudburst`` there.)
    monkeypatch.chdir(run)
    monkeypatch.syspath_prepend(str(run))
    refusal = refused(["train", "--resume", "."], monkeypatch, capsys)
    assert refusal.returncode == 2 and not marker.exists()
    assert "evil" not in sys.modules
    assert refusal.stderr.strip().splitlines() == [
        "cloudburst: invalid config: model: --resume . (its config.json) names the factory "
        "'evil:net', which would import and run that code; pass --model evil:net (or "
        "--trust-config) if you mean to run it"
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-m", "cloudburst", "train", "--resume", ".", "--trust-config"]
    trusted = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=120)
    assert trusted.returncode == 2 and not marker.exists()
    assert "cannot import module 'evil'" in trusted.stderr


def test_only_processes_the_launcher_started_are_signalled(tmp_path):
    """A SIGSTOPped rank is reaped (it is the launcher's); a PID planted in a ``start`` record
    of the metrics, its command line mentioning multiprocessing, is not."""
    out = tmp_path / "run"
    flags = ("--strategy", "asgd", "--servers", "1", "--n-sync", "2", "--checkpoint-every", "10")
    cli(
        "train", *flags, *QUIET, "--steps", "40", "--min-step-time-s", "0.01",
        "--heartbeat-timeout-s", "2", "--inject-fault", "stop:2@10", "--out", str(out),
    )  # fmt: skip
    assert read_summary(out)["lost_workers"] == [2]
    stopped = [r for r in read_jsonl(out / "metrics" / "rank2.jsonl") if r["event"] == "start"]
    assert len(stopped) == 1 and not _alive(stopped[0]["pid"])

    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "multiprocessing"],
        start_new_session=True,
    )
    try:
        with open(out / "metrics" / "rank0.jsonl", "a") as f:
            f.write(json.dumps({"event": "start", "rank": 0, "pid": bystander.pid}) + "\n")
        cli("train", "--resume", str(out), "--steps", "50", "--no-progress")
        assert read_summary(out)["samples"] > 0
        assert bystander.poll() is None and _alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()


# ------------------------------------------------------------------- binding
@pytest.fixture
def netns_pair():
    """Two namespaces joined by a veth pair: in the first, an interface other than loopback
    (with an address) that a preset GLOO_SOCKET_IFNAME can name."""
    with two_namespaces() as pair:
        if pair is None or shutil.which("ss") is None:
            pytest.skip("needs root, iproute2's ip and ss")
        yield pair


def _listeners(ns: str) -> set[str]:
    """Local addresses of the TCP sockets listening in namespace ``ns``."""
    text = ip("netns", "exec", ns, "ss", "-Hltn", check=False).stdout
    return {line.split()[3] for line in text.splitlines() if line.strip()}


def test_a_local_job_listens_on_loopback_only_whatever_gloo_socket_ifname_says(
    tmp_path, netns_pair
):
    out, ns = tmp_path / "run", netns_pair.names[0]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": netns_pair.ifnames[0], "OMP_NUM_THREADS": "1"}
    cmd = [
        "ip", "netns", "exec", ns, sys.executable, "-m", "cloudburst", "train",
        "--strategy", "asgd", "--servers", "1", "--workers", "2", *QUIET, "--steps", "150",
        "--min-step-time-s", "0.02", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen: set[str] = set()
    deadline = time.monotonic() + 240
    # Sample the listening sockets until the job has written its summary.
    while proc.poll() is None and time.monotonic() < deadline:
        if (out / "metrics" / "rank2.jsonl").is_file():  # the ranks are up (gloo connected)
            seen |= _listeners(ns)
        time.sleep(0.1)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert read_summary(out)["samples"] > 0
    # The store and every rank's gloo listener were seen, and all on 127.0.0.1.
    assert len(seen) >= 3, seen
    assert {addr.rsplit(":", 1)[0] for addr in seen} == {"127.0.0.1"}, seen
