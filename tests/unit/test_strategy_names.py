"""No code branches on a strategy's name, a strategy's own settings included (they ask the
running strategy's spec: ``validate``, a trait, the settings it brings): what differs between
strategies is a trait or a hook of their spec (docs/architecture.md, "Adding a strategy"). An
AST scan for comparisons (``==``, ``!=``, ``in``, ``not in``, ``match``) with a built-in
strategy's name, alone or in a tuple, list or set."""

from __future__ import annotations

import ast
from pathlib import Path

from cloudburst.strategies import BUILT_IN

PACKAGE = Path(__file__).resolve().parents[2] / "cloudburst"


def _names_in(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and node.value in BUILT_IN:
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [n for element in node.elts for n in _names_in(element)]
    return []


def name_comparisons(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: name`` for each comparison with a strategy's name in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        else:
            continue
        for name in (n for operand in operands for n in _names_in(operand)):
            found.append((node.lineno, f"{filename}:{node.lineno}: {name!r}"))
    return [hit for _, hit in sorted(found, key=lambda lineno_hit: lineno_hit[0])]


def test_no_strategy_name_is_compared_anywhere_in_the_package():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in name_comparisons(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert found == []


def test_the_scan_finds_each_form_of_comparison():
    source = (
        'if cfg.job.strategy == "daso": pass\n'
        'ok = s["strategy"] != "asgd"\n'
        'if cfg.job.strategy in ("easgd", "async_diloco"): pass\n'
        'if "gossip" not in names: pass\n'
        'match cfg.job.strategy:\n    case "sync": pass\n'
        'if cfg.model.model == "cnn" or cfg.strategy_spec.lockstep: pass\n'
    )
    assert [hit.split(": ")[1] for hit in name_comparisons(source)] == [
        "'daso'",
        "'asgd'",
        "'easgd'",
        "'async_diloco'",
        "'gossip'",
        "'sync'",
    ]
