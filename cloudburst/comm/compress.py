"""Compressed communication: fewer bytes for the same sum, and the error feedback that keeps the
error from accumulating.

Mechanism only: the strategies decide what to compress (a gradient, a pseudo-gradient, a
replica's drift, an asgd push) and when. ``--compress`` names the method
(docs/algorithms.md#compression). The stateless maths (quantise, the bytes of one
point-to-point message) live in :mod:`cloudburst.comm.quantise`, below
:mod:`cloudburst.comm.p2p`, which sends asgd's, EASGD's and gossip's payloads compressed;
they are re-exported here.

- ``none``: fp32, the collectives as they always were (bit-identical).
- ``bf16``: cast to bfloat16, all-reduce (summed in bf16, as PyTorch's ``bf16_compress_hook``
  and DASO's downcast do), cast back: 2 bytes a value; relative error ≤ 2⁻⁸ per rounding.
- ``fp8``: ``float8_e4m3fn`` with one fp32 scale per block of :data:`BLOCK` values (block
  absmax ↦ 448): ~1 byte a value; relative error ≤ 2⁻⁴ per value (3 mantissa bits).
- ``int8``: symmetric int8 with one fp32 scale per block (block absmax ↦ 127): ~1 byte a
  value; absolute error ≤ absmax(block)/254 per value.
- ``powersgd[:r]``: PowerSGD (Vogels et al. 2019), rank r (default 1), PyTorch's own DDP hook;
  ``sync`` only (it compresses gradient matrices inside DDP's buckets).

Quantised (int8, fp8) all-reduces are an **all-gather** of every rank's quantised blocks and
scales, each rank then dequantising and summing in fp32, in rank order (so every rank gets the
same bits). Summing the quantised values themselves is wrong twice over: int8 sums overflow
(W·127 does not fit in a byte) and every rank quantised with its own scales, so the integers
of two ranks are not in the same unit. The price of the all-gather: each rank receives
(W − 1) quantised vectors instead of a ring's 2(W − 1)/W fp32 ones, which still saves bytes
(about 4× at W = 2, 2× at W = 4) until W is large; counted as sent.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): a lossy method whose error would
otherwise be lost for good (int8, fp8; PowerSGD keeps its own) adds what it failed to send last
time to what it sends now: x' = x + e, send C(x'), e ← x' − C(x'). Over k rounds the sent sum
then differs from the true sum by the last residual only (bounded by one rounding), not by k of
them. :class:`ErrorFeedback` holds the residuals of one worker, by key; its ``state_dict`` goes
into the strategy's checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cloudburst.comm.collectives import Pending, all_reduce_sum
from cloudburst.comm.link import EmulatedWork, LinkEmulator
from cloudburst.comm.quantise import (  # noqa: F401 - the stateless maths, also from here
    BLOCK,
    FP8_MAX,
    INT8_MAX,
    METHODS,
    QUANTISED,
    _pack,
    _unpack,
    decode,
    dequantise,
    encode,
    packed_bytes,
    payload_bytes,
    quantise,
    round_trip,
)
from cloudburst.comm.stats import CommStats, count_collective, ring_bytes
from cloudburst.comm.transport import REAL, Transport


@dataclass(frozen=True)
class Compression:
    """A parsed ``--compress`` value: the method and PowerSGD's rank."""

    method: str = "none"
    rank: int = 1

    @classmethod
    def parse(cls, text: str) -> Compression:
        name, _, arg = text.partition(":")
        if name not in METHODS:
            raise ValueError(
                f"{text!r} is not allowed; choose one of none, bf16, fp8, int8, powersgd[:RANK]"
            )
        if arg and name != "powersgd":
            raise ValueError(f"{text!r}: only powersgd takes an argument (its rank)")
        rank = 1
        if arg:
            try:
                rank = int(arg)
            except ValueError:
                rank = 0
            if rank < 1:
                raise ValueError(f"{text!r}: powersgd's rank must be an integer >= 1")
        return cls(name, rank)

    @property
    def active(self) -> bool:
        return self.method != "none"

    @property
    def quantised(self) -> bool:
        return self.method in QUANTISED


# ---------------------------------------------------------------------------- error feedback
class ErrorFeedback:
    """One worker's residuals e, by key (a fragment, a DDP bucket): what compression left out."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """x + e (a new tensor; e = 0 the first time)."""
        e = self.residuals.get(key)
        return x + e if e is not None else x.clone()

    def remember(self, key: str, intended: torch.Tensor, sent: torch.Tensor) -> None:
        """e ← intended − sent."""
        self.residuals[key] = (intended - sent).detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {str(k): v.clone() for k, v in state.items()}


# ---------------------------------------------------------------------------- collectives
class _Finishing(Pending):
    """A pending collective whose result still needs a step (decompression) after the wait."""

    def __init__(self, works: list, stats: CommStats, comm: Transport, finish: Callable[[], None]):
        super().__init__(works, stats, comm)
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        super().wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def gather_cost_bytes(per_rank_bytes: int, group_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-gather: (n − 1) others' pieces."""
    return (group_size - 1) * per_rank_bytes


def compressed_all_reduce_sum(
    tensor: torch.Tensor,
    group: Any,
    stats: CommStats,
    method: str,
    feedback: ErrorFeedback | None = None,
    key: str = "",
    link: LinkEmulator | None = None,
    spans_nodes: bool = False,
    async_op: bool = False,
    comm: Transport = REAL,
) -> Pending:
    """Sum the fp32 ``tensor`` in place over ``group``, sending it compressed with ``method``
    (see the module docstring); with ``feedback``, the residual under ``key`` is added before
    compressing and the new one kept. Counted as the bytes actually sent. Every rank ends with
    the same bits. ``none`` is :func:`~cloudburst.comm.collectives.all_reduce_sum` itself."""
    kw = dict(link=link, spans_nodes=spans_nodes, async_op=async_op, comm=comm)
    if method == "none":
        return all_reduce_sum(tensor, group, stats, **kw)
    if method == "bf16":
        low = tensor.to(torch.bfloat16)
        inner = all_reduce_sum(low, group, stats, **{**kw, "async_op": True})
        pending = _Finishing(inner.works, stats, comm, lambda: tensor.copy_(low))
        if not async_op:
            pending.wait()
        return pending
    if method not in QUANTISED:
        raise ValueError(f"compressed all-reduce: {method!r} is not bf16, fp8 or int8")
    x = feedback.compensate(key, tensor) if feedback is not None else tensor
    codes, scales = quantise(x, method)
    if feedback is not None:
        feedback.remember(key, x.reshape(-1), dequantise(codes, scales, x.numel()))
    packed = _pack(codes, scales)
    size = comm.group_size(group)
    gathered = packed.new_empty(size * packed.numel())
    work = comm.all_gather(gathered, packed, group, async_op=True)
    count_collective(stats, gather_cost_bytes(packed.numel(), size), spans_nodes)
    if link is not None and link.active and spans_nodes and size > 1:
        # A ring all-gather carries (n − 1)/n of the n pieces: the bandwidth of an all-reduce
        # of half their total (its 2(n − 1) latencies overstate the gather's n − 1).
        cost = link.allreduce_s(size * packed.numel() // 2, size)
        stats.emulated_link_s += cost
        work = EmulatedWork(work, link.reserve(cost))
    numel = tensor.numel()

    def finish() -> None:
        pieces = gathered.view(size, -1)
        total = _unpack(pieces[0], numel, method)
        for r in range(1, size):
            total += _unpack(pieces[r], numel, method)
        tensor.view(-1).copy_(total)

    pending = _Finishing([work], stats, comm, finish)
    if not async_op:
        pending.wait()
    return pending


def wire_bytes_per_value(method: str) -> float:
    """Bytes a value costs on the wire (for the docs and the tests' expectations)."""
    return {"none": 4.0, "bf16": 2.0}.get(method, 1.0 + 4.0 / BLOCK)


__all__ = [
    "BLOCK",
    "METHODS",
    "Compression",
    "ErrorFeedback",
    "compressed_all_reduce_sum",
    "decode",
    "dequantise",
    "encode",
    "gather_cost_bytes",
    "packed_bytes",
    "payload_bytes",
    "quantise",
    "ring_bytes",
    "round_trip",
    "wire_bytes_per_value",
]
