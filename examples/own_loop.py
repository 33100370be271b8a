"""Your own training loop with a cloudburst strategy and explicit calls, launched by torchrun.

    torchrun --nproc-per-node 3 examples/own_loop.py --strategy asgd --servers 1 --n-sync 5
    torchrun --nproc-per-node 2 examples/own_loop.py --strategy sync
    torchrun --nproc-per-node 4 examples/own_loop.py --strategy daso --nodes 2

Only the lines marked ``# cloudburst`` differ from a plain PyTorch loop.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import cloudburst
from cloudburst.data import synthetic, worker_shard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="sync")
    p.add_argument("--servers", type=int, default=0)
    p.add_argument("--n-sync", type=int, default=1)
    p.add_argument("--nodes", type=int, default=None, help="emulated nodes (daso)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="runs/own-loop")
    args = p.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    cfg = cloudburst.RunConfig(  # cloudburst
        strategy=args.strategy,
        workers=world - args.servers,
        servers=args.servers,
        n_sync=args.n_sync,
        nodes=args.nodes,
        steps=args.steps,
        dataset="synthetic",
        out=args.out,
    )
    job = cloudburst.Job(cfg)  # cloudburst

    torch.manual_seed(0)  # the same initial θ on every rank
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 10))
    # Your data here; this example uses cloudburst's small synthetic set (noisy templates).
    data = synthetic(4000, 1000)
    x_test, y_test = data.x_test, data.y_test

    if job.is_server:  # cloudburst
        final = job.serve(model)  # cloudburst
        if final is not None:
            acc = (final(x_test).argmax(1) == y_test).float().mean().item()
            # (the newline in the text, flushed: one write, whole lines between ranks)
            print(f"final global model: test accuracy {acc:.3f}\n", end="", flush=True)
        return

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x_all, y_all = worker_shard(data, job.worker_index, job.num_workers)  # its own shard
    steps_per_epoch = len(x_all) // 64
    # hooks=False: this example makes the calls itself (examples/dataloader_loop.py lets
    # job.wrap hook the optimizer instead)
    model = job.wrap(model, optimizer, steps_per_epoch, args.steps, hooks=False)  # cloudburst
    job.start()  # cloudburst
    g = torch.Generator().manual_seed(100 + job.worker_index)
    for _ in range(args.steps):
        idx = torch.randint(0, len(x_all), (64,), generator=g)
        x, y = x_all[idx], y_all[idx]
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        job.after_backward()  # cloudburst
        optimizer.step()
        job.after_step(len(x), loss.item())  # cloudburst
    report = job.finish()  # cloudburst
    # (the newline in the text, flushed: one write, whole lines between ranks)
    line = f"worker {job.worker_index}: loss {loss.item():.3f}, sent {report['sent_bytes']} bytes"
    print(line + "\n", end="", flush=True)


if __name__ == "__main__":
    main()
