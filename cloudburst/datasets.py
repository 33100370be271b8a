"""Readers for datasets on local paths: CIFAR-10 (python version), an image folder, a ``.npz`` file.

A dataset is named by a spec string, ``KIND`` or ``KIND:PATH`` (see ``parse_dataset_spec``):

- ``cifar10:PATH`` — the extracted "CIFAR-10 python version" (``data_batch_1..5``, ``test_batch``,
  optional ``batches.meta``); PATH is that directory or its parent holding
  ``cifar-10-batches-py/``. The batches are pickles, so they are read with an unpickler that only
  rebuilds numpy arrays and refuses every other global: a pickle can run code when loaded.
- ``imagefolder:PATH`` — ``PATH/CLASS/*.png|jpg|jpeg|bmp|gif|webp``; classes are the sorted
  subdirectory names. ``PATH/train`` with ``PATH/test`` (or ``PATH/val``) gives the splits;
  otherwise a stratified test split is held out (``_holdout_positions``). Images are decoded
  lazily, batch by batch, so this works for folders that do not fit in memory.
- ``npz:PATH`` — arrays ``x_train, y_train[, x_test, y_test]`` (or ``x, y[, x_test, y_test]``),
  read with ``allow_pickle=False``. uint8 ``[N,C,H,W]``, ``[N,H,W,C]`` (C in {1, 3}) or
  ``[N,H,W]`` are images; anything else numeric is a float32 feature array.

Every failure is a ``DatasetError`` whose message is one line naming the path and the problem.
Images come out as uint8 NCHW; ``Preprocess`` turns a batch into normalised float32, with random
crop + flip when augmenting, vectorised over the batch and seeded by a ``torch.Generator``.
"""

from __future__ import annotations

import codecs
import functools
import os
import pickle
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

DATASET_KINDS = ("cifar10", "imagefolder", "npz")
GENERATED_KINDS = ("mnist1d", "synthetic")  # made in memory by cloudburst.data; take no path

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_DIRNAME = "cifar-10-batches-py"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
STATS_MAX_IMAGES = 2048  # images decoded to estimate an image folder's mean/std
MAX_IMAGE_PIXELS = 64_000_000  # an image file larger than this is refused (8000 x 8000)
MAX_ASPECT_RATIO = 16  # longer side at most this many times the shorter one
STD_FLOOR = 1e-3  # a constant channel would otherwise divide by zero
NPZ_SPLIT_SEED = 0  # seed of the legacy numpy RandomState that picks a held-out npz test split


class DatasetError(ValueError):
    """A dataset on disk is missing, laid out wrongly or malformed. ``str(e)`` is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------
# Sources: what a loader hands to the data pipeline


class TensorSource:
    """Samples held in memory: ``x`` (any per-sample shape) and int64 labels ``y`` [N]."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise DatasetError(
                f"TensorSource needs tensors, got {type(x).__name__} and {type(y).__name__}"
            )
        if y.dtype != torch.int64 or y.dim() != 1:
            raise DatasetError(
                f"labels must be an int64 vector, got {y.dtype} of shape {tuple(y.shape)}"
            )
        if x.dim() < 1 or len(x) != len(y):
            raise DatasetError(
                f"{len(y)} labels for samples of shape {tuple(x.shape)}; need one label per sample"
            )
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return len(self.y)

    @property
    def targets(self) -> torch.Tensor:
        return self.y

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]


class ImageFileSource:
    """Images decoded from files on demand, as uint8 [B, 3, S, S] with S = ``image_size``.

    Each image is converted to RGB, its shorter side resized to S (bilinear) and the centre S×S
    cropped (offset ``(side - S) // 2``). Holds only paths and labels, so it pickles cheaply
    into DataLoader worker processes.
    """

    def __init__(self, paths: list[str], labels: list[int], image_size: int):
        if len(paths) != len(labels):
            raise DatasetError(f"{len(paths)} image paths but {len(labels)} labels")
        if image_size < 1:
            raise DatasetError(f"image_size must be >= 1, got {image_size}")
        self.paths = [str(p) for p in paths]
        self.labels = torch.as_tensor(list(labels), dtype=torch.int64).reshape(-1)
        self.image_size = int(image_size)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def targets(self) -> torch.Tensor:
        return self.labels

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.as_tensor(idx, dtype=torch.int64).reshape(-1)
        size = self.image_size
        out = torch.empty((len(positions), 3, size, size), dtype=torch.uint8)
        for row, i in enumerate(positions.tolist()):
            out[row] = torch.from_numpy(_decode_image(self.paths[i], size)).permute(2, 0, 1)
        return out, self.labels[positions]


def _decode_image(path: str, size: int) -> np.ndarray:
    """One image file → uint8 [size, size, 3]: RGB, shorter side resized to size, centre crop."""
    try:
        from PIL import Image
    except ImportError as e:  # Pillow arrives with matplotlib, but say so if it is missing
        raise DatasetError(f"{path}: reading images needs Pillow (pip install pillow)") from e
    try:
        with Image.open(path) as src:
            w, h = src.size  # from the header: checked before anything is decoded
            _check_image_size(path, w, h)
            img = src.convert("RGB")
        scale = size / min(w, h)
        new_w, new_h = max(size, round(w * scale)), max(size, round(h * scale))
        if (new_w, new_h) != (w, h):
            img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
        left, top = (new_w - size) // 2, (new_h - size) // 2
        img = img.crop((left, top, left + size, top + size))
        return np.array(img, dtype=np.uint8)  # a writable copy
    except DatasetError:
        raise
    except Exception as e:  # decoders of corrupt files raise many types; all mean "unreadable"
        raise DatasetError(f"{path}: cannot read image ({_describe(e)})") from e


def _check_image_size(path: str, width: int, height: int) -> None:
    """Refuse an image that would be huge to decode or to resize (a 60,000,000 x 1 image
    resized to a shorter side of 32 would be 1.9e9 x 32 pixels)."""
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise DatasetError(
            f"{path}: image of {width}x{height} pixels is outside 1..{MAX_IMAGE_PIXELS} pixels"
        )
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise DatasetError(
            f"{path}: image of {width}x{height} pixels has an aspect ratio above "
            f"{MAX_ASPECT_RATIO}:1; crop it first"
        )


# --------------------------------------------------------------------------------------------
# What a loader returns


@dataclass
class LoadedData:
    train: TensorSource | ImageFileSource
    test: TensorSource | ImageFileSource
    num_classes: int
    input_shape: tuple[int, ...]  # per-sample shape the model sees, e.g. (3, 32, 32) or (40,)
    is_image: bool  # uint8 NCHW images (augment + normalise) vs float32 features (as is)
    mean: tuple[float, ...] | None  # per-channel, on the [0, 1] pixel scale; None for features
    std: tuple[float, ...] | None
    classes: list[str] | None = None


def channel_stats(x_uint8: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of uint8 NCHW images on the [0, 1] scale.

    Accumulated in float64 over chunks of samples, so a large set needs no float copy;
    std is floored at ``STD_FLOOR``.
    """
    moments = _ChannelMoments()
    for start in range(0, len(x_uint8), 1024):
        moments.add(x_uint8[start : start + 1024])
    return moments.result()


class _ChannelMoments:
    def __init__(self) -> None:
        self.count = 0
        self.sum: torch.Tensor | None = None
        self.sum_sq: torch.Tensor | None = None

    def add(self, x_uint8: torch.Tensor) -> None:
        if x_uint8.dtype != torch.uint8 or x_uint8.dim() != 4:
            raise ValueError(
                f"channel_stats needs uint8 [N, C, H, W], got {x_uint8.dtype} "
                f"of shape {tuple(x_uint8.shape)}"
            )
        x = x_uint8.to(torch.float64) / 255.0
        s, s2 = x.sum(dim=(0, 2, 3)), (x * x).sum(dim=(0, 2, 3))
        self.sum = s if self.sum is None else self.sum + s
        self.sum_sq = s2 if self.sum_sq is None else self.sum_sq + s2
        self.count += x.shape[0] * x.shape[2] * x.shape[3]

    def result(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        if self.count == 0 or self.sum is None or self.sum_sq is None:
            raise ValueError("channel_stats needs at least one pixel")
        mean = self.sum / self.count
        var = (self.sum_sq / self.count - mean * mean).clamp_min(0.0)
        std = var.sqrt().clamp_min(STD_FLOOR)
        return tuple(mean.tolist()), tuple(std.tolist())


# --------------------------------------------------------------------------------------------
# Spec parsing and the entry points

_SPEC_FORMS = "mnist1d, synthetic, cifar10:PATH, imagefolder:PATH, npz:PATH"


def parse_dataset_spec(spec: str) -> tuple[str, str | None]:
    """``"mnist1d"`` → ``("mnist1d", None)``; ``"npz:/d/x.npz"`` → ``("npz", "/d/x.npz")``.

    Splits at the first ``:``, so a path may itself contain colons.
    """
    kind, sep, path = spec.partition(":")
    kind = kind.strip()
    if kind in GENERATED_KINDS:
        if sep:
            raise DatasetError(
                f"dataset {spec!r}: {kind} is generated in memory and takes no path; "
                f"use one of {_SPEC_FORMS}"
            )
        return kind, None
    if kind in DATASET_KINDS:
        if not path.strip():
            raise DatasetError(
                f"dataset {spec!r}: {kind} needs a path, as {kind}:PATH; use one of {_SPEC_FORMS}"
            )
        return kind, path
    raise DatasetError(f"dataset {spec!r}: unknown kind {kind!r}; use one of {_SPEC_FORMS}")


def check_dataset(kind: str, path: str) -> None:
    """Cheap preflight: PATH exists and has the layout of KIND. Decodes nothing."""
    root = _resolve(kind, path)
    if kind == "cifar10":
        _cifar_dir(root)
    elif kind == "imagefolder":
        _imagefolder_splits(root)
    else:
        with _open_npz(root) as archive:
            _npz_keys(root, archive)


def load_path_dataset(
    kind: str, path: str, image_size: int = 32, test_fraction: float = 0.1
) -> LoadedData:
    """Read the dataset KIND at PATH. ``image_size`` applies to imagefolder only;
    ``test_fraction`` only where the data brings no test split of its own."""
    root = _resolve(kind, path)
    if not 0.0 < test_fraction < 1.0:
        raise DatasetError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if image_size < 1:
        raise DatasetError(f"image_size must be >= 1, got {image_size}")
    if kind == "cifar10":
        return _load_cifar10(root)
    if kind == "imagefolder":
        return _load_imagefolder(root, image_size, test_fraction)
    return _load_npz(root, test_fraction)


def _resolve(kind: str, path: str) -> Path:
    if kind not in DATASET_KINDS:
        raise DatasetError(
            f"dataset kind {kind!r} is not read from a path; path kinds: {', '.join(DATASET_KINDS)}"
        )
    root = Path(os.path.expanduser(path))
    if not root.exists():
        raise DatasetError(f"{kind}:{path}: no such file or directory")
    return root


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


# --------------------------------------------------------------------------------------------
# Image folder


def _list_classes(root: Path) -> dict[str, list[str]]:
    """CLASS → sorted image paths under ``root/CLASS`` (recursively; hidden names skipped,
    symlinked subdirectories inside a class not followed)."""
    if not root.is_dir():
        raise DatasetError(f"imagefolder:{root}: not a directory")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DatasetError(
            f"imagefolder:{root}: no class subdirectories; expected {root}/CLASS/IMAGE "
            f"with extensions {', '.join(IMAGE_EXTENSIONS)}"
        )
    images: dict[str, list[str]] = {}
    for name in classes:
        found = []
        for dirpath, dirnames, filenames in os.walk(root / name):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            found += [
                os.path.join(dirpath, f)
                for f in filenames
                if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)
            ]
        images[name] = sorted(found)
    empty = [name for name, files in images.items() if not files]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise DatasetError(
            f"imagefolder:{root}: no images ({', '.join(IMAGE_EXTENSIONS)}) in class "
            f"director{'y' if len(empty) == 1 else 'ies'} {shown}"
        )
    return images


def _imagefolder_splits(
    root: Path,
) -> tuple[dict[str, list[str]], dict[str, list[str]] | None]:
    """(train classes, test classes or None when a test split must be held out)."""
    train_dir = root / "train"
    test_dir = next((root / n for n in ("test", "val") if (root / n).is_dir()), None)
    if not (train_dir.is_dir() and test_dir is not None):
        classes = _list_classes(root)
        if list(classes) == ["train"]:
            raise DatasetError(
                f"imagefolder:{root}: has train/ but no test/ or val/; give both, or put the "
                f"class directories directly in {root} to hold out a test split"
            )
        return classes, None
    train, test = _list_classes(train_dir), _list_classes(test_dir)
    if list(train) != list(test):
        only_train = sorted(set(train) - set(test))
        only_test = sorted(set(test) - set(train))
        raise DatasetError(
            f"imagefolder:{root}: {train_dir.name}/ and {test_dir.name}/ must hold the same "
            f"classes; only in {train_dir.name}/: {only_train[:5]}, "
            f"only in {test_dir.name}/: {only_test[:5]}"
        )
    return train, test


def _holdout_positions(n: int, test_fraction: float) -> list[int]:
    """Which of a class's n sorted files go to the test split: k = round(n · test_fraction),
    at least 1 and at most n − 1 (a class of one image keeps it for training), at evenly
    spaced positions floor((i + ½) · n / k). No random numbers, so stable across versions."""
    if n < 2:
        return []
    k = min(n - 1, max(1, round(n * test_fraction)))
    return [int((i + 0.5) * n / k) for i in range(k)]


def _load_imagefolder(root: Path, image_size: int, test_fraction: float) -> LoadedData:
    train_classes, test_classes = _imagefolder_splits(root)
    classes = list(train_classes)
    train_paths: list[str] = []
    train_labels: list[int] = []
    test_paths: list[str] = []
    test_labels: list[int] = []
    for label, name in enumerate(classes):
        files = train_classes[name]
        if test_classes is not None:
            held_out = test_classes[name]
        else:
            chosen = set(_holdout_positions(len(files), test_fraction))
            held_out = [f for i, f in enumerate(files) if i in chosen]
            files = [f for i, f in enumerate(files) if i not in chosen]
        train_paths += files
        train_labels += [label] * len(files)
        test_paths += held_out
        test_labels += [label] * len(held_out)
    if not test_paths:
        raise DatasetError(
            f"imagefolder:{root}: too few images to hold out a test split (every class has "
            f"one image); add images or give train/ and test/ directories"
        )
    train = ImageFileSource(train_paths, train_labels, image_size)
    mean, std = _image_source_stats(train)
    return LoadedData(
        train=train,
        test=ImageFileSource(test_paths, test_labels, image_size),
        num_classes=len(classes),
        input_shape=(3, image_size, image_size),
        is_image=True,
        mean=mean,
        std=std,
        classes=classes,
    )


def _image_source_stats(
    source: ImageFileSource, max_images: int = STATS_MAX_IMAGES
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Channel stats of up to ``max_images`` training images, after resize and crop, at evenly
    spaced positions floor(i · N / k) of the training list (ordered by class, then path)."""
    n = len(source)
    k = min(n, max_images)
    positions = torch.tensor([i * n // k for i in range(k)], dtype=torch.int64)
    moments = _ChannelMoments()
    for start in range(0, k, 256):
        images, _ = source.get_batch(positions[start : start + 256])
        moments.add(images)
    return moments.result()


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


# --------------------------------------------------------------------------------------------
# Batched augmentation and normalisation


class Preprocess:
    """uint8 NCHW batch → normalised float32; float batches pass through as float32.

    With ``augment``: zero-pad by ``pad`` pixels, crop back at a random offset in
    [0, 2·pad] per sample and axis, and flip horizontally with p = ½ per sample — gathered
    in one indexing op, with all randomness from ``generator`` so a batch is reproducible.
    Padding is applied to pixels before normalisation (as torchvision's RandomCrop(padding)
    followed by Normalize). Holds only tuples and numbers, so it pickles into workers.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], augment: bool, pad: int = 4):
        if len(mean) == 0 or len(mean) != len(std):
            raise ValueError(f"mean and std need one entry per channel, got {mean} and {std}")
        if any(s <= 0 for s in std):
            raise ValueError(f"std must be positive per channel, got {std}")
        if pad < 0:
            raise ValueError(f"pad must be >= 0 pixels, got {pad}")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.augment = bool(augment)
        self.pad = int(pad)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if x.is_floating_point():
            return x.to(torch.float32)
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] != len(self.mean):
            raise ValueError(
                f"Preprocess needs uint8 [B, {len(self.mean)}, H, W] or a float batch, "
                f"got {x.dtype} of shape {tuple(x.shape)}"
            )
        if self.augment:
            x = self._crop_and_flip(x, generator)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
        return (x.to(torch.float32) / 255.0 - mean) / std

    def _crop_and_flip(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        batch, channels, height, width = x.shape
        pad = self.pad
        rng_device = generator.device if generator is not None else torch.device("cpu")
        draw = dict(generator=generator, device=rng_device)
        top = torch.randint(0, 2 * pad + 1, (batch,), **draw).to(x.device)
        left = torch.randint(0, 2 * pad + 1, (batch,), **draw).to(x.device)
        flip = (torch.rand(batch, **draw) < 0.5).to(x.device)
        padded = F.pad(x, (pad, pad, pad, pad))
        rows = top[:, None] + torch.arange(height, device=x.device)  # [B, H]
        cols = left[:, None] + torch.arange(width, device=x.device)  # [B, W]
        cols = torch.where(flip[:, None], cols.flip(1), cols)  # reading columns backwards = flip
        return padded[
            torch.arange(batch, device=x.device)[:, None, None, None],
            torch.arange(channels, device=x.device)[None, :, None, None],
            rows[:, None, :, None],
            cols[:, None, None, :],
        ]
