"""Readers for datasets on local paths (files generated in tmp_path). Files declaring huge
memory (issue 44) are refused in one line before allocating, measured in bytes (tracemalloc)."""

from __future__ import annotations

import codecs
import io
import math
import os
import pickle
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cloudburst.config import ConfigError, RunConfig
from cloudburst.data import in_memory, load_dataset
from cloudburst.data.datasets import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    MAX_DATASET_BYTES,
    DatasetError,
    ImageFileSource,
    Preprocess,
    TensorSource,
    channel_stats,
    check_dataset,
    load_path_dataset,
    parse_dataset_spec,
)
from cloudburst.data.datasets.cifar import CIFAR10_MAX_FILE_BYTES
from tests.datagen import write_imagefolder, write_npz

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)
SMALL_PEAK_BYTES = 8 * 2**20  # far below every declared size here, above a refusal's own needs


def refused(fn, *fragments: str) -> int:
    """fn() raises a one-line DatasetError containing every fragment; returns the peak bytes
    traced while it ran."""
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError) as info:
            fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return peak


# ----------------------------------------------------------------------------------------- CIFAR-10
class _Python2Pickler(pickle._Pickler):
    """Writes str and bytes as Python 2 ``str`` opcodes, as the published CIFAR-10 pickles do."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_as_py2_str(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = _save_as_py2_str
    dispatch[str] = _save_as_py2_str


def _dump(obj, path: Path, py2: bool = True) -> None:
    if not py2:  # a Python 3 pickle at protocol 2: bytes become _codecs.encode(..., "latin1")
        path.write_bytes(pickle.dumps(obj, protocol=2))
        return
    buf = io.BytesIO()
    _Python2Pickler(buf, protocol=2).dump(obj)
    # numpy 1 module names, as in the original files (GLOBAL is a text opcode at protocol 2)
    path.write_bytes(buf.getvalue().replace(b"cnumpy._core.", b"cnumpy.core."))


def _cifar_batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"fake batch",
        b"labels": [(seed + i) % 10 for i in range(n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
    }


def _write_cifar(parent: Path, py2: bool = True) -> Path:
    root = parent / "cifar-10-batches-py"
    root.mkdir(parents=True)
    for i in range(1, 6):
        _dump(_cifar_batch(20, seed=i), root / f"data_batch_{i}", py2)
    _dump(_cifar_batch(10, seed=0), root / "test_batch", py2)
    names = b"airplane automobile bird cat deer dog frog horse ship truck".split()
    meta = {b"label_names": names, b"num_cases_per_batch": 20, b"num_vis": 3072}
    _dump(meta, root / "batches.meta", py2)
    return root


@pytest.mark.parametrize("py2", [True, False], ids=["python2-pickles", "python3-protocol2"])
def test_cifar10_loads_with_layout_labels_and_classes(tmp_path, py2):
    root = _write_cifar(tmp_path, py2)
    data = load_path_dataset("cifar10", str(root))
    assert len(data.train) == 100 and len(data.test) == 10
    assert data.train.x.shape == (100, 3, 32, 32) and data.train.x.dtype == torch.uint8
    assert data.train.targets.dtype == torch.int64
    assert data.input_shape == (3, 32, 32) and data.is_image and data.num_classes == 10
    assert data.mean == CIFAR10_MEAN and data.std == CIFAR10_STD
    assert data.classes[0] == "airplane" and data.classes[9] == "truck"
    # pixel (row 5, col 7) of sample 3 in data_batch_2 (train index 20 + 3): R, G, B planes
    raw = _cifar_batch(20, seed=2)[b"data"][3]
    x = data.train.x[23]
    for c in range(3):
        assert x[c, 5, 7] == raw[c * 1024 + 5 * 32 + 7]
    assert data.train.targets[:20].tolist() == [(1 + i) % 10 for i in range(20)]
    assert data.test.targets.tolist() == [i % 10 for i in range(10)]
    xb, yb = data.train.get_batch(torch.tensor([23, 0]))
    assert torch.equal(xb[0], x) and yb.tolist() == [5, 1]
    # the parent directory holding cifar-10-batches-py/ works too
    via_parent = load_path_dataset("cifar10", str(tmp_path))
    assert torch.equal(via_parent.train.x, data.train.x)
    check_dataset("cifar10", str(tmp_path))


def test_cifar10_without_meta_names_classes_by_digit_and_missing_batches_are_listed(tmp_path):
    root = _write_cifar(tmp_path)
    (root / "batches.meta").unlink()
    assert load_path_dataset("cifar10", str(root)).classes == [str(i) for i in range(10)]
    (root / "data_batch_4").unlink()
    (root / "test_batch").unlink()
    refused(lambda: check_dataset("cifar10", str(root)), "data_batch_4", "test_batch")
    refused(lambda: load_path_dataset("cifar10", str(tmp_path)), "data_batch_4")
    refused(lambda: check_dataset("cifar10", str(tmp_path / "nope")), "no such file")
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"\x1f\x8b")
    refused(lambda: check_dataset("cifar10", str(tmp_path / "cifar-10-python.tar.gz")), "extracted")


@pytest.mark.parametrize(
    "broken, fragment",
    [
        ({b"data": np.zeros((20, 3000), np.uint8), b"labels": [0] * 20}, "3072"),
        ({b"data": np.zeros((20, 3072), np.float32), b"labels": [0] * 20}, "uint8"),
        ({b"data": np.zeros((20, 3072), np.uint8), b"labels": [0] * 19 + [10]}, "0..9"),
        ({b"data": np.zeros((20, 3072), np.uint8), b"labels": [0] * 19}, "19 labels"),
        ({b"labels": [0] * 20}, "'data'"),
        ({b"data": np.zeros((3, 3072), np.uint8), b"labels": np.zeros(3, int)}, "list of ints"),
        ([1, 2, 3], "list"),
        (None, "not a readable"),  # the real test batch, its pickle cut short
    ],
)
def test_cifar10_malformed_batch(tmp_path, broken, fragment):
    path = _write_cifar(tmp_path) / ("test_batch" if broken is None else "data_batch_2")
    if broken is None:
        path.write_bytes(path.read_bytes()[:500])
    else:
        _dump(broken, path)
    refused(lambda: load_path_dataset("cifar10", str(path.parent)), path.name, fragment)


class _Call:
    """Pickles as ``fn(*args)``: what a crafted batch file can ask the unpickler to do."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("py2", [True, False])
def test_cifar10_refuses_code_in_pickles(tmp_path, py2):
    root = _write_cifar(tmp_path / "data")
    marker = tmp_path / "PWNED"
    evil = _Call(os.system, f"touch {marker}")
    load = lambda: load_path_dataset("cifar10", str(root))  # noqa: E731
    _dump({b"data": evil, b"labels": [0]}, root / "data_batch_3", py2)
    refused(load, "data_batch_3", "refuses to unpickle global", "system")
    assert not marker.exists()
    _dump({b"label_names": evil}, root / "batches.meta", py2)
    _dump(_cifar_batch(20, seed=3), root / "data_batch_3", py2)
    refused(load, "batches.meta", "refuses")
    assert not marker.exists()


# ------------------------------------------------------------------------------------- Image folder
def _image(path: Path, size: tuple[int, int], colour=(10, 7, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def _stripes(path: Path, size: tuple[int, int], bands: list[tuple[int, tuple]], axis: int) -> None:
    """Bands of colour along x (axis=1) or y (axis=0): [(band length in pixels, colour)]."""
    w, h = size
    a = np.zeros((h, w, 3), np.uint8)
    along = a if axis == 0 else a.swapaxes(0, 1)  # a view: rows, or columns
    start = 0
    for length, colour in bands:
        along[start : start + length] = colour
        start += length
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(a).save(path)


def test_imagefolder_resizes_shorter_side_then_center_crops(tmp_path):
    # 80×40, S=20: resized to 40×20, crop columns 10..29, i.e. source columns 20..59 (green)
    _stripes(tmp_path / "a" / "wide.png", (80, 40), [(20, RED), (40, GREEN), (20, BLUE)], axis=1)
    # 20×50, S=10: resized to 10×25, crop rows 7..16, i.e. source rows 14..33 (green)
    _stripes(tmp_path / "b" / "tall.png", (20, 50), [(14, RED), (20, GREEN), (16, BLUE)], axis=0)
    src = ImageFileSource([str(tmp_path / "a" / "wide.png")], [0], 20)
    x, y = src.get_batch(torch.tensor([0]))
    assert x.shape == (1, 3, 20, 20) and x.dtype == torch.uint8 and y.tolist() == [0]
    img = x[0].permute(1, 2, 0).int()  # H, W, C
    green = torch.tensor(GREEN)
    assert (img[:, 1:-1] - green).abs().max() <= 1  # interior: only the green band
    assert img[:, 0, 0].min() > 0 and img[:, 0, 2].max() == 0  # left edge blends with red
    assert img[:, -1, 2].min() > 0 and img[:, -1, 0].max() == 0  # right edge blends with blue
    tall = ImageFileSource([str(tmp_path / "b" / "tall.png")], [1], 10).get_batch(torch.tensor([0]))
    img = tall[0][0].permute(1, 2, 0).int()
    assert img.shape == (10, 10, 3)
    assert (img[1:-1] - green).abs().max() <= 1
    assert img[0, :, 0].min() > 0 and img[-1, :, 2].min() > 0


def _folder(root: Path, counts: dict[str, int]) -> None:
    for c, n in counts.items():
        for i in range(n):
            size = (40, 30) if i % 2 else (20, 50)
            _image(root / c / f"img{i:02d}.png", size, (40 * i % 256, 7, 200))


def test_imagefolder_held_out_split_is_stratified_and_deterministic(tmp_path):
    _folder(tmp_path, {"cat": 10, "dog": 5, "emu": 1})
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    _image(tmp_path / "cat" / "more" / "deep.JPG", (9, 9))  # nested, upper-case extension
    _image(tmp_path / ".hidden" / "x.png", (9, 9))  # hidden directories are not classes
    data = load_path_dataset("imagefolder", str(tmp_path), image_size=12, test_fraction=0.2)
    assert data.classes == ["cat", "dog", "emu"] and data.num_classes == 3
    assert data.input_shape == (3, 12, 12) and data.is_image
    assert isinstance(data.train, ImageFileSource) and isinstance(data.test, ImageFileSource)
    assert torch.bincount(data.train.targets).tolist() == [9, 4, 1]  # cat has 11 files
    assert torch.bincount(data.test.targets).tolist() == [2, 1]  # the single emu stays in train
    assert not set(data.train.paths) & set(data.test.paths)
    assert len(set(data.train.paths) | set(data.test.paths)) == 17
    again = load_path_dataset("imagefolder", str(tmp_path), image_size=12, test_fraction=0.2)
    assert again.train.paths == data.train.paths and again.test.paths == data.test.paths
    assert again.mean == data.mean and again.std == data.std
    x, y = data.test.get_batch(torch.arange(len(data.test)))
    assert x.shape == (3, 3, 12, 12) and y.tolist() == [0, 0, 1]
    # By hand: each image is one solid colour (40·i mod 256, 7, 200), so a channel's mean and
    # population std are those of its values over the training images: cat 0,1,3-7,9 and
    # more/deep.JPG ((10, 7, 30) as PIL decodes the JPEG), dog 0,1,3,4 and emu 0.
    with Image.open(tmp_path / "cat" / "more" / "deep.JPG") as deep:
        deep_r, deep_g, deep_b = deep.convert("RGB").getpixel((4, 4))
    assert deep_g == 7
    red = [40 * i % 256 for i in (0, 1, 3, 4, 5, 6, 7, 9)] + [deep_r]
    red += [40 * i % 256 for i in (0, 1, 3, 4)] + [0]
    assert red[:8] == [0, 40, 120, 160, 200, 240, 24, 104]
    blue = [200] * 8 + [deep_b] + [200] * 5
    for c, values in ((0, red), (2, blue)):
        scaled = np.array(values, dtype=np.float64) / 255
        assert data.mean[c] == pytest.approx(scaled.mean(), abs=1e-9)
        assert data.std[c] == pytest.approx(scaled.std(), abs=1e-9)
    assert data.mean[1] == pytest.approx(7 / 255, abs=1e-9)
    assert data.std[1] == pytest.approx(1e-3)  # green is constant: floored
    # picklable for DataLoader workers
    clone, ids = pickle.loads(pickle.dumps(data.train)), torch.tensor([0, 5])
    assert torch.equal(clone.get_batch(ids)[0], data.train.get_batch(ids)[0])


def test_imagefolder_train_test_dirs_and_corrupt_image(tmp_path):
    _folder(tmp_path / "train", {"a": 3, "b": 2})
    _folder(tmp_path / "val", {"a": 1, "b": 1})
    (tmp_path / "val" / "b" / "bad.png").write_bytes(b"this is not a png")
    check_dataset("imagefolder", str(tmp_path))
    data = load_path_dataset("imagefolder", str(tmp_path), image_size=8)
    assert len(data.train) == 5 and len(data.test) == 3
    assert data.test.targets.tolist() == [0, 1, 1]
    bad = data.test.paths.index(str(tmp_path / "val" / "b" / "bad.png"))
    data.test.get_batch(torch.tensor([0, 1 if bad == 2 else 2]))
    refused(lambda: data.test.get_batch(torch.tensor([bad])), "bad.png", "cannot read image")
    # a truncated PNG in the training split is found while computing the mean/std
    good = tmp_path / "train" / "a" / "img00.png"
    good.write_bytes(good.read_bytes()[:60])
    refused(lambda: load_path_dataset("imagefolder", str(tmp_path)), "img00.png")


def test_imagefolder_layout_errors(tmp_path):
    (empty := tmp_path / "empty").mkdir()
    refused(lambda: check_dataset("imagefolder", str(empty)), "no class subdirectories")
    refused(lambda: load_path_dataset("imagefolder", str(empty)), "no class subdirectories")
    _folder(tmp_path / "one", {"a": 2})
    (tmp_path / "one" / "b").mkdir()
    refused(lambda: check_dataset("imagefolder", str(tmp_path / "one")), "no images", "b")
    _folder(tmp_path / "split" / "train", {"a": 2, "b": 2})
    _folder(tmp_path / "split" / "test", {"a": 1, "c": 1})
    refused(lambda: check_dataset("imagefolder", str(tmp_path / "split")), "same classes", "'c'")
    _folder(tmp_path / "single", {"a": 1, "b": 1})
    refused(lambda: load_path_dataset("imagefolder", str(tmp_path / "single")), "too few")
    _folder(tmp_path / "only_train" / "train", {"a": 2})
    refused(lambda: check_dataset("imagefolder", str(tmp_path / "only_train")), "no test/")
    refused(lambda: check_dataset("imagefolder", str(tmp_path / "missing")), "no such")


# --------------------------------------------------------------------------------------------- .npz
def _images(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


def test_npz_nhwc_nchw_and_grayscale_images(tmp_path):
    nhwc = _images(12, (6, 5, 3))
    y = np.arange(12, dtype=np.uint8) % 4
    np.savez(tmp_path / "nhwc.npz", x_train=nhwc, y_train=y, x_test=nhwc[:4], y_test=y[:4] + 2)
    data = load_path_dataset("npz", str(tmp_path / "nhwc.npz"))
    assert data.is_image and data.input_shape == (3, 6, 5) and data.num_classes == 6
    assert data.train.x.dtype == torch.uint8
    assert torch.equal(data.train.x, torch.from_numpy(nhwc).permute(0, 3, 1, 2))
    assert data.train.targets.dtype == torch.int64
    scaled = nhwc.astype(np.float64) / 255
    assert np.allclose(data.mean, scaled.mean(axis=(0, 1, 2)))
    assert np.allclose(data.std, scaled.std(axis=(0, 1, 2)))

    nchw = np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2))
    np.savez(tmp_path / "nchw.npz", x_train=nchw, y_train=y, x_test=nchw[:4], y_test=y[:4])
    same = load_path_dataset("npz", str(tmp_path / "nchw.npz"))
    assert torch.equal(same.train.x, data.train.x) and same.mean == data.mean

    gray = _images(12, (6, 5))
    np.savez(tmp_path / "gray.npz", x=gray, y=y.astype(np.int16), x_test=gray[:2], y_test=y[:2])
    g = load_path_dataset("npz", str(tmp_path / "gray.npz"))
    assert g.train.x.shape == (12, 1, 6, 5) and g.input_shape == (1, 6, 5) and len(g.mean) == 1


def test_npz_float_features_and_held_out_split(tmp_path):
    x = np.random.default_rng(1).normal(size=(20, 7))
    x[:, 0] = np.arange(20)  # a sample id
    y = np.arange(20) % 3
    np.savez(tmp_path / "f.npz", x=x, y=y)
    data = load_path_dataset("npz", str(tmp_path / "f.npz"), test_fraction=0.25)
    assert not data.is_image and data.mean is None and data.std is None
    assert data.input_shape == (7,) and data.train.x.dtype == torch.float32
    assert len(data.train) == 15 and len(data.test) == 5 and data.num_classes == 3
    train_ids, test_ids = data.train.x[:, 0].tolist(), data.test.x[:, 0].tolist()
    assert sorted(train_ids + test_ids) == list(range(20))
    assert train_ids == sorted(train_ids)  # file order kept within a split
    assert data.test.targets.tolist() == [int(i) % 3 for i in test_ids]
    again = load_path_dataset("npz", str(tmp_path / "f.npz"), test_fraction=0.25)
    assert torch.equal(again.test.x, data.test.x) and torch.equal(again.train.y, data.train.y)
    check_dataset("npz", str(tmp_path / "f.npz"))
    # float images stay features: the model sees them as they are
    np.savez(
        tmp_path / "f4.npz", x_train=np.zeros((4, 3, 2, 2), np.float32), y_train=np.zeros(4, int)
    )
    assert load_path_dataset("npz", str(tmp_path / "f4.npz")).input_shape == (3, 2, 2)


@pytest.mark.parametrize(
    "arrays, fragment",
    [
        ({"x": np.array([object()] * 3, dtype=object), "y": np.zeros(3, int)}, "cannot read"),
        ({"x": np.zeros((5, 2)), "y": np.zeros(4, int)}, "4 labels for 5"),
        ({"x": np.array([[0.0, np.nan], [1, 2]]), "y": np.zeros(2, int)}, "NaN"),
        ({"x": np.array([[1e39, 0.0], [1, 2]]), "y": np.zeros(2, int)}, "infinite"),
        ({"x": np.zeros(5), "y": np.zeros(5, int)}, "feature axis"),
        ({"x": np.zeros((5, 2)), "y": np.zeros(5)}, "integer"),
        ({"x": np.zeros((5, 2)), "y": -np.ones(5, int)}, "negative"),
        ({"x": np.zeros((5, 2)), "labels": np.zeros(5, int)}, "expected arrays"),
        ({"x": np.zeros((5, 2)), "y": np.zeros(5, int), "x_test": np.zeros((1, 2))}, "no y_test"),
        ({"x": np.zeros((5, 4, 4, 5), np.uint8), "y": np.zeros(5, int)}, "neither NCHW"),
        ({"x": np.zeros((5, 2), complex), "y": np.zeros(5, int)}, "need numbers"),
        ({"x": np.zeros((5, 2)), "y": np.zeros(5, int), "x_test": np.zeros((1, 3)),
          "y_test": np.zeros(1, int)}, "x_test samples"),
    ],
)  # fmt: skip
def test_npz_malformed(tmp_path, arrays, fragment):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    refused(lambda: load_path_dataset("npz", str(path)), "bad.npz", fragment)


def test_npz_not_an_archive(tmp_path):
    text = tmp_path / "text.npz"
    text.write_text("hello\n" * 10)
    refused(lambda: check_dataset("npz", str(text)), "text.npz", "not a readable .npz")
    refused(lambda: load_path_dataset("npz", str(text)), "not a readable .npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    refused(lambda: load_path_dataset("npz", str(tmp_path / "single.npy")), "single array")
    broken = tmp_path / "broken.npz"
    np.savez(broken, x=np.zeros((5, 2)), y=np.zeros(5, int))
    broken.write_bytes(broken.read_bytes()[:-30])  # the zip directory is cut off
    refused(lambda: load_path_dataset("npz", str(broken)), "broken.npz", "not a readable")
    refused(lambda: check_dataset("npz", str(tmp_path)), "not a file")


# ------------------------------------------------------------------------------ Specs and preflight
@pytest.mark.parametrize(
    "spec, expected",
    [
        ("mnist1d", ("mnist1d", None)),
        ("synthetic", ("synthetic", None)),
        ("cifar10:/a/b", ("cifar10", "/a/b")),
        ("imagefolder:rel/dir", ("imagefolder", "rel/dir")),
        ("npz:/d/with:colon.npz", ("npz", "/d/with:colon.npz")),
        ("cifar10", "needs a path"),
        ("npz:", "needs a path"),
        ("mnist1d:/x", "takes no path"),
        ("synthetic:", "takes no path"),
        ("imagenet:/x", "unknown kind"),
        ("/some/path", "unknown kind"),
    ],
)
def test_parse_dataset_spec(spec, expected):
    """A spec parses to (kind, path), or fails with one line that lists the valid forms."""
    if isinstance(expected, tuple):
        assert parse_dataset_spec(spec) == expected
    else:
        refused(lambda: parse_dataset_spec(spec), expected, "cifar10:PATH", "mnist1d")


def test_bad_arguments_are_refused(tmp_path):
    refused(lambda: check_dataset("mnist1d", str(tmp_path)), "not read from a path")
    _folder(tmp_path / "f", {"a": 2})
    refused(
        lambda: load_path_dataset("imagefolder", str(tmp_path / "f"), test_fraction=1.0),
        "test_fraction",
    )
    src = TensorSource(torch.zeros(4, 2), torch.arange(4))
    assert len(src) == 4 and torch.equal(src.get_batch(torch.tensor([3]))[1], torch.tensor([3]))
    refused(lambda: TensorSource(torch.zeros(4, 2), torch.arange(3)), "3 labels")
    refused(lambda: TensorSource(torch.zeros(4, 2), torch.zeros(4)), "int64")
    with pytest.raises(ValueError, match="uint8"):
        channel_stats(torch.zeros(2, 1, 2, 2))
    with pytest.raises(ValueError, match="uint8"):
        Preprocess((0.5,), (0.5,), augment=False)(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="std"):
        Preprocess((0.5,), (0.0,), augment=False)


def test_channel_stats_by_hand():
    # one channel, two pixels per image: values 0, 1 | 1, 1 → mean 3/4, std sqrt(3/4 − 9/16)
    x = torch.tensor([[[[0, 255]]], [[[255, 255]]]], dtype=torch.uint8)
    assert channel_stats(x) == (pytest.approx((0.75,)), pytest.approx((math.sqrt(3 / 16),)))
    # more images than one chunk of 1024: 1100 black, 400 white in channel 0; channel 1 grey
    many = torch.zeros(1500, 2, 1, 1, dtype=torch.uint8)
    many[1100:, 0] = 255
    many[:, 1] = 51
    mean, std = channel_stats(many)
    p = 400 / 1500
    assert mean == pytest.approx((p, 0.2)) and std == pytest.approx((math.sqrt(p * (1 - p)), 1e-3))


# --------------------------------------------------------------------------------------- Preprocess
def normalise(x: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 [.., C, H, W] → (x / 255 − mean_c) / std_c, channel by channel."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for c in range(x.shape[-3]):
        out[..., c, :, :] = (x[..., c, :, :].float() / 255 - mean[c]) / std[c]
    return out


def test_preprocess_normalises_exactly_without_augmentation():
    x = torch.from_numpy(_images(5, (3, 4, 6)))
    mean, std = (0.1, 0.5, 0.9), (0.2, 0.3, 0.4)
    out = Preprocess(mean, std, augment=False)(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    # pixel 255 of channel 2: (1 − 0.9) / 0.4 = 0.25; pixel 0 of channel 0: −0.1 / 0.2 = −0.5
    ones = Preprocess(mean, std, augment=False)(torch.full((1, 3, 1, 1), 255, dtype=torch.uint8))
    zeros = Preprocess(mean, std, augment=False)(torch.zeros((1, 3, 1, 1), dtype=torch.uint8))
    assert ones.flatten().tolist() == pytest.approx([4.5, 5 / 3, 0.25])
    assert zeros.flatten().tolist() == pytest.approx([-0.5, -5 / 3, -2.25])
    assert torch.allclose(out, normalise(x, mean, std), atol=1e-6)
    features = torch.randn(3, 7, dtype=torch.float64)
    passed = Preprocess(mean, std, augment=True)(features, torch.Generator().manual_seed(0))
    assert passed.dtype == torch.float32 and torch.equal(passed, features.float())


def _crops(out: torch.Tensor, x: torch.Tensor, pad: int, mean, std, **close):
    """Per sample of ``out``: how many (top, left, flip) crops of ``x`` zero-padded by ``pad``,
    normalised by hand, it is ``close`` to, and the top and flip of the last (brute force)."""
    h, w = x.shape[-2:]
    padded = normalise(torch.nn.functional.pad(x, (pad, pad, pad, pad)), mean, std)
    matches = torch.zeros(len(x), dtype=torch.int64)
    tops, flips = torch.full((len(x),), -1), torch.full((len(x),), -1)
    for top in range(2 * pad + 1):
        for left in range(2 * pad + 1):
            crop = padded[:, :, top : top + h, left : left + w]
            for flip in (0, 1):
                candidate = crop.flip(-1) if flip else crop
                hit = torch.isclose(out, candidate, **close).flatten(1).all(1)
                matches += hit
                tops[hit], flips[hit] = top, flip
    return matches, tops, flips


def test_preprocess_augmentation_is_seeded_and_each_sample_is_a_padded_crop():
    x = torch.from_numpy(_images(16, (3, 8, 8), seed=4))
    mean, std = (0.5, 0.4, 0.3), (0.25, 0.2, 0.1)
    pre = Preprocess(mean, std, augment=True, pad=4)
    a, b, c = (pre(x, torch.Generator().manual_seed(seed)) for seed in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == x.shape and a.dtype == torch.float32
    one = torch.ones(16, dtype=torch.int64)  # random pixels: exactly one crop fits
    assert torch.equal(_crops(a, x, 4, mean, std, atol=1e-5)[0], one)
    assert pickle.loads(pickle.dumps(pre)).mean == pre.mean
    # no padding: every sample is the image itself or its mirror image
    zero_pad = Preprocess(mean, std, augment=True, pad=0)(x, torch.Generator().manual_seed(1))
    matches, _, flips = _crops(zero_pad, x, 0, mean, std, atol=1e-5)
    assert torch.equal(matches, one) and 0 < int(flips.sum()) < 16


def test_preprocess_flips_half_the_samples_and_draws_offsets_uniformly():
    # 2000 tiny images, pad 1: each sample is one of 3 × 3 offsets × 2 flips. Pixels are
    # 1..255, so the zero padding in a crop gives its offset away.
    n, pad = 2000, 1
    x = torch.from_numpy(np.random.default_rng(3).integers(1, 256, (n, 1, 3, 3), dtype=np.uint8))
    out = Preprocess((0.0,), (1.0,), augment=True, pad=pad)(x, torch.Generator().manual_seed(5))
    matches, tops, flips = _crops(out, x, pad, (0.0,), (1.0,), rtol=0, atol=1e-6)
    assert torch.equal(matches, torch.ones(n, dtype=torch.int64))  # one crop each
    # p(flip) = 1/2: 1000 ± 100 (4.5 standard deviations); each top offset 2000/3 ± 100
    assert 900 <= int(flips.sum()) <= 1100
    assert all(567 <= int((tops == t).sum()) <= 767 for t in range(3))


# ------------------------------------------------------------------- Declared sizes (issue 44): npz
def _npz_with_member(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _npy_header(shape: tuple[int, ...], dtype: str) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


def _bomb(tmp_path: Path) -> Path:
    """The attack's shape: [2e6, 1000] uint8 declared, 2 GB of zeros deflated to almost nothing."""
    x, y = _npy_header((2_000_000, 1000), "|u1"), _npy_header((2,), "<i8")
    return _npz_with_member(tmp_path / "bomb.npz", {"x.npy": x, "y.npy": y})


def test_a_deflated_npz_bomb_is_refused_from_its_header_without_allocating(tmp_path):
    bomb = _bomb(tmp_path)
    assert bomb.stat().st_size < 1000
    peak = refused(
        lambda: load_dataset(f"npz:{bomb}"),
        "npz:",
        "array 'x' would take 7.45 GiB (shape [2000000, 1000] uint8 as float32)",
        "over the 2.00 GiB limit for a dataset",
    )
    assert peak < SMALL_PEAK_BYTES


def test_npz_arrays_count_together_against_the_limit_and_as_loaded(tmp_path):
    # a real compressed bomb: 1 MiB of zeros in a few KiB; a limit just above, just below
    path = tmp_path / "zeros.npz"
    np.savez_compressed(path, x=np.zeros((1024, 1, 32, 32), np.uint8), y=np.zeros(1024, int))
    assert path.stat().st_size < 64 * 1024
    ok = load_dataset(f"npz:{path}", max_bytes=2**20 + 1024 * 8)
    assert ok.x_train.shape[1:] == (1, 32, 32)
    refused(lambda: load_dataset(f"npz:{path}", max_bytes=2**20), "array 'y'", "1.00 MiB limit")
    # uint8 features (not an image layout) become float32: four bytes each
    np.savez(path, x=np.zeros((1024, 300), np.uint8), y=np.zeros(1024, int))
    refused(
        lambda: load_dataset(f"npz:{path}", max_bytes=2**20),
        "array 'x' would take 1.17 MiB (shape [1024, 300] uint8 as float32)",
    )


def test_an_npz_member_whose_zip_size_disagrees_with_its_header_is_refused(tmp_path):
    short = _npy_header((100, 4), "<f8") + np.zeros((10, 4)).tobytes()  # 10 rows of 100
    members = {"x.npy": short, "y.npy": _npy_header((0,), "<i8")}
    path = _npz_with_member(tmp_path / "lying.npz", members)
    refused(
        lambda: load_dataset(f"npz:{path}"),
        "array 'x' declares shape [100, 4] float64",
        "damaged or crafted",
    )


# ----------------------------------------------------------------------------------------- CIFAR
def _refused_batch(tmp_path, payload: bytes, *fragments: str, peak=SMALL_PEAK_BYTES) -> None:
    """CIFAR-10 whose data_batch_2 holds ``payload`` is refused within ``peak`` bytes."""
    root = _write_cifar(tmp_path)
    (root / "data_batch_2").write_bytes(payload)
    assert refused(lambda: load_dataset(f"cifar10:{root}"), "data_batch_2", *fragments) < peak


def test_cifar_batches_that_ask_numpy_for_a_million_images_are_refused(tmp_path):
    # 193 bytes that allocate a million images
    batch = {
        b"data": _Call(np.ndarray, (1_000_040, 3072), np.dtype("u1")),
        b"labels": _Call(np.ndarray, (1_000_040,), np.dtype("i8")),  # uninitialised memory
    }
    payload = pickle.dumps(batch, protocol=2)
    assert len(payload) < 300
    _refused_batch(tmp_path / "a", payload, "refuses to call numpy.ndarray directly")
    # an array must be filled from the file's own bytes
    from numpy._core.multiarray import _reconstruct

    big = _Call(_reconstruct, np.ndarray, (1_000_040, 3072), b"B")
    _refused_batch(tmp_path / "b", pickle.dumps({b"data": big, b"labels": []}, 2), "_reconstruct")


def test_a_cifar_pickle_that_builds_or_declares_more_bytes_than_it_holds_is_refused(tmp_path):
    text = "\x00" * 2**20  # one MiB, memoised once, decoded a thousand times: 1 GiB
    payload = pickle.dumps([_Call(codecs.encode, text, "latin1") for _ in range(1000)], 2)
    assert len(payload) < 2 * 2**20
    _refused_batch(tmp_path / "a", payload, "builds more than twice its", peak=32 * 2**20)
    payload = b"\x80\x04\x8e" + struct.pack("<Q", 2**34) + b"abc"  # BINBYTES8 of 16 GiB
    _refused_batch(tmp_path / "b", payload, "not a readable batch pickle", "bytes8")


def test_a_cifar_batch_file_over_its_size_limit_is_refused_from_stat(tmp_path):
    big = _write_cifar(tmp_path)
    with open(big / "data_batch_5", "r+b") as f:  # sparse: no 65 MiB written
        f.truncate(CIFAR10_MAX_FILE_BYTES + 2**20)
    peak = refused(
        lambda: load_dataset(f"cifar10:{big}"),
        "data_batch_5",
        "a file of 65.0 MiB is over the 64.0 MiB limit for a CIFAR-10 batch file",
    )
    assert peak < SMALL_PEAK_BYTES


# ------------------------------------------------------------------------------------------ text
def test_a_sparse_text_file_over_the_limit_is_refused_from_stat_without_reading(tmp_path):
    path = tmp_path / "huge.txt"
    with open(path, "wb") as f:
        f.truncate(MAX_DATASET_BYTES + 1)  # sparse: takes no disk
    # a read would allocate at least one chunk of 16 MiB; the refusal takes far less
    peak = refused(
        lambda: load_dataset(f"text:{path}", context=8),
        f"text:{path}: the corpus (1 file(s)) would take 2.00 GiB",
        "over the 2.00 GiB limit for a dataset",
    )
    assert peak < SMALL_PEAK_BYTES
    refused(lambda: check_dataset("text", str(path)), "2.00 GiB limit")
    (tmp_path / "small.txt").write_bytes(b"abc " * 1000)
    refused(lambda: load_dataset(f"text:{tmp_path / 'small.txt'}", max_bytes=3999), "3999 bytes")


# ----------------------------------------------------------------------------------- imagefolder
def test_an_image_folders_decoded_test_split_is_bounded(tmp_path):
    root = write_imagefolder(tmp_path / "imgs", per_class=10, classes=2)
    load = lambda **kw: load_dataset(f"imagefolder:{root}", **{"image_size": 8, **kw})  # noqa: E731
    data = load()
    n_test = len(data.test)
    assert in_memory(data.test).x.shape == (n_test, 3, 8, 8)
    below = n_test * 192 - 1  # bytes: one short of the decoded test split
    refused(
        lambda: load(max_bytes=below),
        "the test split decoded",
        f"{n_test} images of 3x8x8 uint8",
        "--test-size caps it",
    )
    assert len(load(test_size=n_test - 1, max_bytes=below).test) == n_test - 1
    refused(lambda: load(image_size=9000), "image_size")


def test_the_limit_is_a_config_option_and_errors_are_one_config_line_before_launch(tmp_path):
    from cloudburst.cli.checks import preflight

    assert RunConfig().data.max_dataset_bytes == MAX_DATASET_BYTES
    bomb = _bomb(tmp_path)
    cfg = RunConfig(dataset=f"npz:{bomb}", model="mlp", workers=2, out=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match=r"^dataset: npz:.*bomb\.npz: array 'x' would take"):
        preflight(cfg)
    # a file that fits the default is refused under a smaller --max-dataset-gib, and the
    # ranks read it with the same limit (train.py and the simulator pass it as preflight does)
    ok = write_npz(tmp_path / "ok.npz")  # 250 images of 3 KiB and their labels: ~0.75 MiB
    preflight(RunConfig(dataset=f"npz:{ok}", model="mlp", workers=2, out=str(tmp_path / "o")))
    small = RunConfig(
        dataset=f"npz:{ok}", model="mlp", workers=2, out=str(tmp_path / "o"), max_dataset_gib=1e-4
    )
    with pytest.raises(ConfigError, match=r"^dataset: npz:.*over the 107374 bytes limit"):
        preflight(small)
    with pytest.raises(ConfigError, match="max_dataset_gib"):
        RunConfig(max_dataset_gib=0.0)
