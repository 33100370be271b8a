"""``text:PATH`` (cloudburst/datasets/text.py, cloudburst/data.py): byte tokens, a contiguous
held-out tail, disjoint worker shards, batches of random windows that are a function of
(seed, batch index), sorted directories, ``text:stdlib``, and the bad inputs."""

from __future__ import annotations

import random

import pytest
import torch

from cloudburst.config import ConfigError, RunConfig
from cloudburst.data import TextStream, batch_stream, in_memory, load_dataset, worker_source
from cloudburst.datasets import DatasetError, check_dataset
from cloudburst.datasets.text import STDLIB_SKIP_DIRS, corpus_files, load_text, stdlib_dir


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
    tail_bytes = raw[-tail:]
    for x, y in zip(test.x, test.y, strict=True):  # every test window lies in the tail
        window = bytes(x.tolist()) + bytes(y[-1:].tolist())
        assert window in tail_bytes
    # spread evenly from the tail's first byte to its last window, without overlapping
    starts = [round(i * (tail - 17) / 7) for i in range(8)]
    assert all(b - a >= 16 for a, b in zip(starts, starts[1:], strict=False))
    for start, x in zip(starts, test.x, strict=True):
        assert bytes(x.tolist()) == tail_bytes[start : start + 16]


def test_shards_are_disjoint_and_cover_the_training_tokens(tmp_path):
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


def test_batches_are_a_function_of_seed_and_batch_index_and_resume(tmp_path):
    data = load_dataset(f"text:{corpus(tmp_path / 'a.txt')}", context=16)
    shard = worker_source(data, 1, 2)
    a = batch_stream(shard, 8, seed=5)
    first = [next(a) for _ in range(5)]
    again = [next(batch_stream(shard, 8, seed=5)) for _ in range(1)]
    assert torch.equal(first[0][0], again[0][0])
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


def test_a_directory_is_read_in_sorted_order_without_hidden_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("2" * 300)
    (tmp_path / "a.txt").write_text("1" * 300)
    (tmp_path / "c.txt").write_text("3" * 300)
    (tmp_path / ".hidden").write_text("x" * 300)
    names = [p.relative_to(tmp_path).as_posix() for p in corpus_files(str(tmp_path))]
    assert names == ["a.txt", "b/z.txt", "c.txt"]
    train, _ = load_text(str(tmp_path), context=8, test_windows=2)
    assert bytes(train.tokens[:600].tolist()) == b"1" * 300 + b"2" * 300


def test_stdlib_is_the_interpreters_python_sources():
    files = corpus_files("stdlib")
    root = stdlib_dir()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and "os.py" in rel
    assert not any(set(r.split("/")[:-1]) & STDLIB_SKIP_DIRS for r in rel)
    check_dataset("text", "stdlib")
    assert RunConfig(model="gpt", dataset="text:stdlib").dataset == "text:stdlib"


def test_bad_inputs_are_one_line_errors_or_counted(tmp_path, caplog):
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
    # two invalid sequences and one genuine U+FFFD: two replaced, the text's own one kept
    body = "ok \ufffd ".encode() + b"\xff" + b"x" * 500 + b"\xc3(" + b"y" * 500
    (tmp_path / "latin.txt").write_bytes(body)
    with caplog.at_level("WARNING"):
        train, _ = load_text(str(tmp_path / "latin.txt"), context=8, test_windows=2)
    assert train.replaced == 2 and "2 invalid UTF-8" in caplog.text
    decoded = body.decode("utf-8", errors="replace").encode()
    assert bytes(train.tokens.tolist()) == decoded[: train.tokens.numel()]
    with pytest.raises(DatasetError, match="context must be"):
        load_text(str(tmp_path / "latin.txt"), context=0)
    with pytest.raises(ConfigError, match="context"):
        RunConfig(model="gpt", dataset="text:stdlib", context=0)
