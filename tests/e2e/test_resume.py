"""Checkpoints, ``--resume`` and restarts under ``--max-restarts``, with injected faults.

The deterministic strategies must end exactly where an undisturbed run of the same seed ends
(the reference checkpoints at the same steps: checkpoints do not change the arithmetic).
"""

import pytest
import torch

from cloudburst.metrics import read_jsonl
from tests.helpers import cli, read_summary

pytestmark = pytest.mark.e2e

COMMON = (
    "--dataset", "synthetic", "--model", "mlp", "--workers", "2", "--batch-size", "16",
    "--steps", "40", "--checkpoint-every", "10", "--eval-every-s", "60", "--no-progress",
    "--comm-timeout-s", "20",
)  # fmt: skip
STRATEGY_FLAGS = {
    "sync": (),
    "local_sgd": ("--period", "4"),
    "diloco": ("--period", "4", "--diloco-outer-lr", "0.5", "--diloco-outer-momentum", "0.5"),
    "daso": ("--nodes", "2", "--workers", "4", "--daso-global-skip", "2",
             "--daso-batches-to-wait", "1", "--daso-warmup-epochs", "0.1",
             "--daso-cooldown-epochs", "0.1"),
}  # fmt: skip


def _params(out):
    payload = torch.load(out / "model.pt", weights_only=True)["payload"]
    return payload["state_dict"]


def _events(out, rank):
    return read_jsonl(out / "metrics" / f"rank{rank}.jsonl")


def _assert_same_model(a, b, tol=1e-5):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=tol, rtol=0), f"{k} differs after the restart"


# local_sgd is diloco's base class (its state is a subset of diloco's): not run separately.
@pytest.mark.parametrize("strategy", ["sync", "diloco", "daso"])
def test_a_killed_worker_restarts_the_job_from_its_checkpoint_on_the_same_trajectory(
    tmp_path, strategy
):
    flags = ("--strategy", strategy, *COMMON, *STRATEGY_FLAGS[strategy])
    ref, hurt = tmp_path / "ref", tmp_path / "hurt"
    cli("train", *flags, "--out", str(ref))
    # Worker rank 1 dies after step 25: the checkpoint of step 20 is the last one.
    proc = cli(
        "train", *flags, "--out", str(hurt), "--max-restarts", "1", "--inject-fault", "kill:1@25"
    )
    summary = read_summary(hurt)
    assert summary["final_test_accuracy"] == pytest.approx(
        read_summary(ref)["final_test_accuracy"], abs=1e-6
    ), proc.stderr
    _assert_same_model(ref, hurt)
    resumes = [e for e in _events(hurt, 0) if e["event"] == "resume"]
    # DASO checkpoints at the first step without a global sync in flight (20 or 21).
    assert len(resumes) == 1 and resumes[0]["attempt"] == 1
    assert resumes[0]["step"] == 20 or (strategy == "daso" and resumes[0]["step"] == 21)
    starts = [e for e in _events(hurt, 1) if e["event"] == "start"]
    assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"]


def test_resume_by_hand_after_a_failed_run_and_a_nan_step(tmp_path):
    flags = ("--strategy", "sync", *COMMON)
    ref, hurt = tmp_path / "ref", tmp_path / "hurt"
    cli("train", *flags, "--out", str(ref), "--inject-fault", "nan:1@5")
    # No restarts: the job fails, one line per failed rank, the checkpoints stay.
    proc = cli(
        "train", *flags, "--out", str(hurt), "--inject-fault", "nan:1@5",
        "--inject-fault", "kill:1@33", check=False,
    )  # fmt: skip
    # torch's agent names the first rank to fail: the killed one or its peer (gloo raises).
    assert proc.returncode == 1 and (
        "rank 1 failed" in proc.stderr or "rank 0 failed" in proc.stderr
    )
    assert not (hurt / "summary.json").exists()
    steps_before = [e["step"] for e in _events(hurt, 0) if e["event"] == "step"]
    proc = cli("train", "--resume", str(hurt))
    assert "resuming every worker from step 30" in proc.stderr
    _assert_same_model(ref, hurt)
    summary = read_summary(hurt)
    # The NaN step was skipped on both replicas (its gradient is averaged), in both runs.
    assert read_summary(ref)["final_test_accuracy"] == pytest.approx(
        summary["final_test_accuracy"], abs=1e-6
    )
    worker_reports = [e for e in _events(hurt, 0) if e["event"] == "final"]
    assert worker_reports[-1]["steps_skipped_nonfinite"] == 1
    assert worker_reports[-1]["resumed_from_step"] == 30
    # The learning curve continues: the resumed run appends to the same metrics.
    steps_after = [e["step"] for e in _events(hurt, 0) if e["event"] == "step"]
    assert steps_after[: len(steps_before)] == steps_before and steps_after[-1] == 40


def test_resume_refuses_corrupt_and_foreign_checkpoints_and_touches_nothing(tmp_path):
    out = tmp_path / "run"
    cli("train", "--strategy", "sync", *COMMON, "--out", str(out))
    ckpt = sorted((out / "checkpoints").glob("worker1-*.pt"))[-1]
    good = ckpt.read_bytes()
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    model_before = (out / "model.pt").read_bytes()
    for bad in (good[: len(good) // 2], b"\x00" * 100):
        ckpt.write_bytes(bad)
        proc = cli("train", "--resume", str(out), check=False)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "resume:" in lines[0] and "cannot be read safely" in lines[0]
    ckpt.write_bytes(good)
    proc = cli("train", "--resume", str(out), "--strategy", "local_sgd", check=False)
    assert proc.returncode == 2 and "strategy cannot change" in proc.stderr
    after = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    assert after == before and (out / "model.pt").read_bytes() == model_before


def test_gossip_restarts_and_continues(tmp_path):
    out = tmp_path / "g"
    cli(
        "train", "--strategy", "gossip", *COMMON, "--out", str(out), "--max-restarts", "1",
        "--inject-fault", "kill:0@25",
    )  # fmt: skip
    summary = read_summary(out)
    assert summary["final_test_accuracy"] > 0.5
    # Worker 1 may be ahead of worker 0; both resume from the latest step both saved.
    assert [e["step"] for e in _events(out, 1) if e["event"] == "resume"] in ([10], [20])


def test_asgd_resumes_its_servers_and_workers(tmp_path):
    out = tmp_path / "a"
    flags = ("--strategy", "asgd", "--servers", "1", "--n-sync", "2", *COMMON)
    cli("train", *flags, "--out", str(out))
    version = read_summary(out)["samples_applied"]
    proc = cli("train", "--resume", str(out), "--steps", "60")
    assert "resuming workers from steps 0:30, 1:30" in proc.stderr
    resumed = [e for e in _events(out, 0) if e["event"] == "resume"]
    assert resumed and resumed[-1]["version"] > 0
    summary = read_summary(out)
    assert summary["samples_applied"] > version and summary["final_test_accuracy"] > 0.5


def test_a_hung_asgd_worker_is_declared_lost_and_the_run_finishes(tmp_path):
    out = tmp_path / "stop"
    cli(
        "train", "--strategy", "asgd", "--servers", "1", "--workers", "3", "--n-sync", "2",
        "--dataset", "synthetic", "--model", "mlp", "--batch-size", "16", "--steps", "60",
        "--min-step-time-s", "0.02", "--heartbeat-timeout-s", "2", "--no-progress",
        "--inject-fault", "stop:3@10", "--out", str(out),
    )  # fmt: skip
    summary = read_summary(out)
    assert summary["lost_workers"] == [3] and summary["final_test_accuracy"] > 0.5
    fired = [e for e in _events(out, 3) if e["event"] == "fault"]
    assert [(e["kind"], e["step"]) for e in fired] == [("stop", 10)]
