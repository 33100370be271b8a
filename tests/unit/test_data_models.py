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
