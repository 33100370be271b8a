"""The GPU path: CUDA replicas, pinned-memory staging to the servers, NCCL or gloo collectives.
Skipped without CUDA (CI has none): ``pytest -m gpu`` where a GPU is."""

import pytest
import torch

from cloudburst.models import build_model
from cloudburst.records.checkpoint import load_model_into
from cloudburst.records.metrics import read_run
from tests import reference as ref
from tests.datagen import write_cifar10
from tests.support import cli, read_summary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

COMMON = [*ref.COMMON, "--device", "cuda"]
COMMON[COMMON.index("--model") + 1] = "mlp"  # not the reference's cnn


def assert_matches_sgd(out, steps: int, workers: int) -> None:
    """The run's model is single-process SGD's on the CPU, each step on the concatenation of
    the workers' batches (the plain-PyTorch reference)."""
    expected = ref.sync_sgd(steps, workers, model="mlp")
    for p, q in zip(ref.trained(out, "mlp").parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def test_asgd_cuda_replica_through_pinned_staging_equals_sgd(tmp_path):
    out = tmp_path / "asgd"
    args = "--strategy asgd --workers 1 --servers 1 --n-sync 2 --steps 40".split()
    cli("train", *args, "--out", str(out), *COMMON)
    assert_matches_sgd(out, 40, workers=1)
    summary = read_summary(out)
    assert summary["device"].startswith("cuda")
    final = [r for r in read_run(out)["rank1"] if r["event"] == "final"][0]
    # The first fetch (θ to the GPU), then 20 rounds: Δ to the host and θ back, 4 bytes each.
    assert final["staging_bytes"] == (1 + 20 * 2) * 4 * ref.parity_numel("mlp")


def test_sync_two_workers_sharing_one_gpu_use_gloo_and_equal_sgd(tmp_path):
    if torch.cuda.device_count() > 1:
        pytest.skip("this checks the one-GPU fallback")
    out = tmp_path / "sync"
    cli("train", *"--strategy sync --workers 2 --steps 30".split(), "--out", str(out), *COMMON)
    summary = read_summary(out)
    assert summary["backend"] == "gloo" and summary["device"].startswith("cuda")
    assert_matches_sgd(out, 30, workers=2)


def test_nccl_with_two_workers_on_one_gpu_is_refused_clearly(tmp_path):
    if torch.cuda.device_count() > 1:
        pytest.skip("this machine has a GPU per worker")
    out = tmp_path / "nccl"
    args = "--strategy sync --workers 2 --steps 5 --backend nccl".split()
    proc = cli("train", *args, "--out", str(out), *COMMON, check=False)
    assert proc.returncode == 2 and not out.exists()
    assert "NCCL cannot run two ranks on one GPU" in proc.stderr


def test_sync_one_worker_on_nccl(tmp_path):
    out = tmp_path / "nccl1"
    args = "--strategy sync --workers 1 --steps 20 --backend nccl".split()
    cli("train", *args, "--out", str(out), *COMMON)
    assert read_summary(out)["backend"] == "nccl"


@pytest.mark.parametrize("strategy", ["sync", "asgd"])
def test_resnet20_on_cifar_format_data_with_bf16_autocast(tmp_path, strategy):
    root = write_cifar10(tmp_path / "data", per_batch=64, test=64)
    out = tmp_path / strategy
    extra = ["--servers", "1", "--n-sync", "4", "--server-lr", "0.5"] if strategy == "asgd" else []
    args = f"""--strategy {strategy} --workers 2 --model resnet20 --epochs 2 --batch-size 32
    --lr 0.05 --autocast bf16 --device cuda --no-progress --eval-every-s 0.5""".split()
    cli("train", *args, *extra, "--dataset", f"cifar10:{root}", "--out", str(out))
    summary = read_summary(out)
    assert summary["device"].startswith("cuda")
    assert 0.0 <= summary["final_test_accuracy"] <= 1.0
    model = build_model("resnet20", (3, 32, 32), 10, seed=0)
    load_model_into(out / "model.pt", model)
    # Batch-norm statistics were trained (the servers hold only parameters: worker 0's).
    assert model.bn.running_mean.abs().sum() > 0


@pytest.mark.parametrize("nodes", ["1", "2"])
def test_daso_on_cuda_replicas(tmp_path, nodes):
    # One GPU: the ranks share it, so the node and global groups run gloo on CUDA tensors.
    out = tmp_path / f"daso{nodes}"
    args = f"--strategy daso --workers 2 --nodes {nodes} --epochs 4 --daso-warmup-epochs 1"
    untimed = [a for a in COMMON if a not in ("--eval-every-s", "1000")]
    cli("train", *args.split(), "--daso-cooldown-epochs", "1", "--out", str(out), *untimed)
    summary = read_summary(out)
    assert summary["device"].startswith("cuda") and summary["nodes"] == int(nodes)
    assert summary["final_test_accuracy"] > 0.5
