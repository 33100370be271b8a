"""``text:PATH``: byte-level language-model data from local text (docs/lm.md).

A UTF-8 file, or every regular file under a directory (recursively, in sorted order of their
relative paths, hidden ones skipped), concatenated. ``text:stdlib`` is the running
interpreter's standard library: its ``.py`` files, without ``site-packages``, ``test``/``tests``
and ``idle_test`` (about 13 MB on CPython 3.11), a corpus every machine with Python has.
Bytes that are not UTF-8 are decoded with replacement (U+FFFD) and counted
(``TokenStream.replaced``); the tokens are the bytes of the decoded text (vocabulary 256), so
one token is one byte and bits per byte = nats per token / ln 2.

The last ``TEXT_TEST_FRACTION`` of the tokens (at least enough for the test windows) is held
out, contiguous; the test set is ``test_size`` windows spread evenly over that tail (starts in
exact integer arithmetic). Training windows are drawn at random positions of a worker's shard
per batch (``cloudburst.data``).

Memory: the corpus's size is taken from ``stat`` and refused over ``max_bytes``
(``MAX_DATASET_BYTES``) before a byte is read; it is then checked as UTF-8 in chunks and
memory-mapped read-only, so the ranks of a machine share one copy in the page cache. A single
valid file is mapped in place (its validity remembered in the cache); a directory, or a file
with invalid UTF-8, is first written once (decoded with replacement) to
``$CLOUDBURST_CACHE/text-KEY-REPLACED.u8`` (KEY from the paths, sizes and modification times)
and that file is mapped. A corpus must not be truncated while a run reads it (reading a mapped
page past the new end faults).
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import logging
import os
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from cloudburst.data.datasets.base import (
    MAX_DATASET_BYTES,
    DatasetError,
    _describe,
    cache_dir,
    check_size,
)

log = logging.getLogger(__name__)

STDLIB = "stdlib"
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
TEXT_TEST_FRACTION = 0.05
TEXT_TEST_WINDOWS = 64  # test windows when --test-size is not given
DEFAULT_CONTEXT = 64
VOCAB = 256
_CHUNK_BYTES = 16 * 2**20  # read and decoded this much at a time
_CACHE_FORMAT = "text-v1"  # part of a cached corpus's key: bump when the layout changes


class TokenStream:
    """A contiguous run of byte tokens (uint8 [n]) read as windows of ``context`` tokens.

    Its length counts the disjoint windows it holds, so an epoch is one pass over its tokens.
    ``get_batch(starts)`` → (x, y), int64 [B, context]: the window at each start and the same
    shifted by one token (the next-token targets). ``mapped_from`` is the file the tokens are
    a read-only memory map of (None when they are in memory).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        context: int,
        replaced: int = 0,
        mapped_from: Path | None = None,
    ):
        if tokens.dtype != torch.uint8 or tokens.dim() != 1:
            raise DatasetError(f"tokens must be a uint8 vector, got {tokens.dtype} {tokens.shape}")
        if context < 1 or tokens.numel() < context + 1:
            raise DatasetError(
                f"{tokens.numel()} tokens are too few for one window of context {context}"
            )
        self.tokens, self.context, self.replaced = tokens, int(context), int(replaced)
        self.mapped_from = mapped_from

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.context

    @property
    def max_start(self) -> int:
        """The last start of a window whose targets are inside the tokens."""
        return self.tokens.numel() - self.context - 1

    def get_batch(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = torch.as_tensor(starts, dtype=torch.int64).reshape(-1, 1)
        rows = offsets + torch.arange(self.context + 1)
        window = self.tokens[rows].to(torch.int64)
        return window[:, :-1], window[:, 1:]

    def shard(self, worker: int, num_workers: int) -> TokenStream:
        """Worker ``worker``'s contiguous, disjoint slice of the tokens (equal sizes)."""
        per = self.tokens.numel() // num_workers
        if per < self.context + 1:
            raise DatasetError(
                f"{self.tokens.numel()} training tokens cannot be split over {num_workers} workers "
                f"with windows of {self.context} tokens"
            )
        shard = self.tokens[worker * per : (worker + 1) * per]  # a view: nothing is copied
        return TokenStream(shard, self.context, mapped_from=self.mapped_from)


class TokenWindows:
    """Fixed windows held in memory (the test set): int64 ``x``, ``y`` [N, context]."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def targets(self) -> torch.Tensor:
        return self.y

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(spec_path: str) -> list[Path]:
    """The files of ``text:PATH`` in the order they are concatenated."""
    if spec_path == STDLIB:
        root = stdlib_dir()
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS)
            found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
        return sorted(found, key=lambda p: p.relative_to(root).as_posix())
    root = Path(os.path.expanduser(spec_path))
    if not root.exists():
        raise DatasetError(f"text:{spec_path}: no such file or directory")
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DatasetError(f"text:{spec_path}: neither a file nor a directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [
            Path(dirpath) / f
            for f in filenames
            if not f.startswith(".") and (Path(dirpath) / f).is_file()
        ]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def corpus_bytes(spec_path: str, files: list[Path] | None = None) -> int:
    """The corpus's size in bytes, from ``stat`` alone."""
    total = 0
    for f in corpus_files(spec_path) if files is None else files:
        try:
            total += f.stat().st_size
        except OSError as e:
            raise DatasetError(f"text:{spec_path}: cannot read {f} ({_describe(e)})") from e
    return total


class _Utf8Counter:
    """Decodes a byte stream fed in chunks as one UTF-8 text, with replacement, and counts the
    invalid sequences replaced (U+FFFD in the text, less those spelled in the bytes)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._in_text = self._in_bytes = 0
        self._tail = b""  # the last 2 bytes: a spelled U+FFFD may straddle two chunks

    def feed(self, raw: bytes, final: bool = False) -> str:
        text = self._decoder.decode(raw, final)
        self._in_text += text.count("\ufffd")
        joined = self._tail + raw
        self._in_bytes += joined.count("\ufffd".encode())
        self._tail = joined[-2:]
        return text

    @property
    def replaced(self) -> int:
        return self._in_text - self._in_bytes


def _chunks(spec_path: str, files: list[Path]) -> Iterator[bytes]:
    for f in files:
        try:
            with open(f, "rb") as src:
                while chunk := src.read(_CHUNK_BYTES):
                    yield chunk
        except OSError as e:
            raise DatasetError(f"text:{spec_path}: cannot read {f} ({_describe(e)})") from e


def _count_replaced(spec_path: str, files: list[Path]) -> int:
    counter = _Utf8Counter()
    for chunk in _chunks(spec_path, files):
        counter.feed(chunk)
    counter.feed(b"", final=True)
    return counter.replaced


def _is_valid_utf8(spec_path: str, files: list[Path]) -> bool:
    """Whether the corpus is valid UTF-8: read through once, then remembered in the cache by
    an empty ``text-KEY.valid`` file, so the other ranks of the machine need not read it."""
    marker = cache_dir() / f"text-{_cache_key(files)}.valid"
    if marker.is_file():
        return True
    if _count_replaced(spec_path, files):
        return False
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # only a saving: the next rank reads the file through again
    return True


def _cache_key(files: list[Path]) -> str:
    h = hashlib.sha256(_CACHE_FORMAT.encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:24]


def _decoded(
    spec_path: str, files: list[Path], max_bytes: int, counter: _Utf8Counter
) -> Iterator[bytes]:
    """The corpus decoded with replacement, re-encoded, chunk by chunk, within ``max_bytes``
    (each invalid byte becomes the 3 bytes of U+FFFD, so this can outgrow the files)."""
    written = 0
    for chunk in itertools.chain(_chunks(spec_path, files), [None]):
        data = counter.feed(chunk or b"", final=chunk is None).encode("utf-8")
        written += len(data)
        check_size(f"text:{spec_path}: the corpus decoded", written, max_bytes)
        yield data


def _write_decoded(spec_path: str, files: list[Path], max_bytes: int) -> tuple[Path, int]:
    """The decoded corpus, written once to the cache: (its path, sequences replaced). Written
    to a temporary file and renamed, so concurrent ranks never map half of one."""
    root = cache_dir()
    key = _cache_key(files)
    found = sorted(root.glob(f"text-{key}-*.u8")) if root.is_dir() else []
    if found:
        return found[0], int(found[0].stem.rsplit("-", 1)[1])
    root.mkdir(parents=True, exist_ok=True)
    counter = _Utf8Counter()
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".text-{key}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for data in _decoded(spec_path, files, max_bytes, counter):
                out.write(data)
        final = root / f"text-{key}-{counter.replaced}.u8"
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final, counter.replaced


def _map(path: Path) -> torch.Tensor:
    """The bytes of ``path`` as a uint8 tensor backed by a read-only shared memory map."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():  # read-only on purpose: nothing writes tokens
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(mapped)


def read_corpus(
    spec_path: str, max_bytes: int = MAX_DATASET_BYTES
) -> tuple[torch.Tensor, int, Path | None]:
    """(uint8 tokens, invalid UTF-8 sequences replaced, the file they are mapped from) of
    ``text:PATH``; refused from ``stat`` alone when over ``max_bytes``. Where the cache cannot
    be written, a decoded corpus is held in memory instead (mapped from None), with a warning."""
    files = corpus_files(spec_path)
    total = corpus_bytes(spec_path, files)
    check_size(f"text:{spec_path}: the corpus ({len(files)} file(s))", total, max_bytes)
    if total == 0:
        raise DatasetError(f"text:{spec_path}: the corpus is empty ({len(files)} file(s), 0 bytes)")
    backing: Path | None = None
    if len(files) == 1 and _is_valid_utf8(spec_path, files):
        backing, replaced = files[0], 0
    else:
        try:
            backing, replaced = _write_decoded(spec_path, files, max_bytes)
        except OSError as e:
            log.warning(
                "text:%s: cannot cache the decoded corpus under %s (%s); this rank holds its "
                "own copy (set CLOUDBURST_CACHE to a writable directory to share one)",
                spec_path,
                cache_dir(),
                _describe(e),
            )
            counter = _Utf8Counter()
            data = bytearray()
            for chunk in _decoded(spec_path, files, max_bytes, counter):
                data += chunk
            tokens, replaced = torch.frombuffer(data, dtype=torch.uint8), counter.replaced
    if backing is not None:
        try:
            tokens = _map(backing)
        except (OSError, ValueError) as e:
            raise DatasetError(f"text:{spec_path}: cannot map {backing} ({_describe(e)})") from e
    if tokens.numel() == 0:
        raise DatasetError(f"text:{spec_path}: the corpus is empty ({len(files)} file(s), 0 bytes)")
    check_size(f"text:{spec_path}: the corpus", tokens.numel(), max_bytes)
    if replaced:
        log.warning("text:%s: %d invalid UTF-8 sequence(s) replaced by U+FFFD", spec_path, replaced)
    return tokens, replaced, backing


def spread_starts(last: int, n: int) -> list[int]:
    """``n`` window starts spread evenly over 0..last: round(i · last / (n − 1)), rounding
    halves to even, in exact integer arithmetic (float32 would round past ``last`` once it
    passes 2²⁴)."""
    if n == 1:
        return [0]
    starts = []
    for i in range(n):
        q, r = divmod(i * last, n - 1)
        twice = 2 * r
        starts.append(q + (twice > n - 1 or (twice == n - 1 and q % 2 == 1)))
    return starts


def load_text(
    spec_path: str,
    context: int = DEFAULT_CONTEXT,
    train_windows: int | None = None,
    test_windows: int | None = None,
    max_bytes: int = MAX_DATASET_BYTES,
    test_fraction: float = TEXT_TEST_FRACTION,
) -> tuple[TokenStream, TokenWindows]:
    """(training tokens, test windows): the contiguous tail held out, windows spread over it.

    ``train_windows`` caps the training tokens at that many windows' worth (from the start);
    a corpus over ``max_bytes`` is refused before it is read.
    """
    if not isinstance(context, int) or context < 1:
        raise DatasetError(f"text:{spec_path}: context must be a positive integer, got {context!r}")
    if not 0.0 < test_fraction < 1.0:
        raise DatasetError(
            f"text:{spec_path}: test_fraction must be in (0, 1), got {test_fraction}"
        )
    tokens, replaced, backing = read_corpus(spec_path, max_bytes)
    n_test = TEXT_TEST_WINDOWS if test_windows is None else int(test_windows)
    if n_test < 1:
        raise DatasetError(f"text:{spec_path}: need at least one test window, got {n_test}")
    tail = max(round(tokens.numel() * test_fraction), n_test * context + 1)
    if tokens.numel() - tail < 2 * (context + 1):
        raise DatasetError(
            f"text:{spec_path}: {tokens.numel()} bytes are too few for a training split and "
            f"{n_test} held-out windows of {context} tokens"
        )
    # the windows are copied out as int64, with their gather indices: bound them too
    check_size(
        f"text:{spec_path}: {n_test} test windows of {context} tokens",
        2 * n_test * (context + 1) * 8,
        max_bytes,
        "as int64 with their indices",
    )
    train, test = tokens[:-tail], tokens[-tail:]
    if train_windows is not None:
        train = train[: min(train.numel(), int(train_windows) * context + 1)]
    starts = torch.tensor(spread_starts(test.numel() - context - 1, n_test), dtype=torch.int64)
    x, y = TokenStream(test, context).get_batch(starts)
    return TokenStream(train, context, replaced, backing), TokenWindows(x, y)
