"""Models made for the benchmarks (not in the package): ``--model benchmarks.bench_models:NAME``.

``mnist1d_wide_cnn``: the MNIST-1D paper's CNN widened to 48 channels with a 2048-unit hidden
layer before the classifier: large where communication is concerned, small where the 2 CPU cores
are. Its numbers and why this shape: benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class WideConvNet1D(nn.Module):
    """Three stride-2 convolutions of ``channels``, then a hidden layer of ``hidden`` units."""

    def __init__(self, input_length=40, num_classes=10, channels=48, hidden=2048):
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
        for conv in (self.conv1, self.conv2, self.conv3):
            h = conv(h).relu()
        return self.linear(self.hidden(h.flatten(1)).relu())


def mnist1d_wide_cnn(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Factory for ``--model benchmarks.bench_models:mnist1d_wide_cnn`` (1-D inputs only)."""
    if len(input_shape) != 1:
        shape = tuple(input_shape)
        raise ValueError(f"mnist1d_wide_cnn takes 1-D inputs such as (40,), got {shape}")
    return WideConvNet1D(input_shape[0], num_classes)
