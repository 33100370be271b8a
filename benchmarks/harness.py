"""The one harness every benchmark uses: provenance, runs in a seeded random order with an A/A
control, honest statistics (time to target held for k evaluations, censored runs counted, t
intervals paired by seed, ratios judged against both copies of their control, verdicts from the
interval) and one report template: ``results/<name>.md`` + ``.json``, whose claims
``benchmarks/evidence.py`` turns into the evidence table. The rules and why:
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: Where reports go: the committed evidence, or the folder ``make bench`` names (its hour tier)
RESULTS = Path(os.environ.get("CLOUDBURST_BENCH_RESULTS") or REPO / "benchmarks" / "results")
QUICK_RESULTS = REPO / "runs" / "bench-quick"  # --quick output: a smoke test, never evidence
RUNS = REPO / "runs" / "bench"
BUSY_FRACTION = 0.25  # other processes using more than this share of all cores = a busy machine
K_CONSECUTIVE = 3  # evaluations a time to target must hold for
CLI = (sys.executable, "-m", "cloudburst")
Vals = Sequence[float | None]  # per-seed values, None = censored
Interval = tuple[float, float, float]  # (estimate, 2.5th, 97.5th percentile)
SIMULATE = (*CLI, "simulate", "--overwrite")  # a run_train command: the virtual cluster


def parse_args(description: str | None, add: Callable | None = None) -> argparse.Namespace:
    """The flags every benchmark has plus the script's own, added by ``add(parser)``."""
    first_line = description.strip().splitlines()[0] if description else None
    p = argparse.ArgumentParser(description=first_line)
    p.add_argument("--quick", action="store_true", help="a small smoke subset; not evidence")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (script's default)")
    p.add_argument("--force", action="store_true", help="run on a dirty tree or a busy machine")
    p.add_argument("--out", default=None, help="report path (default results/<name>.md)")
    p.add_argument("--replay", type=Path, default=None, metavar="RESULT.json",
                   help="report on the runs a result stored instead of running (history: the "
                        "runs stay that result's commit's)")  # fmt: skip
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="with --replay, re-simulate K seeded-random stored runs of each batch "
                        "at this commit: all bit for bit identical, the result holds at this "
                        "code")  # fmt: skip
    if add is not None:
        add(p)
    args = p.parse_args()
    if args.seeds is not None and args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.verify and args.replay is None or args.verify < 0:
        p.error("--verify K needs --replay RESULT.json and K >= 0")
    return args


def start(description: str | None, add: Callable | None = None) -> tuple[Any, Provenance]:
    """:func:`parse_args`, then :meth:`Provenance.capture` (which may refuse to start)."""
    args = parse_args(description, add)
    return args, Provenance.capture(args)


def about(doc: str) -> str:
    """A script's docstring as a report's settings: without its title and command lines."""
    paragraphs = doc.strip().split("\n\n")[1:]
    return "\n\n".join(p for p in paragraphs if not p.startswith("    ")).strip()


# ---------------------------------------------------------------------------- provenance
def _git(*argv: str) -> str:
    proc = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, check=False)
    return proc.stdout


def git_commit() -> tuple[str, list[str]]:
    """(short commit, paths changed outside results and runs/; or $CLOUDBURST_GIT_REVISION)."""
    if os.environ.get("CLOUDBURST_GIT_REVISION"):
        return os.environ["CLOUDBURST_GIT_REVISION"] + " (given; tree without .git)", []
    commit = _git("rev-parse", "--short", "HEAD").strip() or "unknown"
    lines = _git("status", "--porcelain").splitlines()
    return commit, [x[3:] for x in lines if not x[3:].startswith(("benchmarks/results/", "runs/"))]


def cpu_ticks() -> tuple[int, int]:
    """(all, idle + iowait) CPU ticks of the machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)


def cpu_busy_fraction(interval_s: float = 1.0) -> float:
    """Share of all cores busy over ``interval_s`` (/proc/stat: the load average lags)."""
    try:
        total0, idle0 = cpu_ticks()
        time.sleep(interval_s)
        total1, idle1 = cpu_ticks()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def _cpuinfo(key: str) -> str | None:
    """The first ``key`` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith(key)), None)


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown"


NUMERIC_PACKAGES = ("numpy", "scipy", "mnist1d")
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def numerics() -> str:
    """What beside the code sets a simulation's floating-point results: the versions of the
    packages that make the data and the maths, and the CPU's vector extensions (torch picks its
    kernels by them). A stored run re-simulates bit for bit only where this line is the same."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    flags = (_cpuinfo("flags") or "").split()
    simd = [f for f in SIMD_FLAGS if f in flags] or ["unknown"]
    return ", ".join(f"{n} {ver(n)}" for n in NUMERIC_PACKAGES) + "; CPU " + " ".join(simd)


@dataclass
class Provenance:
    """Where and how a result was made: command, commit, machine, load. See :meth:`capture`."""

    command: str
    cwd: str
    commit: str
    dirty: list[str]
    forced: bool
    quick: bool
    started_utc: str
    python: str
    torch: str
    cpu: str
    nproc: int
    gpu: str | None
    host: str
    platform: str
    busy_fraction_before: float
    load_before: float
    loads: list[float] = field(default_factory=list)
    load_after: float | None = None
    commit_after: str | None = None
    replayed_from: str | None = None  # --replay: the commit whose stored runs this reports on
    # --verify: (arm, seed, identical) of each stored run re-simulated at this commit
    verified: list[tuple[str, int, bool]] = field(default_factory=list)
    # --replay: the real runs made at this commit because the replayed result had none of them
    new_runs: int = 0
    numerics: str | None = None  # :func:`numerics`; None in results made before it was recorded
    journal_file: str | None = None  # :meth:`journal`: every run as it ends, for a resume
    args: Any = field(default=None, repr=False)

    @classmethod
    def capture(cls, args: argparse.Namespace) -> Provenance:
        """The provenance; exits on a dirty tree or a busy machine unless --force or --quick."""
        import torch

        commit, dirty = git_commit()
        quick = bool(getattr(args, "quick", False))
        force = bool(getattr(args, "force", False)) or quick
        if dirty and not force:
            sys.exit(
                f"benchmark refused: the tree has {len(dirty)} uncommitted change(s) "
                f"({', '.join(dirty[:3])}{', …' if len(dirty) > 3 else ''}); commit them or "
                "pass --force (the result is then marked dirty)"
            )
        busy = cpu_busy_fraction()
        # a replay that re-simulates nothing measures nothing: the machine's load cannot move it
        # (a journal's replay resumes a run that stopped: it makes the runs still missing)
        replay = getattr(args, "replay", None)
        measures = replay is None or getattr(args, "verify", 0) or is_journal(replay)
        if busy > BUSY_FRACTION and not force and measures:
            sys.exit(
                f"benchmark refused: the machine is busy ({100 * busy:.0f} % of "
                f"{os.cpu_count()} cores in use by other processes, limit "
                f"{100 * BUSY_FRACTION:.0f} %); wait, or pass --force"
            )
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        return cls(shlex.join(sys.orig_argv), os.getcwd(), commit + ("+dirty" if dirty else ""),
                   dirty, force, quick, datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
                   platform.python_version(), torch.__version__, _cpu_model(),
                   os.cpu_count() or 1, gpu, socket.gethostname(), platform.platform(),
                   round(busy, 3), load1(), numerics=numerics(), args=args)  # fmt: skip

    def replayed_runs(self) -> list[Run] | None:
        """With ``--replay RESULT.json``: that result's stored runs (its commit recorded in
        :attr:`replayed_from`, said in the report); otherwise None: run the arms."""
        path = getattr(self.args, "replay", None)
        if path is None:
            return None
        data = read_journal(path) if is_journal(path) else json.loads(Path(path).read_text())
        old = data.get("provenance", {})
        # A replay's runs were made by the result it replayed: name that one.
        self.replayed_from = old.get("replayed_from") or (
            f"{old.get('commit', '?')}` (started {old.get('started_utc')} UTC, "
            f"load {old.get('load_before')} before, {old.get('load_after')} "
            "after: the load lines below are the replay's)")  # fmt: skip
        if not old.get("replayed_from"):  # a replay of a replay already says its maker's
            self.replayed_from += (f"; its numerics: {old['numerics']}" if old.get("numerics")
                                   else "; its numerics not recorded")  # fmt: skip
        if old.get("new_runs"):  # that result added runs of its own to those it replayed
            self.replayed_from += f" and `{old.get('commit')}` ({old['new_runs']} runs it added)"
        return [Run(**r) for r in data.get("runs", [])]

    def stored_runs(self) -> dict[tuple[str, int, tuple[str, ...] | None], Run] | None:
        """:meth:`replayed_runs` by (arm, seed, place: :func:`run_place`), read once; None
        without ``--replay``."""
        if getattr(self, "_stored", None) is None:
            runs = self.replayed_runs()
            self._stored = (None if runs is None else
                            {(r.arm, r.seed, run_place(r.out_dir)): r for r in runs})  # fmt: skip
        return self._stored

    def journal(self, run: Run) -> None:
        """Append ``run`` to this benchmark's journal (its first line this provenance), so a
        script that stops late keeps the runs it made: ``--replay JOURNAL.jsonl`` resumes it,
        making only the runs still missing. The file: ``runs/bench/journal/`` (git-ignored)."""
        with _JOURNAL_LOCK:  # simulate_all's threads end runs concurrently
            if self.journal_file is None:
                stamp = re.sub(r"\D", "", self.started_utc)
                name = f"{Path(sys.argv[0]).stem}-{stamp}.jsonl"
                self.journal_file = str(self.runs_dir("journal") / name)
            path = Path(self.journal_file)
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"provenance": self.to_dict()}, default=str) + "\n")
                print(f"runs journaled to {path} (if this stops early: --replay {path})",
                      flush=True)  # fmt: skip
            with path.open("a") as f:
                f.write(json.dumps(run.to_dict(), default=str) + "\n")

    def results_dir(self) -> Path:
        """Where reports go: ``benchmarks/results/``, or ``runs/bench-quick/`` for --quick."""
        return QUICK_RESULTS if self.quick else RESULTS

    def runs_dir(self, name: str) -> Path:
        """Where the run directories of benchmark ``name`` go (git-ignored)."""
        return (QUICK_RESULTS / "runs" if self.quick else RUNS) / name

    def sample_load(self) -> float:
        """Record the 1-min load average now (after each run) and return it."""
        self.loads.append(load1())
        return self.loads[-1]

    def finish(self) -> None:
        self.load_after, self.commit_after = load1(), git_commit()[0]

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "args"}


_JOURNAL_LOCK = threading.Lock()


def is_journal(path: str | Path | None) -> bool:
    return path is not None and str(path).endswith(".jsonl")


def read_journal(path: str | Path) -> dict[str, Any]:
    """A journal (:meth:`Provenance.journal`) as a result's ``provenance`` and ``runs``; a last
    line cut short by the stop is left out."""
    lines = Path(path).read_text().splitlines()
    if not lines:
        sys.exit(f"--replay: {path} is an empty journal")
    runs = []
    for line in lines[1:]:
        try:
            runs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return {"provenance": json.loads(lines[0]).get("provenance", {}), "runs": runs}


# ---------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Arm:
    """One configuration: ``cloudburst train`` flags without ``--out``/``--seed``."""

    name: str
    argv: Sequence[str] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "argv", tuple(self.argv))


@dataclass
class Run:
    """One run of one arm: ``evals`` (:func:`read_evals`) of the global model, ``values`` what
    else was measured. A failed run is kept, with ``failed`` set."""

    arm: str
    seed: int
    wall_s: float
    summary: dict[str, Any] = field(default_factory=dict)
    evals: list[tuple[float, int, float]] = field(default_factory=list)
    failed: str | None = None
    load_before: float | None = None
    load_after: float | None = None
    values: dict[str, Any] = field(default_factory=dict)
    out_dir: str | None = None
    position: int | None = None  # its place in its seed's shuffled order (interleave)

    @property
    def final_accuracy(self) -> float | None:
        return self.summary.get("final_test_accuracy")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def records(out_dir: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, record) of every rank's metrics records, a line cut short by a kill left out."""
    for path in sorted(Path(out_dir, "metrics").glob("rank*.jsonl")):
        for line in path.read_text(errors="ignore").splitlines():
            try:
                yield path.name, json.loads(line)
            except json.JSONDecodeError:
                continue


def read_evals(
    out_dir: str | Path, field: str = "test_accuracy", sign: float = 1.0
) -> list[tuple[float, int, float]]:
    """The eval records as ``(time_s, samples, sign × field)`` by time (``train_time_s`` if
    any): the accuracy, or with ``"test_loss", -1`` the negated loss, so that "holds a loss of
    at most L" is :func:`time_to_target` of −L."""
    evals = []
    for _, r in records(out_dir):
        if r.get("event") == "eval" and isinstance(r.get(field), int | float):
            t = r.get("train_time_s", r["time_s"])
            evals.append((float(t), int(r.get("samples", 0)), sign * float(r[field])))
    return sorted(evals)


def read_summary(out_dir: str | Path) -> dict[str, Any]:
    """A run directory's ``summary.json`` without its ``config`` (``{}`` if there is none)."""
    path = Path(out_dir, "summary.json")
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary.pop("config", None)
    return summary


def run_train(
    arm: Arm, seed: int, out_dir: str | Path, timeout_s=900.0, command=(*CLI, "train")
) -> Run:
    """``<command> <argv> --seed S --out D --no-progress`` in a subprocess (``OMP_NUM_THREADS=1``,
    the repository on ``PYTHONPATH``; ``command``: ``cloudburst train``, :data:`SIMULATE`, a
    peer's script...). A non-zero exit, a timeout or no ``summary.json`` sets ``failed``."""
    out_dir = Path(out_dir)
    cmd = [*command, *arm.argv, "--seed", str(seed), "--out", str(out_dir), "--no-progress"]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    started, failed = time.monotonic(), None
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            failed = f"exit {proc.returncode}: {tail[0][:300]}"
    except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout_s:g} s"
    wall = time.monotonic() - started
    summary = read_summary(out_dir)
    failed = failed or (None if summary else "no summary.json")
    evals = read_evals(out_dir) if (out_dir / "metrics").is_dir() else []
    return Run(arm.name, seed, round(wall, 3), summary, evals, failed, out_dir=str(out_dir))


def step_s(step_times: dict[str, list[list[float]]], skip_steps: int = 0) -> float | None:
    """Median of Δtime ÷ Δsteps over every rank's windows ``[step, time_s]`` from ``skip_steps``."""
    per_step = [
        (b[1] - a[1]) / (b[0] - a[0])
        for times in step_times.values()
        for a, b in itertools.pairwise(times)
        if b[0] > a[0] and a[0] >= skip_steps
    ]
    return statistics.median(per_step) if per_step else None


def run_step_s(out_dir: str | Path, skip_steps: int = 32) -> float | None:
    """:func:`step_s` of a run directory's ``step`` records (every rank's)."""
    times: dict[str, list[list[float]]] = {}
    for rank, r in records(out_dir):
        if r.get("event") == "step":
            times.setdefault(rank, []).append([r["step"], r["time_s"]])
    return step_s(times, skip_steps)


def slug(name: str) -> str:
    """``name`` as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "arm"


def interleave(
    arms: Sequence[Arm], seeds: Sequence[int], control: str | None = None,
    run: Callable[[Arm, int], Run] | None = None, *, prov: Provenance | None = None,
    out_root: str | Path | None = None, timeout_s: float = 900.0, order_seed: int = 0,
    phase: str | None = None,
) -> list[Run]:  # fmt: skip
    """Every arm once per seed, seed by seed, in an order shuffled per seed by
    ``random.Random(f"{order_seed}:{seed}")`` (recorded as each Run's ``position``; rotating
    the order put the A/A copy right before its control every time); ``control``'s arm runs a
    second time per seed as ``"<name> (A/A)"`` (the A/A pair). ``run(arm, seed)`` defaults to
    :func:`run_train` into ``out_root/<arm>/seed<S>``. Each Run gets the 1-min load average
    before and after it; failed runs are kept.

    With ``--replay RESULT.json`` a stored run of the same arm and seed (one whose directory
    has the folder ``phase``, where a script runs an arm in more than one phase) stands in for
    the run; the others run here, counted in ``prov.new_runs`` and said in the report, so a
    script can add seeds to a stored result without re-running what it has."""
    arms = list(arms)
    if control is not None:
        base = next((a for a in arms if a.name == control), None)
        if base is None:
            raise ValueError(f"control arm {control!r} is not among {[a.name for a in arms]}")
        arms.append(Arm(aa_name(control), base.argv))
    if len({a.name for a in arms}) != len(arms):
        raise ValueError(f"arm names must be unique, got {[a.name for a in arms]}")
    if run is None:
        root = Path(out_root) if out_root is not None else RUNS

        def run(arm: Arm, seed: int) -> Run:
            return run_train(arm, seed, root / slug(arm.name) / f"seed{seed}", timeout_s)

    stored = prov.stored_runs() if prov is not None else None
    runs = []
    for seed in seeds:
        order = random.Random(f"{order_seed}:{seed}").sample(arms, len(arms))
        for position, arm in enumerate(order):
            if stored is not None and (old := stored_in(stored, arm.name, seed, phase)):
                runs.append(old)
                continue
            before = load1()
            runs.append(r := run(arm, seed))
            r.load_before, r.load_after = before, prov.sample_load() if prov else load1()
            r.position = position
            if prov is not None:
                prov.journal(r)
            if stored is not None:
                prov.new_runs += 1
            print(f"  {arm.name} seed {seed}: {describe(r)}", flush=True)
    return runs


def stored_in(
    stored: dict[tuple[str, int, tuple[str, ...] | None], Run], arm: str, seed: int,
    phase: str | None,
) -> Run | None:  # fmt: skip
    """The stored run of ``arm`` and ``seed`` (in ``phase``'s folder if given); exits when
    more than one matches (the script must name its phases)."""
    found = [r for (a, s, place), r in stored.items()
             if a == arm and s == seed and (phase is None or phase in (place or ()))]  # fmt: skip
    if len(found) > 1:
        sys.exit(f"--replay: the result stored {len(found)} runs of {arm} seed {seed}; "
                 "the script must pass interleave(phase=...)")  # fmt: skip
    return found[0] if found else None


def aa_name(control: str) -> str:
    return f"{control} (A/A)"


def describe(r: Run) -> str:
    if r.failed:
        return f"FAILED ({r.failed})"
    acc = [] if r.final_accuracy is None else [f"final acc {100 * r.final_accuracy:.1f} %"]
    values = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.values.items()]
    return ", ".join([f"wall {r.wall_s:.1f} s", *acc, *values])


def by_arm(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs grouped by arm name, each group in seed order."""
    out: dict[str, list[Run]] = {}
    for r in sorted(runs, key=lambda r: r.seed):
        out.setdefault(r.arm, []).append(r)
    return out


# ---------------------------------------------------------------------------- statistics
def time_to_target(evals: Sequence[tuple], target: float, k: int = K_CONSECUTIVE) -> float | None:
    """The time of the first evaluation from which the accuracy is ≥ ``target`` for ``k``
    consecutive evaluations (that one included); ``None`` (censored) if there is none."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    held = 0
    for i, (_, _, acc) in enumerate(evals):
        held = held + 1 if acc >= target else 0
        if held == k:
            return evals[i - k + 1][0]
    return None


def censored_median(times: Sequence[float | None], budget_s: float) -> tuple[float | str, int]:
    """(median, how many censored): ``None`` sorts above every time (median ``"> <budget> s"``)."""
    if not times:
        raise ValueError("censored_median of no runs")
    med = statistics.median(sorted(float("inf") if t is None else t for t in times))
    return (f"> {budget_s:.4g} s" if med == float("inf") else med), sum(t is None for t in times)


def _uncensor(values: Sequence[float | None], budget_s: float | None) -> list[float]:
    if any(v is None for v in values) and budget_s is None:
        raise ValueError("censored values (None) need budget_s")
    return [budget_s if v is None else float(v) for v in values]  # type: ignore[misc]


#: How every interval is made; each report says so under its claims.
INTERVALS = (
    "Intervals: 95 % Student t — of the mean per-seed difference (paired by seed) for a "
    "difference, of the mean log ratio for a ratio (the value is the geometric mean of the "
    "per-seed ratios), Welch's where the sides are not paired; their coverage is nominal at "
    "any n ≥ 2 when the per-seed values are normal (log-normal for ratios), where a percentile "
    "bootstrap at n = 5 covers ~85 %. A ratio or difference against a control that has an A/A "
    "copy is judged against both copies (the interval shown spans both); the A/A column gives "
    "the copy ÷ (for a difference, −) the side it repeats with its interval, flagged when that "
    "excludes 1 (0)."
)


def _t_mean(x: Sequence[float], y: Sequence[float] | None = None) -> Interval:
    """(mean(x) − mean(y), 95 % t interval): one-sample on ``x`` when ``y`` is None, else
    Welch's two-sample interval; with fewer than 2 values a side the interval is unbounded."""
    from scipy.stats import t as student_t

    mean = statistics.fmean(x) - (statistics.fmean(y) if y is not None else 0.0)
    sides = [x] if y is None else [x, y]
    if any(len(v) < 2 for v in sides):
        return mean, -math.inf, math.inf
    parts = [statistics.variance(v) / len(v) for v in sides]
    se = math.sqrt(sum(parts))
    if se == 0:
        return mean, mean, mean
    if y is None:
        df = len(x) - 1
    else:  # Welch–Satterthwaite
        df = se**4 / sum(p * p / (len(v) - 1) for p, v in zip(parts, sides, strict=True))
    half = float(student_t.ppf(0.975, df)) * se
    return mean, mean - half, mean + half


def ratio_interval(
    a: Vals, b: Vals, budget_s: float | None = None, paired: bool = False
) -> Interval:
    """(a ÷ b, 95 % interval), from the logs: ``paired`` (seed i's a with seed i's b) the
    geometric mean of the per-pair ratios and a t interval of the mean log ratio, otherwise
    the ratio of geometric means and Welch's interval. Censored values (``None``) count as
    ``budget_s``. Every value must be positive."""
    xa, xb = _uncensor(a, budget_s), _uncensor(b, budget_s)
    if not xa or not xb:
        raise ValueError("a ratio interval needs at least one value on each side")
    if paired and len(xa) != len(xb):
        raise ValueError(f"a paired ratio needs pairs, got {len(xa)} and {len(xb)} values")
    if min(xa + xb) <= 0:
        raise ValueError("a ratio interval needs positive values (a value is <= 0)")
    la, lb = [math.log(v) for v in xa], [math.log(v) for v in xb]
    if paired:
        m, lo, hi = _t_mean([p - q for p, q in zip(la, lb, strict=True)])
    else:
        m, lo, hi = _t_mean(la, lb)
    return math.exp(m), math.exp(lo), math.exp(hi)


def paired_ratio(a: Vals, b: Vals, budget_s: float | None = None) -> Interval:
    """:func:`ratio_interval` paired by seed (or round: what a pair shares cancels)."""
    return ratio_interval(a, b, budget_s, paired=True)


def difference_interval(a: Sequence[float], b: Sequence[float], paired: bool = True) -> Interval:
    """(mean(a) − mean(b), 95 % t interval): paired by seed, or Welch's when ``paired`` is
    False."""
    if paired:
        if len(a) != len(b):
            raise ValueError(f"a paired difference needs pairs, got {len(a)} and {len(b)} values")
        return _t_mean([p - q for p, q in zip(a, b, strict=True)])
    return _t_mean(a, b)


def pairs(x: Vals, y: Vals) -> tuple[list[float], list[float]]:
    """The seeds where both sides have a (non-zero) value, as two aligned lists."""
    both = [(p, q) for p, q in zip(x, y, strict=True) if p and q]
    return [p for p, _ in both], [q for _, q in both]


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not ``None`` (``None`` if there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def times_to(runs: Sequence[Run], target: float, k: int = K_CONSECUTIVE) -> list[float | None]:
    """Each run's :func:`time_to_target` (a failed run counts as censored)."""
    return [None if r.failed else time_to_target(r.evals, target, k) for r in runs]


def mean_log_time(runs: Sequence[Run], target: float, budget: float) -> float:
    """The mean log time to ``target`` (:func:`times_to`) of ``runs``, a run that never holds it
    counted at ``budget``: the tuning phases' score (the log of a geometric-mean time)."""
    return statistics.mean(math.log(t or budget) for t in times_to(runs, target))


def budget_of(runs: Sequence[Run]) -> float:
    """The censoring budget: the longest training time any of ``runs`` recorded."""
    longest = max((r.evals[-1][0] for r in runs if r.evals), default=0.0)
    return longest or max((r.wall_s for r in runs), default=0.0)


CENSORED_SAMPLES = "the fewest any censored run had processed by its budget: a lower bound of each"


def censored_floor(runs: Iterable[tuple[int | None, int]]) -> int:
    """What a censored run's samples to target count as, from (samples to target or None,
    samples processed within the budget) per run: the fewest any censored run had processed,
    a lower bound of each one's count. With none censored: the fewest processed (unused)."""
    runs = list(runs)
    ends = [done for to, done in runs if to is None]
    return min(ends or [done for _, done in runs], default=1)


def fmt(value: Any, digits: int = 3) -> str:
    """A number to ``digits`` significant figures; ``None`` as ``-``; strings as they are."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"


def pct(acc: float | None) -> str:
    return "-" if acc is None else f"{100 * acc:.1f}"


# ---------------------------------------------------------------------------- verdicts
PASS, MISS, INCONCLUSIVE = "PASS", "MISS", "inconclusive"
_NUM = r"([-−]?\d+(?:\.\d+)?)"


@dataclass(frozen=True)
class Rule:
    """What a target asks of a value: ``lo ≤ value ≤ hi`` (``None``: that side is open)."""

    lo: float | None
    hi: float | None

    def holds(self, x: float) -> bool:
        return (self.lo is None or x >= self.lo) and (self.hi is None or x <= self.hi)


def parse_target(target: str) -> Rule | None:
    """The rule a claim's target text states: ``≤ x`` / ``< x``, ``≥ x`` / ``> x`` (a comment may
    follow), ``within ±x``, ``c ± x`` or ``c ± x %`` (anywhere in the text); ``None`` when it
    states none a number can be judged by (``(reference)``, ``14 / 14``, ``reproduced``)."""
    text = target.replace("−", "-").replace("<=", "≤").replace(">=", "≥").strip()
    num = lambda m, i: float(m.group(i).replace("−", "-"))  # noqa: E731
    if m := re.match(rf"^([≤<≥>])\s*{_NUM}", text):
        x = num(m, 2)
        return Rule(None, x) if m.group(1) in "≤<" else Rule(x, None)
    if m := re.match(rf"^within\s*±\s*{_NUM}", text):
        return Rule(-num(m, 1), num(m, 1))
    if m := re.search(rf"{_NUM}\s*±\s*{_NUM}\s*(%?)", text):
        c, x = num(m, 1), num(m, 2)
        x = abs(c) * x / 100 if m.group(3) else x
        return Rule(c - x, c + x)
    return None


def interval_verdict(rule: Rule, lo: float, hi: float) -> str:
    """PASS if all of ``[lo, hi]`` meets the rule, MISS if all is outside, else inconclusive."""
    inside = (rule.lo is None or lo >= rule.lo) and (rule.hi is None or hi <= rule.hi)
    outside = (rule.lo is not None and hi < rule.lo) or (rule.hi is not None and lo > rule.hi)
    return PASS if inside else MISS if outside else INCONCLUSIVE


# ---------------------------------------------------------------------------- the report
@dataclass
class Claim:
    """One verdict row: ``value`` against ``target`` (``"≤ 0.75"``), ``aa`` the A/A control's
    value and ``aa_interval`` its interval, ``interval`` the 95 % interval (:data:`INTERVALS`),
    ``inputs`` the per-seed values it came from; :meth:`judge` makes the verdict the
    interval's."""

    name: str
    value: float | str | None
    target: str
    ok: bool | None
    aa: float | str | None = None
    interval: tuple[float, float] | None = None
    seeds: int | None = None
    note: str = ""
    inconclusive: bool = False
    inputs: dict[str, Any] | None = None
    aa_interval: tuple[float, float] | None = None
    aa_null: float = 1.0  # what two identical arms give: 1 for a ratio, 0 for a difference

    @property
    def verdict(self) -> str:
        verdict = "-" if self.ok is None else PASS if self.ok else MISS
        return INCONCLUSIVE if self.inconclusive else verdict

    @property
    def aa_differs(self) -> bool:
        """Whether the A/A interval excludes :attr:`aa_null` (1 for a ratio, 0 for a
        difference): two copies of one arm measured apart."""
        iv = self.aa_interval
        return iv is not None and not iv[0] <= self.aa_null <= iv[1]

    def judge(self) -> Claim:
        """The verdict :func:`interval_verdict` gives (a MISS for another reason stands)."""
        rule = parse_target(self.target)
        if self.interval is None or self.ok is None or rule is None:
            return self
        verdict = interval_verdict(rule, *self.interval)
        if verdict == MISS:
            self.ok = False
        elif verdict == INCONCLUSIVE:
            self.ok, self.inconclusive = None, True
        return self

    def row(self) -> list[str]:
        iv, note = self.interval, f" ({self.note})" if self.note else ""
        interval = "-" if iv is None else f"[{fmt(iv[0])}, {fmt(iv[1])}]"
        aa = fmt(self.aa)
        if self.aa_interval is not None:
            aa += f" [{fmt(self.aa_interval[0])}, {fmt(self.aa_interval[1])}]"
        flag = f" — **A/A interval excludes {fmt(self.aa_null)}**" if self.aa_differs else ""
        return [self.name, f"**{fmt(self.value)}**", self.target, aa, interval,
                fmt(self.seeds), self.verdict + flag + note]  # fmt: skip


CLAIM_HEADERS = ["claim", "value", "target", "A/A [interval]", "95 % interval", "seeds", "verdict"]


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]


#: The note of a claim at a level chosen after its runs were seen (a sensitivity check, not
#: a confirmation).
NAMED_AFTER = "a level named after the runs"


def ratio_claim(
    report: Report, name: str, a: Vals, b: Vals, aa: Vals | float | None, target: str,
    ok: Callable[[float], bool | None], budget_s: float | None = None, *,
    paired: bool | None = None, aa_of: str = "b", samples: bool = False, note: str = "",
) -> Claim:  # fmt: skip
    """Add the claim a ÷ b with its interval (:func:`ratio_interval`) and the A/A ratio beside
    it: the repeat ``aa`` ÷ the side it repeats (``aa_of``) with its interval, or ``aa`` itself
    when it is a number. With A/A runs the claim is also computed against the copy (a ÷ aa, or
    aa ÷ b) and judged on the span of both intervals: it passes only if it holds against
    each copy. ``paired`` (default: as many values on both sides) pairs by seed. Censored values
    count as ``budget_s`` (noted); a censored median makes the ratio a bound, and only the
    interval's informative side is judged (:meth:`Claim.judge`). ``samples``: the values are
    samples to target, censored ones counted at ``budget_s`` samples (:func:`censored_floor`).
    ``note`` comes first in the claim's note (e.g. :data:`NAMED_AFTER`)."""
    if aa_of not in ("a", "b"):
        raise ValueError(f"aa_of must be 'a' or 'b', got {aa_of!r}")
    paired = len(a) == len(b) if paired is None else paired
    ratio, lo, hi = ratio_interval(a, b, budget_s, paired)
    aa_runs = [] if aa is None or isinstance(aa, int | float) else list(aa)
    aa_ratio, aa_interval = aa if isinstance(aa, int | float) else None, None
    notes = [note] if note else []
    if aa_runs:
        side = a if aa_of == "a" else b
        pair = lambda x, y: paired and len(x) == len(y)  # noqa: E731
        aa_ratio, *aa_interval = ratio_interval(aa_runs, side, budget_s, pair(aa_runs, side))
        other = (aa_runs, b) if aa_of == "a" else (a, aa_runs)
        _, lo2, hi2 = ratio_interval(*other, budget_s, pair(*other))
        notes.append(f"against the A/A copy [{fmt(lo2)}, {fmt(hi2)}]")
        lo, hi = min(lo, lo2), max(hi, hi2)
    censored = sum(v is None for v in (*a, *b, *aa_runs))
    unit = f"samples ({CENSORED_SAMPLES})" if samples else "s budget"
    if censored:
        notes.append(f"{censored} censored runs counted at the {fmt(budget_s)} {unit}")
    value: float | str = ratio
    verdict, judged = ok(ratio), (lo, hi)
    a_out, b_out = (isinstance(censored_median(x, 0)[0], str) for x in (a, b))
    if a_out and b_out:  # neither side's median reached the target: no ratio at all
        value, judged = "both censored", (-math.inf, math.inf)
    elif a_out:  # a's median is beyond the budget: the ratio is a lower bound
        value, judged = f"≥ {fmt(ratio)}", (lo, math.inf)
    elif b_out:  # b's is: the ratio is an upper bound
        value, judged = f"≤ {fmt(ratio)}", (-math.inf, hi)
    aa_iv = (*aa_interval,) if aa_interval else None
    claim = Claim(name, value, target, verdict, aa_ratio, judged, min(len(a), len(b)),
                  "; ".join(notes), aa_interval=aa_iv)  # fmt: skip
    claim.inputs = {"a": list(a), "b": list(b), "aa": aa_runs or None, "aa_of": aa_of,
                    "budget_s": budget_s, "paired": paired}  # fmt: skip
    claim.judge().interval = (lo, hi)
    report.claims.append(claim)
    return claim


def diff_claim(
    report: Report, name: str, a: Sequence[float], b: Sequence[float], target: str,
    ok: Callable[[float, float, float], bool], *, paired=True, digits: int | None = 2,
    aa_copy: Sequence[float] | None = None, scale: float = 100.0, **kwargs,
) -> Claim:  # fmt: skip
    """Add the claim mean(a) − mean(b) × ``scale`` (100: fractions to points; 1: a loss in
    nats) with its t interval (paired by seed unless ``paired`` is False), rounded to
    ``digits`` (None: not rounded); ``ok(d, lo, hi)`` gets the unrounded values. ``aa_copy``:
    b's A/A copy, per seed; the claim is also computed as a − copy and judged on the span of
    both intervals (as :func:`ratio_claim` does), and the A/A column shows copy − b with its
    interval (flagged when that excludes 0). ``kwargs``: the claim's other fields (seeds,
    note). The per-seed values (and a scale other than 100) are kept as the claim's inputs."""
    d, lo, hi = (scale * x for x in difference_interval(a, b, paired=paired))
    r = (lambda x: x) if digits is None else (lambda x: round(x, digits))  # noqa: E731
    if aa_copy is not None:
        _, lo2, hi2 = (scale * x for x in difference_interval(a, aa_copy, paired=paired))
        lo, hi = min(lo, lo2), max(hi, hi2)
        against = f"against the A/A copy [{fmt(r(lo2))}, {fmt(r(hi2))}]"
        kwargs["note"] = ", ".join(x for x in (kwargs.get("note"), against) if x)
        aa_d, *aa_iv = (scale * x for x in difference_interval(aa_copy, b, paired=paired))
        aa_d, *aa_iv = (r(x) + 0.0 for x in (aa_d, *aa_iv))  # + 0.0: no "-0" shown
        kwargs.update(aa=aa_d, aa_interval=(aa_iv[0], aa_iv[1]), aa_null=0.0)
    claim = report.claim(name, r(d), target, ok(d, lo, hi), interval=(r(lo), r(hi)), **kwargs)
    copy = {} if aa_copy is None else {"aa": list(aa_copy)}
    unit = {} if scale == 100.0 else {"scale": scale}
    claim.inputs = claim.inputs or {"diff": (list(a), list(b)), "paired": paired, **copy, **unit}
    return claim


def at_samples(r: Run, samples: int) -> float | None:
    """Accuracy of the run's last evaluation at or before ``samples`` trained (None: none)."""
    seen = [acc for _, s, acc in r.evals if s <= samples]
    return seen[-1] if seen else None


def run_place(out_dir: str | Path | None) -> tuple[str, ...] | None:
    """A run's directory below the last ``runs`` folder (its batch, arm and seed: what tells
    apart the runs of a result whose batches repeat an arm's name, as per_sample's W = 4 and
    W = 16 do); None for a run stored without its directory."""
    if not out_dir:
        return None
    parts = Path(out_dir).parts
    return parts[len(parts) - parts[::-1].index("runs") :] if "runs" in parts else parts


def simulate_all(
    jobs: Iterable[tuple[Arm, int, Path]], prov: Provenance, workers: int = 2, timeout_s=900.0
) -> list[Run]:
    """``cloudburst simulate`` of each (arm, seed, out dir), ``workers`` at a time (a
    simulation's results do not depend on the machine's load: no interleaving needed).

    With ``--replay RESULT.json`` the stored runs of the same (arm, seed) instead, so every
    later choice is the stored result's; ``--verify K`` re-simulates K of each batch, drawn
    with a seeded generator, and records whether each is bit for bit the stored one. Jobs the
    result did not store (an arm or seed added since) are simulated here, counted in
    ``prov.new_runs`` and said in the report."""
    jobs = list(jobs)

    def one(job: tuple[Arm, int, Path]) -> Run:
        r = run_train(*job, timeout_s, SIMULATE)
        print(f"  {r.arm} seed {r.seed}: {describe(r)}", flush=True)
        prov.journal(r)
        return r

    def simulate(batch: list[tuple[Arm, int, Path]]) -> list[Run]:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, batch))

    stored = prov.stored_runs()
    if stored is None:
        runs = simulate(jobs)
        prov.sample_load()
        return runs

    def stored_run(job: tuple[Arm, int, Path]) -> Run | None:
        a, seed, out = job
        return stored.get((a.name, seed, run_place(out))) or stored.get((a.name, seed, None))

    found = [stored_run(job) for job in jobs]
    kept = [job for job, r in zip(jobs, found, strict=True) if r is not None]
    new = [i for i, r in enumerate(found) if r is None]  # arms or seeds the result lacks
    rng = random.Random(f"verify {len(prov.verified)} {len(jobs)}")
    chosen = rng.sample(kept, min(prov.args.verify, len(kept)))
    done = simulate(chosen + [jobs[i] for i in new])
    for job, r in zip(chosen, done[: len(chosen)], strict=True):
        prov.verified.append((r.arm, r.seed, same_run(r, stored_run(job))))
    for i, r in zip(new, done[len(chosen) :], strict=True):
        found[i] = r
    prov.new_runs += len(new)
    prov.sample_load()
    return found


def same_run(a: Run, b: Run) -> bool:
    """Whether two simulations of one arm and seed computed the same: every evaluation, the
    final accuracy and loss, the samples and the training time, compared bit for bit (as JSON
    stores them). The time is left out where the step time was calibrated on the machine (a
    measurement, not a computation: ``step_time_source`` ``calibrated``)."""

    def key(r: Run) -> str:
        model = r.summary.get("clock_model") or {}
        timed = model.get("step_time_source") != "calibrated"
        kept = {k: r.summary.get(k) for k in ("samples", "final_test_loss")}
        kept["train_time_s"] = r.summary.get("train_time_s") if timed else None
        evals = [list(e) if timed else list(e)[1:] for e in r.evals]
        return json.dumps([evals, r.final_accuracy, kept, bool(r.failed)])

    return key(a) == key(b)


class Report:
    """Title, provenance header, claims, then the sections in the order added; :meth:`write`
    makes ``<out>.md`` and ``<out>.json`` (provenance, claims, data, runs)."""

    def __init__(self, name: str, title: str, prov: Provenance):
        self.name, self.title, self.prov = name, title, prov
        self.claims: list[Claim] = []
        self.body: list[str] = []
        self.data: dict[str, Any] = {}

    def claim(self, *args: Any, **kwargs: Any) -> Claim:
        """Add a :class:`Claim` (its fields), judged by its interval."""
        self.claims.append(Claim(*args, **kwargs).judge())
        return self.claims[-1]

    def settings(self, text: str) -> Report:
        self.body += ["## Settings", "", text.strip(), ""]
        return self

    def section(self, heading: str) -> Report:
        self.body += [f"## {heading}", ""]
        return self

    def table(self, headers: str | Sequence[str], rows: Sequence[Sequence[Any]]) -> Report:
        """A table; ``headers`` as a list or as one string ``"a | b | c"``."""
        if isinstance(headers, str):
            headers = [h.strip() for h in headers.split("|")]
        self.body += [*md_table(headers, rows), ""]
        return self

    def text(self, text: str) -> Report:
        self.body += [text.strip(), ""]
        return self

    def curves(self, groups: dict[str, list[Run]], seed: int) -> None:
        """A figure of the first run of each arm's curves (next to the report's .md). Replayed
        runs whose directories are gone keep the figure drawn when they were made, if any."""
        from cloudburst.cli.plot import plot_runs

        first = [rs[0] for rs in groups.values() if rs[0].out_dir and rs[0].evals]
        if not first:
            return
        png = self.path().with_suffix(".png")
        if all((Path(r.out_dir) / "metrics").is_dir() for r in first):
            png.parent.mkdir(parents=True, exist_ok=True)
            plot_runs([r.out_dir for r in first], str(png), f"seed {seed}", [r.arm for r in first])
        elif not png.is_file():
            return
        self.body += [f"![test error against time and samples, seed {seed}]({png.name})", ""]

    def path(self) -> Path:
        out = getattr(self.prov.args, "out", None)
        return Path(out).with_suffix(".md") if out else self.prov.results_dir() / f"{self.name}.md"

    def header(self) -> list[str]:
        p = self.prov
        loads = ", ".join(f"{x:.2f}" for x in p.loads) or "-"
        moved = p.commit_after and p.commit_after != p.commit.removesuffix("+dirty")
        replayed = [
            f"- **runs replayed** from the result of `{p.replayed_from} (`--replay`): the "
            "runs are that commit's, the report this one's: history, not new evidence"
        ]
        differ = [f"{arm} seed {seed}" for arm, seed, same in p.verified if not same]
        if p.verified and not differ:
            replayed = [
                f"- **runs stored** by the result of `{p.replayed_from} (`--replay`); "
                f"{len(p.verified)} of them, drawn at random, re-simulated at this commit "
                "(`--verify`): **bit for bit identical** (every evaluation, the final accuracy "
                "and loss, the samples, and the training time where the step time is modelled), "
                "so the result holds at this code"
            ]
        elif differ:
            replayed[0] += f"; re-simulated at this commit, **these differ**: {', '.join(differ)}"
        if p.new_runs:
            replayed[0] += (f"; **{p.new_runs} run(s) made at this commit**, the ones that "
                            "result did not store (new evidence)")  # fmt: skip
        replayed = replayed if p.replayed_from else []
        return [
            f"# {self.title}",
            "",
            f"- command: `{p.command}` (cwd `{p.cwd}`), started {p.started_utc} UTC",
            f"- commit: `{p.commit}`"
            + (f" — **changed during the run** to `{p.commit_after}`" if moved else "")
            + (" — **forced** (dirty tree or busy machine allowed)" if p.forced else ""),
            *replayed,
            f"- machine: {p.cpu}, {p.nproc} cores, GPU {p.gpu or 'none'}, host `{p.host}`, "
            f"`{p.platform}`",
            f"- python {p.python}, torch {p.torch}"
            + (f"; {p.numerics}" if p.numerics else " (numerics not recorded)"),
            f"- load (1-min average): {p.load_before:.2f} before, "
            f"{fmt(p.load_after)} after; after each run: {loads}; other processes' CPU share "
            f"at the start {100 * p.busy_fraction_before:.0f} %",
            *(["- **--quick smoke run: not a result**"] if p.quick else []),
            "",
        ]

    def markdown(self) -> str:
        lines = self.header()
        if self.claims:
            rows = [c.row() for c in self.claims]
            method = [INTERVALS, ""] if any(c.interval for c in self.claims) else []
            lines += ["## Claims", "", *md_table(CLAIM_HEADERS, rows), "", *method]
        return "\n".join([*lines, *self.body]).rstrip() + "\n"

    def write(self, runs: Sequence[Run] = ()) -> Path:
        self.prov.finish()
        md = self.path()
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(self.markdown())
        data = {"name": self.name, "title": self.title, "provenance": self.prov.to_dict(),
                "claims": [asdict(c) for c in self.claims], "data": self.data,
                "runs": [r.to_dict() for r in runs]}  # fmt: skip
        md.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        print(f"wrote {md.relative_to(REPO) if md.is_relative_to(REPO) else md}", flush=True)
        return md
