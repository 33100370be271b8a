"""Every relative link in README.md and docs/*.md resolves to a file and an ``#anchor`` to a
heading's GitHub slug or an ``<a id>``; code is not links, URLs are not checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than ``-``
    and ``_`` removed, each space a ``-`` (so ``a (`b`)`` → ``a-b``, ``x — y`` → ``x--y``)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a file offers: heading slugs (a repeated one gets -1, -2, …) and HTML ids."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text()):
        found.update(HTML_ID.findall(line))
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for i, line in prose_lines(path.read_text()):
        line = INLINE_CODE.sub("", line)  # `[x](y)` is code; [`x`](y) a link
        out += [(i, t) for t in LINK.findall(line) + IMAGE.findall(line)]
    return out


def broken(path: Path, root: Path = REPO) -> list[str]:
    """``file:line: target — why`` for each relative link of ``path`` that does not resolve."""
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{line}: {target}"
        if not dest.exists():
            bad.append(f"{where} — no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} — no heading or id '{anchor}' in {dest.name}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_every_relative_link_and_anchor_resolves(path):
    assert broken(path) == []


def test_the_link_pattern_finds_the_readmes_links():
    found = [t for _, t in links(REPO / "README.md")]
    assert "docs/cli.md" in found and any(t.startswith("docs/evidence.md#c-") for t in found)


@pytest.mark.parametrize(
    "heading, expected",
    [
        (
            "Emulated devices (`--min-step-time-s`, `--straggler`)",
            "emulated-devices---min-step-time-s---straggler",
        ),
        ("Failures, checkpoints and restarts", "failures-checkpoints-and-restarts"),
        ("Virtual cluster: `cloudburst simulate`", "virtual-cluster-cloudburst-simulate"),
        ("What a run writes (`--out DIR`)", "what-a-run-writes---out-dir"),
        ("Streaming DiLoCo", "streaming-diloco"),
        ("local_sgd — post-local SGD", "local_sgd--post-local-sgd"),
    ],
)
def test_slugs_are_githubs(heading, expected):
    assert slug(heading) == expected


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text('# B title\n\n## Two words\n\n<a id="row-1"></a>\n')
    a = tmp_path / "README.md"
    a.write_text(
        "# A\n\n[ok](docs/b.md#two-words) [ok](docs/b.md#row-1) [ok](#a) "
        "[web](https://example.com/x) `[code](nowhere.md)`\n\n"
        "```\n[in a fence](nowhere.md)\n```\n\n"
        "[gone](docs/missing.md) [bad anchor](docs/b.md#three-words) [self](#nope)\n"
    )
    assert broken(a, tmp_path) == [
        "README.md:9: docs/missing.md — no such file",
        "README.md:9: docs/b.md#three-words — no heading or id 'three-words' in b.md",
        "README.md:9: #nope — no heading or id 'nope' in README.md",
    ]
