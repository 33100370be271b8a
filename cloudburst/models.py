"""Models of the MNIST-1D paper (Greydanus 2020): an MLP and a small 1-D CNN.

Published test accuracy on MNIST-1D: MLP 68%, CNN 94%. Neither has batch norm or dropout,
so data-parallel runs can be compared exactly with a single-process reference.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, input_length: int = 40, num_classes: int = 10, hidden: int = 100):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_length, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class ConvNet1D(nn.Module):
    """The MNIST-1D paper's CNN: three stride-2 convolutions (25 channels) and a linear head."""

    def __init__(self, input_length: int = 40, num_classes: int = 10, channels: int = 25):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        length = input_length
        for k in (5, 3, 3):
            length = (length + 2 - k) // 2 + 1
        self.linear = nn.Linear(channels * length, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], 1, -1)
        h = self.conv1(h).relu()
        h = self.conv2(h).relu()
        h = self.conv3(h).relu()
        return self.linear(h.flatten(1))


def build_model(name: str, input_length: int, num_classes: int, seed: int) -> nn.Module:
    """The same seed gives the same initial θ on every rank (the cold start)."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(input_length, num_classes)
    if name == "cnn":
        return ConvNet1D(input_length, num_classes)
    raise ValueError(f"unknown model {name!r}")


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y)."""
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, x.shape[0], batch):
        logits = model(x[i : i + batch])
        loss += nn.functional.cross_entropy(logits, y[i : i + batch], reduction="sum").item()
        correct += (logits.argmax(1) == y[i : i + batch]).sum().item()
    model.train(was_training)
    return correct / x.shape[0], loss / x.shape[0]
