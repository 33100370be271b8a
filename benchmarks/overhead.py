"""Step-time overhead of cloudburst's ``sync``: ÷ raw DDP at W = 2 and 4, ÷ a plain loop at W = 1.

Each world size is one set of gloo processes (127.0.0.1, 1 thread each) holding every variant
side by side, each with its own model (the MNIST-1D CNN, seed 0), SGD optimizer and the same
batches (64 samples a step split over the W ranks): ``plain`` (W = 1: no ``torch.distributed``);
``ddp`` (``DistributedDataParallel``, no comm hook); ``sync`` (``SyncStrategy``, called as the
training loop calls it); the reference again as the A/A control.

A step is the loop's: forward, loss, ``zero_grad``, backward, optimizer step, ``loss.item()``.
Each round (behind a barrier) every variant warms up, then the variants take their timed steps
in turn, in an order shuffled each round (seeded), so load from elsewhere slows every variant
alike; a variant's round value is the median of its steps on rank 0. Ratio = the geometric mean
of the rounds' ratios, 95 % t interval over rounds (harness.INTERVALS). Every variant sees the
same batches, so its parameters must equal the reference's at the end: the largest difference is
reported.

    .venv/bin/python benchmarks/overhead.py [--quick] [--force]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from cloudburst.config import RunConfig  # noqa: E402
from cloudburst.data import load_dataset  # noqa: E402
from cloudburst.launch.agents import free_port  # noqa: E402
from cloudburst.loop.train_step import make_optimizer  # noqa: E402
from cloudburst.models import build_model  # noqa: E402
from cloudburst.runtime.context import Context  # noqa: E402
from cloudburst.strategies.replica import make_strategy  # noqa: E402

TARGET = 1.05  # sync ÷ reference, at most
BATCH = 64
WARMUP = 5  # steps of each variant a round before its timed steps


def _rank(rank: int, world: int, port: int, rounds: int, steps: int, out: str):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    data = load_dataset("mnist1d", 4000, 1000)
    x, y = data.train.x, data.train.y
    per = BATCH // world  # this rank's slice of a 64-sample step
    starts = range(rank * per, len(x) - BATCH + 1, BATCH)
    batches = [(x[i : i + per], y[i : i + per]) for i in starts]
    cfg = RunConfig(strategy="sync", workers=world, model="cnn", batch_size=per, lr=0.05)
    ctx = Context(cfg=cfg, rank=rank, world_size=world, num_servers=0, num_workers=world,
                  workers_group=None, store=store, t0=time.time())  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    setups = {}
    names = ["plain", "ddp", "sync", "plain (A/A)"] if world == 1 else ["ddp", "sync", "ddp (A/A)"]
    for name in names:
        model = build_model("cnn", data.input_shape, data.num_classes, 0)
        optimizer = make_optimizer(cfg, model.parameters())
        net, strategy = model, None
        if name.startswith("ddp"):
            net = DistributedDataParallel(model)
        elif name == "sync":
            strategy = make_strategy(ctx)
            net = strategy.wrap(model, optimizer)
            strategy.start()
        setups[name] = (model, net, optimizer, strategy)
    done = dict.fromkeys(setups, 0)

    def step(name: str) -> None:
        model, net, optimizer, strategy = setups[name]
        xb, yb = batches[done[name] % len(batches)]
        done[name] += 1
        loss = loss_fn(net(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if strategy is not None:
            strategy.after_backward()
        optimizer.step()
        loss.item()
        if strategy is not None:
            strategy.after_step(per)

    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = random.Random(f"0:{r}").sample(names, len(names))  # the same on every rank
        dist.barrier()
        for name in order:
            for _ in range(WARMUP):
                step(name)
        spent: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(steps):  # the variants in turn, step by step: each meets the same noise
            for name in order:
                t0 = time.perf_counter()
                step(name)
                spent[name].append(time.perf_counter() - t0)
        for name in names:
            times[name].append(statistics.median(spent[name]))
    flat = {n: torch.nn.utils.parameters_to_vector(s[0].parameters()) for n, s in setups.items()}
    diff = {n: (v - flat[names[0]]).abs().max().item() for n, v in flat.items()}
    if rank == 0:
        Path(out).write_text(json.dumps({"round_median_s": times, "max_param_diff": diff}))
    dist.destroy_process_group()


def measure(world: int, rounds: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        mp.spawn(_rank, args=(world, free_port(), rounds, steps, out), nprocs=world)
        return json.loads(Path(out).read_text())


def main() -> None:
    args, prov = harness.start(__doc__)
    rounds, steps = (2, 5) if args.quick else (20, 30)  # timed steps a round, after WARMUP
    report = harness.Report("overhead", "Step-time overhead of sync: ÷ DDP, ÷ a plain loop", prov)
    report.settings(
        f"SGD lr 0.05; {rounds} rounds, each variant {WARMUP} warm-up + {steps} timed "
        f"steps a round.\n\n{harness.about(__doc__)}"
    )
    rows, diffs = [], []
    for world in (1, 2, 4):
        result = measure(world, rounds, steps)
        prov.sample_load()
        med, ref = result["round_median_s"], "plain" if world == 1 else "ddp"
        report.data[f"W={world}"] = result
        claim = f"sync step ÷ {'plain loop' if world == 1 else 'raw DDP'}, W = {world}"
        harness.ratio_claim(report, claim, med["sync"], med[ref], med[harness.aa_name(ref)],
                            f"≤ {TARGET}", lambda x: x <= TARGET)  # fmt: skip
        rows += [[world, variant, 1e3 * statistics.median(v)] for variant, v in med.items()]
        diff = ", ".join(f"{k} {v:.2g}" for k, v in result["max_param_diff"].items())
        diffs.append(f"W = {world}: {diff}")
    report.table(["W", "variant", "median step (ms)"], rows)
    report.text("Largest |θ − θ_reference| after the same batches: " + "; ".join(diffs) + ".")
    report.write()


if __name__ == "__main__":
    main()
