"""User datasets and models through the CLI: CIFAR-10, ImageFolder and .npz files on disk,
ResNet-20, the ConvNet and factory models, image size, augmentation and loader processes,
bf16 autocast, the test-set size and TensorBoard (their bad input: tests/e2e/test_cli.py)."""

import pytest
import torch

from cloudburst.data import batch_stream, evaluate_dataset, in_memory, load_dataset, worker_source
from cloudburst.models import build_model
from cloudburst.records.checkpoint import load_model_into
from tests import reference as ref
from tests.datagen import write_cifar10, write_imagefolder, write_npz
from tests.reference import COMMON
from tests.support import cli, rank_events, read_summary

pytestmark = pytest.mark.e2e

QUIET = ["--no-progress", "--eval-every-s", "0.5"]


def test_resnet20_one_epoch_on_a_cifar10_directory(tmp_path):
    # (asgd: sync's DDP path is the parity tests')
    root = write_cifar10(tmp_path / "data", per_batch=40, test=40)
    out = tmp_path / "asgd"
    args = """--strategy asgd --workers 2 --servers 1 --n-sync 2 --server-lr 0.5 --model resnet20
    --epochs 1 --batch-size 20 --data-workers 1""".split()
    cli("train", *args, "--dataset", f"cifar10:{root.parent}", "--out", str(out), *QUIET)
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
    # The reported accuracy is that of the saved model (its buffers included) on the test set.
    data = load_dataset(f"cifar10:{root.parent}")
    acc, _ = evaluate_dataset(model, in_memory(data.test), data.preprocess(augment=False))
    assert summary["final_test_accuracy"] == acc
    [final_eval] = [e for e in rank_events(out, 0, "eval") if e.get("final")]
    assert final_eval["test_accuracy"] == acc and final_eval["samples"] == 200


def test_imagefolder_with_the_convnet_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = write_imagefolder(tmp_path / "images", per_class=8, classes=3)
    out = tmp_path / "if"
    args = "--strategy sync --workers 2 --model convnet --epochs 3 --batch-size 4 --tensorboard"
    args += " --log-every-steps 1"
    cli("train", *args.split(), "--dataset", f"imagefolder:{root}", "--out", str(out), *QUIET)
    summary = read_summary(out)
    # 3 classes x 8 images, one held out per class: 21 training images, 10 per worker.
    assert summary["steps_per_worker"] == 3 * (10 // 4)
    events = EventAccumulator(str(out / "tensorboard" / "worker0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"step/loss", "eval/test_accuracy", "step/sent_bytes"} <= tags
    assert [e.step for e in events.Scalars("step/loss")] == list(range(1, 7))


def test_npz_images_learn_with_asgd(tmp_path):
    path = write_npz(tmp_path / "d.npz", n=400, test=100)
    out = tmp_path / "npz"
    args = """--strategy asgd --workers 2 --servers 1 --n-sync 2 --server-lr 0.5 --model mlp
    --epochs 8 --batch-size 20 --lr 0.02 --data-workers 0""".split()
    cli("train", *args, "--dataset", f"npz:{path}", "--out", str(out), *QUIET)
    # The classes differ by colour and a bright quadrant: an MLP learns them well above chance.
    assert read_summary(out)["final_test_accuracy"] > 0.5


TINY = (
    "import math, torch\n"
    "def tiny(num_classes, input_shape):\n"
    "    linear = torch.nn.Linear(math.prod(input_shape), num_classes)\n"
    "    return torch.nn.Sequential(torch.nn.Flatten(), linear)\n"
)


def test_a_model_factory_on_16px_images_without_augmentation_equals_plain_sgd(
    tmp_path, monkeypatch
):
    # One worker, so the run is plain SGD on its batches: the same whatever the number of
    # DataLoader processes (batch g is a function of the seed and g only), not augmented,
    # and of 16x16 images (the factory sizes its layer from the input shape it is given).
    (tmp_path / "mymodels.py").write_text(TINY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    root = write_imagefolder(tmp_path / "images", per_class=8, classes=3)
    out = tmp_path / "factory"
    cli("train", "--strategy", "sync", "--workers", "1", "--dataset", f"imagefolder:{root}",
        "--image-size", "16", "--no-augment", "--data-workers", "2", "--model", "mymodels:tiny",
        "--batch-size", "4", "--steps", "8", "--lr", "0.05", "--out", str(out), *QUIET)  # fmt: skip
    assert read_summary(out)["config"]["model"] == "mymodels:tiny"

    data = load_dataset(f"imagefolder:{root}", image_size=16)
    assert data.input_shape == (3, 16, 16)
    model = build_model("mymodels:tiny", data.input_shape, data.num_classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stream = batch_stream(
        worker_source(data, 0, 1), 4, seed=0, preprocess=data.preprocess(augment=False)
    )
    for _ in range(8):
        ref.train_step(model, opt, *next(stream))
    trained = build_model("mymodels:tiny", (3, 16, 16), data.num_classes, seed=0)
    load_model_into(out / "model.pt", trained)
    ref.assert_same_params(trained, model)


def test_bf16_autocast_on_the_cpu_equals_its_simulation(tmp_path):
    # One worker, bf16 autocast of the forward pass and loss, a 300-sample test set; and
    # the final accuracy is the saved model's, evaluated as the run does.
    out = tmp_path / "bf16"
    cli("train", *COMMON, "--strategy", "sync", "--workers", "1", "--model", "mlp", "--steps",
        "30", "--autocast", "bf16", "--test-size", "300", "--out", str(out))  # fmt: skip
    expected = ref.sync_sgd(30, workers=1, model="mlp", autocast=True, test_size=300)
    ref.assert_same_params(ref.trained(out, "mlp"), expected)
    fp32 = ref.sync_sgd(30, workers=1, model="mlp", test_size=300)
    ref.assert_params_differ(expected, fp32, at_least=1e-4)
    data = load_dataset("synthetic", 4000, 300)
    acc, _ = evaluate_dataset(ref.trained(out, "mlp"), in_memory(data.test), None, autocast=True)
    assert read_summary(out)["final_test_accuracy"] == acc
    assert round(acc * 300) == acc * 300  # out of 300 samples
