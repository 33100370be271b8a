"""``text:PATH``: byte-level language-model data from local text (docs/lm.md).

A UTF-8 file, or every regular file under a directory (recursively, in sorted order of their
relative paths, hidden ones skipped), concatenated. ``text:stdlib`` is the running
interpreter's standard library: its ``.py`` files, without ``site-packages``, ``test``/``tests``
and ``idle_test`` (about 13 MB on CPython 3.11), a corpus every machine with Python has.
Bytes that are not UTF-8 are decoded with replacement (U+FFFD) and counted
(``TokenStream.replaced``); the tokens are the bytes of the decoded text (vocabulary 256), so
one token is one byte and bits per byte = nats per token / ln 2.

The last ``TEXT_TEST_FRACTION`` of the tokens (at least enough for the test windows) is held
out, contiguous; the test set is ``test_size`` windows spread evenly over that tail. Training
windows are drawn at random positions of a worker's shard per batch (``cloudburst.data``).
"""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path

import torch

from cloudburst.datasets.base import DatasetError, _describe

log = logging.getLogger(__name__)

STDLIB = "stdlib"
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
TEXT_TEST_FRACTION = 0.05
TEXT_TEST_WINDOWS = 64  # test windows when --test-size is not given
DEFAULT_CONTEXT = 64
VOCAB = 256
MAX_TEXT_BYTES = 2**31 - 1  # int32-indexable; larger corpora should be cut first


class TokenStream:
    """A contiguous run of byte tokens (uint8 [n]) read as windows of ``context`` tokens.

    Its length counts the disjoint windows it holds, so an epoch is one pass over its tokens.
    ``get_batch(starts)`` → (x, y), int64 [B, context]: the window at each start and the same
    shifted by one token (the next-token targets).
    """

    def __init__(self, tokens: torch.Tensor, context: int, replaced: int = 0):
        if tokens.dtype != torch.uint8 or tokens.dim() != 1:
            raise DatasetError(f"tokens must be a uint8 vector, got {tokens.dtype} {tokens.shape}")
        if context < 1 or tokens.numel() < context + 1:
            raise DatasetError(
                f"{tokens.numel()} tokens are too few for one window of context {context}"
            )
        self.tokens, self.context, self.replaced = tokens, int(context), int(replaced)

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
        return TokenStream(self.tokens[worker * per : (worker + 1) * per], self.context)


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


def read_corpus(spec_path: str) -> tuple[torch.Tensor, int]:
    """(uint8 tokens, invalid UTF-8 sequences replaced) of ``text:PATH``."""
    files = corpus_files(spec_path)
    parts = []
    for f in files:
        try:
            parts.append(f.read_bytes())
        except OSError as e:
            raise DatasetError(f"text:{spec_path}: cannot read {f} ({_describe(e)})") from e
    raw = b"".join(parts)
    if not raw:
        raise DatasetError(f"text:{spec_path}: the corpus is empty ({len(files)} file(s), 0 bytes)")
    text = raw.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd") - raw.count("\ufffd".encode())
    data = text.encode("utf-8") if replaced else raw
    if len(data) > MAX_TEXT_BYTES:
        raise DatasetError(f"text:{spec_path}: {len(data)} bytes; at most {MAX_TEXT_BYTES}")
    if replaced:
        log.warning("text:%s: %d invalid UTF-8 sequence(s) replaced by U+FFFD", spec_path, replaced)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), replaced


def load_text(
    spec_path: str,
    context: int = DEFAULT_CONTEXT,
    train_windows: int | None = None,
    test_windows: int | None = None,
) -> tuple[TokenStream, TokenWindows]:
    """(training tokens, test windows): the contiguous tail held out, windows spread over it.

    ``train_windows`` caps the training tokens at that many windows' worth (from the start).
    """
    if not isinstance(context, int) or context < 1:
        raise DatasetError(f"text:{spec_path}: context must be a positive integer, got {context!r}")
    tokens, replaced = read_corpus(spec_path)
    n_test = TEXT_TEST_WINDOWS if test_windows is None else int(test_windows)
    if n_test < 1:
        raise DatasetError(f"text:{spec_path}: need at least one test window, got {n_test}")
    tail = max(round(tokens.numel() * TEXT_TEST_FRACTION), n_test * context + 1)
    if tokens.numel() - tail < 2 * (context + 1):
        raise DatasetError(
            f"text:{spec_path}: {tokens.numel()} bytes are too few for a training split and "
            f"{n_test} held-out windows of {context} tokens"
        )
    train, test = tokens[:-tail], tokens[-tail:]
    if train_windows is not None:
        train = train[: min(train.numel(), int(train_windows) * context + 1)]
    starts = torch.linspace(0, test.numel() - context - 1, n_test).round().to(torch.int64)
    x, y = TokenStream(test, context).get_batch(starts)
    return TokenStream(train, context, replaced), TokenWindows(x, y)
