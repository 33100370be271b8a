"""No code branches on a strategy's name: what differs between strategies is a trait or a hook
of their spec (docs/architecture.md, "Adding a strategy"). An AST scan for comparisons (``==``,
``!=``, ``in``, ``not in``, ``match``) with a built-in strategy's name, alone or in a collection."""

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
    names = [hit.split(": ")[1] for hit in name_comparisons(source)]
    assert names == ["'daso'", "'asgd'", "'easgd'", "'async_diloco'", "'gossip'", "'sync'"]


def settings_reads(source: str, sections: set[str], filename: str = "<source>") -> list[str]:
    """``file:line: cfg.<section>.<field>`` for each read of a strategy's settings in
    ``source`` (an attribute chain ``….cfg.<section>.<field>`` or ``cfg.<section>.<field>``)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)):
            continue
        owner = node.value.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if node.value.attr in sections and name == "cfg":
            found.append(f"{filename}:{node.lineno}: cfg.{node.value.attr}.{node.attr}")
    return found


def test_no_module_outside_the_strategies_reads_a_strategys_settings():
    """Outside ``strategies/``, what depends on a strategy's settings is asked of its spec
    (``cfg.strategy_spec``), never read from them (``cfg.asgd.shard_standby``)."""
    from cloudburst.strategies import settings_classes

    sections = {part.section for part in settings_classes()}
    found = [read for path in sorted(PACKAGE.rglob("*.py")) if "strategies" not in path.parts
             for read in settings_reads(path.read_text(), sections, str(path))]  # fmt: skip
    assert found == []
    probe = "def f(ctx):\n    return ctx.cfg.daso.global_skip, cfg.training.lr, cfg.asgd\n"
    assert settings_reads(probe, sections) == ["<source>:2: cfg.daso.global_skip"]
