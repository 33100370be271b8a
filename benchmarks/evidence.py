"""The evidence table and the "Choosing a strategy" advice, generated from the claims in
``benchmarks/results/*.json``; ``--rescore`` re-derives stored claims with the harness's rules.

    .venv/bin/python benchmarks/evidence.py            # rewrite the text between the markers
    .venv/bin/python benchmarks/evidence.py --check    # exit 1 if a marked block is stale
    .venv/bin/python benchmarks/evidence.py --results runs/bench-quick --print
    .venv/bin/python benchmarks/evidence.py --rescore overhead local_sgd daso transport
    .venv/bin/python benchmarks/evidence.py --history  # the commands re-making history results

Details (markers, anchors, re-judging, re-scoring): benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import harness  # noqa: E402
from benchmarks.harness import CLAIM_HEADERS, REPO, RESULTS, Claim, fmt, md_table  # noqa: E402

BEGIN, END = "<!-- evidence:begin -->", "<!-- evidence:end -->"
CHOOSING = "<!-- choosing:begin -->", "<!-- choosing:end -->"
#: The README's advice, a row per situation and strategy: (situation, strategy, link, time,
#: quality), time and quality each (result, claim name prefix, what the value measures) or None.
Cell = tuple[str, str, str] | None
ADVICE: list[tuple[str, str, str, Cell, Cell]] = [
    ("One worker of four 2× slower (real runs, W = 4, every arm 40 s)", "`asgd`", "loopback",
     ("stragglers", "time to 85 %, asgd ÷ sync", "× sync's time to 85 %"),
     ("stragglers", "accuracy at the 40 s budget, asgd − sync",
      " points from sync when sync's time is up")),
    ("Sixty-four workers on 16 nodes, Pareto(2) step times, ResNet-50's size (virtual cluster, "
     "every arm's lr tuned)", "`diloco --replica node` (H = 8)", "10 Gbit/s",
     ("equal_time_pareto_w64", "time to sync's final accuracy − 0.5, diloco H=8 node",
      "× sync's time to its final accuracy − 0.5"),
     ("equal_time_pareto_w64", "accuracy at sync's time T, diloco H=8 node",
      " points from sync at sync's training time")),
    ("The same 64 workers, one replica per rank, no barrier (virtual cluster, every arm's lr "
     "tuned)", "`asgd --servers 4` (per rank: every rank pushes its Δ over the slow link)",
     "10 Gbit/s",
     ("staleness_w64", "time to sync's final − 0.5, asgd ÷ sync, W = 64",
      "× sync's time to its final accuracy − 0.5"),
     ("staleness_w64", "accuracy at sync's time T, asgd − sync (points), W = 64",
      " points from sync at sync's training time")),
    ("Two nodes of two, 1 Gbit/s between them (real runs, sync's lr and lr warm-up tuned, "
     "fresh seeds)", "`diloco --fragments 4 --fragment-delay 1` (Streaming DiLoCo, H = 8, lr 0.1)",
     "1 Gbit/s",
     ("slow_link_warmup", "time to 89.0 (named before), streaming lr 0.1 ÷ sync",
      "× sync's time to 89 % (named before from a pilot)"),
     ("slow_link_warmup", "accuracy at sync's time T, streaming lr 0.1 − sync",
      " points from sync when sync's time is up")),
    ("Two nodes of two, 1 Gbit/s between them (real runs, sync's lr and lr warm-up tuned, "
     "fresh seeds)", "`daso --daso-warmup-epochs 1 --daso-global-skip 8 --daso-batches-to-wait 2 "
     "--daso-cycling-downcast bf16 --warmup-steps 64` (lr 0.2)", "1 Gbit/s",
     ("slow_link_warmup", "time to 89.0 (named before), daso slow-link lr 0.2 warm-up 64 ÷ sync",
      "× sync's time to 89 % (named before from a pilot)"),
     ("slow_link_warmup", "accuracy at sync's time T, daso slow-link lr 0.2 warm-up 64 − sync",
      " points from sync when sync's time is up")),
    ("Sixteen workers, DiLoCo per sample (virtual cluster, sync's lr tuned)",
     "`diloco` (H = 8, outer 0.5/0.8)", "any", None,
     ("per_sample", "final accuracy at equal samples, diloco − sync (points), W = 16",
      " points from sync at equal samples")),
    ("Nodes of several workers, DiLoCo between them (time: real 2 × 2; quality: virtual "
     "4 × 4, equal samples)", "`diloco --replica node`", "1 / 10 Gbit/s",
     ("node_replicas", "real 2 × 2 at 1 Gbit/s: step time, node ÷ rank replicas",
      "× per-rank replicas' step time"),
     ("node_replicas", "final accuracy, node − rank replicas (points), diloco, 4 nodes",
      " points from per-rank replicas")),
    ("A small GPT, 2 nodes of 2 workers over 100 Mbit/s (real runs, every arm within sync's "
     "time)", "`diloco --replica node --fragments 4 --fragment-delay 1 --compress int8` (H = 8, "
     "twice sync's steps)", "100 Mbit/s",
     ("lm_slow_link_levels", "time to 2.46 nats (named before), streaming int8 node ×2 ÷ sync",
      "× sync's time to 2.46 nats (named before from a pilot)"),
     ("lm_slow_link_levels", "test loss at sync's time T, streaming int8 node ×2 − sync",
      " nats per byte from sync's loss when sync's time is up")),
    ("Two nodes of two, 1 Gbit/s between them, the fewest bytes (real runs; time: 288 steps, "
     "quality: 800)",
     "`diloco --period 32 --fragments 4 --fragment-delay 4 --diloco-outer-lr 0.5 --compress "
     "int8` (Streaming DiLoCo int8, H = 32)", "1 Gbit/s",
     ("compress", "time to 80 %: `sdiloco_f4_int8_h32` ÷ `sync`", "× sync's time to 80 %"),
     ("compress", "… at equal steps, its final accuracy − sync's (points), real W = 4",
      " points from sync at equal steps")),
    ("No straggler, fast link (W = 4)", "`sync` (DDP)", "loopback",
     ("overhead", "sync step ÷ raw DDP, W = 4", "× raw DDP's step time"), None),
]  # fmt: skip
ADVICE_HEADERS = ["situation", "strategy", "link", "time", "quality", "evidence"]


def load(results: Path) -> list[tuple[Path, dict]]:
    """(json path, data) of every result file with claims, by file name."""
    out = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"evidence: cannot read {path}: {e}")
        out += [(path, data)] if isinstance(data, dict) and data.get("claims") else []
    return out


def claim_of(c: dict) -> Claim:
    """A stored claim, judged by its interval ("re-judged" noted where that changed it)."""
    claim = Claim(**{k: v for k, v in c.items() if k in Claim.__dataclass_fields__})
    before = claim.verdict
    if claim.judge().verdict != before:
        claim.note = ", ".join(x for x in (f"re-judged from {before}", claim.note) if x)
    return claim


def link(path: Path, where: Path) -> str:
    return os.path.relpath(path, where.parent).replace(os.sep, "/")


def made_at(prov: dict, repo: Path = REPO) -> tuple[str, bool]:
    """The commits whose code made a result's runs, and whether any of them is history: the
    package (``cloudburst/``) has changed between it and the working tree. A result's own
    commit made its runs — or, where ``--replay`` took them from another result and did not
    re-simulate every one it checked bit for bit (``--verify``), the commits named in
    ``replayed_from`` did (with its own for the runs it added). An unknown commit is not
    judged. A commit given with words after it (a run on a copy without ``.git``: "abc1234
    (given; …)") is its first word."""
    own = (prov.get("commit") or "?").split()[0].removesuffix("+dirty")
    old = prov.get("replayed_from")
    verified = prov.get("verified") or []
    made = [own]
    if old and not (verified and all(same for *_, same in verified)):
        made = re.findall(r"^(\w+)`|and `(\w+)`", old)
        made = [a or b for a, b in made] + ([own] if prov.get("new_runs") else [])
    changed = [package_changed(c, repo) for c in made]
    text = ", ".join(f"`{c}`" for c in made)
    return (f"{text} — history: the package changed since", True) if any(changed) else (text, False)


def package_changed(commit: str, repo: Path = REPO) -> bool | None:
    """Whether ``cloudburst/`` differs between ``commit`` and the working tree (None: git
    cannot tell, e.g. a commit this clone lacks)."""
    r = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", commit, "--", "cloudburst"],
                       capture_output=True)  # fmt: skip
    return {0: False, 1: True}.get(r.returncode)


def rerun_command(prov: dict) -> str | None:
    """The command that makes a result again at this code: the one its provenance records,
    from the script on, without ``--replay``, ``--verify`` and ``--force`` (a replay's stored
    runs are what has to be re-made; a forced run runs unforced, on an idle machine). None
    where the record names no script under ``benchmarks/``."""
    words = shlex.split(prov.get("command", ""))
    script = next((i for i, w in enumerate(words) if re.fullmatch(r"benchmarks/\w+\.py", w)), None)
    if script is None:
        return None
    kept, words = [words[script]], iter(words[script + 1 :])
    for w in words:
        flag = w.split("=", 1)[0]
        if flag in ("--replay", "--verify") and "=" not in w:
            next(words, None)  # the flag's value
        elif flag not in ("--replay", "--verify", "--force"):
            kept.append(w)
    return shlex.join(kept)


def history(results: Path, repo: Path = REPO) -> list[str]:
    """:func:`rerun_command` of every result the package changed under, one a line, in the
    results' order (a result whose record names no script is skipped, said on stderr)."""
    lines = []
    for path, data in load(results):
        prov = data.get("provenance", {})
        if made_at(prov, repo)[1]:
            command = rerun_command(prov)
            if command is None:
                print(f"evidence: {path.stem}: no command to re-run it", file=sys.stderr)
            lines += [command] if command else []
    return lines


def table(results: Path, where: Path = REPO / "README.md") -> list[str]:
    """The evidence table, links relative to ``where`` (the file that will hold it)."""
    rows, history, files = [], [], load(results)
    for path, data in files:
        (commit, old), md = made_at(data.get("provenance", {})), path.with_suffix(".md")
        history += [path.stem] if old else []
        rows += [[f'<a id="c-{path.stem}-{i}"></a>[{path.stem}]({link(md, where)})',
                  *claim_of(c).row(), commit]
                 for i, c in enumerate(data["claims"], 1)]  # fmt: skip
    if not rows:
        return ["(no result file has claims yet: run `make bench`)"]
    summary = (f"{len(files) - len(history)} of {len(files)} results were made by the current "
               "package code" + (f"; history (the package changed since their runs): "
                                 f"{', '.join(history)}" if history else "") + ".")  # fmt: skip
    return [summary, "", *md_table(["result", *CLAIM_HEADERS, "commit"], rows)]


def choosing(results: Path, evidence_file: Path, where: Path) -> list[str]:
    """The advice table: per situation and strategy, the measured effect on time and on quality
    (value, interval, verdict), each linking to its row of the evidence table."""
    found = {
        path.stem: [(i, claim_of(c)) for i, c in enumerate(data["claims"], 1)]
        for path, data in load(results)
    }
    target = link(evidence_file, where) if evidence_file != where else ""

    def cell(spec: Cell) -> tuple[str, str]:
        if spec is None:
            return "-", ""
        stem, prefix, unit = spec
        hits = [(i, c) for i, c in found.get(stem, []) if c.name.startswith(prefix)]
        if not hits:
            return "not measured", ""
        i, c = hits[0]
        iv = f" [{fmt(c.interval[0])}, {fmt(c.interval[1])}]" if c.interval else ""
        aa = f", its A/A interval excludes {fmt(c.aa_null)}" if c.aa_differs else ""
        text = f"{fmt(c.value)}{unit}{bound(c)}{iv}: {shown(c)} (target {c.target}{aa})"
        return text + other_levels(c, [c2 for _, c2 in found[stem]]), f"c-{stem}-{i}"

    rows = []
    for situation, strategy, link_, time_spec, quality_spec in ADVICE:
        (time_text, time_ref), (quality_text, quality_ref) = cell(time_spec), cell(quality_spec)
        refs = ", ".join(
            f"[{what}]({target}#{ref})"
            for what, ref in (("time", time_ref), ("quality", quality_ref))
            if ref
        )
        if refs:
            rows.append([situation, strategy, link_, time_text, quality_text, refs])
    if not rows:
        return ["(no result file has the claims the advice rests on: run `make bench`)"]
    return md_table(ADVICE_HEADERS, rows)


def shown(c: Claim) -> str:
    return {"inconclusive": "**inconclusive**", "-": "no verdict"}.get(c.verdict, c.verdict)


def bound(c: Claim) -> str:
    """Why a ratio is a bound: on how many seeds the side whose median is censored reached the
    level at all (the baseline ``b`` for ≤, the arm ``a`` for ≥: :func:`harness.ratio_claim`)."""
    if not (isinstance(c.value, str) and c.value[:1] in "≤≥"):
        return ""
    who, side = ("the baseline", "b") if c.value[0] == "≤" else ("it", "a")
    values = (c.inputs or {}).get(side)
    if not values:
        return ""
    reached = sum(v is not None for v in values)
    return f" (a bound: {who} reached it on {reached} of {len(values)} seeds)"


def other_levels(c: Claim, claims: list[Claim]) -> str:
    """A time claim's verdict at the other levels its result judged ("time to L, rest" beside
    "time to L', rest"), said where it differs from the headline's: a verdict that holds at
    one target only is not advice."""
    if not c.name.startswith("time to ") or ", " not in c.name:
        return ""
    rest = c.name.removeprefix("time to ").split(", ", 1)[1]
    others = [
        (x.name.removeprefix("time to ").split(", ", 1)[0], x)
        for x in claims
        if x is not c and x.name.startswith("time to ") and x.name.endswith(f", {rest}")
    ]
    differ = [f"{lv}: {shown(x)}" for lv, x in others if x.verdict != c.verdict]
    same = [lv for lv, x in others if x.verdict == c.verdict]
    return (f"; at {', '.join(differ)}" if differ else "") + (
        f"; the same at {', '.join(same)}" if same else ""
    )


def splice(readme: str, lines: list[str], markers: tuple[str, str] = (BEGIN, END)) -> str:
    """``readme`` with the text between the markers replaced by ``lines``."""
    begin, end = markers
    if readme.count(begin) != 1 or readme.count(end) != 1 or readme.find(begin) > readme.find(end):
        sys.exit(f"evidence: the file needs exactly one {begin} … {end} pair, in that order")
    head, rest = readme.split(begin)
    return head + begin + "\n" + "\n".join(lines) + "\n" + end + rest.split(end)[1]


def marked(markers: tuple[str, str], root: Path = REPO) -> Path | None:
    """The one file of README.md and docs/*.md holding ``markers`` (None: none does)."""
    holders = [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
               if p.is_file() and markers[0] in p.read_text()]  # fmt: skip
    if len(holders) > 1:
        sys.exit(f"evidence: {markers[0]} is in {len(holders)} files: {holders}")
    return holders[0] if holders else None


# ---------------------------------------------------------------------------- --rescore
def _recipes(stem: str, data: dict) -> dict[str, dict]:
    """Claim name → its per-seed (per-round) inputs from the stored runs, for results written
    before claims kept them: ``{"a", "b", "aa", "budget_s"}`` or ``{"diff": (a, b)}`` (points)."""
    runs = [harness.Run(**r) for r in data.get("runs", [])]
    groups = harness.by_arm(runs)

    def value(arm: str, key: str) -> list:
        return [r.values.get(key) for r in groups.get(arm, [])]

    def acc(arm: str) -> list:
        return [r.summary.get("final_test_accuracy") for r in groups.get(arm, [])]

    out: dict[str, dict] = {}
    if stem == "overhead":
        for key, res in data["data"].items():
            med, ref = res["round_median_s"], "plain" if key == "W=1" else "ddp"
            name = f"sync step ÷ {'plain loop' if ref == 'plain' else 'raw DDP'}, W = {key[2:]}"
            out[name] = {"a": med["sync"], "b": med[ref], "aa": med[f"{ref} (A/A)"]}
    if stem == "transport":
        g = {arm: value(arm, "gbps") for arm in groups}
        out["asgd push+fetch ÷ raw gloo (throughput)"] = {"a": g["asgd"], "b": g["raw"],
                                                           "aa": g["raw (A/A)"]}  # fmt: skip
        for arm, what in (("duplex", "both directions at once"), ("pipelined", "not package code")):
            out[f"{arm} reference ÷ raw gloo ({what})"] = {"a": g[arm], "b": g["raw"]}
        out["asgd's CPU-bound ceiling ÷ raw gloo (raw ms × 2 cores ÷ asgd CPU ms)"] = {
            "withdrawn": "asgd's own measurement rescaled, so it could not disagree (issue 25)"
        }
    for c in data["claims"] if stem.startswith("accuracy") else []:
        if m := re.match(r"final accuracy, (.+?) − sync \(points\)", c["name"]):
            out[c["name"]] = {"diff": (acc(m[1]), acc("sync"))}  # seed-sorted: paired
    budget = harness.budget_of(runs)
    for c in data["claims"] if stem in ("local_sgd", "daso") else []:
        if m := re.match(r"time per step, (\S+) ÷ (\S+),", c["name"]):
            aa = harness.pairs(value("local_sgd (A/A)", "step_s"), value("local_sgd", "step_s"))
            a, b = harness.pairs(value(m[1], "step_s"), value(m[2], "step_s"))
            out[c["name"]] = {"a": a, "b": b, "aa": harness.paired_ratio(*aa)[0]}
            if m[1] == "local_sgd" and len(aa[0]) == len(a):  # both copies of local_sgd
                out[c["name"]].update(aa=aa[0], aa_of="a")
        elif m := re.match(r"time to ([\d.]+) %, (\S+) ÷ (\S+),", c["name"]):
            t = {arm: harness.times_to(rs, float(m[1]) / 100) for arm, rs in groups.items()}
            aa = harness.paired_ratio(t["sync (A/A)"], t["sync"], budget)[0]
            aa = t["sync (A/A)"] if m[3] == "sync" else aa  # both copies of sync
            out[c["name"]] = {"a": t[m[2]], "b": t[m[3]], "aa": aa, "budget_s": budget}
        elif m := re.match(r"final accuracy, (\S+) − sync", c["name"]):
            out[c["name"]] = {"diff": (acc(m[1]), acc("sync"))}
        if "÷ sync_powersgd" in c["name"]:
            out[c["name"]] = {
                "withdrawn": "PowerSGD at rank 1 from iteration 2 never reached "
                "85 % (37-65 %): an untuned baseline, a straw man (issue 40)"
            }
    return out


def rescore(path: Path, head: str) -> list[str]:
    """Re-derive ``path``'s claims and write them back, stamped; the names it could not."""
    data = json.loads(path.read_text())
    recipes = _recipes(path.stem, data)
    report = harness.Report(path.stem, "", harness.Provenance.__new__(harness.Provenance))
    claims, missing, withdrawn = [], [], []
    for c in data["claims"]:
        old = Claim(**{k: v for k, v in c.items() if k in Claim.__dataclass_fields__})
        inputs, rule = recipes.get(old.name) or old.inputs, harness.parse_target(old.target)

        def point(x: float, rule: harness.Rule | None = rule) -> bool | None:
            return None if rule is None else rule.holds(x)

        if inputs and "withdrawn" in inputs:
            withdrawn.append(f"{old.name} ({fmt(old.value)}): {inputs['withdrawn']}")
            continue
        if inputs and "diff" in inputs:
            # the verdict of the rounded value the row shows
            digits = 2 if "scale" not in inputs else 4
            rounded = lambda d, lo, hi, n=digits: point(round(d, n))  # noqa: E731
            new = harness.diff_claim(report, old.name, *inputs["diff"], old.target, rounded,
                                     seeds=old.seeds, aa_copy=inputs.get("aa"), digits=digits,
                                     scale=inputs.get("scale", 100.0))  # fmt: skip
        elif inputs:
            new = harness.ratio_claim(report, old.name, inputs["a"], inputs["b"], inputs.get("aa"),
                                      old.target, point, inputs.get("budget_s"),
                                      aa_of=inputs.get("aa_of", "b"))  # fmt: skip
        else:
            missing.append(old.name)
            why = "no per-seed values stored" if old.interval else "no interval: a count, kept"
            old.note = ", ".join(x for x in (old.note, f"not re-scored: {why}") if x)
            claims.append(old)
            continue
        first = re.search(r"re-scored; was [^,]*", old.note or "")  # the stored value, kept
        was = first[0] if first else f"re-scored; was {fmt(old.value)} {old.verdict}"
        new.note = ", ".join(x for x in (new.note, was) if x)
        claims.append(new)
    data["claims"] = [json.loads(json.dumps(c.__dict__, default=list)) for c in claims]
    stamp = (f"- **re-scored at `{head}`** (`benchmarks/evidence.py --rescore`): the runs are "
             f"`{data.get('provenance', {}).get('commit', '?')}`'s, the statistics and verdicts "
             "the harness's rules at that commit (t intervals paired by seed or round, a "
             "ratio to a baseline judged against both its copies; PASS only when the whole "
             "interval meets the target): history, not new evidence"
             + "".join(f"; withdrawn: {w}" for w in withdrawn))  # fmt: skip
    data["rescored"] = stamp
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    md = path.with_suffix(".md")
    rows = "\n".join(md_table(CLAIM_HEADERS, [c.row() for c in claims])) + "\n"
    rows += "" if harness.INTERVALS in md.read_text() else f"\n{harness.INTERVALS}\n"
    text = re.sub(r"## Claims\n\n(\|.*\n)+", lambda _: "## Claims\n\n" + rows, md.read_text())
    text = re.sub(r"\n- \*\*re-scored at .*\n", "\n", text)
    md.write_text(re.sub(r"(\n- commit: .*\n)", lambda m: m[1] + stamp + "\n", text, count=1))
    return missing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of result .json files")
    p.add_argument("--readme", type=Path, default=None, help="the file holding the table's markers")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 if a marked block is stale")
    group.add_argument("--print", action="store_true", help="print the table, write nothing")
    group.add_argument("--rescore", nargs="+", metavar="RESULT", help="re-derive these results")
    group.add_argument(
        "--history", action="store_true", help="print the commands re-making history results"
    )
    args = p.parse_args()
    if args.history:
        print("\n".join(history(args.results)))
        return
    if args.rescore:
        head = harness.git_commit()[0]
        for stem in args.rescore:
            path = args.results / f"{stem}.json"
            if not path.is_file():
                sys.exit(f"evidence: no result {path}")
            missing = rescore(path, head)
            note = f"; not re-scored: {missing}" if missing else ""
            print(f"evidence: {stem} re-scored{note}")
        return
    table_file = args.readme or marked((BEGIN, END))
    if table_file is None:
        sys.exit(f"evidence: no file of README.md, docs/*.md holds {BEGIN}")
    lines = table(args.results, table_file)
    if args.print:
        print("\n".join(lines))
        return
    advice_file = marked(CHOOSING)
    stale, blocks = [], [(table_file, (BEGIN, END), lines)]
    if advice_file:
        blocks.append((advice_file, CHOOSING, choosing(args.results, table_file, advice_file)))
    for file, markers, new_lines in blocks:
        old = file.read_text()
        new = splice(old, new_lines, markers)
        if args.check:
            stale += [str(file)] if new != old else []
        elif new != old:
            file.write_text(new)
            print(f"evidence: {markers[0]} block of {file} rewritten")
    if advice_file is None:
        print(f"evidence: no file holds {CHOOSING[0]}: the advice was not written", file=sys.stderr)
    if stale:
        sys.exit(f"evidence: stale: {', '.join(stale)}; run benchmarks/evidence.py")


if __name__ == "__main__":
    main()
