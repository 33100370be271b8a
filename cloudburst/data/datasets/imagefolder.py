"""An image folder: ``PATH/CLASS/*.png|jpg|...``, with ``train``/``test`` splits or a held-out one;
images decoded lazily, batch by batch.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cloudburst.data.datasets.base import (
    IMAGE_EXTENSIONS,
    STATS_CHUNK_BYTES,
    STATS_MAX_IMAGES,
    DatasetError,
    ImageFileSource,
    LoadedData,
    _ChannelMoments,
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
    spaced positions floor(i · N / k) of the training list (ordered by class, then path),
    decoded in chunks of at most ``STATS_CHUNK_BYTES`` (uint8 plus two float64 copies)."""
    n = len(source)
    k = min(n, max_images)
    positions = torch.tensor([i * n // k for i in range(k)], dtype=torch.int64)
    per_image = 3 * source.image_size**2 * (1 + 8 + 8)
    chunk = max(1, min(256, STATS_CHUNK_BYTES // per_image))
    moments = _ChannelMoments()
    for start in range(0, k, chunk):
        images, _ = source.get_batch(positions[start : start + chunk])
        moments.add(images)
    return moments.result()
