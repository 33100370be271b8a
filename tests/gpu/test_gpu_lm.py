"""The GPT on CUDA: bf16 autocast trains it, and its loss agrees with fp32 on the CPU. Skipped
without CUDA: ``pytest -m gpu`` where a GPU is (W = 4 DiLoCo/sync: benchmarks/results/lm.md)."""

import math

import pytest
import torch

from cloudburst.data import evaluate_dataset, lm_loss
from cloudburst.data.datasets import TokenWindows
from cloudburst.models import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_autocast_on_cuda_trains_the_gpt_and_agrees_with_the_cpu():
    model = build_model("gpt:layers=2,width=64,heads=4", (32,), 256, 0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (8, 32), generator=g)
    test = TokenWindows(x, (x + 1) % 256)
    _, cpu_loss = evaluate_dataset(model, test, None)
    cuda = model.to("cuda")
    _, gpu_loss = evaluate_dataset(cuda, test, None, device="cuda", autocast=True)
    assert abs(gpu_loss - cpu_loss) < 0.05 and abs(cpu_loss - math.log(256)) < 0.2
    opt = torch.optim.AdamW(cuda.parameters(), lr=3e-3)
    xb, yb = x.cuda(), ((x + 1) % 256).cuda()
    for _ in range(30):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(cuda(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, trained = evaluate_dataset(cuda, test, None, device="cuda", autocast=True)
    assert trained < gpu_loss - 1.0  # the shift-by-one rule is learnable in 30 steps
