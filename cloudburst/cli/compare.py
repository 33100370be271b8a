"""``cloudburst compare``: several strategies (or several settings of one) on the same data,
model and budget, one after another on this machine; one table, one plot.

A run is named by a spec ``STRATEGY[:field=value[,field=value...]]`` — ``sync``,
``asgd:n_sync=10,server_lr=0.25``, ``diloco:period=16`` — whose fields override the settings
shared by every run (the ``train`` flags given to ``compare``). Every run's config is
validated before the first one starts. Each run writes its own directory ``OUT/<label>``;
the comparison writes ``OUT/curves.png`` (test error against wall time and against samples;
test loss for language models) and ``OUT/summary.md`` (language models: a table of final test
loss, bits per byte and bytes sent besides).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cloudburst.config import ConfigError, RunConfig
from cloudburst.loop.summary import format_summary
from cloudburst.records.rundir import safe_label


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"asgd:n_sync=10,server_lr=0.25"`` → ``("asgd", {"n_sync": "10", ...})``."""
    name, _, rest = spec.partition(":")
    overrides: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"compare: {spec!r}: {item!r} is not field=value (e.g. asgd:n_sync=10)"
            )
        overrides[key.strip().replace("-", "_")] = value.strip()
    if not name:
        raise ConfigError(f"compare: {spec!r} names no strategy (e.g. sync, asgd:n_sync=10)")
    return name, overrides


def comparison_configs(
    specs: list[str], common: dict[str, Any], out: str
) -> list[tuple[str, RunConfig]]:
    """One validated config per spec (labels must differ)."""
    if not specs:
        raise ConfigError("compare: name at least one run, e.g. --runs sync asgd")
    runs = []
    for spec in specs:
        name, overrides = parse_spec(spec)
        values = {**common, "strategy": name, **overrides}
        label = safe_label(spec)
        values["out"] = str(Path(out) / label)
        runs.append((label, RunConfig.from_dict(values)))
    labels = [label for label, _ in runs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"compare: two runs have the same name ({', '.join(labels)})")
    return runs


def run_comparison(
    runs: list[tuple[str, RunConfig]], out: str, title: str = "cloudburst compare"
) -> list[dict[str, Any]]:
    """Run each config in turn; print the table, write ``OUT/curves.png`` and
    ``OUT/summary.md``. A Ctrl-C stops the run in progress and the comparison (the table of
    what finished so far is printed) and is raised again."""
    from cloudburst.cli.plot import plot_runs
    from cloudburst.launch import JobInterrupted, run_local_job

    Path(out).mkdir(parents=True, exist_ok=True)
    summaries: list[dict[str, Any]] = []
    done: list[str] = []
    for i, (label, cfg) in enumerate(runs, 1):
        print(
            f"== {i}/{len(runs)} {label}: {cfg.job.workers} workers, {cfg.job.servers} servers",
            file=sys.stderr,
            flush=True,
        )
        try:
            summaries.append(run_local_job(cfg))
        except JobInterrupted:
            if summaries:
                print(format_summary(summaries, labels=done))
            raise
        done.append(label)
    table = format_summary(summaries, labels=done)
    print(table)
    plot = plot_runs(
        [cfg.output.out for _, cfg in runs], str(Path(out) / "curves.png"), title, done
    )
    lines = [f"# {title}", "", "```", table, "```", ""]
    for label, cfg in runs:
        settings = {k: v for k, v in cfg.to_dict().items() if k not in ("out", "progress")}
        lines.append(f"- {label}: {settings}")
    (Path(out) / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"learning curves: {plot}", file=sys.stderr)
    return summaries
