"""Small datasets in the on-disk formats users bring, written by the tests themselves."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def class_images(n: int, seed: int, size: int = 32, classes: int = 10):
    """(uint8 [n, size, size, 3] images, labels): each class a colour and a bright quadrant,
    learnable in a few steps, so tiny runs can check that training does something."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    colours = np.random.default_rng(1).integers(0, 256, (classes, 3))
    x = rng.integers(0, 60, (n, size, size, 3)).astype(np.int64)
    x += colours[labels][:, None, None, :] // 2
    half = size // 2
    for i, c in enumerate(labels):
        r, q = divmod(int(c) % 4, 2)
        x[i, r * half : (r + 1) * half, q * half : (q + 1) * half] += 100
    return np.clip(x, 0, 255).astype(np.uint8), labels.astype(np.int64)


def write_cifar10(root: Path, per_batch: int = 40, test: int = 40, seed: int = 0) -> Path:
    """A CIFAR-10 "python version" directory (5 training batches and a test batch)."""
    d = Path(root) / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)

    def dump(name: str, n: int, s: int) -> None:
        x, y = class_images(n, s)
        data = x.transpose(0, 3, 1, 2).reshape(n, 3072)  # R plane, G plane, B plane
        record = {b"batch_label": name.encode(), b"labels": y.tolist(), b"data": data}
        with open(d / name, "wb") as f:
            pickle.dump(record, f, protocol=2)

    for i in range(1, 6):
        dump(f"data_batch_{i}", per_batch, seed * 10 + i)
    dump("test_batch", test, seed * 10 + 9)
    names = [f"class{i}".encode() for i in range(10)]
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": names}, f, protocol=2)
    return d


def write_imagefolder(root: Path, per_class: int = 6, classes: int = 3, seed: int = 0) -> Path:
    """ImageFolder layout: one directory of PNG files per class, images of mixed sizes."""
    from PIL import Image

    root = Path(root)
    x, y = class_images(per_class * classes * 3, seed, size=40, classes=classes)
    counts = dict.fromkeys(range(classes), 0)
    for img, label in zip(x, y, strict=True):
        if counts[int(label)] >= per_class:
            continue
        counts[int(label)] += 1
        d = root / f"class_{label}"
        d.mkdir(parents=True, exist_ok=True)
        size = (40, 30) if counts[int(label)] % 2 else (36, 48)
        Image.fromarray(img).resize(size).save(d / f"{counts[int(label)]}.png")
    return root


def write_npz(path: Path, n: int = 200, test: int = 50, seed: int = 0) -> Path:
    x, y = class_images(n + test, seed)
    np.savez(path, x_train=x[:n], y_train=y[:n], x_test=x[n:], y_test=y[n:])
    return Path(path)
