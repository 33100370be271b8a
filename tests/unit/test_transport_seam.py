"""Outside ``comm/`` and ``sim/`` nothing starts a thread itself (``ctx.comm.spawn`` does) nor
asks whether the cluster is simulated (docs/architecture.md); ``liveness.py``'s heartbeat and
watchdog threads belong to the process, not to a rank's tasks."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cloudburst"
#: Where threads are started and the two clusters told apart.
ALLOWED = ("comm/", "sim/", "liveness.py")


def offences(source: str) -> list[str]:
    """Each ``threading.Thread(...)`` / ``Thread(...)`` call and ``.simulated`` read."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            if "Thread" in (getattr(node.func, "attr", None), getattr(node.func, "id", None)):
                found.append((node.lineno, "a thread started directly"))
        elif isinstance(node, ast.Attribute) and node.attr == "simulated":
            found.append((node.lineno, ".simulated"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_threads_and_the_cluster_kind_stay_behind_the_transport():
    bad = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if not relative.startswith(ALLOWED) and (found := offences(path.read_text())):
            bad[relative] = found
    assert bad == {}


def test_the_check_finds_what_it_forbids():
    source = (
        "import threading\n"
        "threading.Thread(target=f).start()\n"
        "if ctx.comm.simulated:\n    pass\n"
        "t: threading.Thread | None = None\n"  # an annotation starts nothing
    )
    assert offences(source) == ["line 2: a thread started directly", "line 3: .simulated"]
