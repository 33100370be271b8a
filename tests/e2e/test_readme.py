"""The documentation runs: every fenced ``bash`` / ``sh`` and ``python`` block of README.md and
docs/*.md, and every ``$ command`` transcript, is checked against the code:

- ``cloudburst train|simulate|compare …`` (also under torchrun) parses with the CLI's own parser
  into a valid config; ``plot`` and ``demo`` parse; ``make TARGET`` names a Makefile target;
- ``torchrun …`` parses with torchrun's parser; the script it names takes the flags given;
- a transcript (``$ cloudburst …`` then what it prints) is run: the output is the text's;
- a Python block runs as written (one that uses ``cloudburst.Job`` under ``torchrun
  --standalone``, with the ranks its ``RunConfig`` asks for).

A block that cannot run here is in :data:`SKIP`, keyed by a piece of its text; an entry that
matches no block fails, so the list stays true."""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO, cli_env, refused

pytestmark = pytest.mark.e2e

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Blocks not run, by a piece of their text: why.
SKIP = {
    "# machine A (10.0.0.1)": "two machines' commands side by side (a layout, not a script)",
    "openssl rand -hex 32 >": "lines of a SLURM batch script (tests/unit/test_slurm_recipe.py "
    "runs the shipped one)",
}

#: Blocks that fail because of a known package bug, by a piece of their text: the bug. Strict:
#: once the bug is fixed the block passes and its entry must go.
KNOWN_BUGS: dict[str, str] = {}

#: A user's data the commands refer to (``~`` is the test's directory: a user's data under
#: ``~/data`` is an empty directory of that name); ``examples/`` is copied there as shipped.
USER_DATA = ["data/cifar-10-batches-py"]


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found, lines = [], enumerate(path.read_text().splitlines(), 1)
    for number, line in lines:
        if fence := re.match(r"^(\s*)```(\w*)\s*$", line):
            body = []
            for _, inner in lines:  # to the closing fence (the same iterator)
                if inner.strip().startswith("```"):
                    break
                body.append(inner[len(fence.group(1)) :])
            found.append(Block(path, number, fence.group(2).lower(), "\n".join(body)))
    return found


def runnable() -> list[Block]:
    """The blocks to check: bash/sh, python, and untagged ones that are ``$`` transcripts."""
    out = []
    for path in DOCS:
        for b in blocks(path):
            transcript = b.lang == "" and b.text.lstrip().startswith("$ ")
            if b.lang in ("bash", "sh", "shell", "python") or transcript:
                out.append(b)
    return out


def entry(table: dict[str, str], block: Block) -> str | None:
    """Why ``table`` (keyed by a piece of a block's text) lists ``block``, if it does."""
    return next((why for key, why in table.items() if key in block.text), None)


def commands(text: str) -> list[list[str]]:
    """The shell commands of a block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


# ---------------------------------------------------------------------------- the checks
def check_cloudburst(argv: list[str], where: str) -> None:
    from cloudburst.cli import build_config, build_parser
    from cloudburst.config import ConfigError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"{where}: cloudburst {shlex.join(argv)} does not parse") from e
    try:
        if args.command == "train":
            build_config(args)
        elif args.command == "compare":
            _compare_configs(args)
        elif args.command == "simulate":
            _simulation_configs(args)
    except ConfigError as e:
        raise AssertionError(f"{where}: cloudburst {shlex.join(argv)}: {e}") from None


def _compare_configs(args) -> None:
    """The configs of ``compare``'s runs, as its command builds them (nothing launched)."""
    from cloudburst.cli import CLI_ONLY
    from cloudburst.cli.compare import comparison_configs

    values = {k: v for k, v in vars(args).items() if k not in (*CLI_ONLY, "runs")}
    comparison_configs(args.runs, values, values.pop("out", None) or "runs/compare")


def _simulation_configs(args) -> None:
    """A simulated run's config and the virtual cluster's, or a sweep's points, as
    ``simulate`` builds them (nothing run)."""
    import dataclasses

    from cloudburst.cli import CLI_ONLY, SWEEP_ONLY
    from cloudburst.config import RunConfig
    from cloudburst.config.simulation import SimulationConfig
    from cloudburst.sim import sweep

    sim_names = {f.name for f in dataclasses.fields(SimulationConfig)}
    given = {k: v for k, v in vars(args).items() if k not in (*CLI_ONLY, *SWEEP_ONLY)}
    values = {k: v for k, v in given.items() if k not in sim_names}
    sim_values = {k: v for k, v in given.items() if k in sim_names}
    SimulationConfig.from_dict(sim_values)
    if not any(getattr(args, k, None) for k in SWEEP_ONLY):
        RunConfig.from_dict({"out": "runs/sim", **values})
        return
    field, points = sweep.parse_sweep(args.sweep) if args.sweep else (None, [None])
    strategies = sweep.parse_strategies(args.strategies) if args.strategies else None
    seeds = sweep.parse_seeds(args.seeds) if args.seeds else None
    out = values.pop("out", None) or "runs/sweep"
    strategies = strategies or [str(values.get("strategy", "sync"))]
    seeds = seeds or [int(values.get("seed", 0))]
    assert sweep.sweep_points(values, sim_values, field, points, strategies, seeds, out)


def check_torchrun(argv: list[str], where: str) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.module:
        assert args.training_script == "cloudburst", f"{where}: torchrun -m {args.training_script}"
        check_cloudburst(args.training_script_args, where)
        return
    script = REPO / args.training_script
    assert script.is_file(), f"{where}: {args.training_script} does not exist"
    helped = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                            text=True, timeout=120, env=cli_env(), cwd=REPO)  # fmt: skip
    assert helped.returncode == 0, f"{where}: {script.name} --help: {helped.stderr}"
    for flag in (a.split("=")[0] for a in args.training_script_args if a.startswith("--")):
        assert flag in helped.stdout, f"{where}: {script.name} takes no {flag}"


def check_make(argv: list[str], where: str) -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for target in argv or ["all"]:
        assert target in targets, f"{where}: the Makefile has no target {target!r}"


def check_command(words: list[str], where: str) -> None:
    if words[0] in (sys.executable, "python") and words[1:3] == ["-m", "cloudburst"]:
        words = ["cloudburst", *words[3:]]
    head, rest = words[0].removeprefix(".venv/bin/"), words[1:]
    if head == "cloudburst":
        check_cloudburst(rest, where)
    elif head == "torchrun":
        check_torchrun(rest, where)
    elif head == "make":
        check_make(rest, where)
    elif head == "pip":
        pass  # an installation: not repeated here
    else:
        raise AssertionError(f"{where}: no check for {head!r}: add one to {__name__}, or SKIP")


def check_transcript(block: Block, monkeypatch, capsys) -> None:
    """``$ cloudburst …`` lines and what each prints (stdout and stderr, in that order). The
    documented transcripts are refusals: each runs through the CLI's ``main()`` in this
    process (a transcript that launches a job fails here: run it as a subprocess instead)."""
    lines = block.text.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    for k, i in enumerate(starts):
        words = shlex.split(lines[i][2:])
        expected = lines[i + 1 : starts[k + 1] if k + 1 < len(starts) else None]
        assert words[0] == "cloudburst", f"{block.where}: transcripts of {words[0]!r} not run"
        proc = refused(words[1:], monkeypatch, capsys)
        said = (proc.stdout + proc.stderr).strip().splitlines()
        assert said == expected, f"{block.where}: {shlex.join(words)} printed {said}"


def check_python(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.text)
    cmd = [sys.executable, str(script)]
    if "cloudburst.Job" in block.text:  # under torchrun, with the ranks its config asks for
        ranks = str(world_size(block))
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env(),
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, f"{block.where}: {cmd[1:-1]}:\n{proc.stdout}\n{proc.stderr}"


def world_size(block: Block) -> int:
    """The ranks the snippet's ``RunConfig(...)`` (literal arguments) asks for."""
    from cloudburst.config import RunConfig

    for node in ast.walk(ast.parse(block.text)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "RunConfig":
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            return RunConfig(**{"out": "unused", **kw}).world_size
    raise AssertionError(f"{block.where}: a cloudburst.Job snippet without a literal RunConfig")


# ---------------------------------------------------------------------------- the tests
BLOCKS = runnable()


def test_the_docs_have_runnable_blocks_and_every_skip_entry_matches_one():
    assert any(b.path.name == "README.md" for b in BLOCKS)
    for key in (*SKIP, *KNOWN_BUGS):
        matches = [b.where for b in BLOCKS if key in b.text]
        assert len(matches) == 1, f"entry {key!r} matches {matches or 'no block'}"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_each_documented_block_runs_or_parses(block, tmp_path, monkeypatch, capsys, request):
    if reason := entry(SKIP, block):
        pytest.skip(reason)
    if bug := entry(KNOWN_BUGS, block):
        request.applymarker(pytest.mark.xfail(reason=bug, strict=True))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    for name in USER_DATA:
        (tmp_path / name).mkdir(parents=True)
    if block.lang == "python":
        check_python(block, tmp_path)
    elif block.lang == "":
        check_transcript(block, monkeypatch, capsys)
    else:
        for words in commands(block.text):
            check_command(words, block.where)
        check_plotted_runs_were_written(commands(block.text), block.where)


def check_plotted_runs_were_written(lines: list[list[str]], where: str) -> None:
    """A ``cloudburst plot DIR …`` plots what an earlier command of its block wrote: each DIR
    is the ``--out`` of a ``train``/``simulate``/``compare`` before it (a ``train`` without
    ``--out`` writes a run the reader cannot name)."""
    from cloudburst.cli import build_parser

    parser, written = build_parser(), set()
    for words in lines:
        if words[0].removeprefix(".venv/bin/") != "cloudburst":
            continue
        args = parser.parse_args(words[1:])
        if args.command == "plot":
            missing = [r for r in args.runs if r.rstrip("/") not in written]
            assert not missing, f"{where}: plot {missing}: no command before it writes them"
        elif getattr(args, "out", None):
            written.add(args.out.rstrip("/"))


def test_the_readmes_demo_table_has_the_columns_the_demo_prints():
    from cloudburst.loop.summary import format_summary

    table = next(b.text for b in blocks(REPO / "README.md")
                 if b.lang == "" and b.text.lstrip().startswith("run  strategy"))  # fmt: skip
    shown = table.strip().splitlines()
    runs = [{"strategy": line.split()[1], "workers": 4} for line in shown[1:]]
    printed = format_summary(runs, [line.split()[0] for line in shown[1:]]).splitlines()
    assert shown[0].split() == printed[0].split(), "the README's demo table has other columns"
