"""Step-time overhead of cloudburst's ``sync`` strategy at world size 1.

What is measured: the wall time of one training step of the MNIST-1D CNN
(``cloudburst.models.build_model("cnn", 40, 10, seed)``) on MNIST-1D
(``cloudburst.data.load_dataset("mnist1d", 4000, 1000)`` through ``BatchStream``), batch 64,
SGD lr 0.05 momentum 0.9 (``cloudburst.train.make_optimizer``), in three variants:

- ``plain``: a single-process loop, no ``torch.distributed``;
- ``ddp``: ``DistributedDataParallel`` at world size 1 (gloo), no comm hook;
- ``sync``: cloudburst's ``SyncStrategy``: ``wrap``, and ``after_backward`` / ``after_step``
  called where ``cloudburst/train.py``'s ``run_worker`` calls them. With one worker ``wrap``
  returns the model itself (nothing to average); with more it is DDP + a counting hook.

A step is exactly ``run_worker``'s ``train_step`` (next batch, forward, loss,
``zero_grad(set_to_none=True)``, backward, [after_backward], optimizer step, ``loss.item()``)
[+ ``after_step``]. Everything runs in this one process (a world-size-1 gloo group on a
``HashStore``), one thread. Each variant has its own model, optimizer and batch stream, all
built from the same seed. In each of ``--rounds`` rounds every variant runs ``--warmup``
untimed steps and then ``--steps`` timed steps; the variants take turns round-robin, the order
rotated by one every round (many short rounds, so that the variants compared are always close
in time on a shared, noisy machine). Every step is timed; the step time of a variant is the
median of all its timed steps. The ratios sync/plain and sync/ddp (target <= 1.05 each) are
judged on the paired estimate: the median over rounds of the ratio of the two variants'
per-round medians (variants a few seconds apart, so the machine's slow spells cancel; an
earlier version of this script judged the pooled ratio, which on this shared machine swung by
+-10 % between runs while the code compared was the same); the ratio of the pooled medians
and every per-round ratio are shown beside it. All three
variants see the same batches, so their parameters must agree at the end; the largest
difference is reported as a check.

    .venv/bin/python benchmarks/overhead.py [--out benchmarks/results/overhead.md]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from cloudburst.config import RunConfig  # noqa: E402
from cloudburst.data import BatchStream, load_dataset  # noqa: E402
from cloudburst.models import build_model  # noqa: E402
from cloudburst.runtime import Context  # noqa: E402
from cloudburst.strategies import make_strategy  # noqa: E402
from cloudburst.train import make_optimizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402

VARIANTS = ("plain", "ddp", "sync")
TARGET = 1.05  # sync / plain and sync / ddp, at most
SEED = 0


class Variant:
    """One training set-up; ``step()`` runs one training step."""

    def __init__(self, name: str, cfg: RunConfig, ctx: Context, data) -> None:
        self.name = name
        self.model = build_model(cfg.model, data.input_length, data.num_classes, cfg.seed)
        self.optimizer = make_optimizer(cfg, self.model.parameters())
        self.stream = BatchStream(data.x_train, data.y_train, cfg.batch_size, seed=cfg.seed * 1000)
        self.loss_fn = nn.CrossEntropyLoss()
        self.batch_size = cfg.batch_size
        self.strategy = None
        if name == "plain":
            self.net: nn.Module = self.model
        elif name == "ddp":
            self.net = DistributedDataParallel(self.model)
        elif name == "sync":
            self.strategy = make_strategy(ctx)
            self.net = self.strategy.wrap(self.model, self.optimizer)
            self.strategy.start()
        else:
            raise ValueError(name)
        self.step: Callable[[], float] = self._strategy_step if self.strategy else self._plain_step

    def _plain_step(self) -> float:
        xb, yb = next(self.stream)
        loss = self.loss_fn(self.net(xb), yb)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _strategy_step(self) -> float:
        # cloudburst/train.py run_worker: train_step(), then strategy.after_step(batch_size).
        strategy = self.strategy
        xb, yb = next(self.stream)
        loss = self.loss_fn(self.net(xb), yb)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        strategy.after_backward()
        self.optimizer.step()
        value = loss.item()
        strategy.after_step(self.batch_size)
        return value

    def run(self, warmup: int, steps: int) -> list[float]:
        """``warmup`` untimed steps, then ``steps`` timed ones; returns each step's seconds."""
        for _ in range(warmup):
            self.step()
        gc.collect()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(benchutil.RESULTS / "overhead.md"))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="cloudburst-bench-") as tmp:
        # The generated MNIST-1D arrays are cached under $CLOUDBURST_CACHE; without one, in tmp.
        os.environ.setdefault("CLOUDBURST_CACHE", str(Path(tmp) / "cache"))
        data = load_dataset("mnist1d", 4000, 1000)
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        cfg = RunConfig(
            strategy="sync",
            workers=1,
            servers=0,
            dataset="mnist1d",
            train_size=4000,
            test_size=1000,
            model="cnn",
            batch_size=64,
            optimizer="sgd",
            lr=0.05,
            momentum=0.9,
            seed=SEED,
            steps=args.rounds * (args.warmup + args.steps),
            out=str(Path(tmp) / "run"),
            progress=False,
        )
        ctx = Context(
            cfg=cfg,
            rank=0,
            world_size=1,
            num_servers=0,
            num_workers=1,
            workers_group=None,
            store=store,
            t0=time.time(),
        )
        variants = {name: Variant(name, cfg, ctx, data) for name in VARIANTS}

        round_med: dict[str, list[float]] = {v: [] for v in VARIANTS}
        all_steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
        orders = []
        t_start = time.perf_counter()
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            orders.append(order)
            for name in order:
                times = variants[name].run(args.warmup, args.steps)
                round_med[name].append(benchutil.median(times))
                all_steps[name].extend(times)
        elapsed = time.perf_counter() - t_start

        reference = torch.nn.utils.parameters_to_vector(variants["plain"].model.parameters())
        max_diff = {
            name: (
                torch.nn.utils.parameters_to_vector(variants[name].model.parameters()) - reference
            )
            .abs()
            .max()
            .item()
            for name in ("ddp", "sync")
        }
        sync_stats = variants["sync"].strategy.stats.as_dict()
        dist.destroy_process_group()

    med = {v: benchutil.median(round_med[v]) for v in VARIANTS}
    med_step = {v: benchutil.median(all_steps[v]) for v in VARIANTS}

    def ratio_row(a: str, b: str, target: float | None) -> list[str]:
        value = med_step[a] / med_step[b]
        per_round = [x / y for x, y in zip(round_med[a], round_med[b], strict=True)]
        paired = f"{benchutil.median(per_round):.3f}"
        listed = ", ".join(f"{x:.3f}" for x in per_round)
        if target is None:
            return [f"{a} / {b}", f"{value:.3f}", paired, "(reference)", "-", listed]
        # The verdict is the paired estimate: each round compares variants that ran seconds
        # apart, so slow spells of this shared machine cancel out; the pooled-median ratio is
        # shown beside it.
        verdict = benchutil.verdict(benchutil.median(per_round), target, higher_is_better=False)
        return [f"{a} / {b}", f"{value:.3f}", paired, f"<= {target}", verdict, listed]

    lines = [
        "# Step-time overhead of the `sync` strategy at world size 1",
        "",
        *benchutil.provenance_lines(),
        "- settings: MNIST-1D CNN (`build_model('cnn', 40, 10, 0)`), "
        "`load_dataset('mnist1d', 4000, 1000)` + `BatchStream`, batch 64, SGD lr 0.05 "
        f"momentum 0.9; {args.rounds} rounds x 3 variants, each {args.warmup} warm-up + "
        f"{args.steps} timed steps per round, order rotated per round; one process, "
        "world-size-1 gloo group (HashStore), 1 thread",
        "- variants: `plain` = no torch.distributed; `ddp` = DistributedDataParallel, no hook; "
        "`sync` = SyncStrategy.wrap with after_backward / after_step as in run_worker (with one "
        "worker wrap returns the model itself: nothing to average, so no DDP)",
        "",
        "## Results",
        "",
        *benchutil.table(
            [
                "variant",
                "median step (ms)",
                "median of round medians (ms)",
                "round medians (ms)",
            ],
            [
                [
                    v,
                    f"{1e3 * med_step[v]:.4f}",
                    f"{1e3 * med[v]:.4f}",
                    ", ".join(f"{1e3 * x:.4f}" for x in round_med[v]),
                ]
                for v in VARIANTS
            ],
        ),
        "",
        "## Ratios",
        "",
        "`value` = ratio of the median step times; `paired` (the verdict's) = median over "
        "rounds of the ratio of the two variants' per-round medians; `per round` = those ratios.",
        "",
        *benchutil.table(
            ["ratio", "value", "paired", "target", "verdict", "per round"],
            [
                ratio_row("sync", "plain", TARGET),
                ratio_row("sync", "ddp", TARGET),
                ratio_row("ddp", "plain", None),
            ],
        ),
        "",
        "Order per round: " + "; ".join(" ".join(o) for o in orders),
        "",
        "Check: largest |θ_variant − θ_plain| after the same batches: "
        + ", ".join(f"{k} {v:.3g}" for k, v in max_diff.items())
        + f". SyncStrategy counters at the end: {sync_stats}.",
        "",
        f"Timed section: {elapsed:.0f} s.",
    ]
    path = benchutil.write_markdown(args.out, lines)
    print("\n".join(lines))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
