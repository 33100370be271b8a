"""Compressed communication: fewer bytes for the same sum, and the error feedback that keeps the
error from accumulating.

Mechanism only: the strategies decide what to compress (a gradient, a pseudo-gradient, a
replica's drift, an asgd push) and when. ``--compress`` names the method
(docs/algorithms.md#compression). The stateless maths (quantise, the bytes of one
point-to-point message) live in :mod:`cloudburst.comm.quantise`, below
:mod:`cloudburst.comm.p2p`, which sends asgd's, EASGD's and gossip's payloads compressed;
they are re-exported here.

Methods (formats, error bounds, what each strategy sends: docs/algorithms.md#compression):
``none`` (fp32, the plain collectives, bit-identical), ``bf16`` (summed in bf16, as PyTorch's
``bf16_compress_hook``), ``fp8`` / ``int8`` (1 byte a value + one fp32 scale per :data:`BLOCK`
values, with error feedback), ``powersgd[:r]`` (PyTorch's DDP hook; ``sync`` only).

The quantised all-reduce (ALGORITHMS.md §8) is a reduce-scatter then all-gather of quantised
chunks (two all-to-alls): rank j owns chunk j, sums the W dequantised pieces in fp32 in rank
order, re-quantises the sum and sends it to all, so every rank gets the owner's bits. Bytes
per rank: 2(W − 1)/W of the packed vector on average (:func:`quantised_sent_bytes`), 0.254×
an fp32 ring at every W. At W ≤ :data:`GATHER_MAX_W` (2) an all-gather of the packed vectors
is kept: the same bytes, one rounding and W − 1 latencies. Counted as sent, when started.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): send C(x + e), keep
e ← x + e − C(x + e), so k rounds differ from the true sum by one residual, not k. The
reduce-scatter rounds twice and keeps two residuals: the sender's (``key``) and the chunk
owner's (``key + OWNER``), both in :class:`ErrorFeedback`'s ``state_dict`` (the checkpoint).
A checkpoint without the owner's resumes with it at zero (the all-gather rounded once); a
residual whose size does not fit the run is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cloudburst.comm.collectives import Pending, all_reduce_sum, all_to_all_s
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

#: PowerSGD's first compressed iteration unless ``powersgd:RANK:START`` says: 2, the earliest
#: PyTorch allows with error feedback and warm start.
POWERSGD_START = 2
#: The largest rank or start iteration accepted (an int64 step count is far beyond any run).
_MAX_COUNT = 10**9


def _count(text: str, what: str, value: str, least: int) -> int:
    """``value`` as an integer in ``least``..10⁹, or a one-line error naming ``what``."""
    number = int(value) if value.isdigit() else -1
    if not least <= number <= _MAX_COUNT:
        raise ValueError(f"{text!r}: powersgd's {what} must be an integer in {least}..{_MAX_COUNT}")
    return number


@dataclass(frozen=True)
class Compression:
    """A parsed ``--compress`` value: the method, and PowerSGD's rank and the iteration it
    starts compressing at (``powersgd:RANK:START``; before it, plain all-reduce: its authors'
    warm-up, PyTorch's ``start_powerSGD_iter``)."""

    method: str = "none"
    rank: int = 1
    start: int = POWERSGD_START

    @classmethod
    def parse(cls, text: str) -> Compression:
        name, _, arg = text.partition(":")
        if name not in METHODS:
            raise ValueError(
                f"{text!r} is not allowed; choose one of none, bf16, fp8, int8, "
                "powersgd[:RANK[:START]]"
            )
        if arg and name != "powersgd":
            raise ValueError(f"{text!r}: only powersgd takes arguments (its rank and start)")
        rank_text, _, start_text = arg.partition(":")
        rank = _count(text, "rank", rank_text, 1) if arg else 1
        start = _count(text, "start", start_text, POWERSGD_START) if ":" in arg else POWERSGD_START
        return cls(name, rank, start)

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
        if e is None:
            return x.clone()
        if e.numel() != x.numel():
            raise ValueError(
                f"error feedback {key!r}: the residual holds {e.numel()} values, this run sends "
                f"{x.numel()} (a checkpoint of another model, worker count or compression)"
            )
        return x + e.view_as(x)

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


#: Up to this group size a quantised all-reduce is an all-gather (see the module docstring).
GATHER_MAX_W = 2
#: The key suffix of a chunk owner's residual (the reduce-scatter form's second rounding).
OWNER = ":owner"


def chunk_blocks(numel: int, group_size: int) -> list[int]:
    """Blocks of a ``numel``-value vector owned by each group position in the reduce-scatter
    form: as even as whole blocks allow, the first positions one more (some none when the
    vector has fewer blocks than ranks)."""
    blocks = -(-numel // BLOCK)
    base, extra = divmod(blocks, group_size)
    return [base + (1 if j < extra else 0) for j in range(group_size)]


def quantised_sent_bytes(numel: int, group_size: int, position: int) -> int:
    """Bytes the rank at ``position`` sends (and receives) in a quantised all-reduce of
    ``numel`` values: the all-gather's (W − 1) packed vectors up to :data:`GATHER_MAX_W`;
    above, the other owners' chunks plus its own chunk to the W − 1 others. Summed over the
    group: 2(W − 1) packed vectors, 2(W − 1)/W of one per rank on average."""
    if group_size <= GATHER_MAX_W:
        return gather_cost_bytes(packed_bytes(numel, "int8"), group_size)
    blocks = chunk_blocks(numel, group_size)
    mine = blocks[position]
    return (sum(blocks) - mine + (group_size - 1) * mine) * (BLOCK + 4)


def _rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The reduce-scatter's wire format: one row of BLOCK code bytes and the block's 4 scale
    bytes per block (uint8, blocks × (BLOCK + 4)), so a run of blocks is a run of rows."""
    blocks = scales.numel()
    return torch.cat(
        [codes.view(torch.uint8).view(blocks, BLOCK), scales.view(torch.uint8).view(blocks, 4)],
        dim=1,
    )


def _from_rows(rows: torch.Tensor, method: str) -> torch.Tensor:
    """The fp32 values (blocks × BLOCK) of :func:`_rows`' bytes."""
    dtype = torch.int8 if method == "int8" else torch.float8_e4m3fn
    return rows[:, :BLOCK].view(dtype).float() * rows[:, BLOCK:].view(torch.float32)


class _TwoPhase(Pending):
    """A quantised all-reduce under way: the works of its first step, then ``finish`` (the
    owner's sum, the second step and the decoding), the whole wait timed into the stats."""

    def __init__(self, works: list, stats: CommStats, comm: Transport, finish: Callable[[], None]):
        super().__init__(works, stats, comm)
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        if self._finish is None:
            return
        t0 = self.comm.now()
        for w in self.works:
            w.wait()
        finish, self._finish = self._finish, None
        finish()
        self.stats.wait_s += self.comm.now() - t0


def _emulate(
    link, stats: CommStats, work, sent_bytes: int, size: int, spans_nodes: bool, group: Any
):
    """``work``, done no earlier than the emulated link carries this rank's ``sent_bytes`` of
    an all-to-all over ``group`` (the real run; the virtual cluster charges its own clock)."""
    if link is None or not link.active or not spans_nodes or size < 2:
        return work
    cost = all_to_all_s(link, sent_bytes, size)
    stats.emulated_link_s += cost
    return EmulatedWork(work, link.book_collective(cost, group))


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
    (see the module docstring); with ``feedback``, the residuals under ``key`` (and, above
    :data:`GATHER_MAX_W`, ``key + OWNER``) are added before compressing and the new ones kept.
    Counted as the bytes actually sent. Every rank ends with the same bits. ``none`` is
    :func:`~cloudburst.comm.collectives.all_reduce_sum` itself. With ``async_op`` the first
    step (the gather, or the scatter of the chunks) overlaps until ``wait()``, which runs the
    rest."""
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
    size = comm.group_size(group)
    x = feedback.compensate(key, tensor) if feedback is not None else tensor
    codes, scales = quantise(x, method)
    if feedback is not None:
        feedback.remember(key, x.reshape(-1), dequantise(codes, scales, x.numel()))
    if size <= GATHER_MAX_W:
        finish, work, first = _gather(tensor, codes, scales, group, method, comm)
        position = 0
    else:
        finish, work, first = _reduce_scatter(
            tensor, codes, scales, group, method, comm, feedback, key
        )
        position = comm.group_rank(group)
    count_collective(stats, quantised_sent_bytes(tensor.numel(), size, position), spans_nodes)
    work = _emulate(link, stats, work, first, size, spans_nodes, group)

    def emulated_finish() -> None:
        finish(lambda w, nbytes: _emulate(link, stats, w, nbytes, size, spans_nodes, group))

    pending = _TwoPhase([work], stats, comm, emulated_finish)
    if not async_op:
        pending.wait()
    return pending


def _gather(tensor, codes, scales, group, method, comm):
    """W ≤ :data:`GATHER_MAX_W`: every rank's packed vector to every rank; each dequantises
    them all and sums in fp32 in rank order. Returns (finish, the work, bytes it sends)."""
    packed = _pack(codes, scales)
    size = comm.group_size(group)
    gathered = packed.new_empty(size * packed.numel())
    work = comm.all_gather(gathered, packed, group, async_op=True)
    numel = tensor.numel()

    def finish(_emulate_second) -> None:
        pieces = gathered.view(size, -1)
        total = _unpack(pieces[0], numel, method)
        for r in range(1, size):
            total += _unpack(pieces[r], numel, method)
        tensor.view(-1).copy_(total)

    return finish, work, (size - 1) * packed.numel()


def _reduce_scatter(tensor, codes, scales, group, method, comm, feedback, key):
    """W > :data:`GATHER_MAX_W`: chunk j (whole blocks, :func:`chunk_blocks`) to its owner j;
    the owner's fp32 sum in rank order, re-quantised with its residual; all owners' chunks to
    every rank (both steps all-to-alls)."""
    size = comm.group_size(group)
    me = comm.group_rank(group)
    numel = tensor.numel()
    blocks = chunk_blocks(numel, size)
    unit = BLOCK + 4  # bytes of one block: its codes and its scale
    send = _rows(codes, scales).view(-1)
    mine = blocks[me]
    received = send.new_empty(size * mine * unit)
    work = comm.all_to_all(
        received, send, [mine * unit] * size, [b * unit for b in blocks], group, async_op=True
    )

    def finish(emulate_second) -> None:
        pieces = _from_rows(received.view(size * mine, unit), method).view(size, mine * BLOCK)
        total = torch.zeros(mine * BLOCK, device=tensor.device)
        for r in range(size if mine else 0):  # in rank order: the same bits on any owner
            total += pieces[r]
        owned = feedback.compensate(key + OWNER, total) if feedback is not None else total
        own_codes, own_scales = quantise(owned, method)
        if feedback is not None:
            feedback.remember(key + OWNER, owned, dequantise(own_codes, own_scales, owned.numel()))
        own = _rows(own_codes, own_scales).view(-1)
        gathered = own.new_empty(sum(blocks) * unit)
        second = comm.all_to_all(
            gathered, own.repeat(size), [b * unit for b in blocks], [mine * unit] * size,
            group, async_op=True,
        )  # fmt: skip
        emulate_second(second, (size - 1) * mine * unit).wait()
        values = _from_rows(gathered.view(sum(blocks), unit), method)
        tensor.view(-1).copy_(values.view(-1)[:numel])

    return finish, work, (sum(blocks) - mine) * unit


def wire_bytes_per_value(method: str) -> float:
    """Bytes a value costs on the wire (for the docs and the tests' expectations)."""
    return {"none": 4.0, "bf16": 2.0}.get(method, 1.0 + 4.0 / BLOCK)


__all__ = [
    "BLOCK",
    "METHODS",
    "Compression",
    "ErrorFeedback",
    "GATHER_MAX_W",
    "OWNER",
    "chunk_blocks",
    "compressed_all_reduce_sum",
    "decode",
    "dequantise",
    "encode",
    "gather_cost_bytes",
    "packed_bytes",
    "payload_bytes",
    "quantise",
    "quantised_sent_bytes",
    "ring_bytes",
    "round_trip",
    "wire_bytes_per_value",
]
