"""The package's import graph (docs/architecture.md): no import circle, counting every
``import`` and ``from … import`` — at the top, inside functions and under ``TYPE_CHECKING`` —
and ``torch.distributed`` imported only by the modules the architecture page names."""

from __future__ import annotations

import ast
import fnmatch
import os
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cloudburst"
#: The modules that import torch.distributed (docs/architecture.md, "What imports
#: torch.distributed"); everything else reaches other ranks through the Transport.
DISTRIBUTED = {
    "cloudburst.comm.allreduce",
    "cloudburst.comm.transport",
    "cloudburst.runtime",
    "cloudburst.runtime.context",
    "cloudburst.runtime.groups",
    "cloudburst.runtime.rejoin",
    "cloudburst.comm.liveness",
    "cloudburst.launch.agents",
}


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(the package's modules ``name`` imports, every module name it imports)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    every: set[str] = set()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
            every.update(f"{base}.{a.name}" for a in node.names)
        else:
            continue
        every.update(names)
        for target in map(resolve, (n for n in names if n.startswith("cloudburst"))):
            if target is not None and target != name:
                targets.add(target)
    return targets, every


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known)[0] for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each group of modules that all reach one another, sorted."""

    def reach(v: str) -> set[str]:
        seen, todo = set(), [v]
        while todo:
            new = edges.get(todo.pop(), set()) - seen
            seen |= new
            todo += new
        return seen

    reaches = {v: reach(v) for v in edges}
    groups = {tuple(sorted(w for w in reaches[v] if v in reaches[w])) for v in edges}
    return sorted(list(g) for g in groups if len(g) > 1)


def test_the_package_has_no_import_circle_and_only_the_named_modules_import_torch_distributed():
    assert cycles(graph(PACKAGE)) == []
    known = modules(PACKAGE)
    users = {
        name
        for name, path in known.items()
        if any(m == "torch.distributed" or m.startswith("torch.distributed.")
               for m in imports(name, path, known)[1])
    }  # fmt: skip
    assert users == DISTRIBUTED


def test_a_circle_through_a_lazy_or_type_checking_import_is_found(tmp_path):
    pkg = tmp_path / "cloudburst"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cloudburst.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cloudburst import c\n"
    )
    (pkg / "c.py").write_text("def f():\n    from cloudburst.a import x\n")
    assert cycles(graph(pkg)) == [["cloudburst.a", "cloudburst.c", "cloudburst.sub.b"]]
    (pkg / "c.py").write_text("def f():\n    return 1\n")
    assert cycles(graph(pkg)) == []


@pytest.mark.skipif("MUTANT_UNDER_TEST" in os.environ, reason="mutmut's longer rewritten copy")
def test_no_module_is_over_600_lines():
    """A module a reader can hold (issue 41; docs/architecture.md): split by concern before
    one grows past 600 lines."""
    long = {p.relative_to(PACKAGE.parent).as_posix(): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}  # fmt: skip
    assert long == {}


DOC = PACKAGE.parent / "docs" / "architecture.md"


def doc_layers(text: str) -> list[list[str]]:
    """The ```layers block of the architecture page: a line per layer, top first."""
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    return [line.split() for line in block.splitlines() if line.strip()]


def place(layers: list[list[str]], path: str) -> int | None:
    """The layer of a module (its path under cloudburst/): the most specific name that covers
    it — the file itself, then a ``strategies/*/…`` pattern, then the longest folder."""
    best: tuple[int, int] | None = None
    for level, names in enumerate(layers):
        for name in names:
            if name.endswith("/"):
                rank = len(name) if path.startswith(name) else None
            elif "*" in name:
                same_depth = path.count("/") == name.count("/")
                rank = 10_000 if fnmatch.fnmatchcase(path, name) and same_depth else None
            else:
                rank = 20_000 if path == name else None
            if rank is not None and (best is None or rank > best[0]):
                best = (rank, level)
    return None if best is None else best[1]


def runs_back_up(root: Path, layers: list[list[str]]) -> tuple[list[str], list[str]]:
    """(modules no layer places, imports from a module to one on a higher layer)."""
    known = modules(root)
    where = {name: path.relative_to(root).as_posix() for name, path in known.items()}
    level = {name: place(layers, path) for name, path in where.items()}
    unplaced = sorted(where[n] for n, lv in level.items() if lv is None)
    up = sorted(f"{where[a]} -> {where[b]}" for a, targets in graph(root).items()
                for b in targets if level[a] is not None and level[b] is not None
                and level[b] < level[a])  # fmt: skip
    return unplaced, up


def test_every_import_runs_down_the_layers_the_architecture_page_draws():
    assert runs_back_up(PACKAGE, doc_layers(DOC.read_text())) == ([], [])


def test_an_import_back_up_a_layer_or_an_unplaced_module_is_found(tmp_path):
    pkg = tmp_path / "cloudburst"
    (pkg / "low" / "inner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("from cloudburst.low import base\n")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "base.py").write_text("")
    (pkg / "low" / "inner" / "__init__.py").write_text("")
    (pkg / "low" / "inner" / "leaf.py").write_text("def f():\n    from cloudburst import top\n")
    layers = [["__init__.py", "top.py"], ["low/"], ["low/*/leaf.py"]]
    assert runs_back_up(pkg, layers) == ([], ["low/inner/leaf.py -> top.py"])
    assert place(layers, "low/base.py") == 1 and place(layers, "low/inner/leaf.py") == 2
    unplaced, up = runs_back_up(pkg, [["top.py"], ["low/"]])
    assert unplaced == ["__init__.py"] and up == ["low/inner/leaf.py -> top.py"]
