"""``.npz`` arrays, read with ``allow_pickle=False``.

Each array's ``.npy`` header (shape, dtype) is read through :mod:`zipfile` before its data: an
array whose memory as loaded would pass ``max_bytes`` (``MAX_DATASET_BYTES``, summed over the
arrays), or whose zip member declares a size that does not match its header, is refused
without being decompressed — a 2 MB deflated member can declare gigabytes.
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import numpy as np
import torch

from cloudburst.data.datasets.base import (
    MAX_DATASET_BYTES,
    NPZ_SPLIT_SEED,
    DatasetError,
    LoadedData,
    TensorSource,
    _describe,
    _gib,
    channel_stats,
    check_size,
)

# --------------------------------------------------------------------------------------------
# .npz arrays

_NPZ_LAYOUTS = (("x_train", "y_train"), ("x", "y"))
_NPY_HEADER_MAX = 10_000  # bytes of a .npy header (numpy's own default limit)


def _open_npz(path: Path) -> zipfile.ZipFile:
    if not path.is_file():
        raise DatasetError(f"npz:{path}: not a file")
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic == b"\x93NUMPY":
        raise DatasetError(
            f"npz:{path}: holds a single array (.npy); save x_train, y_train, x_test, y_test "
            f"with np.savez"
        )
    if not zipfile.is_zipfile(path):  # np.load would try it as a pickle, which is refused
        raise DatasetError(f"npz:{path}: not a readable .npz file (not a zip archive)")
    try:
        return zipfile.ZipFile(path)
    except Exception as e:  # a damaged zip
        raise DatasetError(f"npz:{path}: not a readable .npz file ({_describe(e)})") from e


def _npz_names(archive: zipfile.ZipFile) -> dict[str, str]:
    """Array name → zip member, as ``np.load`` names them (``x.npy`` is array ``x``)."""
    return {(n[:-4] if n.endswith(".npy") else n): n for n in archive.namelist()}


def _npz_keys(path: Path, archive: zipfile.ZipFile) -> tuple[str, str, bool]:
    """(x key, y key, whether x_test/y_test are present)."""
    keys = set(_npz_names(archive))
    layout = next(((x, y) for x, y in _NPZ_LAYOUTS if x in keys and y in keys), None)
    if layout is None:
        raise DatasetError(
            f"npz:{path}: expected arrays x_train, y_train (or x, y) and optionally x_test, "
            f"y_test; found {sorted(keys)}"
        )
    if ("x_test" in keys) != ("y_test" in keys):
        present, absent = ("x_test", "y_test") if "x_test" in keys else ("y_test", "x_test")
        raise DatasetError(f"npz:{path}: has {present} but no {absent}")
    return layout[0], layout[1], "x_test" in keys


def _npy_header(
    path: Path, archive: zipfile.ZipFile, key: str
) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, header length in bytes) of array ``key``; its data is not read."""
    member = _npz_names(archive)[key]
    try:
        with archive.open(member) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f, _NPY_HEADER_MAX)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(f, _NPY_HEADER_MAX)
            else:
                raise ValueError(f".npy format version {version[0]}.{version[1]} (need 1.0 or 2.0)")
            header_bytes = f.tell()
    except Exception as e:  # a damaged member or header
        raise DatasetError(f"npz:{path}: cannot read array {key!r} ({_describe(e)})") from e
    if dtype.hasobject:
        raise DatasetError(
            f"npz:{path}: cannot read array {key!r} (dtype {dtype} holds Python objects, "
            f"which need pickle; store numbers)"
        )
    return tuple(shape), dtype, header_bytes


def _loaded_itemsize(shape: tuple[int, ...], dtype: np.dtype, is_label: bool) -> int:
    """Bytes per element once loaded: labels become int64; uint8 images stay uint8; every other
    sample array becomes float32 features (see ``_npz_samples``)."""
    if is_label:
        return 8
    if dtype == np.uint8 and len(shape) in (3, 4):
        return 1
    return 4


class _Budget:
    """Bytes the file's arrays may take as loaded, all together."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0


def _npz_array(
    path: Path, archive: zipfile.ZipFile, key: str, budget: _Budget, is_label: bool = False
) -> np.ndarray:
    """Array ``key``, read only after its header shows that it fits in what is left of the
    budget and that its zip member declares exactly the size of that data."""
    shape, dtype, header_bytes = _npy_header(path, archive, key)
    count = math.prod(shape)  # Python ints: no overflow
    loaded = _loaded_itemsize(shape, dtype, is_label)
    shown = f"shape {list(shape)} {dtype}" + (
        f" as {'int64' if is_label else 'float32'}" if loaded != dtype.itemsize else ""
    )
    need = count * max(dtype.itemsize, loaded)
    if budget.used:
        shown += f"; the file's arrays {_gib(budget.used + need)} in all"
    check_size(
        f"npz:{path}: array {key!r}", need, budget.limit - budget.used, shown, limit=budget.limit
    )
    budget.used += need
    declared = archive.getinfo(_npz_names(archive)[key]).file_size
    if declared != header_bytes + count * dtype.itemsize:
        raise DatasetError(
            f"npz:{path}: array {key!r} declares shape {list(shape)} {dtype} "
            f"({header_bytes + count * dtype.itemsize} bytes with its header) but its zip "
            f"member declares {declared} bytes; the file is damaged or crafted"
        )
    try:
        with archive.open(_npz_names(archive)[key]) as f:
            return np.lib.format.read_array(f, allow_pickle=False, max_header_size=_NPY_HEADER_MAX)
    except Exception as e:  # corrupt members, a bad CRC
        raise DatasetError(f"npz:{path}: cannot read array {key!r} ({_describe(e)})") from e


def _npz_labels(path: Path, key: str, y: np.ndarray, n: int) -> torch.Tensor:
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise DatasetError(
            f"npz:{path}: {key} must be a 1-D integer array, got {y.dtype} of shape {y.shape}"
        )
    if len(y) != n:
        raise DatasetError(f"npz:{path}: {key} has {len(y)} labels for {n} samples")
    if n == 0:
        raise DatasetError(f"npz:{path}: {key} is empty")
    if y.min() < 0:
        raise DatasetError(f"npz:{path}: {key} has negative label {y.min()}; labels are 0..C-1")
    return torch.from_numpy(y.astype(np.int64))


def _npz_samples(path: Path, key: str, x: np.ndarray) -> tuple[torch.Tensor, bool]:
    """(samples, is_image): uint8 images as NCHW uint8, everything else as float32 features."""
    if x.ndim < 2:
        raise DatasetError(
            f"npz:{path}: {key} must have a sample axis and at least one feature axis, "
            f"got shape {x.shape}"
        )
    if x.dtype == np.uint8 and x.ndim == 3:  # [N, H, W] grayscale
        return torch.from_numpy(np.ascontiguousarray(x[:, None])), True
    if x.dtype == np.uint8 and x.ndim == 4:
        if x.shape[1] in (1, 3):  # NCHW (preferred when both readings fit)
            return torch.from_numpy(np.ascontiguousarray(x)), True
        if x.shape[-1] in (1, 3):  # NHWC
            return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))), True
        raise DatasetError(
            f"npz:{path}: {key} is uint8 of shape {x.shape}, neither NCHW nor NHWC with 1 or 3 "
            f"channels; store it as float32 to use it as features"
        )
    if x.dtype.kind not in "biuf":
        raise DatasetError(f"npz:{path}: {key} has dtype {x.dtype}; need numbers")
    with np.errstate(over="ignore"):  # values beyond float32 become inf, reported below
        features = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if not torch.isfinite(features).all():
        raise DatasetError(f"npz:{path}: {key} has NaN or infinite values (as float32)")
    return features, False


def _npz_holdout(n: int, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices: a legacy ``RandomState(NPZ_SPLIT_SEED)`` permutation (a frozen
    stream), whose last k = round(n · test_fraction) entries (1 ≤ k ≤ n − 1) are the test
    split; both index lists sorted, so samples keep their file order."""
    k = min(n - 1, max(1, round(n * test_fraction)))
    order = np.random.RandomState(NPZ_SPLIT_SEED).permutation(n)
    return np.sort(order[: n - k]), np.sort(order[n - k :])


def _load_npz(path: Path, test_fraction: float, max_bytes: int = MAX_DATASET_BYTES) -> LoadedData:
    """The arrays of ``path``; their memory as loaded is at most ``max_bytes`` in all."""
    archive = _open_npz(path)
    budget = _Budget(max_bytes)
    with archive:
        x_key, y_key, has_test = _npz_keys(path, archive)
        x, is_image = _npz_samples(path, x_key, _npz_array(path, archive, x_key, budget))
        y = _npz_labels(path, y_key, _npz_array(path, archive, y_key, budget, True), len(x))
        if has_test:
            x_test, test_is_image = _npz_samples(
                path, "x_test", _npz_array(path, archive, "x_test", budget)
            )
            y_test = _npz_labels(
                path, "y_test", _npz_array(path, archive, "y_test", budget, True), len(x_test)
            )
            if test_is_image != is_image or x_test.shape[1:] != x.shape[1:]:
                kinds = {True: "uint8 images", False: "features"}
                raise DatasetError(
                    f"npz:{path}: x_test samples are {kinds[test_is_image]} of shape "
                    f"{tuple(x_test.shape[1:])}, {x_key} samples are {kinds[is_image]} of shape "
                    f"{tuple(x.shape[1:])}; both splits need the same sample shape"
                )
        else:
            if len(x) < 2:
                raise DatasetError(f"npz:{path}: need at least 2 samples to hold out a test split")
            train_idx, test_idx = (torch.from_numpy(i) for i in _npz_holdout(len(x), test_fraction))
            x, x_test, y, y_test = x[train_idx], x[test_idx], y[train_idx], y[test_idx]
    mean, std = channel_stats(x) if is_image else (None, None)
    return LoadedData(
        train=TensorSource(x, y),
        test=TensorSource(x_test, y_test),
        num_classes=int(max(y.max(), y_test.max())) + 1,
        input_shape=tuple(x.shape[1:]),
        is_image=is_image,
        mean=mean,
        std=std,
    )
