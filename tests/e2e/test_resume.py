"""Checkpoints, ``--resume`` and restarts under ``--max-restarts``, with injected faults: the
deterministic strategies end exactly where an undisturbed run of the same seed (a shared run,
checkpointing at the same steps) ends."""

import copy
import os
import shutil
import signal

import pytest
import torch

from cloudburst.records.checkpoint import load_checkpoint, save_checkpoint
from tests import reference as ref
from tests.support import (
    cli,
    final_record,
    finish_job,
    rank_events,
    rank_logs,
    read_events,
    read_summary,
    refused,
    saved_state,
    start_job,
    wait_running,
)

pytestmark = pytest.mark.e2e

COMMON = (
    "--dataset", "synthetic", "--model", "mlp", "--workers", "2", "--batch-size", "16",
    "--steps", "40", "--checkpoint-every", "10", "--eval-every-s", "60", "--no-progress",
    "--comm-timeout-s", "20",
)  # fmt: skip
# Every run also has worker rank 1's loss at step 5 NaN (a first-attempt fault).
NAN = ("--inject-fault", "nan:1@5")
STRATEGY_FLAGS = {
    "sync": (),
    "diloco": ("--period", "4", "--diloco-outer-lr", "0.5", "--diloco-outer-momentum", "0.5"),
    "daso": ("--nodes", "2", "--workers", "4", "--daso-global-skip", "2",
             "--daso-batches-to-wait", "1", "--daso-warmup-epochs", "0.1",
             "--daso-cooldown-epochs", "0.1"),
}  # fmt: skip
# Steps skipped for that NaN: sync's averaged gradient is NaN on both workers, DASO's on both
# ranks of rank 1's node; a DiLoCo worker's gradient is its own.
NAN_SKIPPED = {"sync": 2, "diloco": 1, "daso": 2}


def _flags(strategy: str) -> tuple[str, ...]:
    return ("--strategy", strategy, *COMMON, *STRATEGY_FLAGS[strategy], *NAN)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """``undisturbed(strategy)``: its run without the kill, made once (read it, or copy it)."""
    runs = {}

    def run(strategy: str):
        if strategy not in runs:
            out = tmp_path_factory.mktemp(strategy) / "run"
            try:
                cli("train", *_flags(strategy), "--out", str(out))
                runs[strategy] = out
            except BaseException as e:  # noqa: BLE001 - every test that needs it fails alike
                runs[strategy] = e
        if isinstance(runs[strategy], BaseException):
            raise AssertionError(f"the undisturbed {strategy} run failed: {runs[strategy]}")
        return runs[strategy]

    return run


def _assert_same_model(a, b, why: str = ""):
    """Runs ``a`` and ``b`` end on the same model (to 1e-5) and final accuracy (to 1e-6)."""
    pa, pb = saved_state(a), saved_state(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=1e-5, rtol=0), f"{k} differs after the restart"
    accuracy = read_summary(a)["final_test_accuracy"]
    assert read_summary(b)["final_test_accuracy"] == pytest.approx(accuracy, abs=1e-6), why


# local_sgd is diloco's base class (its state is a subset of diloco's): not run separately;
# sync resumes by hand below (the same resume, without the agent's restart).
@pytest.mark.parametrize("strategy", ["diloco", "daso"])
def test_a_killed_worker_restarts_the_job_from_its_checkpoint_on_the_same_trajectory(
    tmp_path, strategy, undisturbed
):
    ref, hurt = undisturbed(strategy), tmp_path / "hurt"
    # Worker rank 1 dies after step 25: the checkpoint of step 20 is the last one.
    proc = cli(
        "train", *_flags(strategy), "--out", str(hurt), "--max-restarts", "1",
        "--inject-fault", "kill:1@25",
    )  # fmt: skip
    _assert_same_model(ref, hurt, proc.stderr)
    resumes = rank_events(hurt, 0, "resume")
    # DASO checkpoints at the first step without a global sync in flight (20 or 21).
    assert len(resumes) == 1 and resumes[0]["attempt"] == 1
    assert resumes[0]["step"] == 20 or (strategy == "daso" and resumes[0]["step"] == 21)
    starts = rank_events(hurt, 1, "start")
    assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"]
    # The faults fired once, in the first attempt; the skipped step's count was restored
    # from the checkpoint.
    faults = [(e["kind"], e["step"]) for e in rank_events(hurt, 1, "fault")]
    assert faults == [("nan", 5), ("kill", 25)]
    assert read_summary(hurt)["steps_skipped_nonfinite"] == NAN_SKIPPED[strategy]
    assert read_summary(ref)["steps_skipped_nonfinite"] == NAN_SKIPPED[strategy]


def test_resume_by_hand_after_a_failed_run_and_a_nan_step(tmp_path, undisturbed):
    ref, hurt = undisturbed("sync"), tmp_path / "hurt"
    # No restarts: the job fails, one line per failed rank, the checkpoints stay.
    proc = cli("train", *_flags("sync"), "--out", str(hurt), "--inject-fault", "kill:1@33",
               check=False)  # fmt: skip
    # torch's agent names the first rank to fail: the killed one or its peer (gloo raises).
    assert proc.returncode == 1 and any(f"rank {r} failed" in proc.stderr for r in (0, 1))
    # What is there says the run failed (no summary of a finished run).
    assert not (hurt / "summary.json").exists() or read_summary(hurt).get("failed")
    steps_before = [e["step"] for e in rank_events(hurt, 0, "step")]
    proc = cli("train", "--resume", str(hurt))
    assert "resuming every worker from step 30" in proc.stderr
    _assert_same_model(ref, hurt)
    summary = read_summary(hurt)
    # The NaN step was skipped on both replicas (its gradient is averaged), in both runs.
    report = final_record(hurt, 0)
    assert report["steps_skipped_nonfinite"] == 1 and report["resumed_from_step"] == 30
    assert summary["steps_skipped_nonfinite"] == 2
    # The learning curve continues: the resumed run appends to the same metrics.
    steps_after = [e["step"] for e in rank_events(hurt, 0, "step")]
    assert steps_after[: len(steps_before)] == steps_before and steps_after[-1] == 40
    assert steps_before[-1] == 30


def _files(run) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_resume_refuses_corrupt_foreign_and_changed_runs_and_touches_nothing(
    tmp_path, monkeypatch, capsys, undisturbed
):
    from cloudburst.cli import build_config, build_parser
    from cloudburst.config import ConfigError

    ref = undisturbed("sync")
    [ckpt_name] = [p.name for p in sorted((ref / "checkpoints").glob("worker1-*.pt"))[-1:]]
    good = load_checkpoint(ref / "checkpoints" / ckpt_name, "worker-state")

    # Worker 1's latest checkpoint replaced, in a copy of the run each: cut short; and
    # well-formed checkpoints of other runs: another seed, another run directory's identity.
    def foreign(**identity):
        state = {"identity": {**good["identity"], **identity}, "step": 30}
        return lambda path: save_checkpoint(path, "worker-state", state)

    def cut(path):
        path.write_bytes(path.read_bytes()[:1000])

    bad_files = {
        "truncated": (cut, "cannot be read safely"),
        "seed": (foreign(seed=1), "belongs to another run: its seed is 1, this run's is 0"),
        "run": (foreign(run="0" * 32), "belongs to another run: its run is '" + "0" * 32 + "'"),
    }
    runs = {}
    for name, (spoil, _) in bad_files.items():
        runs[name] = shutil.copytree(ref, tmp_path / name)
        spoil(runs[name] / "checkpoints" / ckpt_name)
    runs["changes"] = shutil.copytree(ref, tmp_path / "changes")
    before = {name: _files(run) for name, run in runs.items()}
    # The CLI's entry point, in this process (a refusal launches nothing)
    for what, (_, expected) in bad_files.items():
        done = refused(["train", "--resume", str(runs[what])], monkeypatch, capsys)
        assert done.returncode == 2 and done.stdout == "", (what, done.stdout)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("cloudburst: invalid config: resume: ")
        assert expected in lines[0], lines
    # What makes a run's identity cannot change when it resumes: refused by the CLI's parser
    # and config check, before anything is read or started (in this process).
    changes = {
        "servers": ["--servers", "1"],
        "model": ["--model", "cnn"],
        "dataset": ["--dataset", "mnist1d"],
        "batch_size": ["--batch-size", "32"],
    }
    for key, args in changes.items():
        parsed = build_parser().parse_args(["train", "--resume", str(runs["changes"]), *args])
        with pytest.raises(ConfigError, match=f"^resume: {key} cannot change"):
            build_config(parsed)
    # A refused resume changes no file.
    assert {name: _files(run) for name, run in runs.items()} == before


def test_gossip_restarts_and_continues(tmp_path):
    out = tmp_path / "g"
    cli(
        "train", "--strategy", "gossip", *COMMON, "--out", str(out), "--max-restarts", "1",
        "--inject-fault", "kill:0@25",
    )  # fmt: skip
    summary = read_summary(out)
    assert summary["final_test_accuracy"] > 0.5 and summary["lost_workers"] == []
    # Worker 1 may be ahead of worker 0; both resume from the latest step both saved.
    resumed = [e["step"] for e in rank_events(out, 1, "resume")]
    assert resumed in ([10], [20])
    assert [e["step"] for e in rank_events(out, 0, "resume")] == resumed
    assert [e["step"] for e in rank_events(out, 0, "step")][-1] == 40


def test_asgd_resumes_its_server_and_worker_exactly(tmp_path):
    # One worker, so that the run and its resumption are determined: the worker restarts
    # from its step-30 checkpoint (optimizer, data position) and from the server's θ, the
    # server from its shard checkpoint, whose sgd rule has momentum (optimizer state).
    out = tmp_path / "a"
    cli("train", *ref.COMMON, "--strategy", "asgd", "--workers", "1", "--servers", "1",
        "--n-sync", "2", "--server-rule", "sgd", "--server-lr", "0.5", "--server-momentum",
        "0.5", "--steps", "40", "--checkpoint-every", "10", "--out", str(out))  # fmt: skip
    worker = ref.AsgdWorker(n_fetch=2, n_push=2, rule="sgd", lr=0.5, momentum=0.5)
    checkpoint = worker.train(40, checkpoint_at=30)
    worker.finish()
    ref.assert_same_params(ref.trained(out), worker.global_model())
    assert read_summary(out)["samples_applied"] == 20 * 32  # 20 pushes of 2 steps

    proc = cli("train", "--resume", str(out), "--steps", "60")
    assert "resuming workers from steps 0:30" in proc.stderr
    [server_resume] = rank_events(out, 0, "resume")
    assert server_resume["version"] == 20
    assert [e["step"] for e in rank_events(out, 1, "resume")] == [30]
    forgetful = copy.deepcopy(worker)  # a server that lost its momentum would end elsewhere
    forgetful.server.opt = torch.optim.SGD([forgetful.server.theta], lr=0.5, momentum=0.5)
    for w in (worker, forgetful):
        w.resume(checkpoint)
        w.train(30)  # steps 31..60 again: 15 more pushes
        w.finish()
    ref.assert_same_params(ref.trained(out), worker.global_model())
    ref.assert_params_differ(worker.global_model(), forgetful.global_model(), at_least=1e-4)
    summary = read_summary(out)
    assert final_record(out, 0)["version"] == 20 + 15
    assert summary["samples_applied"] == (20 + 15) * 32 and summary["samples"] == 60 * 16


def test_a_restarted_server_points_to_resume_which_continues_the_run(tmp_path):
    """A server shard killed mid-run (server 1: server 0 also holds the job's store) is
    restarted by its agent but cannot rejoin: it fails with a line pointing to ``--resume``,
    the job fails, and ``--resume`` continues it from the workers' and shards' checkpoints
    (easgd, two shards)."""
    out = tmp_path / "easgd"
    proc = start_job(["--strategy", "easgd", "--workers", "2", "--servers", "2", "--easgd-tau",
                      "2", "--dataset", "synthetic", "--model", "mlp", "--batch-size", "16",
                      "--steps", "2000", "--min-step-time-s", "0.01", "--checkpoint-every", "10",
                      "--max-restarts", "1", "--comm-timeout-s", "5", "--heartbeat-timeout-s",
                      "3", "--eval-every-s", "60", "--no-progress", "--out", str(out)])  # fmt: skip

    def server_pid() -> int | None:  # once worker rank 3 is past step 30 and shard 1 saved
        records = read_events(out / "metrics" / "rank3.jsonl", growing=True)
        steps = [e["step"] for e in records if e["event"] == "step"]
        if steps and steps[-1] >= 30 and (out / "checkpoints" / "server1.pt").is_file():
            server = read_events(out / "metrics" / "rank1.jsonl", growing=True)
            return next(e["pid"] for e in server if e["event"] == "start")
        return None

    os.kill(wait_running(proc, server_pid, "the run to get going", 120), signal.SIGKILL)
    stdout, stderr = finish_job(proc, 180)
    assert proc.returncode == 1, stdout + stderr
    assert "rank 1 failed" in stderr
    assert not (out / "summary.json").exists() or read_summary(out).get("failed")
    logs = rank_logs(out)
    assert "parameter-server rank 1 was restarted" in logs
    assert "restart the whole job from its checkpoints with --resume" in logs

    proc = cli("train", "--resume", str(out), "--steps", "60")
    assert "resuming workers from steps" in proc.stderr
    summary = read_summary(out)
    assert summary["lost_workers"] == [] and summary["samples"] == 2 * 60 * 16
    for server in (0, 1):  # each shard from its own checkpoint
        resumes = rank_events(out, server, "resume")
        assert len(resumes) == 1 and resumes[0]["version"] >= 10
    for worker in (2, 3):  # each worker from its own latest checkpoint, to step 60
        [resume] = rank_events(out, worker, "resume")
        assert resume["step"] % 10 == 0 and 10 <= resume["step"] < 60
        assert [e["step"] for e in rank_events(out, worker, "step")][-1] == 60
