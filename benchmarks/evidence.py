"""Regenerate the README's evidence table from the claims in ``benchmarks/results/*.json``.

    .venv/bin/python benchmarks/evidence.py            # rewrite README.md between the markers
    .venv/bin/python benchmarks/evidence.py --check    # print the table; exit 1 if README differs
    .venv/bin/python benchmarks/evidence.py --results runs/bench-quick --print

Only the text between ``<!-- evidence:begin -->`` and ``<!-- evidence:end -->`` is replaced:
one row per claim (:meth:`harness.Report.claim`), with the A/A value, the interval, the seeds,
the verdict and the result file's commit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import CLAIM_HEADERS, REPO, RESULTS, Claim, md_table  # noqa: E402

BEGIN, END = "<!-- evidence:begin -->", "<!-- evidence:end -->"


def table(results: Path) -> list[str]:
    """The evidence table: every claim of every result file with claims, by file name."""
    rows = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"evidence: cannot read {path}: {e}")
        if not isinstance(data, dict) or not data.get("claims"):
            continue
        md = path.with_suffix(".md")
        link = f"[{path.stem}]({md.relative_to(REPO) if md.is_relative_to(REPO) else md})"
        commit = data.get("provenance", {}).get("commit", "?")
        for c in data["claims"]:
            claim = Claim(**{k: v for k, v in c.items() if k in Claim.__dataclass_fields__})
            rows.append([link, *claim.row(), f"`{commit}`"])
    if not rows:
        return ["(no result file has claims yet: run `make bench`)"]
    return md_table(["result", *CLAIM_HEADERS, "commit"], rows)


def splice(readme: str, lines: list[str]) -> str:
    """``readme`` with the text between the markers replaced by ``lines``."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.find(BEGIN) > readme.find(END):
        sys.exit(f"evidence: README.md needs exactly one {BEGIN} … {END} pair, in that order")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of result .json files")
    p.add_argument("--readme", type=Path, default=REPO / "README.md")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    group.add_argument("--print", action="store_true", help="print the table, write nothing")
    args = p.parse_args()
    lines = table(args.results)
    if args.print:
        print("\n".join(lines))
        return
    old = args.readme.read_text()
    new = splice(old, lines)
    if args.check:
        print("\n".join(lines))
        sys.exit(0 if new == old else f"evidence: {args.readme} is stale; run evidence.py")
    args.readme.write_text(new)
    print(f"evidence: {max(len(lines) - 2, 0)} claim rows written to {args.readme}")


if __name__ == "__main__":
    main()
