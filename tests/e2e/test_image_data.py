"""User datasets and models through the CLI: CIFAR-10, ImageFolder and .npz files on disk,
ResNet-20, the ConvNet and factory models, bf16 autocast, TensorBoard, and their bad input."""

import pickle

import pytest
import torch

from cloudburst.checkpoint import load_model_into
from cloudburst.metrics import read_run
from cloudburst.models import build_model
from tests.datagen import write_cifar10, write_imagefolder, write_npz
from tests.helpers import cli, read_summary

pytestmark = pytest.mark.e2e

QUIET = ["--no-progress", "--eval-every-s", "0.5"]


@pytest.mark.parametrize("strategy", ["sync", "asgd"])
def test_resnet20_one_epoch_on_a_cifar10_directory(tmp_path, strategy):
    root = write_cifar10(tmp_path / "data", per_batch=40, test=40)
    out = tmp_path / strategy
    extra = ["--servers", "1", "--n-sync", "2", "--server-lr", "0.5"] if strategy == "asgd" else []
    cli(
        "train",
        "--strategy",
        strategy,
        "--workers",
        "2",
        *extra,
        "--dataset",
        f"cifar10:{root.parent}",
        "--model",
        "resnet20",
        "--epochs",
        "1",
        "--batch-size",
        "20",
        "--data-workers",
        "1",
        "--out",
        str(out),
        *QUIET,
    )
    summary = read_summary(out)
    # 200 training images over 2 workers, batch 20: one epoch is 5 steps each.
    assert summary["steps_per_worker"] == 5 and summary["samples"] == 200
    assert summary["device"] == "cpu" and summary["backend"] == "gloo"
    model = build_model("resnet20", (3, 32, 32), 10, seed=0)
    load_model_into(out / "model.pt", model)
    # The saved model carries trained batch-norm statistics; with asgd they come from
    # worker 0 (the servers hold parameters only).
    assert model.bn.running_mean.abs().sum() > 0
    assert model.bn.num_batches_tracked.item() == 5
    evals = [r for recs in read_run(out).values() for r in recs if r["event"] == "eval"]
    assert evals and all(0 <= e["test_accuracy"] <= 1 for e in evals)


def test_imagefolder_with_the_convnet_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = write_imagefolder(tmp_path / "images", per_class=8, classes=3)
    out = tmp_path / "if"
    cli(
        "train",
        "--strategy",
        "sync",
        "--workers",
        "2",
        "--dataset",
        f"imagefolder:{root}",
        "--model",
        "convnet",
        "--epochs",
        "3",
        "--batch-size",
        "4",
        "--tensorboard",
        "--log-every-steps",
        "1",
        "--out",
        str(out),
        *QUIET,
    )
    summary = read_summary(out)
    # 3 classes x 8 images, one held out per class: 21 training images, 10 per worker.
    assert summary["steps_per_worker"] == 3 * (10 // 4)
    events = EventAccumulator(str(out / "tensorboard" / "worker0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"step/loss", "eval/test_accuracy", "step/bytes_sent"} <= tags
    assert [e.step for e in events.Scalars("step/loss")] == list(range(1, 7))


def test_npz_images_learn_with_asgd(tmp_path):
    path = write_npz(tmp_path / "d.npz", n=400, test=100)
    out = tmp_path / "npz"
    cli(
        "train",
        "--strategy",
        "asgd",
        "--workers",
        "2",
        "--servers",
        "1",
        "--n-sync",
        "2",
        "--server-lr",
        "0.5",
        "--dataset",
        f"npz:{path}",
        "--model",
        "mlp",
        "--epochs",
        "8",
        "--batch-size",
        "20",
        "--lr",
        "0.02",
        "--data-workers",
        "0",
        "--out",
        str(out),
        *QUIET,
    )
    # The classes differ by colour and a bright quadrant: an MLP learns them well above chance.
    assert read_summary(out)["final_test_accuracy"] > 0.5


def test_a_model_factory_named_on_the_command_line(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def tiny(num_classes, input_shape):\n"
        "    n = 1\n"
        "    for d in input_shape:\n"
        "        n *= d\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(n, num_classes))\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = tmp_path / "factory"
    cli(
        "train",
        "--dataset",
        "synthetic",
        "--model",
        "mymodels:tiny",
        "--workers",
        "2",
        "--steps",
        "30",
        "--out",
        str(out),
        *QUIET,
    )
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(40, 10))
    load_model_into(out / "model.pt", model)
    assert read_summary(out)["config"]["model"] == "mymodels:tiny"


def test_bf16_autocast_on_the_cpu_learns(tmp_path):
    out = tmp_path / "bf16"
    cli(
        "train",
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--workers",
        "2",
        "--steps",
        "150",
        "--autocast",
        "bf16",
        "--out",
        str(out),
        *QUIET,
    )
    assert read_summary(out)["final_test_accuracy"] > 0.8


def test_bad_datasets_and_models_are_one_line_errors_before_launch(tmp_path, monkeypatch):
    cifar = write_cifar10(tmp_path / "c", per_batch=30, test=10)
    broken = tmp_path / "broken" / "cifar-10-batches-py"
    broken.mkdir(parents=True)
    for f in cifar.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "data_batch_3").write_bytes((cifar / "data_batch_3").read_bytes()[:500])
    evil = tmp_path / "evil" / "cifar-10-batches-py"
    evil.mkdir(parents=True)
    for f in cifar.iterdir():
        (evil / f.name).write_bytes(f.read_bytes())
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    (evil / "test_batch").write_bytes(pickle.dumps(Exploit()))
    (tmp_path / "notnpz.npz").write_text("hello")
    (tmp_path / "badmodel.py").write_text("def net():\n    return 3\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = tmp_path / "never"
    cases = [
        (["--dataset", f"cifar10:{tmp_path / 'missing'}"], "does not exist"),
        (["--dataset", "cifar10"], "cifar10:PATH"),
        (["--dataset", f"cifar10:{broken}"], "data_batch_3"),
        (["--dataset", f"cifar10:{evil}"], "refuses to unpickle"),
        (["--dataset", f"npz:{tmp_path / 'notnpz.npz'}"], "notnpz.npz"),
        (["--dataset", f"imagefolder:{tmp_path / 'c'}"], "imagefolder"),
        (["--dataset", f"cifar10:{cifar}", "--model", "cnn"], "1-D"),
        (["--model", "resnet20"], "resnet20"),
        (["--model", "nosuchmodule:net"], "nosuchmodule"),
        (["--model", "badmodel:net"], "badmodel:net"),
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--workers", "0"], ""),
        (["--backend", "nccl", "--device", "cpu"], "nccl"),
        (["--config", str(tmp_path / "fp8.toml")], "autocast"),
    ]
    (tmp_path / "fp8.toml").write_text('autocast = "fp8"\n')
    for args, words in cases:
        proc = cli("train", *args, "--out", str(out), check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, args
        assert not out.exists()
    assert not marker.exists()
