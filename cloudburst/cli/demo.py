"""``cloudburst demo``: the strategies side by side on MNIST-1D (the main job of the README).

One call of :mod:`cloudburst.cli.compare`: each strategy trains the MNIST-1D CNN with 4 workers on
this machine for the same number of samples; the demo prints the comparison table and writes
``OUT/curves.png`` (test error against wall time and against samples) and ``OUT/summary.md``.
"""

from __future__ import annotations

from cloudburst.cli.compare import comparison_configs, run_comparison

# Settings found on MNIST-1D (benchmarks/results/accuracy.md): 4 workers x batch 64, SGD with
# momentum. asgd adds the 4 workers' updates with λ = 1/W: with λ = 1 (the plain sum) the
# CNN diverges at any learning rate that trains in this budget.
DEMO_RUNS: dict[str, str] = {
    "sync": "sync",
    "asgd": "asgd:servers=1,n_sync=10,server_lr=0.25",
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
    common = {**COMMON, **({"epochs": epochs} if epochs is not None else {})}
    specs = [DEMO_RUNS.get(name, name) for name in strategies or list(DEMO_RUNS)]
    runs = comparison_configs(specs, common, out)
    # Each run's directory is named after its strategy, as before.
    runs = [(spec.split(":")[0], cfg) for spec, (_, cfg) in zip(specs, runs, strict=True)]
    for label, cfg in runs:
        cfg.output.out = f"{out}/{label}"
    return run_comparison(runs, out, title="cloudburst demo: MNIST-1D CNN")
