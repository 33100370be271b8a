import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from cloudburst import shard_dataset
from cloudburst.data import (
    BatchStream,
    batch_stream,
    evaluate_dataset,
    load_dataset,
    synthetic,
    worker_shard,
    worker_source,
)
from cloudburst.data.datasets import CIFAR10_MEAN, CIFAR10_STD
from cloudburst.models import build_model, evaluate
from tests.datagen import write_cifar10


def test_worker_shards_are_disjoint_and_equal():
    ds = synthetic(103, 10)
    shards = [worker_shard(ds, w, 4) for w in range(4)]
    assert all(x.shape[0] == 25 for x, _ in shards)
    assert torch.equal(torch.cat([x for x, _ in shards]), ds.x_train[:100])


def test_batch_stream_is_deterministic_and_resumable():
    ds = synthetic(50, 10)
    a = BatchStream(ds.x_train, ds.y_train, 8, seed=3)
    first = [next(a)[1] for _ in range(9)]  # crosses an epoch boundary (6 batches per epoch)
    b = BatchStream(ds.x_train, ds.y_train, 8, seed=3)
    assert all(torch.equal(x, next(b)[1]) for x in first)
    state = a.state_dict()
    nxt = next(a)[1]
    c = BatchStream(ds.x_train, ds.y_train, 8, seed=3)
    c.load_state_dict(state)
    assert torch.equal(next(c)[1], nxt)


@pytest.mark.slow
def test_mnist1d_is_generated_locally_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDBURST_CACHE", str(tmp_path))
    ds = load_dataset("mnist1d", 400, 100)
    assert ds.x_train.shape == (400, 40) and ds.x_test.shape == (100, 40)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert sorted(ds.y_train.unique().tolist()) == list(range(10))  # every digit is there
    assert len(list(tmp_path.glob("mnist1d-*.npz"))) == 1
    import mnist1d.data  # the second load reads the cache: generating again fails here

    monkeypatch.setattr(mnist1d.data, "make_dataset", lambda *a, **k: pytest.fail("generated"))
    again = load_dataset("mnist1d", 400, 100)
    assert torch.equal(again.x_train, ds.x_train) and torch.equal(again.y_test, ds.y_test)


def _accuracy_and_loss_by_hand(logits: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Accuracy and mean cross-entropy −log softmax(logits)[y], one sample at a time."""
    correct, loss = 0, 0.0
    for row, label in zip(logits.double().tolist(), y.tolist(), strict=True):
        correct += max(range(len(row)), key=row.__getitem__) == label
        loss += math.log(sum(math.exp(v) for v in row)) - row[label]
    return correct / len(y), loss / len(y)


def test_models_shapes_and_evaluate():
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(0))
    for name in ("mlp", "cnn"):
        m = build_model(name, 40, 10, seed=0)
        assert m(x).shape == (7, 10)
        with torch.no_grad():
            logits = m.eval()(x)
        m.train()
        # 4 of 7 labels are the model's prediction, 3 are not: accuracy exactly 4/7
        y = logits.argmax(1)
        y[4:] = (y[4:] + 1) % 10
        acc, loss = evaluate(m, x, y, batch=3)  # batches of 3, 3 and 1 samples
        expected_acc, expected_loss = _accuracy_and_loss_by_hand(logits, y)
        assert expected_acc == 4 / 7 and acc == expected_acc
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert m.training  # evaluate restores the mode it found


def _cifar_dataset(tmp_path):
    root = write_cifar10(tmp_path / "c", per_batch=20, test=20)
    return load_dataset(f"cifar10:{root}")


@pytest.mark.parametrize(
    "workers, resumed_workers", [(0, 0), pytest.param(2, 1, marks=pytest.mark.spawns)]
)
def test_loader_stream_is_deterministic_for_any_loader_processes_and_resumes(
    tmp_path, workers, resumed_workers
):
    """The augmented batch stream is the same with 0 or ``workers`` loader processes, across
    an epoch boundary, and a stream resumed from a state (with ``resumed_workers``) gives the
    same next batch."""
    ds = _cifar_dataset(tmp_path)
    source = worker_source(ds, 1, 2)  # 50 images
    pre = ds.preprocess(augment=True)
    streams = [batch_stream(source, 8, seed=4, preprocess=pre, num_workers=n) for n in (0, workers)]
    for _ in range(8):  # crosses an epoch boundary (6 batches per epoch)
        (xa, ya), (xb, yb) = next(streams[0]), next(streams[1])
        assert xa.dtype == torch.float32 and xa.shape == (8, 3, 32, 32)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    state = streams[0].state_dict()
    assert state == {"epoch": 1, "index": 2}
    nxt = next(streams[0])
    again = batch_stream(source, 8, seed=4, preprocess=pre, num_workers=resumed_workers)
    again.load_state_dict(state)
    x, y = next(again)
    assert torch.equal(x, nxt[0]) and torch.equal(y, nxt[1])
    for s in (*streams, again):
        s.close()


def test_path_datasets_are_shuffled_sharded_over_every_class_and_evaluated_normalised(tmp_path):
    ds = _cifar_dataset(tmp_path)
    assert len(ds.train) == 100 and len(ds.test) == 20 and ds.input_shape == (3, 32, 32)
    assert ds.train.x.dtype == torch.uint8 and ds.is_image
    # The same order in every process (a fixed seed), and capped sizes draw from it.
    capped = load_dataset(ds_spec := f"cifar10:{tmp_path / 'c'}", train_size=40, test_size=10)
    assert torch.equal(capped.train.x, ds.train.x[:40])
    assert torch.equal(load_dataset(ds_spec).train.y, ds.train.y)
    shards = [worker_source(ds, w, 3) for w in range(3)]
    assert [len(s) for s in shards] == [33, 33, 33]
    assert torch.equal(torch.cat([s.y for s in shards]), ds.train.y[:99])
    # A file sorted by class (ten of class 0, then ten of class 1, ...): the samples are
    # reordered, not changed, and each of 3 contiguous worker shards holds every class.
    x = np.arange(100, dtype=np.float32).reshape(100, 1) * np.ones((1, 4), np.float32)
    y = np.repeat(np.arange(10), 10)
    np.savez(tmp_path / "sorted.npz", x_train=x, y_train=y, x_test=x[:10], y_test=y[:10])
    data = load_dataset(f"npz:{tmp_path / 'sorted.npz'}")
    ids = data.train.x[:, 0].long()
    assert sorted(ids.tolist()) == list(range(100)) and ids.tolist() != list(range(100))
    assert torch.equal(data.train.y, ids // 10)  # every sample keeps its own label
    for w in range(3):
        assert sorted(set(worker_source(data, w, 3).y.tolist())) == list(range(10)), w
    # evaluate_dataset normalises images like training
    model = build_model("resnet20", ds.input_shape, ds.num_classes, seed=0)
    acc, loss = evaluate_dataset(model, ds.test, ds.preprocess(augment=False), batch=7)
    # by hand: pixels / 255, minus CIFAR-10's channel mean, over its std; no augmentation
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    model.eval()
    with torch.no_grad():
        logits = model((ds.test.x.float() / 255 - mean) / std)
        raw_logits = model(ds.test.x.float())
    expected_acc, expected_loss = _accuracy_and_loss_by_hand(logits, ds.test.y)
    assert acc == pytest.approx(expected_acc) and loss == pytest.approx(expected_loss, rel=1e-4)
    # the check can tell: un-normalised pixels give another loss
    assert _accuracy_and_loss_by_hand(raw_logits, ds.test.y)[1] != pytest.approx(loss, rel=1e-2)


# ---------------------------------------------------------------------------------- shard_dataset
# ``cloudburst.shard_dataset`` / ``Job.shard``: each worker its own part, the same on every rank and
# every run.
def _indices(n: int, workers: int, seed: int | None) -> list[list[int]]:
    ds = TensorDataset(torch.arange(n))
    return [shard_dataset(ds, w, workers, seed).indices for w in range(workers)]


def test_parts_are_equal_disjoint_and_deterministic():
    parts = _indices(103, 4, seed=7)
    assert [len(p) for p in parts] == [25, 25, 25, 25]  # 103 // 4; 3 samples left out
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == 100 and set(flat) <= set(range(103))
    assert parts == _indices(103, 4, seed=7)  # every rank computes the same split
    assert parts != _indices(103, 4, seed=8)
    # one permutation shared by all: the union is its first 100 entries, in worker order
    order = torch.randperm(103, generator=torch.Generator().manual_seed(7)).tolist()
    assert flat == order[:100]


def test_no_seed_means_contiguous_parts_in_order_that_read_the_right_samples():
    assert _indices(10, 3, seed=None) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    ds = TensorDataset(torch.arange(10) * 10)
    part = shard_dataset(ds, 1, 2, seed=None)
    assert [int(part[i][0]) for i in range(len(part))] == [50, 60, 70, 80, 90]


def test_bad_workers_are_refused():
    ds = TensorDataset(torch.arange(3))
    with pytest.raises(ValueError, match=r"worker 2 is not in 0..1"):
        shard_dataset(ds, 2, 2)
    with pytest.raises(ValueError, match="3 samples cannot be shared by 4 workers"):
        shard_dataset(ds, 0, 4)
