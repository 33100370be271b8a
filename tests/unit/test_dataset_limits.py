"""Small files that declare huge memory (issue 44): every reader checks sizes from headers and
file sizes before it allocates, and refuses with one line naming the size and the limit. The
memory a refusal took is measured with tracemalloc (numpy reports its array allocations to it),
so "refused before allocating" is asserted in bytes, never in seconds."""

from __future__ import annotations

import codecs
import io
import pickle
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from cloudburst.data import in_memory, load_dataset
from cloudburst.data.datasets import MAX_DATASET_BYTES, DatasetError, check_dataset
from cloudburst.data.datasets.cifar import CIFAR10_MAX_FILE_BYTES
from tests.datagen import write_cifar10, write_imagefolder, write_npz

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


# ------------------------------------------------------------------------------------------ npz
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
    path = _npz_with_member(
        tmp_path / "lying.npz", {"x.npy": short, "y.npy": _npy_header((0,), "<i8")}
    )
    refused(
        lambda: load_dataset(f"npz:{path}"),
        "array 'x' declares shape [100, 4] float64",
        "damaged or crafted",
    )


# ----------------------------------------------------------------------------------------- CIFAR
class _Call:
    """Pickles as ``fn(*args)``: what a crafted batch file can ask the unpickler to do."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _refused_batch(tmp_path: Path, payload: bytes, *fragments: str) -> int:
    root = write_cifar10(tmp_path, per_batch=10, test=10)
    (root / "data_batch_2").write_bytes(payload)
    return refused(lambda: load_dataset(f"cifar10:{root}"), "data_batch_2", *fragments)


def test_cifar_batches_that_ask_numpy_for_a_million_images_are_refused(tmp_path):
    # 193 bytes that allocate a million images
    batch = {
        b"data": _Call(np.ndarray, (1_000_040, 3072), np.dtype("u1")),
        b"labels": _Call(np.ndarray, (1_000_040,), np.dtype("i8")),  # uninitialised memory
    }
    payload = pickle.dumps(batch, protocol=2)
    assert len(payload) < 300
    peak = _refused_batch(tmp_path / "a", payload, "refuses to call numpy.ndarray directly")
    assert peak < SMALL_PEAK_BYTES
    # an array must be filled from the file's own bytes
    from numpy._core.multiarray import _reconstruct

    big = _Call(_reconstruct, np.ndarray, (1_000_040, 3072), b"B")
    payload = pickle.dumps({b"data": big, b"labels": []}, protocol=2)
    peak = _refused_batch(tmp_path / "b", payload, "_reconstruct")
    assert peak < SMALL_PEAK_BYTES


def test_a_cifar_pickle_that_builds_or_declares_more_bytes_than_it_holds_is_refused(tmp_path):
    text = "\x00" * 2**20  # one MiB, memoised once, decoded a thousand times: 1 GiB
    payload = pickle.dumps([_Call(codecs.encode, text, "latin1") for _ in range(1000)], 2)
    assert len(payload) < 2 * 2**20
    peak = _refused_batch(tmp_path / "a", payload, "builds more than twice its")
    assert peak < 32 * 2**20
    payload = b"\x80\x04\x8e" + struct.pack("<Q", 2**34) + b"abc"  # BINBYTES8 of 16 GiB
    peak = _refused_batch(tmp_path / "b", payload, "not a readable batch pickle", "bytes8")
    assert peak < SMALL_PEAK_BYTES


def test_cifar_batches_keep_the_published_format(tmp_path):
    labels_as_array = {b"data": np.zeros((3, 3072), np.uint8), b"labels": np.zeros(3, int)}
    _refused_batch(tmp_path / "a", pickle.dumps(labels_as_array, 2), "list of ints")
    big = tmp_path / "b" / "cifar-10-batches-py"
    write_cifar10(tmp_path / "b", per_batch=10, test=10)
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
    data = load_dataset(f"imagefolder:{root}", image_size=8)
    n_test = len(data.test)
    assert in_memory(data.test).x.shape == (n_test, 3, 8, 8)
    refused(
        lambda: load_dataset(f"imagefolder:{root}", image_size=8, max_bytes=n_test * 192 - 1),
        "the test split decoded",
        f"{n_test} images of 3x8x8 uint8",
        "--test-size caps it",
    )
    capped = load_dataset(
        f"imagefolder:{root}", image_size=8, test_size=n_test - 1, max_bytes=n_test * 192 - 1
    )
    assert len(capped.test) == n_test - 1
    refused(lambda: load_dataset(f"imagefolder:{root}", image_size=9000), "image_size")


def test_the_limit_is_a_config_option_and_errors_are_one_config_line_before_launch(tmp_path):
    from cloudburst.cli.checks import preflight
    from cloudburst.config import ConfigError, RunConfig

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
