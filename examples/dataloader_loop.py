"""A plain PyTorch loop — a ``Dataset``, a ``DataLoader``, ``loss.backward()``,
``optimizer.step()`` — driven by a cloudburst strategy, launched by torchrun.

    torchrun --nproc-per-node 2 examples/dataloader_loop.py --strategy sync
    torchrun --nproc-per-node 3 examples/dataloader_loop.py --strategy asgd --servers 1
    torchrun --nproc-per-node 2 examples/dataloader_loop.py --strategy local_sgd

The loop itself has no cloudburst call: ``job.wrap`` hooks the model and the optimizer, and
leaving the ``with`` block finishes the job. Only the lines marked ``# cloudburst`` differ from
single-process PyTorch.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cloudburst
from cloudburst.data import synthetic


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="sync")
    p.add_argument("--servers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default="runs/dataloader-loop")
    args = p.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    cfg = cloudburst.RunConfig(  # cloudburst
        strategy=args.strategy,
        workers=world - args.servers,
        servers=args.servers,
        server_lr=1 / (world - args.servers),
        period=4,
        steps=1,  # this loop decides its own length; the field only has to be valid
        dataset="synthetic",
        out=args.out,
    )
    data = synthetic(4000, 1000)  # your Dataset here; this one is noisy templates, 40 features
    train = TensorDataset(data.x_train, data.y_train)
    torch.manual_seed(0)  # the same initial θ on every rank
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 10))

    with cloudburst.Job(cfg) as job:  # cloudburst
        if job.is_server:  # cloudburst
            final = job.serve(model)  # cloudburst
            if final is not None:
                acc = (final(data.x_test).argmax(1) == data.y_test).float().mean().item()
                # (the newline in the text, flushed: one write, whole lines between ranks)
                print(f"final global model: test accuracy {acc:.3f}\n", end="", flush=True)
            return
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model = job.wrap(model, optimizer)  # cloudburst
        loader = DataLoader(
            job.shard(train),  # cloudburst: this worker's part, the same on every run
            batch_size=64,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(job.worker_index),
        )
        for _ in range(args.epochs):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        model.eval()
        with torch.no_grad():
            acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
        # (the newline in the text, flushed: one write, whole lines between ranks)
        print(f"worker {job.worker_index}: replica test accuracy {acc:.3f}\n", end="", flush=True)


if __name__ == "__main__":
    main()
