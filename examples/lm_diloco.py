"""A small GPT trained with DiLoCo on the Python standard library, through the Python API.

    torchrun --nproc-per-node 4 examples/lm_diloco.py
    torchrun --nproc-per-node 2 examples/lm_diloco.py --steps 100 --model gpt:layers=2,width=64

Inner AdamW with linear warm-up, cosine decay and gradient clipping on each worker; every H
steps the averaged change is the outer Nesterov step (cloudburst's DiLoCo). Only the lines
marked ``# cloudburst`` differ from a plain PyTorch loop. docs/lm.md explains the workload.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

import cloudburst
from cloudburst.comm.flat import assign_flat
from cloudburst.data import batch_stream, evaluate_dataset, lm_loss, load_dataset, worker_source
from cloudburst.loop.train_step import clip_gradients, make_optimizer, make_scheduler
from cloudburst.models import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--period", type=int, default=16, help="H: inner steps per outer step")
    p.add_argument("--model", default="gpt", help="gpt or gpt:layers=L,width=D,heads=H")
    p.add_argument("--dataset", default="text:stdlib")
    p.add_argument("--out", default="runs/lm-diloco")
    args = p.parse_args()

    cfg = cloudburst.RunConfig(  # cloudburst
        strategy="diloco",
        workers=int(os.environ["WORLD_SIZE"]),
        model=args.model,
        dataset=args.dataset,
        steps=args.steps,
        period=args.period,
        out=args.out,
    )  # AdamW 4.2e-3, wd 0.1, warm-up + cosine, clip 1, outer averaging (lr 1, momentum 0)
    job = cloudburst.Job(cfg)  # cloudburst

    data = load_dataset(
        cfg.data.dataset, cfg.data.train_size, cfg.data.test_size, context=cfg.data.context
    )
    model = build_model(
        cfg.model.model, data.input_shape, data.num_classes, cfg.training.seed
    )  # same θ₀
    optimizer = make_optimizer(cfg, model.parameters())
    scheduler = make_scheduler(cfg, optimizer, cfg.training.steps)
    shard = worker_source(data, job.worker_index, job.num_workers)  # disjoint tokens
    stream = batch_stream(shard, cfg.training.batch_size, seed=1000 + job.worker_index)
    model = job.wrap(
        model, optimizer, len(shard) // cfg.training.batch_size, cfg.training.steps, hooks=False
    )  # cloudburst
    job.start()  # cloudburst
    for _ in range(cfg.training.steps):
        x, y = next(stream)
        loss = lm_loss(model(x), y)  # nats per byte token
        optimizer.zero_grad()
        loss.backward()
        job.after_backward()  # cloudburst
        clip_gradients(optimizer, cfg.training.clip_grad_norm)
        optimizer.step()
        scheduler.step()
        job.after_step(len(x), loss.item())  # cloudburst
    global_params = job.global_params()  # cloudburst: every worker takes part
    report = job.finish()  # cloudburst
    if job.worker_index == 0 and global_params is not None:
        assign_flat(model, global_params[0])
        _, test_loss = evaluate_dataset(model, data.test, None)
        line = (
            f"global model: test loss {test_loss:.3f} nats/byte ({test_loss / math.log(2):.3f} "
            f"bits/byte), sent {report['sent_bytes']} bytes"
        )
        print(line + "\n", end="", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
