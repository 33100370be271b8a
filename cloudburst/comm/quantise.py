"""The stateless maths of compression: quantise / dequantise block-wise, and the bytes of one
point-to-point message (:func:`encode`, :func:`decode`, :func:`payload_bytes`).

Below :mod:`cloudburst.comm.p2p` (which sends and receives compressed payloads with it) and
:mod:`cloudburst.comm.compress` (collectives, error feedback; re-exports all of this). See
compress.py's docstring for the methods and their error bounds.
"""

from __future__ import annotations

import torch

METHODS = ("none", "bf16", "fp8", "int8", "powersgd")
#: Values per quantisation block (one fp32 scale each: 4/256 = 1.6 % overhead).
BLOCK = 256
INT8_MAX = 127.0
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
QUANTISED = ("int8", "fp8")


# ---------------------------------------------------------------------------- stateless maths
def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    n = x.numel()
    pad = (-n) % BLOCK
    flat = x.reshape(-1).float()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK), n


def quantise(x: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, fp32) as (codes, fp32 scales): int8 codes or float8_e4m3fn codes,
    one scale per block of :data:`BLOCK` values (the last block zero-padded)."""
    blocks, _ = _blocks(x)
    absmax = blocks.abs().amax(dim=1)
    top = INT8_MAX if method == "int8" else FP8_MAX
    # An all-zero block gets scale 1; a block holding NaN or ±inf keeps a non-finite scale, so
    # it decodes to NaN and the receivers' finiteness checks see it (a NaN cast to a code is 0).
    # A scale never underflows to 0 (a block of values below ~1e-42 would decode to NaN): at
    # least the smallest normal float, its values then round to code 0.
    tiny = torch.finfo(torch.float32).tiny
    scales = torch.where(absmax == 0, torch.ones_like(absmax), (absmax / top).clamp_(min=tiny))
    scaled = blocks / scales[:, None]
    if method == "int8":
        codes = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif method == "fp8":
        codes = scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"not a quantised method: {method!r}")
    return codes.reshape(-1), scales


def dequantise(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of :func:`quantise`'s output, the first ``numel`` of them."""
    return (codes.view(-1, BLOCK).float() * scales[:, None]).reshape(-1)[:numel]


def round_trip(x: torch.Tensor, method: str) -> torch.Tensor:
    """What the receivers see of ``x`` (fp32, ``x``'s shape): C⁻¹(C(x))."""
    if method == "none":
        return x.clone()
    if method == "bf16":
        return x.to(torch.bfloat16).float()
    codes, scales = quantise(x, method)
    return dequantise(codes, scales, x.numel()).view_as(x)


def packed_bytes(numel: int, method: str) -> int:
    """Bytes of one rank's quantised vector: 1 per (padded) value + 4 per block."""
    blocks = -(-numel // BLOCK)
    return blocks * BLOCK + 4 * blocks


def _pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)])


def _unpack(packed: torch.Tensor, numel: int, method: str) -> torch.Tensor:
    blocks = -(-numel // BLOCK)
    dtype = torch.int8 if method == "int8" else torch.float8_e4m3fn
    codes = packed[: blocks * BLOCK].view(dtype)
    scales = packed[blocks * BLOCK :].view(torch.float32)
    return dequantise(codes, scales, numel)


# ---------------------------------------------------------------------------- messages
def payload_bytes(numel: int, method: str) -> int:
    """Bytes of a point-to-point payload of ``numel`` values sent with ``method``: what a
    receiver expects, derived from the size it knows (never from a peer's header)."""
    if method == "none":
        return 4 * numel
    if method == "bf16":
        return 2 * numel
    if method in QUANTISED:
        return packed_bytes(numel, method) if numel else 0
    raise ValueError(f"no point-to-point payload for {method!r}")


def encode(x: torch.Tensor, method: str) -> torch.Tensor:
    """``x`` (fp32) as the bytes of one message (uint8, :func:`payload_bytes` of them):
    bf16 values, or int8/fp8 codes followed by their fp32 block scales."""
    if method == "bf16":
        return x.detach().reshape(-1).to(torch.bfloat16).view(torch.uint8)
    codes, scales = quantise(x.detach(), method)
    return _pack(codes, scales)


def decode(packed: torch.Tensor, numel: int, method: str) -> torch.Tensor:
    """The fp32 values of :func:`encode`'s bytes. Untrusted input decodes to values the
    receivers' finiteness checks reject: a block whose scale is not finite and positive (or
    whose fp8 codes are NaN) comes out NaN, never silently zero or sign-flipped."""
    if packed.dtype != torch.uint8 or packed.numel() != payload_bytes(numel, method):
        raise ValueError(
            f"a {method} payload of {numel} values is {payload_bytes(numel, method)} bytes, "
            f"got {packed.numel()} of {packed.dtype}"
        )
    if method == "bf16":
        return packed.view(torch.bfloat16).float()
    if not numel:
        return torch.empty(0)
    blocks = -(-numel // BLOCK)
    scales = packed[blocks * BLOCK :].view(torch.float32)
    valid = torch.isfinite(scales) & (scales > 0)
    if not bool(valid.all()):
        scales = torch.where(valid, scales, torch.full_like(scales, float("nan")))
    dtype = torch.int8 if method == "int8" else torch.float8_e4m3fn
    return dequantise(packed[: blocks * BLOCK].view(dtype), scales, numel)
