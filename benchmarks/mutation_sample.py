"""make mutation's score estimated in about 40 minutes instead of four hours: every mutant of a few
census modules, and a seeded uniform random sample of the rest of the Makefile's MUTANTS, run
by mutmut against make test-fast's tier; the rest's share killed gets a Clopper-Pearson
interval (exact binomial coverage at any n; the finite population ignored, which widens it),
scaled with the census into an interval for the whole score. Run it from a clean copy of the
repository (mutmut writes mutants/ there); it writes the tally to ``--out`` (JSON, every
mutant's status) and prints it. benchmarks/results/mutation.md records a run.

    python benchmarks/mutation_sample.py --out mutation_sample.json
    python benchmarks/mutation_sample.py --tally --sample-file mutation_sample.json
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from scipy.stats import beta

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = [str(Path(sys.executable).with_name("mutmut")), "run", "--max-children", "2"]
CENSUS = ["strategies.asgd.worker", "strategies.sync.worker", "strategies.asgd.summary"]
DEAD = ("killed", "timeout")


def scope() -> list[str]:
    """The Makefile's MUTANTS patterns."""
    block = re.search(r"^MUTANTS := (.*?)\n\n", (ROOT / "Makefile").read_text(), re.S | re.M)
    return re.findall(r"'([^']+)'", block.group(1))


def module(name: str) -> str:
    return re.sub(r"\.x.*", "", name).removeprefix("cloudburst.")


def statuses() -> dict[str, str]:
    out = subprocess.run([MUTMUT[0], "results", "--all", "true"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    pairs = (line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)
    return {name: status for name, status in pairs}


def run(names: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(ROOT / "mutants" / "run.log", "a") as log:  # mutmut's progress
        subprocess.run([*MUTMUT, *names], cwd=ROOT, env=env, check=True, stdout=log, stderr=log)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--census", nargs="*", default=CENSUS, help="modules run in full")
    p.add_argument("--sample", type=int, default=500, help="mutants drawn from the rest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tally", action="store_true", help="run nothing: tally mutants/'s results")
    p.add_argument("--sample-file", type=Path, help="take the sample from a JSON this wrote")
    p.add_argument("--out", type=Path, help="write the tally here (JSON)")
    a = p.parse_args()
    if a.tally and not a.sample_file:
        p.error("--tally needs --sample-file: a fresh draw would tally mutants never run")
    patterns = scope()
    if not a.tally:  # the census first: its run also makes every mutant mutmut can name
        run([q for q in patterns if q.startswith(tuple(f"cloudburst.{m}." for m in a.census))])
    status = statuses()
    named = sorted(n for n in status if any(fnmatch.fnmatchcase(n, q) for q in patterns))
    census = [n for n in named if module(n) in a.census]
    rest = [n for n in named if module(n) not in a.census]
    if a.sample_file:
        sample = [n for n in json.loads(a.sample_file.read_text())["sample"] if n in rest]
    else:
        sample = sorted(random.Random(a.seed).sample(rest, a.sample))
    if not a.tally:
        run(sample)
        status = statuses()
    k, n, c = (
        sum(status[m] in DEAD for m in sample),
        len(sample),
        sum(status[m] in DEAD for m in census),
    )
    lo, hi = beta.ppf(0.025, k, n - k + 1), beta.ppf(0.975, k + 1, n - k)
    total = len(census) + len(rest)
    tally = {
        "census": {m: dict(Counter(status[x] for x in census if module(x) == m)) for m in a.census},
        "sample_counts": dict(Counter(status[m] for m in sample)),
        "rest": len(rest), "sample_size": n, "seed": a.seed,
        "rest_killed_share": [k / n, lo, hi],
        "score": [(c + s * len(rest)) / total for s in (k / n, lo, hi)],
        "sample": sample, "status": {m: status[m] for m in census + sample},
    }  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(tally, indent=1) + "\n")
    print(json.dumps({k: v for k, v in tally.items() if k not in ("sample", "status")}, indent=1))


if __name__ == "__main__":
    main()
