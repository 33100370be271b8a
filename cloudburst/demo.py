"""``cloudburst demo``: the strategies side by side on MNIST-1D (the main job of the README).

Each strategy trains the MNIST-1D CNN with 4 workers on this machine for the same number of
samples; the demo prints a comparison table and writes ``OUT/curves.png`` (test error against
wall time and against samples) and ``OUT/summary.md``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cloudburst.cli import format_summary
from cloudburst.config import RunConfig
from cloudburst.launch import run_local_job
from cloudburst.plot import plot_runs

# Settings found on MNIST-1D (benchmarks/results/accuracy.md): 4 workers x batch 64, SGD with
# momentum. asgd adds the 4 workers' updates with λ = 1/W: with λ = 1 (the plain sum) the
# CNN diverges at any learning rate that trains in this budget.
DEMO_RUNS: dict[str, dict] = {
    "sync": dict(strategy="sync"),
    "asgd": dict(strategy="asgd", servers=1, n_sync=10, server_lr=0.25),
}
COMMON = dict(
    workers=4,
    dataset="mnist1d",
    model="cnn",
    batch_size=64,
    lr=0.1,
    momentum=0.9,
    epochs=64,
    target_accuracy=0.9,
    eval_every_s=0.5,
)


def run_demo(
    out: str, epochs: float | None = None, strategies: list[str] | None = None
) -> list[dict]:
    summaries, dirs = [], []
    for name in strategies or list(DEMO_RUNS):
        values = {**COMMON, **DEMO_RUNS[name], "out": str(Path(out) / name)}
        if epochs is not None:
            values["epochs"] = epochs
        cfg = RunConfig(**values)
        print(f"== {name}: {cfg.workers} workers, {cfg.steps_per_worker()} steps each", flush=True)
        summaries.append(run_local_job(cfg))
        dirs.append(cfg.out)
    table = format_summary(summaries)
    print(table)
    plot = plot_runs(dirs, str(Path(out) / "curves.png"), title="cloudburst demo: MNIST-1D CNN")
    (Path(out) / "summary.md").write_text(
        "# cloudburst demo\n\n```\n"
        + table
        + "\n```\n\n"
        + "\n".join(
            f"- {s['strategy']}: {dataclasses.asdict(RunConfig.from_dict(s['config']))}"
            for s in summaries
        )
        + "\n"
    )
    print(f"learning curves: {plot}")
    return summaries
