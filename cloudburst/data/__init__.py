"""Datasets and batches: MNIST-1D generated locally, a synthetic set, and user datasets.

User datasets (CIFAR-10, ImageFolder, ``.npz``, text) are read from local paths by
:mod:`cloudburst.data.datasets`; here they are ordered, sharded over workers and batched. Text is a
language-model dataset (``Dataset.is_lm``): byte tokens, windows of ``context`` tokens, the loss
per token (:func:`lm_loss`) and bits per byte.

MNIST-1D comes from the ``mnist1d`` package's ``make_dataset`` (its download path is never
used); the generated arrays are cached as ``.npz`` under ``$CLOUDBURST_CACHE`` (default
``~/.cache/cloudburst``) so that every rank of a job does not regenerate them.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cloudburst.data.datasets import (
    MAX_DATASET_BYTES,
    DatasetError,
    Preprocess,
    TensorSource,
    TokenStream,
    TokenWindows,
    load_path_dataset,
    load_text,
    parse_dataset_spec,
)
from cloudburst.data.datasets.base import cache_dir, check_size
from cloudburst.data.datasets.text import DEFAULT_CONTEXT

if TYPE_CHECKING:
    from cloudburst.config import RunConfig

MNIST1D_DATA_SEED = 42  # the published dataset's generation seed


@dataclass
class Dataset:
    """A training and a test split, held in memory or read lazily from files.

    ``train`` and ``test`` are sources (:class:`~cloudburst.data.datasets.TensorSource` or
    :class:`~cloudburst.data.datasets.ImageFileSource`). Image datasets hold uint8 NCHW pixels;
    :attr:`preprocess` turns a batch into normalised floats (and augments training batches).
    """

    train: Any
    test: Any
    num_classes: int
    input_shape: tuple[int, ...]
    is_image: bool = False
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @property
    def is_lm(self) -> bool:
        """A language-model dataset: next-token targets per position, loss per token."""
        return isinstance(self.train, TokenStream)

    @property
    def input_length(self) -> int:
        return self.input_shape[-1]

    # In-memory datasets (MNIST-1D, synthetic, npz, CIFAR-10) expose their tensors.
    @property
    def x_train(self) -> torch.Tensor:
        return self.train.x

    @property
    def y_train(self) -> torch.Tensor:
        return self.train.y

    @property
    def x_test(self) -> torch.Tensor:
        return self.test.x

    @property
    def y_test(self) -> torch.Tensor:
        return self.test.y

    def preprocess(self, augment: bool) -> Preprocess | None:
        """What turns a raw batch into model input; None when the raw batch already is."""
        if not self.is_image:
            return None
        return Preprocess(self.mean, self.std, augment=augment)


def _tensors(x_train, y_train, x_test, y_test, num_classes: int) -> Dataset:
    return Dataset(
        TensorSource(x_train, y_train),
        TensorSource(x_test, y_test),
        num_classes,
        tuple(x_train.shape[1:]),
    )


def load_dataset(
    name: str,
    train_size: int | None = None,
    test_size: int | None = None,
    image_size: int = 32,
    context: int = DEFAULT_CONTEXT,
    max_bytes: int = MAX_DATASET_BYTES,
) -> Dataset:
    """``name`` is a dataset spec: ``mnist1d``, ``synthetic`` or ``KIND:PATH``.

    ``text:PATH``: ``context`` tokens per window, vocabulary 256; ``train_size`` caps the
    training tokens at that many windows' worth, ``test_size`` is the number of test windows.

    ``max_bytes`` bounds what a dataset read from a path may take in memory (npz arrays, a text
    corpus, an image folder's decoded test split), checked from headers and file sizes before
    anything is read; over it, a one-line ``DatasetError`` names the size and the limit.

    A dataset read from a path is put in a fixed pseudo-random order first (the same on every
    rank), so that contiguous worker shards and ``train_size``/``test_size`` caps draw from
    every class even when the files are sorted by class.
    """
    kind, path = parse_dataset_spec(name)
    if kind == "mnist1d":
        return _mnist1d(train_size or 4000, test_size or 1000)
    if kind == "synthetic":
        return synthetic(train_size or 4000, test_size or 1000)
    if kind == "text":
        train, test = load_text(path, context, train_size, test_size, max_bytes=max_bytes)
        return Dataset(train, test, 256, (context,))
    loaded = load_path_dataset(kind, path, image_size=image_size, max_bytes=max_bytes)
    train = _shuffled(loaded.train, train_size, seed=SOURCE_ORDER_SEED)
    test = _shuffled(loaded.test, test_size, seed=SOURCE_ORDER_SEED + 1)
    if not isinstance(test, TensorSource):  # decoded whole by in_memory() to evaluate
        n_bytes = len(test) * math.prod(loaded.input_shape)
        shape = "x".join(map(str, loaded.input_shape))
        check_size(
            f"{kind}:{path}: the test split decoded",
            n_bytes,
            max_bytes,
            f"{len(test)} images of {shape} uint8; --test-size caps it",
        )
    return Dataset(
        train,
        test,
        loaded.num_classes,
        tuple(loaded.input_shape),
        loaded.is_image,
        loaded.mean,
        loaded.std,
    )


SOURCE_ORDER_SEED = 20131220  # fixed: every rank of every run orders a path dataset alike


class SubsetSource:
    """The samples ``indices`` of another source, in that order."""

    def __init__(self, source, indices: torch.Tensor):
        self.source, self.indices = source, indices.to(torch.int64)

    def __len__(self) -> int:
        return self.indices.numel()

    @property
    def targets(self) -> torch.Tensor:
        return self.source.targets[self.indices]

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source.get_batch(self.indices[idx])


def load_run_dataset(cfg: RunConfig) -> Dataset:
    """The dataset a run's config names (:func:`load_dataset` with its data settings): the one
    call the driver, the simulator and the pre-flight checks make."""
    return load_dataset(
        cfg.data.dataset,
        cfg.data.train_size,
        cfg.data.test_size,
        cfg.data.image_size,
        context=cfg.data.context,
        max_bytes=cfg.data.max_dataset_bytes,
    )


def _shuffled(source, size: int | None, seed: int):
    n = len(source)
    if size is not None and size > n:
        raise DatasetError(f"the dataset has {n} samples, fewer than the {size} asked for")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g)[: size or n]
    if isinstance(source, TensorSource):  # stay a plain in-memory source
        return TensorSource(source.x[order], source.y[order])
    return SubsetSource(source, order)


def in_memory(source) -> TensorSource:
    """``source`` decoded once into memory (test sets are read many times)."""
    if isinstance(source, TensorSource | TokenWindows):
        return source
    x, y = source.get_batch(torch.arange(len(source)))
    return TensorSource(x, y)


def synthetic(train_size: int, test_size: int, length: int = 40, classes: int = 10) -> Dataset:
    """Noisy class templates: learnable in a few hundred steps, generated in milliseconds."""
    g = torch.Generator().manual_seed(1234)
    templates = torch.randn(classes, length, generator=g)
    n = train_size + test_size
    y = torch.randint(0, classes, (n,), generator=g)
    x = templates[y] + 0.8 * torch.randn(n, length, generator=g)
    return _tensors(x[:train_size], y[:train_size], x[train_size:], y[train_size:], classes)


def _cache_dir() -> Path:
    return cache_dir()


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
    return _tensors(
        torch.as_tensor(x, dtype=torch.float32),
        torch.as_tensor(y, dtype=torch.int64),
        torch.as_tensor(xt, dtype=torch.float32),
        torch.as_tensor(yt, dtype=torch.int64),
        10,
    )


def worker_shard(ds: Dataset, worker: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s disjoint, contiguous slice of an in-memory training set."""
    src = worker_source(ds, worker, num_workers)
    return src.x, src.y


def worker_source(ds: Dataset, worker: int, num_workers: int):
    """Worker ``worker``'s disjoint, contiguous slice of the training set (equal sizes)."""
    if isinstance(ds.train, TokenStream):
        return ds.train.shard(worker, num_workers)
    per = len(ds.train) // num_workers
    if per < 1:
        raise DatasetError(
            f"{len(ds.train)} training samples cannot be split over {num_workers} workers"
        )
    if isinstance(ds.train, TensorSource):
        sl = slice(worker * per, (worker + 1) * per)
        return TensorSource(ds.train.x[sl], ds.train.y[sl])
    return SubsetSource(ds.train, torch.arange(worker * per, (worker + 1) * per))


def batch_stream(
    source,
    batch_size: int,
    seed: int,
    preprocess: Preprocess | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
):
    """Endless training batches of one worker's shard (see :class:`BatchStream`).

    In-memory features with nothing to preprocess are indexed directly in this process;
    everything else (decoding files, augmentation) runs in ``num_workers`` DataLoader
    processes. Both draw the same batches: a seeded permutation per epoch.
    """
    if isinstance(source, TokenStream):
        return TextStream(source, batch_size, seed)
    if len(source) < batch_size:
        raise DatasetError(
            f"batch_size {batch_size} is larger than this worker's shard of {len(source)} samples"
        )
    if isinstance(source, TensorSource) and preprocess is None and num_workers == 0:
        return BatchStream(source.x, source.y, batch_size, seed)
    return LoaderStream(source, batch_size, seed, preprocess, num_workers, pin_memory)


def _epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


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
        return _epoch_permutation(self.x.shape[0], self.seed, epoch)

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


class _Position:
    """A stream's position as the number of batches it has handed out; a checkpoint holds it as
    (epoch, index), as :class:`BatchStream`'s does. Subclasses set ``batches_per_epoch``."""

    batches_per_epoch: int
    consumed: int = 0

    @property
    def epoch(self) -> int:
        return self.consumed // self.batches_per_epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.consumed % self.batches_per_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["epoch"]) * self.batches_per_epoch + int(state["index"])


class TextStream(_Position):
    """Endless batches of random windows of one worker's tokens.

    Batch ``g`` (0, 1, ...) is ``batch_size`` windows whose starts are drawn uniformly from
    ``0 .. max_start`` by a generator seeded with ``seed · 1_000_003 + g``: a function of
    (seed, batch index) alone, so a resumed stream repeats it. An "epoch" is ``len(source) //
    batch_size`` batches (as many tokens as the shard holds); ``state_dict`` as BatchStream's.
    """

    def __init__(self, source: TokenStream, batch_size: int, seed: int):
        self.source, self.batch_size, self.seed = source, batch_size, seed
        self.batches_per_epoch = max(1, len(source) // batch_size)
        self.consumed = 0

    def batch(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g)
        starts = torch.randint(0, self.source.max_start + 1, (self.batch_size,), generator=gen)
        return self.source.get_batch(starts)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.consumed)
        self.consumed += 1
        return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of [B, T, V] logits against [B, T] next tokens, over all B·T tokens."""
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), reduction=reduction
    )


def loss_function(data: Dataset):
    """The training loss for ``data``: per token for a language model, else per sample."""
    return lm_loss if data.is_lm else torch.nn.CrossEntropyLoss()


def bits_per_byte(nats_per_token: float) -> float:
    """Byte-level tokens: one token is one byte, so bits per byte = nats per token / ln 2."""
    return nats_per_token / math.log(2)


class _Batches(torch.utils.data.Dataset):
    """Map-style view whose item ``g`` is the ``g``-th batch of the endless stream.

    Runs inside DataLoader processes: batch ``g`` is batch ``g % batches_per_epoch`` of epoch
    ``g // batches_per_epoch``, preprocessed with a generator seeded by ``g``, so a batch is
    the same whatever the number of DataLoader processes, and a resumed stream repeats it.
    """

    def __init__(self, source, batch_size: int, seed: int, preprocess: Preprocess | None):
        self.source, self.batch_size, self.seed, self.preprocess = (
            source,
            batch_size,
            seed,
            preprocess,
        )
        self.batches_per_epoch = len(source) // batch_size
        self._epoch, self._perm = -1, None

    def __getitem__(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = divmod(g, self.batches_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, _epoch_permutation(len(self.source), self.seed, epoch)
        idx = self._perm[index * self.batch_size : (index + 1) * self.batch_size]
        x, y = self.source.get_batch(idx)
        if self.preprocess is not None:
            gen = torch.Generator().manual_seed(self.seed * 7_919 + g)
            x = self.preprocess(x, gen)
        return x, y

    def __len__(self) -> int:  # not used for sampling (the sampler is endless)
        return 2**62


class _CountFrom(torch.utils.data.Sampler):
    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        return itertools.count(self.start)


class LoaderStream(_Position):
    """Like :class:`BatchStream`, with loading and preprocessing in DataLoader processes."""

    def __init__(
        self,
        source,
        batch_size: int,
        seed: int,
        preprocess: Preprocess | None,
        num_workers: int,
        pin_memory: bool,
    ):
        self.batches = _Batches(source, batch_size, seed, preprocess)
        self.batches_per_epoch = self.batches.batches_per_epoch
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.consumed = 0
        self._it = None

    def _start(self) -> None:
        loader = torch.utils.data.DataLoader(
            self.batches,
            batch_size=None,  # items are whole batches
            sampler=_CountFrom(self.consumed),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=False,
            prefetch_factor=4 if self.num_workers else None,
        )
        self._it = iter(loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._it is None:
            self._start()
        batch = next(self._it)
        self.consumed += 1
        return batch

    def load_state_dict(self, state: dict[str, int]) -> None:
        super().load_state_dict(state)
        self._it = None  # restart the loader at the new position

    def close(self) -> None:
        self._it = None  # its worker processes exit


@torch.no_grad()
def evaluate_dataset(
    model: torch.nn.Module,
    test: TensorSource,
    preprocess: Preprocess | None,
    device: torch.device | str = "cpu",
    batch: int = 1000,
    autocast: bool = False,
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on an in-memory test split.

    Test windows of a language model: (next-token accuracy, nats per token), over every
    position of every window (sums in float64, so the mean does not depend on ``batch``).
    """
    was_training = model.training
    model.eval()
    device = torch.device(device)
    if isinstance(test, TokenWindows):
        out = _evaluate_lm(model, test, device, max(1, batch // test.x.shape[1]), autocast)
        model.train(was_training)
        return out
    correct, loss, n = 0, 0.0, len(test)
    for i in range(0, n, batch):
        x, y = test.x[i : i + batch], test.y[i : i + batch]
        if preprocess is not None:
            x = preprocess(x)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        logits = logits.float()
        loss += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
    model.train(was_training)
    return correct / n, loss / n


def _evaluate_lm(
    model: torch.nn.Module, test: TokenWindows, device: torch.device, batch: int, autocast: bool
) -> tuple[float, float]:
    correct, loss, n = 0, 0.0, test.y.numel()
    for i in range(0, len(test), batch):
        x, y = test.x[i : i + batch].to(device), test.y[i : i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss += lm_loss(logits, y, reduction="sum").double().item()
        correct += (logits.argmax(-1) == y).sum().item()
    return correct / n, loss / n
