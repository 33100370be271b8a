"""Hostile input and shared machines, as a user meets them: no file left in a directory runs
code, the launcher signals only processes it started, a local job listens on 127.0.0.1 only
whatever the environment says, and a refused output directory loses nothing."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cloudburst.config import RunConfig
from cloudburst.records.metrics import read_jsonl
from tests.e2e.instrumented import ip
from tests.helpers import REPO, cli, read_summary, refused

QUIET = ("--dataset", "synthetic", "--model", "mlp", "--batch-size", "16", "--no-progress")


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
    trusted = subprocess.run(
        [sys.executable, "-m", "cloudburst", "train", "--resume", ".", "--trust-config"],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert trusted.returncode == 2 and not marker.exists()
    assert "cannot import module 'evil'" in trusted.stderr


def test_a_refused_output_directory_loses_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "project"
    (out / "metrics").mkdir(parents=True)
    (out / "metrics" / "results.csv").write_text("mine")
    # (the CLI's entry point in this process: the refusal comes before any launch)
    proc = refused(["train", *QUIET, "--steps", "5", "--out", str(out)], monkeypatch, capsys)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"cloudburst: invalid config: out: {str(out)!r} is not empty")
    assert [p.name for p in out.rglob("*")] == ["metrics", "results.csv"]


def test_only_processes_the_launcher_started_are_signalled(tmp_path):
    """A SIGSTOPped rank is reaped (it is the launcher's), a PID planted in a metrics file is
    not (the old launcher killed any PID found in a ``start`` record whose command line
    mentions multiprocessing)."""
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
def netns_with_veth():
    """A network namespace of the test's own with a veth pair (both ends inside it, an address
    on one end): an interface other than loopback that a preset GLOO_SOCKET_IFNAME can name.
    Nothing is sent anywhere; the namespace goes away with the test."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ss") is None:
        pytest.skip("needs root, iproute2's ip and ss")
    name = f"cbsec-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    made = ip("netns", "add", name, check=False)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` does not work here: {made.stderr.strip()}")
    try:
        ns = ("-n", name)
        ip(*ns, "link", "add", "cbsec0", "type", "veth", "peer", "name", "cbsec1")
        ip(*ns, "addr", "add", f"10.214.{random.randrange(256)}.1/24", "dev", "cbsec0")
        for ifname in ("lo", "cbsec0", "cbsec1"):
            ip(*ns, "link", "set", ifname, "up")
        yield name
    finally:
        ip("netns", "del", name, check=False)


def _listeners(ns: str) -> set[str]:
    """Local addresses of the TCP sockets listening in namespace ``ns``."""
    text = ip("netns", "exec", ns, "ss", "-Hltn", check=False).stdout
    return {line.split()[3] for line in text.splitlines() if line.strip()}


def test_a_local_job_listens_on_loopback_only_whatever_gloo_socket_ifname_says(
    tmp_path, netns_with_veth
):
    out = tmp_path / "run"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "cbsec0", "OMP_NUM_THREADS": "1"}
    cmd = [
        "ip", "netns", "exec", netns_with_veth, sys.executable, "-m", "cloudburst", "train",
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
            seen |= _listeners(netns_with_veth)
        time.sleep(0.1)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert read_summary(out)["samples"] > 0
    # The store and every rank's gloo listener were seen, and all on 127.0.0.1.
    assert len(seen) >= 3, seen
    assert {addr.rsplit(":", 1)[0] for addr in seen} == {"127.0.0.1"}, seen
