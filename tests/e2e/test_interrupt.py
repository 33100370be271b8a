"""Ctrl-C and SIGTERM: every process of the job stops, none is left behind, the summary says
the run was interrupted and what it did, the last complete checkpoints are kept, and the
printed ``--resume`` command continues the run. A SIGKILLed launcher leaves no process either."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cloudburst.records.checkpoint import load_checkpoint
from cloudburst.records.metrics import read_jsonl
from tests.e2e.instrumented import QUIET, session_processes
from tests.support import cli, finish_job, read_summary, start_job, wait_running, wait_until

pytestmark = pytest.mark.e2e

BOUND_S = 120  # a run that does not stop within this is a failure (not a timing measurement)


def _all_gone(sid: int) -> None:
    """Every process of session ``sid`` exits (within the bound: a process that noticed its
    parent's exit may take a moment to finish)."""
    wait_until(lambda: not session_processes(sid), BOUND_S, f"session {sid} to end")


def _fired(path: Path) -> bool:
    return path.is_file() and any(r["event"] == "fault" for r in read_jsonl(path))


def _wait_for_checkpoint(out: Path, proc: subprocess.Popen) -> None:
    """Until both workers have saved the same step: a lockstep run resumes from a step all its
    workers hold, so an interrupt before the slower worker's save would resume from step 0."""

    def steps(worker: int) -> set[str]:
        saved = (out / "checkpoints").glob(f"worker{worker}-step*.pt")
        return {p.name.split("-")[1] for p in saved}

    wait_running(proc, lambda: steps(0) & steps(1), "a checkpoint of every worker", BOUND_S, 0.1)


@pytest.mark.parametrize("torchrun", [False, True], ids=["launcher", "torchrun"])
def test_ctrl_c_stops_every_process_and_resume_continues(tmp_path, torchrun):
    """Ctrl-C of the launcher or of torchrun: every process stops and rank 0 writes the
    interrupted summary; the launcher's run keeps its checkpoints and resumes."""
    out = tmp_path / "run"
    # 150 steps of at least 20 ms: the interrupt comes ~2.6 s of steps before the end, and
    # the resumed run has only the rest to train (torchrun's run: 400, for more margin).
    args = [*QUIET, "--workers", "2", "--steps", "400" if torchrun else "150"]
    args += ["--min-step-time-s", "0.02", "--checkpoint-every", "20", "--out", str(out)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "cloudburst", "train", *args]  # fmt: skip
    proc = start_job(args, cmd if torchrun else None, sigint_default=True)
    _wait_for_checkpoint(out, proc)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole foreground group
    stdout, stderr = finish_job(proc, BOUND_S)
    assert (proc.returncode != 0) if torchrun else (proc.returncode == 130), stderr
    _all_gone(proc.pid)
    summary = read_summary(out)
    assert summary["interrupted"] is True and summary["checkpoints"]
    assert f"continue with: cloudburst train --resume {out}" in stderr
    if torchrun:
        return
    done = max(summary["steps_done"].values())
    assert 20 <= done < 150 and summary["samples"] > 0
    assert summary["resume_command"] == f"cloudburst train --resume {out}"
    kept = sorted((out / "checkpoints").glob("worker*.pt"))
    assert [str(p.relative_to(out)) for p in kept] == summary["checkpoints"]
    for path in kept:
        load_checkpoint(path)  # complete and valid
    assert not list((out / "checkpoints").glob(".*"))  # no torn temporary file kept as one
    assert stdout.splitlines()[0].split()[:3] == ["strategy", "W", "S"]  # the table

    cli("train", "--resume", str(out), "--no-progress")
    resumed = read_summary(out)
    assert "interrupted" not in resumed and resumed["steps_per_worker"] == 150
    starts = [r for r in read_jsonl(out / "metrics" / "rank0.jsonl") if r["event"] == "resume"]
    assert starts and starts[-1]["step"] >= 20


def test_sigterm_stops_servers_workers_and_a_hung_rank(tmp_path):
    """A SIGSTOPped rank cannot act on SIGTERM: the launcher SIGKILLs it at once; a second
    SIGTERM, whenever it comes, neither kills the launcher nor loses the summary."""
    out = tmp_path / "run"
    args = [*QUIET, "--strategy", "asgd", "--servers", "1", "--workers", "2", "--n-sync", "2"]
    args += ["--steps", "400", "--min-step-time-s", "0.02", "--checkpoint-every", "10"]
    args += ["--inject-fault", "stop:2@15", "--out", str(out)]  # a hung rank ignores SIGTERM
    proc = start_job(args, sigint_default=True)
    wait_running(
        proc, lambda: _fired(out / "metrics" / "rank2.jsonl"), "rank 2's stop", BOUND_S, 0.1
    )
    lines: list[str] = []  # the launcher's stderr, read as it comes (and its stdout drained)
    readers = [threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, ""))),
               threading.Thread(target=proc.stdout.read)]  # fmt: skip
    for reader in readers:
        reader.start()
    proc.send_signal(signal.SIGTERM)  # to the launcher only: it stops the rest
    # The second SIGTERM comes once the launcher says it is stopping the job (or has exited).
    wait_until(lambda: proc.poll() is not None or any("Ctrl-C again" in x for x in lines),
               timeout_s=BOUND_S, what="the launcher to announce the stop")  # fmt: skip
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # during the stop or after it: exit 130 either way
    try:
        proc.wait(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    for reader in readers:
        reader.join(timeout=BOUND_S)
    stderr = "".join(lines)
    assert proc.returncode == 130, stderr
    assert "Ctrl-C again to kill it at once" in stderr
    _all_gone(proc.pid)
    assert read_summary(out)["interrupted"] is True


def test_a_sigkilled_launcher_leaves_no_process_behind(tmp_path):
    """SIGKILL cannot be handled: the agents and the forkserver die with the launcher, and the
    ranks with them (each asked the kernel for it), instead of training on unsupervised."""
    out = tmp_path / "run"
    args = [*QUIET, "--workers", "2", "--steps", "100000", "--min-step-time-s", "0.02"]
    proc = start_job([*args, "--out", str(out)], sigint_default=True)

    def training() -> bool:
        paths = [out / "metrics" / f"rank{r}.jsonl" for r in range(2)]
        return all(p.is_file() and '"first_step"' in p.read_text() for p in paths)

    wait_running(proc, training, "both ranks to train", BOUND_S, 0.1)
    proc.kill()  # the launcher only
    proc.wait(timeout=BOUND_S)
    _all_gone(proc.pid)
