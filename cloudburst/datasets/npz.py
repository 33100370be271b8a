"""``.npz`` arrays, read with ``allow_pickle=False``."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from cloudburst.datasets.base import (
    NPZ_SPLIT_SEED,
    DatasetError,
    LoadedData,
    TensorSource,
    _describe,
    channel_stats,
)

# --------------------------------------------------------------------------------------------
# .npz arrays

_NPZ_LAYOUTS = (("x_train", "y_train"), ("x", "y"))


def _open_npz(path: Path):
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
        return np.load(path, allow_pickle=False)
    except Exception as e:  # a damaged zip
        raise DatasetError(f"npz:{path}: not a readable .npz file ({_describe(e)})") from e


def _npz_keys(path: Path, archive) -> tuple[str, str, bool]:
    """(x key, y key, whether x_test/y_test are present)."""
    keys = set(archive.files)
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


def _npz_array(path: Path, archive, key: str) -> np.ndarray:
    try:
        return archive[key]
    except Exception as e:  # object arrays (allow_pickle=False), corrupt members
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


def _load_npz(path: Path, test_fraction: float) -> LoadedData:
    archive = _open_npz(path)
    with archive:
        x_key, y_key, has_test = _npz_keys(path, archive)
        x, is_image = _npz_samples(path, x_key, _npz_array(path, archive, x_key))
        y = _npz_labels(path, y_key, _npz_array(path, archive, y_key), len(x))
        if has_test:
            x_test, test_is_image = _npz_samples(
                path, "x_test", _npz_array(path, archive, "x_test")
            )
            y_test = _npz_labels(path, "y_test", _npz_array(path, archive, "y_test"), len(x_test))
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
