"""``text:PATH`` (cloudburst/data/): byte tokens, a contiguous
held-out tail, disjoint worker shards, batches of random windows that are a function of
(seed, batch index), sorted directories, ``text:stdlib``, and the bad inputs."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch

from cloudburst.config import ConfigError, RunConfig
from cloudburst.data import TextStream, batch_stream, in_memory, load_dataset, worker_source
from cloudburst.data.datasets import DatasetError, check_dataset, text
from cloudburst.data.datasets.text import (
    STDLIB_SKIP_DIRS,
    corpus_files,
    load_text,
    spread_starts,
    stdlib_dir,
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Decoded corpora (directories, invalid UTF-8) are cached here, not in the user's home."""
    monkeypatch.setenv("CLOUDBURST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def corpus(path, n_words: int = 4000, seed: int = 0):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "ünïcode"]
    path.write_text(" ".join(rng.choice(words) for _ in range(n_words)), encoding="utf-8")
    return path


def test_tokens_are_the_bytes_and_the_tail_is_held_out(tmp_path):
    raw = corpus(tmp_path / "a.txt").read_bytes()
    data = load_dataset(f"text:{tmp_path / 'a.txt'}", test_size=8, context=16)
    assert data.is_lm and data.num_classes == 256 and data.input_shape == (16,)
    train = data.train.tokens
    tail = max(round(len(raw) * 0.05), 8 * 16 + 1)
    assert bytes(train.tolist()) == raw[:-tail]  # the head, in order
    test = in_memory(data.test)
    assert test.x.shape == (8, 16) and torch.equal(test.y[:, :-1], test.x[:, 1:])
    # spread evenly from the tail's first byte to its last window, without overlapping
    starts = [round(i * (tail - 17) / 7) for i in range(8)]
    assert all(b - a >= 16 for a, b in zip(starts, starts[1:], strict=False))
    for start, x, y in zip(starts, test.x, test.y, strict=True):
        assert bytes(x.tolist()) + bytes(y[-1:].tolist()) == raw[-tail:][start : start + 17]


def test_shards_are_disjoint_cover_the_training_tokens_and_batch_deterministically(tmp_path):
    data = load_dataset(f"text:{corpus(tmp_path / 'a.txt')}", context=16)
    shards = [worker_source(data, w, 3) for w in range(3)]
    per = data.train.tokens.numel() // 3
    assert torch.equal(torch.cat([s.tokens for s in shards]), data.train.tokens[: 3 * per])
    for s in shards:  # a batch from shard w only reads shard w's tokens
        x, y = TextStream(s, 64, seed=1).batch(0)
        assert x.shape == y.shape == (64, 16) and torch.equal(x[:, 1:], y[:, :-1])
        assert int(x.min()) >= 0 and set(x.flatten().tolist()) <= set(s.tokens.tolist())
    with pytest.raises(DatasetError, match="cannot be split over"):
        worker_source(data, 0, data.train.tokens.numel() // 10)
    # batches are a function of (seed, batch index), and resume
    shard = worker_source(data, 1, 2)
    a = batch_stream(shard, 8, seed=5)
    first = [next(a) for _ in range(5)]
    assert torch.equal(first[0][0], next(batch_stream(shard, 8, seed=5))[0])
    assert not torch.equal(first[0][0], first[1][0])  # a new draw per batch
    assert not torch.equal(first[0][0], next(batch_stream(shard, 8, seed=6))[0])
    state = a.state_dict()
    later = [next(a) for _ in range(3)]
    b = batch_stream(shard, 8, seed=5)
    b.load_state_dict(state)
    resumed = [next(b) for _ in range(3)]
    assert all(torch.equal(p[0], q[0]) for p, q in zip(later, resumed, strict=True))
    # windows start anywhere in the shard, up to the last one whose targets are in it
    stream = TextStream(shard, 64, seed=0)
    gen = [torch.Generator().manual_seed(g) for g in range(50)]
    starts = torch.cat([torch.randint(0, shard.max_start + 1, (64,), generator=g) for g in gen])
    firsts = torch.cat([stream.batch(g)[0] for g in range(50)])
    assert torch.equal(firsts, shard.get_batch(starts)[0])
    assert shard.max_start == shard.tokens.numel() - 17


def test_stdlib_is_the_interpreters_python_sources():
    files = corpus_files("stdlib")
    root = stdlib_dir()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and "os.py" in rel
    assert not any(set(r.split("/")[:-1]) & STDLIB_SKIP_DIRS for r in rel)
    check_dataset("text", "stdlib")
    assert RunConfig(model="gpt", dataset="text:stdlib").data.dataset == "text:stdlib"


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such file or directory"):
        load_dataset(f"text:{tmp_path / 'missing'}")
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig(model="gpt", dataset=f"text:{tmp_path / 'missing'}")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DatasetError, match="the corpus is empty"):
        load_dataset(f"text:{tmp_path / 'empty.txt'}")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DatasetError, match="the corpus is empty"):
        check_dataset("text", str(tmp_path / "emptydir"))
    (tmp_path / "tiny.txt").write_text("abc")
    with pytest.raises(DatasetError, match="too few"):
        load_dataset(f"text:{tmp_path / 'tiny.txt'}", context=16)
    with pytest.raises(DatasetError, match="context must be"):
        load_text(str(tmp_path / "tiny.txt"), context=0)
    with pytest.raises(ConfigError, match="context"):
        RunConfig(model="gpt", dataset="text:stdlib", context=0)


def test_test_windows_are_exact_past_two_to_the_24_bytes_of_tail(tmp_path):
    # a sparse corpus of zeros whose held-out tail (90 %) is just over 2**24 bytes, with a
    # marker where the tail starts and at its very end: the first and last test windows
    n, context, windows = 18_700_000, 16, 8
    path = tmp_path / "big.txt"
    tail = round(n * 0.9)
    assert tail > 2**24
    first, last = b"FIRSTWINDOW-ABCDE", b"LASTWINDOW-VWXYZ!"  # context + 1 bytes each
    with open(path, "wb") as f:
        f.truncate(n)
        f.seek(n - tail)
        f.write(first)
        f.seek(n - len(last))
        f.write(last)
    last_start = tail - context - 1
    assert int(torch.linspace(0, last_start, windows)[-1]) > last_start  # float32 overshoots
    _, test = load_text(str(path), context, test_windows=windows, test_fraction=0.9)
    assert bytes(test.x[0].tolist()) == first[:-1] and bytes(test.y[0].tolist()) == first[1:]
    assert bytes(test.x[-1].tolist()) == last[:-1] and bytes(test.y[-1].tolist()) == last[1:]
    # every start is round(i · last / 7), exactly (halves to even, as Python's round)
    exact = [round(Fraction(i * last_start, windows - 1)) for i in range(windows)]
    assert spread_starts(last_start, windows) == exact
    assert spread_starts(10, 5) == [0, 2, 5, 8, 10] and spread_starts(7, 1) == [0]


def test_a_file_is_memory_mapped_in_place_and_shards_share_it(tmp_path, monkeypatch):
    path = corpus(tmp_path / "a.txt")
    data = load_dataset(f"text:{path}", context=16)
    assert data.train.mapped_from == path
    # its validity is remembered: the machine's other ranks map it without reading it through
    with monkeypatch.context() as m:
        m.setattr(text, "_chunks", lambda *a: pytest.fail("read the corpus again"))
        assert load_dataset(f"text:{path}", context=16).train.mapped_from == path
    shard = worker_source(data, 1, 2)
    base = data.train.tokens.untyped_storage().data_ptr()
    assert shard.tokens.untyped_storage().data_ptr() == base and shard.mapped_from == path
    # a map, not a copy: the file's bytes, changed in place, are what the tokens read
    with open(path, "r+b") as f:
        f.write(b"XYZ")
    assert bytes(data.train.tokens[:3].tolist()) == b"XYZ"


def test_a_directory_is_read_sorted_skipping_hidden_files_and_cached_once(tmp_path, private_cache):
    for name, char in {"b/z.txt": "2", "a.txt": "1", "c.txt": "3", ".hidden": "x"}.items():
        (tmp_path / "d" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / name).write_text(char * 300)
    names = [p.relative_to(tmp_path / "d").as_posix() for p in corpus_files(str(tmp_path / "d"))]
    assert names == ["a.txt", "b/z.txt", "c.txt"]
    first, _ = load_text(str(tmp_path / "d"), context=8, test_windows=2)
    assert bytes(first.tokens[:600].tolist()) == b"1" * 300 + b"2" * 300
    cached = first.mapped_from
    assert cached is not None and cached.parent == private_cache
    assert cached.read_bytes() == b"1" * 300 + b"2" * 300 + b"3" * 300
    stamp = cached.stat().st_mtime_ns, cached.stat().st_ino
    again, _ = load_text(str(tmp_path / "d"), context=8, test_windows=2)  # a second rank
    assert again.mapped_from == cached
    assert (cached.stat().st_mtime_ns, cached.stat().st_ino) == stamp
    assert torch.equal(again.tokens, first.tokens)
    (tmp_path / "d" / "b" / "z.txt").write_text("4" * 301)  # changed: a new entry
    changed, _ = load_text(str(tmp_path / "d"), context=8, test_windows=2)
    assert changed.mapped_from != cached and bytes(changed.tokens[300:302].tolist()) == b"44"


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, None])
def test_invalid_utf8_is_counted_exactly_across_chunk_boundaries(
    tmp_path, monkeypatch, caplog, chunk
):
    """Three invalid sequences (one a truncated 3-byte one) are replaced and counted, and
    logged; the text's own U+FFFD are kept. None: the default chunk size."""
    if chunk is not None:
        monkeypatch.setattr(text, "_CHUNK_BYTES", chunk)
    body = "ok \ufffd ".encode() + b"\xff" + b"x" * 100 + b"\xc3(" + "é\ufffd".encode() * 3
    body += b"\xe2\x82" + b"y" * 100  # a truncated 3-byte sequence
    (tmp_path / "mixed.txt").write_bytes(body)
    with caplog.at_level("WARNING"):
        train, test = load_text(str(tmp_path / "mixed.txt"), context=8, test_windows=2)
    decoded = body.decode("utf-8", errors="replace").encode()
    assert train.replaced == 3 and "3 invalid UTF-8" in caplog.text
    assert train.mapped_from.read_bytes() == decoded
    assert bytes(train.tokens.tolist()) == decoded[: train.tokens.numel()]


def test_without_a_writable_cache_a_decoded_corpus_is_held_in_memory(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("CLOUDBURST_CACHE", str(blocked))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_bytes(b"1" * 300 + b"\xff")
    (tmp_path / "d" / "b.txt").write_text("2" * 300)
    with caplog.at_level("WARNING"):
        train, _ = load_text(str(tmp_path / "d"), context=8, test_windows=2)
    assert train.mapped_from is None and train.replaced == 1
    assert "cannot cache the decoded corpus" in caplog.text
    assert bytes(train.tokens[:304].tolist()) == b"1" * 300 + "\ufffd".encode() + b"2"
