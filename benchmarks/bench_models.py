"""Models made for the benchmarks (not in the package): ``--model benchmarks.bench_models:NAME``.

``mnist1d_wide_cnn`` — the MNIST-1D paper's CNN (Greydanus 2020; ``cloudburst.models.ConvNet1D``:
three stride-2 convolutions) widened to 48 channels, with a wide hidden layer before the
classifier:

    conv(1→48, k5, s2) – conv(48→48, k3, s2) – conv(48→48, k3, s2) – flatten (48 × 5 = 240)
    – linear(240 → 2048) – ReLU – linear(2048 → 10)

528,266 parameters (2.11 MB in fp32, 1.06 MB in bf16), 97 % of them in the hidden layer. A
dense layer costs one multiply-add per parameter per sample, the fewest FLOPs a parameter can
cost in a dense model (the convolutions cost 5-19 per parameter per sample), so the model is
large where communication is concerned and small where the 2 CPU cores are concerned: about
7-10 ms for a training step of batch 64 on one core (SGD with momentum included; ``daso.py``
measures it in every result: "one process, no padding"), against a
``sync`` gradient all-reduce of about 37 ms per step over an emulated 1 Gbit/s, 1 ms link
(``benchmarks/daso.py`` has the arithmetic).

Why 48 channels and not the paper's 25 with a wider layer: the 25-channel stack with a 3648-unit
hidden layer (500 k parameters) overfits MNIST-1D's 4000 training samples and plateaus at
90.3-90.7 % (two seeds, single-process SGD on batch 256, lr 0.1, momentum 0.9, 64 epochs), too
close to the 90 % target to time it; this one plateaus at 91.8-92.8 % (three seeds), crossing
90 % after 420-480 steps. No batch norm, no dropout: replicas differ only by what the strategy
does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

WIDE_CHANNELS = 48
WIDE_HIDDEN = 2048


class WideConvNet1D(nn.Module):
    """Three stride-2 convolutions of ``channels``, then a hidden layer of ``hidden`` units."""

    def __init__(
        self,
        input_length: int = 40,
        num_classes: int = 10,
        channels: int = WIDE_CHANNELS,
        hidden: int = WIDE_HIDDEN,
    ):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        length = input_length
        for k in (5, 3, 3):
            length = (length + 2 - k) // 2 + 1
        self.hidden = nn.Linear(channels * length, hidden)
        self.linear = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], 1, -1)
        h = self.conv1(h).relu()
        h = self.conv2(h).relu()
        h = self.conv3(h).relu()
        h = self.hidden(h.flatten(1)).relu()
        return self.linear(h)


def mnist1d_wide_cnn(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Factory for ``--model benchmarks.bench_models:mnist1d_wide_cnn`` (1-D inputs only)."""
    if len(input_shape) != 1:
        raise ValueError(
            f"mnist1d_wide_cnn takes 1-D inputs such as (40,), got {tuple(input_shape)}"
        )
    return WideConvNet1D(input_shape[0], num_classes)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
