"""A small GPT: the decoder-only transformer of the language-model workload (docs/lm.md).

Pre-norm blocks (LayerNorm → causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)`` → residual; LayerNorm → GELU MLP of 4×width
→ residual), learned positions, a final LayerNorm and an output layer tied to the token
embedding (one matrix). Weights N(0, 0.02), the residual projections N(0, 0.02/√(2·layers)),
biases 0 (GPT-2's init). Input: int64 tokens [B, T] with T ≤ ``context``; output: logits
[B, T, vocab]. No dropout, so data-parallel runs compare exactly with a single process.

Sized by a spec: ``gpt`` (the defaults) or ``gpt:layers=L,width=D,heads=H`` (any subset);
the context length is the dataset's (``--context``). Errors are ``ModelError`` (one line).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

# 2 layers of width 64 (120,576 parameters at context 64): four workers on a 2-core CPU finish
# the default run in minutes (docs/lm.md, "The defaults").
GPT_DEFAULTS = {"layers": 2, "width": 64, "heads": 4}


class ModelError(ValueError):
    """A model name, factory or input shape that cannot work; the message is one line.
    (Re-exported by :mod:`cloudburst.models`, where every model's errors come from.)"""


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer over a vocabulary of ``vocab`` tokens (256: bytes)."""

    def __init__(
        self,
        vocab: int = 256,
        context: int = 128,
        layers: int = 4,
        width: int = 128,
        heads: int = 4,
    ):
        super().__init__()
        for name, value in (("vocab", vocab), ("context", context), ("layers", layers)):
            if not isinstance(value, int) or value < 1:
                raise ModelError(f"gpt: {name} must be a positive integer, got {value!r}")
        if not isinstance(width, int) or not isinstance(heads, int) or heads < 1 or width < 1:
            raise ModelError(
                f"gpt: width and heads must be positive integers, got {width}, {heads}"
            )
        if width % heads:
            raise ModelError(f"gpt: width {width} is not a multiple of heads {heads}")
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one matrix, counted once
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(
                f"gpt: a window of {t} tokens is longer than the context {self.context}"
            )
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def is_gpt_spec(name: str) -> bool:
    return name == "gpt" or name.startswith("gpt:")


def parse_gpt_spec(name: str) -> dict[str, int]:
    """``gpt`` → the defaults; ``gpt:layers=2,width=64`` → those two, the rest default."""

    sizes = dict(GPT_DEFAULTS)
    _, sep, rest = name.partition(":")
    if not sep:
        return sizes
    for item in rest.split(","):
        key, eq, value = item.strip().partition("=")
        if key not in GPT_DEFAULTS or not eq:
            raise ModelError(
                f"model {name!r}: {item.strip()!r} is not KEY=N with KEY one of "
                f"{', '.join(GPT_DEFAULTS)} (e.g. gpt:layers=4,width=128,heads=4)"
            )
        try:
            sizes[key] = int(value)
        except ValueError:
            raise ModelError(f"model {name!r}: {key}={value!r} is not an integer") from None
        if sizes[key] < 1:
            raise ModelError(f"model {name!r}: {key} must be >= 1, got {sizes[key]}")
    if sizes["width"] % sizes["heads"]:
        raise ModelError(
            f"model {name!r}: width {sizes['width']} is not a multiple of heads {sizes['heads']}"
        )
    return sizes
