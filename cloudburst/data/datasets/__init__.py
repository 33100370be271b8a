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
- ``text:PATH`` — byte tokens of a UTF-8 file or a directory of files; ``text:stdlib`` is the
  running interpreter's standard library sources (:mod:`cloudburst.data.datasets.text`).

Every failure is a ``DatasetError`` whose message is one line naming the path and the problem.
Memory is checked before it is allocated, from what a file declares (npz headers, the CIFAR
unpickler's arguments, ``stat``): a dataset may take at most ``max_bytes`` on a rank
(``MAX_DATASET_BYTES``, ``--max-dataset-gib``); the error names the size and the limit.
Images come out as uint8 NCHW; ``Preprocess`` turns a batch into normalised float32, with random
crop + flip when augmenting, vectorised over the batch and seeded by a ``torch.Generator``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cloudburst.data.datasets.base import (  # noqa: F401
    CIFAR10_DIRNAME,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10_TEST_BATCH,
    CIFAR10_TRAIN_BATCHES,
    GENERATED_KINDS,
    IMAGE_EXTENSIONS,
    MAX_ASPECT_RATIO,
    MAX_DATASET_BYTES,
    MAX_IMAGE_PIXELS,
    NPZ_SPLIT_SEED,
    STATS_MAX_IMAGES,
    STD_FLOOR,
    DatasetError,
    ImageFileSource,
    LoadedData,
    Preprocess,
    TensorSource,
    _ChannelMoments,
    _check_image_size,
    _decode_image,
    _describe,
    channel_stats,
    check_size,
)
from cloudburst.data.datasets.cifar import _cifar_dir, _load_cifar10
from cloudburst.data.datasets.imagefolder import _imagefolder_splits, _load_imagefolder
from cloudburst.data.datasets.npz import _load_npz, _npz_keys, _open_npz
from cloudburst.data.datasets.text import (  # noqa: F401
    STDLIB,
    TokenStream,
    TokenWindows,
    corpus_bytes,
    corpus_files,
    load_text,
)

# --------------------------------------------------------------------------------------------
# The registry of the kinds read from a path


@dataclass(frozen=True)
class PathReader:
    """How one kind of labelled dataset on a path is checked (``check(root)``: its layout,
    cheaply, decoding nothing) and loaded (``load(root, image_size, test_fraction,
    max_bytes)``); ``images``: it decodes images (worth DataLoader processes by default)."""

    check: Callable[[Path], object]
    load: Callable[[Path, int, float, int], LoadedData]
    images: bool


def _check_npz(root: Path) -> None:
    with _open_npz(root) as archive:
        _npz_keys(root, archive)


#: The labelled kinds read from a path, by the name a spec gives them (``KIND:PATH``).
PATH_READERS: dict[str, PathReader] = {
    "cifar10": PathReader(_cifar_dir, lambda root, size, frac, cap: _load_cifar10(root), True),
    "imagefolder": PathReader(
        _imagefolder_splits, lambda root, size, frac, cap: _load_imagefolder(root, size, frac), True
    ),
    "npz": PathReader(_check_npz, lambda root, size, frac, cap: _load_npz(root, frac, cap), False),
}
#: Every kind read from a path: the labelled ones and ``text`` (byte tokens, no labels).
DATASET_KINDS = (*PATH_READERS, "text")

# --------------------------------------------------------------------------------------------
# Spec parsing and the entry points

_SPEC_FORMS = ", ".join(
    [*GENERATED_KINDS, *(f"{kind}:PATH" for kind in PATH_READERS), "text:PATH|stdlib"]
)


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


def check_dataset(kind: str, path: str, max_bytes: int = MAX_DATASET_BYTES) -> None:
    """Cheap preflight: PATH exists and has the layout of KIND (and a text corpus's size is
    within ``max_bytes``). Decodes nothing."""
    if kind == "text":
        files = corpus_files(path)
        if not files:
            raise DatasetError(f"text:{path}: the corpus is empty (no files)")
        size = corpus_bytes(path, files)
        check_size(f"text:{path}: the corpus ({len(files)} file(s))", size, max_bytes)
        return
    root = _resolve(kind, path)
    PATH_READERS[kind].check(root)


def load_path_dataset(
    kind: str,
    path: str,
    image_size: int = 32,
    test_fraction: float = 0.1,
    max_bytes: int = MAX_DATASET_BYTES,
) -> LoadedData:
    """Read the dataset KIND at PATH. ``image_size`` applies to imagefolder only;
    ``test_fraction`` only where the data brings no test split of its own; ``max_bytes`` bounds
    the memory of npz arrays (checked from their headers first). Text is read by
    :func:`cloudburst.data.datasets.text.load_text` (it has no labels)."""
    if kind == "text":
        raise DatasetError(f"text:{path}: read text with cloudburst.data.load_dataset")
    root = _resolve(kind, path)
    if not 0.0 < test_fraction < 1.0:
        raise DatasetError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if not 1 <= image_size * image_size <= MAX_IMAGE_PIXELS:  # every image is decoded to it
        raise DatasetError(
            f"image_size must be in 1..{math.isqrt(MAX_IMAGE_PIXELS)} pixels, got {image_size}"
        )
    return PATH_READERS[kind].load(root, image_size, test_fraction, max_bytes)


def _resolve(kind: str, path: str) -> Path:
    if kind not in DATASET_KINDS:
        raise DatasetError(
            f"dataset kind {kind!r} is not read from a path; path kinds: {', '.join(DATASET_KINDS)}"
        )
    root = Path(os.path.expanduser(path))
    if not root.exists():
        raise DatasetError(f"{kind}:{path}: no such file or directory")
    return root
