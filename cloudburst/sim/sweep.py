"""Sweeps of simulated runs: ``cloudburst simulate --sweep FIELD=V1,V2,... --strategies A,B
--seeds 0,1,2`` runs every (strategy, value, seed) point into ``OUT/<strategy>-<FIELD>=<value>-
seed<k>/`` and writes one table (``OUT/sweep.md``, ``OUT/sweep.json``) and two plots
(``OUT/sweep_time_to_target.png``, ``OUT/sweep_accuracy.png``) of time-to-target and final
accuracy against the swept value.

The report is made from the runs' ``summary.json`` files only (:func:`sweep_report`), so it can
be made again from a sweep's directory. Times are virtual seconds. A run that never reached
the target is censored: it is shown as "> T_end, not reached" (T_end: when it ended) and
counted, never averaged in as if it had reached the target at its end.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloudburst.config import FIELDS, ConfigError, RunConfig, coerce_value, field_aliases
from cloudburst.config.simulation import SimulationConfig
from cloudburst.records.rundir import safe_label

# The accuracy the MNIST-1D CNN reaches with every strategy at the defaults (docs/cli.md, "Defaults
# that train"); cloudburst demo reports its time-to-target for the same value.
DEFAULT_TARGET_ACCURACY = 0.9
# Set per point by the sweep itself, or meaningless to sweep.
NOT_SWEPT = {
    "strategy": "use --strategies",
    "seed": "use --seeds",
    "out": "a sweep writes one directory per point",
    "overwrite": "it is not a setting of the run",
    "progress": "it is not a setting of the run",
    "resume": "a sweep starts new runs",
}


@dataclass(frozen=True)
class SweepPoint:
    """One simulated run of a sweep."""

    label: str
    strategy: str
    value: Any
    seed: int
    cfg: RunConfig
    sim: SimulationConfig


# ---------------------------------------------------------------------------- parsing
def _split(text: str, what: str, example: str) -> list[str]:
    items = [item.strip() for item in str(text).split(",")]
    if not items or any(not item for item in items):
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list (e.g. {example})")
    return items


def parse_strategies(text: str) -> list[str]:
    names = _split(text, "strategies", "sync,asgd,gossip")
    if len(set(names)) != len(names):
        raise ConfigError(f"strategies: {text!r} names a strategy twice")
    return names


def parse_seeds(text: str) -> list[int]:
    seeds = []
    for item in _split(text, "seeds", "0,1,2"):
        if not item.isdigit():
            raise ConfigError(f"seeds: {item!r} is not allowed; use integers >= 0 (e.g. 0,1,2)")
        seeds.append(int(item))
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: {text!r} names a seed twice")
    return seeds


def _sweepable_fields() -> dict[str, dataclasses.Field]:
    fields = {f.name: f for f in dataclasses.fields(SimulationConfig)}
    fields.update({name: f for name, (_, f) in FIELDS.items()})
    return fields


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``"workers=2,4,8"`` → ``("workers", [2, 4, 8])``: any scalar field of the run or of the
    clock model, its values parsed with the field's type (a link's ``GBIT,LATENCY`` is written
    ``GBIT:LATENCY`` here, as commas separate the values)."""
    name, sep, rest = str(text).partition("=")
    name = name.strip().replace("-", "_")
    name = field_aliases().get(name, name)
    if not sep or not name or not rest.strip():
        raise ConfigError(f"sweep: {text!r} is not FIELD=V1,V2,... (e.g. workers=2,4,8)")
    fields = _sweepable_fields()
    if name not in fields:
        near = difflib.get_close_matches(name, sorted(fields), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else " (see cloudburst simulate --help)"
        raise ConfigError(f"sweep: unknown field {name!r}{hint}")
    if name in NOT_SWEPT:
        raise ConfigError(f"sweep: {name} cannot be swept; {NOT_SWEPT[name]}")
    type_text = str(fields[name].type)
    if type_text.startswith("list["):
        raise ConfigError(f"sweep: {name} is a list and cannot be swept; sweep a single value")
    values = []
    for item in _split(rest, "sweep", "workers=2,4,8"):
        if name.endswith("_link"):
            item = item.replace(":", ",")
        values.append(coerce_value(name, type_text, None if item.lower() == "none" else item))
    if len(set(map(repr, values))) != len(values):
        raise ConfigError(f"sweep: {text!r} names a value twice")
    return name, values


# ---------------------------------------------------------------------------- the points
def label_of(strategy: str, field: str | None, value: Any, seed: int) -> str:
    """A directory name: ``sync-workers=8-seed0`` (odd characters become ``-``)."""
    middle = "" if field is None else f"-{field}={value}"
    return safe_label(f"{strategy}{middle}-seed{seed}")


def sweep_points(
    values: dict[str, Any],
    sim_values: dict[str, Any],
    field: str | None,
    sweep_values: list[Any],
    strategies: list[str],
    seeds: list[int],
    out: str,
) -> list[SweepPoint]:
    """Every (strategy, value, seed) point's configs, all validated before any runs.

    ``values``: the run's settings (TOML and flags, as for ``train``); ``sim_values``: the
    clock model's. ``field`` None: no sweep, one value.
    """
    sim_names = {f.name for f in dataclasses.fields(SimulationConfig)}
    points = []
    for strategy in strategies:
        for value in sweep_values if field is not None else [None]:
            for seed in seeds:
                run_values = {**values, "strategy": strategy, "seed": seed}
                clock_values = dict(sim_values)
                if field in sim_names:
                    clock_values[field] = value
                elif field is not None:
                    run_values[field] = value
                label = label_of(strategy, field, value, seed)
                run_values["out"] = str(Path(out) / label)
                try:
                    cfg = RunConfig.from_dict(run_values)
                    sim = SimulationConfig.from_dict(clock_values)
                except ConfigError as e:
                    where = strategy if field is None else f"{strategy}, {field}={value}"
                    raise ConfigError(f"{e} (sweep point {where})") from None
                points.append(SweepPoint(label, strategy, value, seed, cfg, sim))
    labels = [p.label for p in points]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"sweep: two points have the same name ({', '.join(labels)})")
    return points


def run_sweep(
    points: list[SweepPoint],
    out: str,
    field: str | None,
    simulate: Callable[[RunConfig, SimulationConfig], dict[str, Any]],
    prepare: Callable[[RunConfig], None] = lambda cfg: None,
    failure: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> dict[str, Any]:
    """Run every point (``prepare`` readies its directory first), then write the report.

    A point whose run raises ``failure`` is reported on stderr and the sweep goes on; its
    (partial) summary marks it failed, and the report lists it apart from the table."""
    Path(out).mkdir(parents=True, exist_ok=True)
    for i, point in enumerate(points, 1):
        print(f"== {i}/{len(points)} {point.label}", file=sys.stderr, flush=True)
        prepare(point.cfg)
        try:
            simulate(point.cfg, point.sim)
        except failure as e:
            print(f"cloudburst: {point.label}: {e}", file=sys.stderr, flush=True)
    return sweep_report(out, field, [p.cfg.output.out for p in points])


# ---------------------------------------------------------------------------- the report
def _point_of(run_dir: Path, field: str | None) -> dict[str, Any]:
    """One run's row, from its summary.json alone."""
    path = run_dir / "summary.json"
    if not path.is_file():
        raise ConfigError(f"sweep: {str(run_dir)!r} has no summary.json (did the run finish?)")
    s = json.loads(path.read_text())
    cfg = s.get("config", {})
    settings = (s.get("clock_model") or {}).get("settings") or s.get("simulation") or {}
    if field is None:
        value = None
    elif field in cfg:
        value = cfg[field]
    else:
        value = settings.get(field)
    end_s = s.get("virtual_time_s", s.get("wall_time_s"))
    return {
        "run": run_dir.name,
        "strategy": s.get("strategy", cfg.get("strategy")),
        "value": value,
        "seed": cfg.get("seed"),
        "simulated": bool(s.get("simulated")),
        "final_test_accuracy": s.get("final_test_accuracy"),
        "target_accuracy": s.get("target_accuracy"),
        "time_to_target_s": s.get("time_to_target_s"),
        "end_s": end_s,
        "reached": s.get("time_to_target_s") is not None,
        "failed": s.get("failed"),
    }


def _mean_sd(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per (strategy, value): accuracy and time-to-target over seeds."""
    order: list[tuple[str, str]] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["strategy"], repr(r["value"]))
        if key not in groups:
            order.append(key)
            groups[key] = []
        groups[key].append(r)
    cells = []
    for key in order:
        group = groups[key]
        accs = [r["final_test_accuracy"] for r in group if r["final_test_accuracy"] is not None]
        reached = [r["time_to_target_s"] for r in group if r["reached"]]
        censored = [r["end_s"] for r in group if not r["reached"] and r["end_s"] is not None]
        acc_mean, acc_sd = _mean_sd(accs)
        ttt_mean, ttt_sd = _mean_sd(reached)
        cells.append(
            {
                "strategy": group[0]["strategy"],
                "value": group[0]["value"],
                "runs": len(group),
                "seeds": [r["seed"] for r in group],
                "reached": len(reached),
                "not_reached": len(group) - len(reached),
                "time_to_target_mean_s": ttt_mean,
                "time_to_target_sd_s": ttt_sd,
                # A censored run only says "more than its end": the smallest end is the bound.
                "not_reached_by_s": min(censored) if censored else None,
                "final_accuracy_mean": acc_mean,
                "final_accuracy_sd": acc_sd,
            }
        )
    return cells


def _ttt_text(cell: dict[str, Any]) -> str:
    parts = []
    if cell["reached"]:
        sd = f" ± {cell['time_to_target_sd_s']:.1f}" if cell["reached"] > 1 else ""
        parts.append(f"{cell['time_to_target_mean_s']:.1f}{sd}")
    if cell["not_reached"]:
        bound = cell["not_reached_by_s"]
        censored = f"> {bound:.1f}, not reached" if bound is not None else "not reached"
        if cell["reached"]:
            censored = f"{cell['not_reached']} of {cell['runs']} {censored}"
        parts.append(censored)
    return "; ".join(parts)


def _acc_text(cell: dict[str, Any]) -> str:
    if cell["final_accuracy_mean"] is None:
        return "-"
    if cell["runs"] > 1:
        return f"{cell['final_accuracy_mean']:.4f} ± {cell['final_accuracy_sd']:.4f}"
    return f"{cell['final_accuracy_mean']:.4f}"


def sweep_table(cells: list[dict[str, Any]], field: str | None, target: float | None) -> str:
    """The Markdown table of :func:`sweep_report`."""
    target_text = "the target" if target is None else f"{target:g}"
    head = (
        ["strategy"]
        + ([field] if field else [])
        + [
            f"time to {target_text} (virtual s)",
            "reached",
            "final accuracy",
            "seeds",
        ]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        row = [str(c["strategy"])] + ([str(c["value"])] if field else [])
        row += [
            _ttt_text(c),
            f"{c['reached']}/{c['runs']}",
            _acc_text(c),
            ",".join(str(s) for s in c["seeds"]),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def sweep_report(
    out: str | Path, field: str | None, run_dirs: list[str] | None = None
) -> dict[str, Any]:
    """Write ``OUT/sweep.md``, ``OUT/sweep.json`` and the two plots from the runs'
    ``summary.json`` files (``run_dirs``, else every ``OUT/*/summary.json``); returns the
    report (sweep.json's content)."""
    out = Path(out)
    dirs = (
        [Path(d) for d in run_dirs]
        if run_dirs is not None
        else sorted(p.parent for p in out.glob("*/summary.json"))
    )
    if not dirs:
        raise ConfigError(f"sweep: no runs under {str(out)!r} (no */summary.json)")
    rows = [_point_of(d, field) for d in dirs]
    targets = {r["target_accuracy"] for r in rows if r["target_accuracy"] is not None}
    target = min(targets) if targets else None
    # A failed run neither reached nor missed the target: it is listed, not tabled.
    failed = [r for r in rows if r["failed"]]
    cells = _cells([r for r in rows if not r["failed"]])
    table = sweep_table(cells, field, target)
    not_reached = sum(c["not_reached"] for c in cells)
    report = {
        "field": field,
        "target_accuracy": target,
        "time_unit": "virtual seconds",
        "runs": rows,
        "cells": cells,
        "not_reached": not_reached,
        "failed": [{"run": r["run"], "failed": r["failed"]} for r in failed],
    }
    lines = [
        "# cloudburst simulate: sweep" + (f" over {field}" if field else ""),
        "",
        f"Times are virtual seconds of the simulated clock. {len(rows) - len(failed)} runs; "
        f"{not_reached} did not reach {target if target is not None else 'the target'} "
        '(shown as "> T_end, not reached": T_end is when the run ended; not averaged in).',
        "",
        table,
        "",
        *(f"- failed, not in the table: {r['run']}: {r['failed']}" for r in failed),
        *([""] if failed else []),
        "Made from each run's summary.json (cloudburst.sim.sweep.sweep_report).",
    ]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    (out / "sweep.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    report["plots"] = plot_sweep(cells, field, target, out)
    return report


# ---------------------------------------------------------------------------- the plots
def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def plot_sweep(
    cells: list[dict[str, Any]], field: str | None, target: float | None, out: Path
) -> list[str]:
    """Time-to-target and final accuracy against the swept value, one line per strategy.

    A cell where some runs did not reach the target also gets a hollow triangle at the
    earliest end of those runs (a lower bound, not a measurement). Log x when the swept
    values span 8x or more."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values: list[Any] = []
    for c in cells:
        if repr(c["value"]) not in map(repr, values):
            values.append(c["value"])
    numeric = field is not None and _numeric(values)
    positions = {repr(v): (v if numeric else i) for i, v in enumerate(values)}
    log_x = numeric and min(values) > 0 and max(values) / min(values) >= 8
    strategies = list(dict.fromkeys(c["strategy"] for c in cells))
    target_text = "the target" if target is None else f"{target:g}"
    paths = []
    for name, ylabel in (
        ("sweep_time_to_target.png", f"time to test accuracy {target_text} (virtual s)"),
        ("sweep_accuracy.png", "final test accuracy"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for strategy in strategies:
            mine = sorted(
                (c for c in cells if c["strategy"] == strategy),
                key=lambda c: positions[repr(c["value"])],
            )
            if name == "sweep_accuracy.png":
                pts = [c for c in mine if c["final_accuracy_mean"] is not None]
                ys = [c["final_accuracy_mean"] for c in pts]
                err = [c["final_accuracy_sd"] for c in pts]
            else:
                pts = [c for c in mine if c["reached"]]
                ys = [c["time_to_target_mean_s"] for c in pts]
                err = [c["time_to_target_sd_s"] for c in pts]
            xs = [positions[repr(c["value"])] for c in pts]
            line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=strategy)
            if name == "sweep_time_to_target.png":
                cens = [c for c in mine if c["not_reached"] and c["not_reached_by_s"] is not None]
                if cens:
                    ax.scatter(
                        [positions[repr(c["value"])] for c in cens],
                        [c["not_reached_by_s"] for c in cens],
                        marker="^",
                        facecolors="none",
                        edgecolors=line[0].get_color(),
                        s=60,
                        label=f"{strategy}: not reached by (end of run)",
                    )
        if log_x:
            ax.set_xscale("log", base=2 if all(isinstance(v, int) for v in values) else 10)
        # Ticks at the swept values, written as given (not 2^3).
        ax.set_xticks([positions[repr(v)] for v in values], [str(v) for v in values])
        ax.minorticks_off()
        ax.set_xlabel(field if field else "(no swept field)")
        ax.set_ylabel(ylabel)
        if name == "sweep_accuracy.png" and target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("cloudburst simulate (virtual cluster)")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    return paths
