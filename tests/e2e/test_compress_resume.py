"""A run with error-feedback compression, killed and restarted from its checkpoint, ends exactly
where the undisturbed run of the same seed ends: Streaming DiLoCo (F = 2 fragments, τ = 1)
with ``--compress int8``, whose checkpoints carry each fragment's residual (and wait for no
fragment in flight). A restart that lost the residuals would send different bytes from then on."""

import pytest
import torch

from cloudburst.records.checkpoint import load_checkpoint
from tests.support import cli, rank_events, read_summary, saved_state

pytestmark = pytest.mark.e2e

FLAGS = (
    "--strategy", "diloco", "--period", "4", "--fragments", "2", "--fragment-delay", "1",
    "--compress", "int8", "--dataset", "synthetic", "--model", "mlp", "--workers", "2",
    "--batch-size", "16", "--steps", "40", "--checkpoint-every", "10", "--eval-every-s", "60",
    "--no-progress", "--comm-timeout-s", "20",
)  # fmt: skip


def test_a_compressed_run_restarted_from_its_checkpoint_equals_the_undisturbed_run(tmp_path):
    ref, hurt = tmp_path / "ref", tmp_path / "hurt"
    cli("train", *FLAGS, "--out", str(ref))
    # Worker rank 1 dies after step 35; the agent restarts the job from the last checkpoint.
    proc = cli("train", *FLAGS, "--out", str(hurt), "--max-restarts", "1",
               "--inject-fault", "kill:1@35")  # fmt: skip
    [resume] = rank_events(hurt, 0, "resume")
    assert resume["attempt"] == 1 and 30 <= resume["step"] < 35, proc.stderr
    # The checkpoint resumed from holds each fragment's residual, and they are not zero.
    [path] = (hurt / "checkpoints").glob(f"worker1-step{resume['step']:08d}.pt")
    residuals = load_checkpoint(path)["strategy"]["compress_feedback"]
    assert set(residuals) == {"fragment0", "fragment1"}
    assert all(r.abs().sum() > 0 for r in residuals.values())

    a, b = saved_state(ref), saved_state(hurt)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after the restart"
    assert read_summary(hurt)["sent_bytes"] == read_summary(ref)["sent_bytes"]
