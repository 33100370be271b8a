import pytest
import torch

from cloudburst.data import BatchStream, load_dataset, synthetic, worker_shard
from cloudburst.models import build_model, evaluate


def test_worker_shards_are_disjoint_and_equal():
    ds = synthetic(103, 10)
    shards = [worker_shard(ds, w, 4) for w in range(4)]
    assert all(x.shape[0] == 25 for x, _ in shards)
    joined = torch.cat([x for x, _ in shards])
    assert torch.equal(joined, ds.x_train[:100])


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


def test_mnist1d_is_generated_locally_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDBURST_CACHE", str(tmp_path))
    ds = load_dataset("mnist1d", 400, 100)
    assert ds.x_train.shape == (400, 40) and ds.x_test.shape == (100, 40)
    assert set(ds.y_train.unique().tolist()) <= set(range(10))
    assert len(list(tmp_path.glob("mnist1d-*.npz"))) == 1
    again = load_dataset("mnist1d", 400, 100)
    assert torch.equal(again.x_train, ds.x_train)


def test_models_shapes_and_evaluate():
    x = torch.randn(7, 40)
    for name in ("mlp", "cnn"):
        m = build_model(name, 40, 10, seed=0)
        assert m(x).shape == (7, 10)
        acc, loss = evaluate(m, x, torch.zeros(7, dtype=torch.int64))
        assert 0 <= acc <= 1 and loss > 0
    # same seed, same initial θ on every rank
    a, b = build_model("cnn", 40, 10, seed=5), build_model("cnn", 40, 10, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _cifar_dataset(tmp_path):
    from tests.datagen import write_cifar10

    root = write_cifar10(tmp_path / "c", per_batch=20, test=20)
    return load_dataset(f"cifar10:{root}")


def test_loader_stream_is_the_same_for_any_number_of_loader_processes(tmp_path):
    from cloudburst.data import batch_stream, worker_source

    ds = _cifar_dataset(tmp_path)
    source = worker_source(ds, 1, 2)  # 50 images
    pre = ds.preprocess(augment=True)
    streams = [batch_stream(source, 8, seed=4, preprocess=pre, num_workers=n) for n in (0, 2)]
    for _ in range(8):  # crosses an epoch boundary (6 batches per epoch)
        (xa, ya), (xb, yb) = next(streams[0]), next(streams[1])
        assert xa.dtype == torch.float32 and xa.shape == (8, 3, 32, 32)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # Resuming from a state gives the same next batch (augmentation included).
    state = streams[0].state_dict()
    nxt = next(streams[0])
    again = batch_stream(source, 8, seed=4, preprocess=pre, num_workers=1)
    again.load_state_dict(state)
    x, y = next(again)
    assert torch.equal(x, nxt[0]) and torch.equal(y, nxt[1])
    for s in (*streams, again):
        s.close()


def test_path_datasets_are_shuffled_once_and_sharded_over_every_class(tmp_path):
    from cloudburst.data import worker_source

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


def test_evaluate_dataset_normalises_images_like_training(tmp_path):
    from cloudburst.data import evaluate_dataset

    ds = _cifar_dataset(tmp_path)
    model = build_model("resnet20", ds.input_shape, ds.num_classes, seed=0)
    acc, loss = evaluate_dataset(model, ds.test, ds.preprocess(augment=False))
    pre = ds.preprocess(augment=False)
    model.eval()
    with torch.no_grad():
        logits = model(pre(ds.test.x))
    expected = (logits.argmax(1) == ds.test.y).float().mean().item()
    assert acc == pytest.approx(expected) and loss > 0
