"""CIFAR-10, the python version: pickled batches read with an unpickler that rebuilds numpy
arrays only (a pickle can run code when loaded).

Memory is bounded by the file, not by what it declares: a batch file is at most
``CIFAR10_MAX_FILE_BYTES``; every length its opcodes declare must lie inside it; an array can
only be filled from the pickle's own bytes (``numpy.ndarray(shape)`` and a non-empty
``_reconstruct`` are refused, so no uninitialised memory); and all it builds — strings and
arrays — is at most twice the file. Then the format is enforced: ``data`` uint8 [N, 3072] with
1 <= N <= 10000 and ``labels`` a list of N ints in 0..9.
"""

from __future__ import annotations

import codecs
import functools
import io
import math
import os
import pickle
import pickletools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from cloudburst.data.datasets.base import (
    CIFAR10_DIRNAME,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10_TEST_BATCH,
    CIFAR10_TRAIN_BATCHES,
    DatasetError,
    LoadedData,
    TensorSource,
    _describe,
    _gib,
)

CIFAR10_BATCH_IMAGES = 10_000  # images per batch file of the published dataset
# A published batch is 31 MB (a Python 2 pickle); re-pickled by Python 3 at protocol 2, its
# bytes become latin-1 text, up to ~1.5x that. Anything larger is not a CIFAR-10 batch.
CIFAR10_MAX_FILE_BYTES = 64 * 2**20

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


@functools.cache
def _numpy_modules() -> tuple[object, object]:
    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy < 2
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]
    return multiarray, numeric


class _ArrayType:
    """What the pickle gets for the global ``numpy.ndarray``: a token that ``_reconstruct``
    accepts and that cannot be called (``ndarray(shape, dtype)`` would allocate uninitialised
    memory of any size; NEWOBJ refuses it too, as it is not a type)."""

    __slots__ = ()  # nor can BUILD give it attributes

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise pickle.UnpicklingError(
            "refuses to call numpy.ndarray directly (its memory would not come from the file)"
        )


_ARRAY_TYPE = _ArrayType()


class _Budget:
    """Bytes the pickle may still build (strings and array data); a shared counter."""

    def __init__(self, source: Path, file_bytes: int):
        self.source, self.file_bytes = source, file_bytes
        self.left = 2 * file_bytes

    def spend(self, n_bytes: int, what: str) -> None:
        self.left -= n_bytes
        if self.left < 0:
            raise DatasetError(
                f"cifar10: {self.source}: builds more than twice its {self.file_bytes} bytes "
                f"({what}); a batch's arrays are made from its own bytes once"
            )


class _PickledArray(np.ndarray):
    """An array being unpickled: its ``__setstate__`` (the BUILD opcode) checks that the data
    is the pickle's own bytes, exactly as many as shape × itemsize, before numpy copies it."""

    _budget: _Budget

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise pickle.UnpicklingError("array state is not (version, shape, dtype, order, data)")
        _, shape, dtype, _, raw = state
        if not isinstance(dtype, np.dtype) or dtype.hasobject:
            raise pickle.UnpicklingError(f"refuses an array of dtype {dtype!r}")
        if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
            raise pickle.UnpicklingError(f"array shape {shape!r} is not a tuple of sizes")
        n_bytes = math.prod(shape) * dtype.itemsize
        if not isinstance(raw, bytes | bytearray) or len(raw) != n_bytes:
            raise pickle.UnpicklingError(
                f"array of shape {shape} {dtype} needs {n_bytes} bytes of data, the pickle "
                f"gives {len(raw) if isinstance(raw, bytes | bytearray) else type(raw).__name__}"
            )
        self._budget.spend(n_bytes, f"an array of shape {list(shape)} {dtype}")
        super().__setstate__(state)


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Rebuilds dicts, lists, strings, numbers and numpy arrays; refuses every other global,
    so a crafted pickle cannot call ``os.system`` or import anything. Each allowed global is
    a checked wrapper bound to this file's budget (see the module docstring)."""

    def __init__(self, file: io.BytesIO, source: Path, file_bytes: int):
        super().__init__(file, encoding="bytes")
        self.source = source
        self.budget = _Budget(source, file_bytes)

    def find_class(self, module: str, name: str) -> object:
        numpy_module = module.removeprefix("numpy.core.").removeprefix("numpy._core.")
        numpy_package = module.startswith(("numpy.core.", "numpy._core."))
        found = {
            ("numpy", "ndarray"): _ARRAY_TYPE,
            ("numpy", "dtype"): np.dtype,
            ("_codecs", "encode"): self._encode,
        }.get((module, name))
        if numpy_package:
            found = {
                ("multiarray", "_reconstruct"): self._reconstruct,
                ("multiarray", "scalar"): self._scalar,
                ("numeric", "_frombuffer"): self._frombuffer,  # protocol 5
            }.get((numpy_module, name))
        if found is None:
            raise DatasetError(
                f"cifar10: {self.source}: refuses to unpickle global {module}.{name} "
                f"(only numpy arrays are allowed)"
            )
        return found

    def _encode(self, text: str, encoding: str = "utf-8") -> bytes:
        # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(text, "latin1"); nothing else.
        if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
            raise pickle.UnpicklingError(f"refuses _codecs.encode with encoding {encoding!r}")
        self.budget.spend(len(text), "strings")
        return codecs.encode(text, encoding)

    def _reconstruct(self, subtype: object, shape: object, dtype: object) -> np.ndarray:
        # numpy pickles an array as _reconstruct(ndarray, (0,), b"b") and then BUILD (setstate)
        if subtype is not _ARRAY_TYPE or shape != (0,):
            raise pickle.UnpicklingError(
                f"refuses _reconstruct of shape {shape!r}: an array's data must come from the file"
            )
        array = _numpy_modules()[0]._reconstruct(_PickledArray, (0,), dtype)
        array._budget = self.budget
        return array

    def _scalar(self, dtype: object, data: object = None) -> object:
        if not isinstance(dtype, np.dtype) or dtype.hasobject:
            raise pickle.UnpicklingError(f"refuses a numpy scalar of dtype {dtype!r}")
        self.budget.spend(dtype.itemsize, "scalars")
        return _numpy_modules()[0].scalar(dtype, data)

    def _frombuffer(self, buf: object, dtype: object, shape: object, order: object) -> np.ndarray:
        if not isinstance(buf, bytes | bytearray) or not isinstance(dtype, np.dtype):
            raise pickle.UnpicklingError("refuses _frombuffer of anything but the pickle's bytes")
        self.budget.spend(len(buf), "arrays")
        array = _numpy_modules()[1]._frombuffer(buf, dtype, shape, order).view(_PickledArray)
        array._budget = self.budget
        return array


def _check_declared_lengths(raw: bytes) -> None:
    """Walk the opcodes (without building anything): every string, bytes or integer the pickle
    declares must lie inside it, so a short file cannot make the unpickler allocate a huge
    buffer for data it does not hold. Raises ValueError otherwise."""
    for _ in pickletools.genops(io.BytesIO(raw)):
        pass


def _read_pickle(path: Path) -> object:
    try:
        file_bytes = os.stat(path).st_size
    except OSError as e:
        raise DatasetError(f"cifar10: {path}: cannot read ({_describe(e)})") from e
    if file_bytes > CIFAR10_MAX_FILE_BYTES:
        raise DatasetError(
            f"cifar10: {path}: a file of {_gib(file_bytes)} is over the "
            f"{_gib(CIFAR10_MAX_FILE_BYTES)} limit for a CIFAR-10 batch file (a published "
            f"batch is 31 MB)"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(file_bytes + 1)  # read() would size its buffer to the limit
        if len(raw) > file_bytes:
            raise ValueError(f"the file grew past {file_bytes} bytes while being read")
        _check_declared_lengths(raw)
        return _NumpyOnlyUnpickler(io.BytesIO(raw), path, len(raw)).load()
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
    if data.shape[1] != 3 * 32 * 32 or not 1 <= data.shape[0] <= CIFAR10_BATCH_IMAGES:
        raise DatasetError(
            f"cifar10: {path}: 'data' must be [N, 3072] (3 planes of 32x32) with "
            f"1 <= N <= {CIFAR10_BATCH_IMAGES}, got {data.shape}"
        )
    if not isinstance(labels, list) or not all(type(v) is int for v in labels):
        shown = type(labels).__name__ if not isinstance(labels, list) else "a list with non-ints"
        raise DatasetError(f"cifar10: {path}: 'labels' must be a list of ints, got {shown}")
    if len(labels) != len(data):
        raise DatasetError(f"cifar10: {path}: {len(labels)} labels for {len(data)} images")
    if not all(0 <= v <= 9 for v in labels):
        raise DatasetError(
            f"cifar10: {path}: labels must be in 0..9, found {min(labels)}..{max(labels)}"
        )
    return data.view(np.ndarray), np.array(labels, dtype=np.int64)


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
