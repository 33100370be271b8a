"""Datasets held in memory: MNIST-1D generated locally, and a synthetic set for fast tests.

MNIST-1D comes from the ``mnist1d`` package's ``make_dataset`` (its download path is never
used); the generated arrays are cached as ``.npz`` under ``$CLOUDBURST_CACHE`` (default
``~/.cache/cloudburst``) so that every rank of a job does not regenerate them.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MNIST1D_DATA_SEED = 42  # the published dataset's generation seed


@dataclass
class Dataset:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_length(self) -> int:
        return self.x_train.shape[-1]


def load_dataset(name: str, train_size: int, test_size: int) -> Dataset:
    if name == "mnist1d":
        return _mnist1d(train_size, test_size)
    if name == "synthetic":
        return synthetic(train_size, test_size)
    raise ValueError(f"unknown dataset {name!r}")


def synthetic(train_size: int, test_size: int, length: int = 40, classes: int = 10) -> Dataset:
    """Noisy class templates: learnable in a few hundred steps, generated in milliseconds."""
    g = torch.Generator().manual_seed(1234)
    templates = torch.randn(classes, length, generator=g)
    n = train_size + test_size
    y = torch.randint(0, classes, (n,), generator=g)
    x = templates[y] + 0.8 * torch.randn(n, length, generator=g)
    return Dataset(x[:train_size], y[:train_size], x[train_size:], y[train_size:], classes)


def _cache_dir() -> Path:
    return Path(os.environ.get("CLOUDBURST_CACHE", Path.home() / ".cache" / "cloudburst"))


def _mnist1d(train_size: int, test_size: int) -> Dataset:
    total = train_size + test_size
    key = hashlib.sha256(f"mnist1d-v1-{total}-{train_size}-{MNIST1D_DATA_SEED}".encode())
    path = _cache_dir() / f"mnist1d-{key.hexdigest()[:16]}.npz"
    arrays = None
    if path.is_file():
        try:
            with np.load(path) as f:
                arrays = {k: f[k] for k in ("x", "y", "x_test", "y_test")}
        except (OSError, ValueError, KeyError):
            arrays = None  # a damaged cache entry is regenerated below
    if arrays is None:
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples = total
        args.train_split = train_size / total
        args.seed = MNIST1D_DATA_SEED
        made = make_dataset(args)
        arrays = {k: np.asarray(made[k]) for k in ("x", "y", "x_test", "y_test")}
        path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: concurrent ranks never read a half-written cache file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    x, y = arrays["x"][:train_size], arrays["y"][:train_size]
    xt, yt = arrays["x_test"][:test_size], arrays["y_test"][:test_size]
    return Dataset(
        torch.as_tensor(x, dtype=torch.float32),
        torch.as_tensor(y, dtype=torch.int64),
        torch.as_tensor(xt, dtype=torch.float32),
        torch.as_tensor(yt, dtype=torch.int64),
        10,
    )


def worker_shard(ds: Dataset, worker: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s disjoint, contiguous slice of the training set (equal sizes)."""
    per = ds.x_train.shape[0] // num_workers
    sl = slice(worker * per, (worker + 1) * per)
    return ds.x_train[sl], ds.y_train[sl]


class BatchStream:
    """Endless mini-batches from one shard: a fresh seeded permutation every epoch.

    The last incomplete batch of an epoch is dropped, so every batch has ``batch_size`` rows.
    ``state_dict`` records the position, so a resumed run draws the same batches.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.batches_per_epoch = x.shape[0] // batch_size
        self.epoch, self.index = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.x.shape[0], generator=g)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index >= self.batches_per_epoch:
            self.epoch += 1
            self.index = 0
            self._perm = self._permutation(self.epoch)
        idx = self._perm[self.index * self.batch_size : (self.index + 1) * self.batch_size]
        self.index += 1
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._perm = self._permutation(self.epoch)
