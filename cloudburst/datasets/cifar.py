"""CIFAR-10, the python version: pickled batches read with an unpickler that rebuilds numpy
arrays only (a pickle can run code when loaded).
"""

from __future__ import annotations

import codecs
import functools
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from cloudburst.datasets.base import (
    CIFAR10_DIRNAME,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10_TEST_BATCH,
    CIFAR10_TRAIN_BATCHES,
    DatasetError,
    LoadedData,
    TensorSource,
    _describe,
)

# --------------------------------------------------------------------------------------------
# CIFAR-10, python version


def _cifar_dir(path: Path) -> Path:
    if path.is_file():
        raise DatasetError(
            f"cifar10:{path}: is a file; expected the extracted 'CIFAR-10 python version' "
            f"directory (tar xzf cifar-10-python.tar.gz)"
        )
    nested = path / CIFAR10_DIRNAME
    root = nested if nested.is_dir() else path
    needed = (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH)
    missing = [name for name in needed if not (root / name).is_file()]
    if missing:
        raise DatasetError(
            f"cifar10:{root}: missing {', '.join(missing)}; expected data_batch_1..5 and "
            f"test_batch here or in {CIFAR10_DIRNAME}/"
        )
    return root


def _allowed_codecs_encode(text: str, encoding: str = "utf-8") -> bytes:
    # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(text, "latin1"); nothing else.
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"refuses _codecs.encode with encoding {encoding!r}")
    return codecs.encode(text, encoding)


@functools.cache
def _pickle_allowlist() -> dict[tuple[str, str], object]:
    """The globals a pickled numpy array needs, under both numpy 1 and numpy 2 module names."""
    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy < 2
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]
    allowed: dict[tuple[str, str], object] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _allowed_codecs_encode,
    }
    for package in ("numpy.core", "numpy._core"):
        allowed[(f"{package}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{package}.multiarray", "scalar")] = multiarray.scalar
        allowed[(f"{package}.numeric", "_frombuffer")] = numeric._frombuffer  # protocol 5
    return allowed


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Rebuilds dicts, lists, strings, numbers and numpy arrays; refuses every other global,
    so a crafted pickle cannot call ``os.system`` or import anything."""

    def __init__(self, file, source: Path):
        super().__init__(file, encoding="bytes")
        self.source = source

    def find_class(self, module: str, name: str) -> object:
        found = _pickle_allowlist().get((module, name))
        if found is None:
            raise DatasetError(
                f"cifar10: {self.source}: refuses to unpickle global {module}.{name} "
                f"(only numpy arrays are allowed)"
            )
        return found


def _read_pickle(path: Path) -> object:
    try:
        with open(path, "rb") as f:
            return _NumpyOnlyUnpickler(f, path).load()
    except DatasetError:
        raise
    except Exception as e:  # truncated or foreign files raise many types
        raise DatasetError(f"cifar10: {path}: not a readable batch pickle ({_describe(e)})") from e


def _dict_get(d: dict, key: str, path: Path) -> object:
    for k in (key.encode(), key):  # Python 2 pickles give bytes keys, Python 3 ones str keys
        if k in d:
            return d[k]
    raise DatasetError(f"cifar10: {path}: no {key!r} entry; found keys {sorted(map(str, d))}")


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _read_pickle(path)
    if not isinstance(batch, dict):
        raise DatasetError(f"cifar10: {path}: holds a {type(batch).__name__}, expected a dict")
    data, labels = _dict_get(batch, "data", path), _dict_get(batch, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise DatasetError(
            f"cifar10: {path}: 'data' must be a uint8 array [N, 3072], got "
            f"{getattr(data, 'dtype', type(data).__name__)} of shape {getattr(data, 'shape', '?')}"
        )
    if data.shape[1] != 3 * 32 * 32 or data.shape[0] == 0:
        raise DatasetError(
            f"cifar10: {path}: 'data' must be [N >= 1, 3072] (3 planes of 32x32), got {data.shape}"
        )
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DatasetError(
            f"cifar10: {path}: 'labels' must be a list of ints, got {labels.dtype} "
            f"of shape {labels.shape}"
        )
    if len(labels) != len(data):
        raise DatasetError(f"cifar10: {path}: {len(labels)} labels for {len(data)} images")
    if labels.min() < 0 or labels.max() > 9:
        raise DatasetError(
            f"cifar10: {path}: labels must be in 0..9, found {labels.min()}..{labels.max()}"
        )
    return data, labels.astype(np.int64)


def _read_cifar_classes(root: Path) -> list[str]:
    meta_path = root / "batches.meta"
    if not meta_path.is_file():
        return [str(i) for i in range(10)]
    meta = _read_pickle(meta_path)
    names = _dict_get(meta, "label_names", meta_path) if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != 10:
        raise DatasetError(f"cifar10: {meta_path}: expected a dict with 10 'label_names'")
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names]


def _cifar_source(root: Path, names: Sequence[str]) -> TensorSource:
    batches = [_read_cifar_batch(root / name) for name in names]
    data = np.concatenate([d for d, _ in batches])
    labels = np.concatenate([lab for _, lab in batches])
    # each row is the R plane, then G, then B, each 32×32 row-major: exactly NCHW
    x = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, 3, 32, 32))
    return TensorSource(x, torch.from_numpy(labels))


def _load_cifar10(path: Path) -> LoadedData:
    root = _cifar_dir(path)
    return LoadedData(
        train=_cifar_source(root, CIFAR10_TRAIN_BATCHES),
        test=_cifar_source(root, (CIFAR10_TEST_BATCH,)),
        num_classes=10,
        input_shape=(3, 32, 32),
        is_image=True,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        classes=_read_cifar_classes(root),
    )
