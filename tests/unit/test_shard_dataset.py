"""``cloudburst.shard_dataset`` / ``Job.shard``: each worker its own part, the same on every
rank and every run."""

import pytest
import torch
from torch.utils.data import TensorDataset

from cloudburst import shard_dataset


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
