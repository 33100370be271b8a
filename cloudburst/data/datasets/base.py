"""What every dataset reader shares: the one-line error, in-memory and image-file sources,
image decoding with size limits, channel statistics, and batched augmentation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

GENERATED_KINDS = ("mnist1d", "synthetic")  # made in memory by cloudburst.data; take no path

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_DIRNAME = "cifar-10-batches-py"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
STATS_MAX_IMAGES = 2048  # images decoded to estimate an image folder's mean/std
STATS_CHUNK_BYTES = 256 * 2**20  # their memory at a time (uint8 and float64 working copies)
MAX_IMAGE_PIXELS = 64_000_000  # an image file larger than this is refused (8000 x 8000)
MAX_ASPECT_RATIO = 16  # longer side at most this many times the shorter one
STD_FLOOR = 1e-3  # a constant channel would otherwise divide by zero
NPZ_SPLIT_SEED = 0  # seed of the legacy numpy RandomState that picks a held-out npz test split
# The most memory one dataset may take on a rank, checked from headers and file sizes before
# anything is allocated: npz arrays as loaded, a text corpus, an image folder's decoded test
# split. A small file can declare a huge array (a 2 MB deflated .npz can unpack to 2 GB).
MAX_DATASET_BYTES = 2 * 2**30


class DatasetError(ValueError):
    """A dataset on disk is missing, laid out wrongly or malformed. ``str(e)`` is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def cache_dir() -> Path:
    """Where generated data is kept between runs and shared by a machine's ranks:
    ``$CLOUDBURST_CACHE``, default ``~/.cache/cloudburst``."""
    return Path(os.environ.get("CLOUDBURST_CACHE", Path.home() / ".cache" / "cloudburst"))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _gib(n_bytes: int) -> str:
    """A size for an error message: ``"7.45 GiB"``, ``"64.0 MiB"``, ``"193 bytes"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n_bytes >= scale:
            value = n_bytes / scale
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{n_bytes} bytes"


def check_size(
    what: str,
    n_bytes: int,
    left: int,
    detail: str = "",
    scope: str = "",
    limit: int | None = None,
) -> None:
    """Raise the one-line ``DatasetError`` for ``what`` taking ``n_bytes`` when only ``left``
    are left of ``limit`` (default: ``left`` is the whole limit): ``npz:P: array 'x' would
    take 7.5 GiB (shape [..] uint8), over the 2.0 GiB limit for a dataset``. Called before
    allocating, with sizes computed from headers and ``stat`` in Python ints."""
    if n_bytes > left:
        detail = f" ({detail})" if detail else ""
        scope = scope or "a dataset (--max-dataset-gib)"
        limit = left if limit is None else limit
        raise DatasetError(
            f"{what} would take {_gib(n_bytes)}{detail}, over the {_gib(limit)} limit for {scope}"
        )


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
