"""Learning curves from run directories: test error against wall time and against samples;
for language-model runs (their eval records carry ``bits_per_byte``) the test loss in nats per
token instead. A simulated run's times are virtual seconds: its axis says so.

Drawn from the JSONL metrics only (like the GPU A-SGD paper's figures 2-4), one line per run.
DASO runs get their phases marked: where cycling begins and where cool-down begins (vertical
dotted lines in the run's colour, from its worker 0 step records).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cloudburst.config import ConfigError  # noqa: E402
from cloudburst.records.metrics import eval_curve, read_run  # noqa: E402
from cloudburst.strategies import strategy_spec  # noqa: E402


def run_label(run_dir: Path) -> str:
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return run_dir.name
    s = json.loads(summary_path.read_text())
    label = f"{s['strategy']} W={s['workers']}" + (" (simulated)" if s.get("simulated") else "")
    return label + strategy_spec(s["strategy"]).run_label(s)


def phase_changes(run_dir: Path) -> list[tuple[str, float, int]]:
    """(phase, time_s, samples) where a DASO run's phase changes, from worker 0's steps."""
    records = read_run(run_dir)
    steps = [r for recs in records.values() for r in recs if r["event"] == "step"]
    steps = [r for r in steps if r.get("role") == "worker0" and "phase" in r]
    changes, last = [], None
    for r in sorted(steps, key=lambda r: r["step"]):
        if r["phase"] != last:
            if last is not None:
                changes.append((r["phase"], r["time_s"], r["samples"]))
            last = r["phase"]
    return changes


def is_simulated(run_dir: Path) -> bool:
    """The run was simulated (``cloudburst simulate``): its times are virtual seconds."""
    path = run_dir / "summary.json"
    return path.is_file() and bool(json.loads(path.read_text()).get("simulated"))


def is_language_model(run_dir: Path) -> bool:
    """The run trained a language model: its evaluations carry bits per byte."""
    return any("bits_per_byte" in e for e in eval_curve(run_dir))


def curve_metric(runs: list[str]) -> str:
    """``"loss"`` when every run is a language model, ``"error"`` when none is."""
    kinds = {is_language_model(Path(run)) for run in runs if (Path(run) / "metrics").is_dir()}
    if len(kinds) > 1:
        raise ConfigError(
            "plot: the runs mix language models (test loss) and classifiers (test error); "
            "plot them separately"
        )
    return "loss" if kinds == {True} else "error"


def time_axis_label(runs: list[str]) -> str:
    """Wall time for real runs, virtual time for simulated ones; a mix says which is which."""
    simulated = [is_simulated(Path(run)) for run in runs]
    if all(simulated):
        return "virtual time (s)"
    if any(simulated):
        return "time (s): virtual for simulated runs, wall for the others"
    return "wall time (s)"


def plot_runs(
    runs: list[str], output: str, title: str | None = None, labels: list[str] | None = None
) -> Path:
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    metric = curve_metric(runs)
    for i, run in enumerate(runs):
        run_dir = Path(run)
        if not (run_dir / "metrics").is_dir():
            raise ConfigError(f"plot: {run!r} is not a run directory (no metrics/ inside)")
        evals = eval_curve(run_dir)
        if not evals:
            continue
        label = labels[i] if labels else run_label(run_dir)
        if metric == "loss":
            err = [e["test_loss"] for e in evals]
        else:
            err = [100 * (1 - e["test_accuracy"]) for e in evals]
        ax_t.plot([e["time_s"] for e in evals], err, label=label, marker=".", markersize=3)
        by_samples = sorted(zip([e["samples"] for e in evals], err, strict=True))
        lines = ax_s.plot(
            [s for s, _ in by_samples],
            [e for _, e in by_samples],
            label=label,
            marker=".",
            markersize=3,
        )
        workers = (
            json.loads((run_dir / "summary.json").read_text())["workers"]
            if (run_dir / "summary.json").is_file()
            else 1
        )
        for phase, t, samples in phase_changes(run_dir):
            colour = lines[0].get_color()
            ax_t.axvline(t, color=colour, linestyle=":", alpha=0.7)
            ax_s.axvline(samples * workers, color=colour, linestyle=":", alpha=0.7)
            ax_t.annotate(
                phase,
                (t, 1),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                rotation=90,
                va="top",
                ha="right",
                color=colour,
            )
    ax_t.set_xlabel(time_axis_label(runs))
    ax_s.set_xlabel("training samples (all workers)")
    for ax in (ax_t, ax_s):
        ax.set_ylabel("test loss (nats per token)" if metric == "loss" else "test error (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
