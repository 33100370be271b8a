"""Gradient all-reduce for DDP, counted: a comm hook equal to DDP's default one.

The hook divides each bucket by the group size and all-reduces it (exactly what
``ddp_comm_hooks.default_hooks.allreduce_hook`` does) and also counts bytes and remembers
when the last bucket was launched, so the loop can measure how long backward() then still
waited for communication (the part of the all-reduce that did not overlap with compute).
Bytes are counted as ring all-reduce moves them: 2(W-1)/W of the bucket, sent and received.

(No ``from __future__ import annotations`` here: DDP checks the hook's real annotations.)
"""

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cloudburst.comm.link import LinkEmulator
from cloudburst.comm.nic import resolve_end
from cloudburst.comm.stats import (  # noqa: F401 - the counting, also importable from here
    CommStats,
    count_collective,
    ring_bytes,
)


@dataclass
class AllreduceHookState:
    group: dist.ProcessGroup | None
    stats: CommStats
    last_launch: float = 0.0
    spans_nodes: bool = False  # the group's ranks are on more than one node
    link: LinkEmulator | None = None  # delays the all-reduce when it spans nodes
    compress: str = "none"  # --compress: which hook (compressed_hook) the DDP gets
    feedback: Any = None  # int8/fp8: the ErrorFeedback of this worker's buckets
    powersgd: Any = None  # powersgd: torch's PowerSGDState


def counting_allreduce_hook(
    state: AllreduceHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer()
    world = dist.get_world_size(state.group)
    count_collective(
        state.stats, ring_bytes(tensor.numel(), tensor.element_size(), world), state.spans_nodes
    )
    state.last_launch = time.perf_counter()
    tensor.div_(world)
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()
    moved = tensor.numel() * tensor.element_size()
    return _through_link(state, fut.then(lambda f: f.value()[0]), moved, world)


def _through_link(state: AllreduceHookState, fut, wire_bytes: int, world: int):
    """``fut``, done no earlier than the emulated link could carry ``wire_bytes`` as a ring
    all-reduce (after the buckets before it) when the group spans nodes; backward() waits for
    every bucket, as on a real wire."""
    link = state.link
    if link is None or not link.active or not state.spans_nodes:
        return fut
    cost = link.allreduce_s(wire_bytes, world)
    deadline = link.book_collective(cost, state.group)
    state.stats.emulated_link_s += cost

    def done(f):
        LinkEmulator.wait_until(resolve_end(deadline))
        return f.value()

    return fut.then(done)


def bf16_hook(
    state: AllreduceHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``bf16_compress_hook`` (cast to bf16, all-reduce, divide, cast back), counted
    as the bf16 bytes it sends."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    world = dist.get_world_size(state.group)
    numel = bucket.buffer().numel()
    count_collective(state.stats, ring_bytes(numel, 2, world), state.spans_nodes)
    state.last_launch = time.perf_counter()
    return _through_link(state, bf16_compress_hook(state.group, bucket), numel * 2, world)


def quantised_hook(
    state: AllreduceHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """int8 / fp8: the bucket (plus its error-feedback residuals) through
    :func:`cloudburst.comm.compress.compressed_all_reduce_sum` (an all-gather at W = 2, a
    reduce-scatter and all-gather of quantised chunks above), divided by W. The two steps run
    inside the hook, before it returns: a second collective started from a future's callback
    would interleave with the next bucket's in a different order on different ranks (see
    :func:`counted_ddp`). So a quantised bucket does not overlap with the backward pass."""
    from cloudburst.comm.compress import compressed_all_reduce_sum
    from cloudburst.comm.transport import REAL

    tensor = bucket.buffer()
    world = dist.get_world_size(state.group)
    compressed_all_reduce_sum(
        tensor,
        state.group,
        state.stats,
        state.compress,
        feedback=state.feedback,
        key=f"bucket{bucket.index()}",
        link=state.link,
        spans_nodes=state.spans_nodes,
        comm=REAL,
    )
    state.last_launch = time.perf_counter()  # the wait is in the stats already
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor.div_(world))
    return fut


def powersgd_numel(state, bucket: dist.GradBucket) -> int:
    """fp32 values PowerSGD all-reduces for ``bucket`` this iteration: the whole bucket while
    vanilla (before ``start_powerSGD_iter``), else the uncompressed tensors plus P and Q of the
    compressed ones (torch's own rule for which are worth compressing)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    if state.iter < state.start_powerSGD_iter:
        return bucket.buffer().numel()
    total = 0
    for tensor in bucket.gradients():
        n, m = tensor.view(tensor.shape[0], -1).shape
        rank = min(n, m, state.matrix_approximation_rank)
        worth, uncompressed, compressed = _should_compress(n, m, rank, state.min_compression_rate)
        total += compressed if worth else uncompressed
    return total


def powersgd_hook(
    state: AllreduceHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``powerSGD_hook`` on ``state.powersgd`` (its error feedback and warm start
    included), counted as the P, Q and uncompressed values it all-reduces."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    world = dist.get_world_size(state.group)
    numel = powersgd_numel(state.powersgd, bucket)
    count_collective(state.stats, ring_bytes(numel, 4, world), state.spans_nodes)
    state.last_launch = time.perf_counter()
    return _through_link(state, powerSGD_hook(state.powersgd, bucket), numel * 4, world)


def compressed_hook(state: AllreduceHookState):
    """The counting DDP comm hook for ``state.compress`` (setting up its state)."""
    method = state.compress.partition(":")[0]
    if method == "none":
        return counting_allreduce_hook
    if method == "bf16":
        return bf16_hook
    if method in ("int8", "fp8"):
        from cloudburst.comm.compress import ErrorFeedback

        state.compress = method
        if state.feedback is None:
            state.feedback = ErrorFeedback()
        return quantised_hook
    if method == "powersgd":
        if state.powersgd is None:
            state.powersgd = new_powersgd_state(state.group, state.compress)
        return powersgd_hook
    raise ValueError(f"compress: unknown method {state.compress!r}")


def new_powersgd_state(group, spec: str):
    """torch's PowerSGDState for ``powersgd[:RANK[:START]]``: error feedback and warm start on,
    vanilla all-reduce before iteration START (2 by default, the fewest torch allows with them;
    PowerSGD's authors start after the learning rate's warm-up)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from cloudburst.comm.compress import Compression

    parsed = Compression.parse(spec)
    return PowerSGDState(
        process_group=group,
        matrix_approximation_rank=parsed.rank,
        start_powerSGD_iter=parsed.start,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )


def counted_ddp(
    model: torch.nn.Module, group, device: torch.device, state, hook=None, one_bucket=False
):
    """``model`` in DDP over ``group`` with a counting comm hook on ``state`` (by default
    :func:`counting_allreduce_hook`; ``hook(state, bucket)`` otherwise): the one place sync,
    DASO's node-local part and the benchmarks' PyTorch peer build their DDP. ``one_bucket``:
    every gradient in one bucket (PowerSGD's hook needs it on gloo, see below)."""
    from torch.nn.parallel import DistributedDataParallel

    options = {}
    if one_bucket:
        # PyTorch's powerSGD_hook issues its P and Q all-reduces from future callbacks; with
        # more than one bucket they interleave with the next bucket's all-reduce in a
        # different order on different ranks, which gloo reports as a collective mismatch
        # (or hangs). One bucket as large as the model avoids it.
        model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        options["bucket_cap_mb"] = model_mb + 1
        options["gradient_as_bucket_view"] = False
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        **options,
    )
    ddp.register_comm_hook(state, hook or counting_allreduce_hook)
    return ddp


def charge_unoverlapped_wait(state) -> None:
    """Called right after ``backward()``: backward returns only when every bucket's
    all-reduce is done, so the time since the last bucket was launched is communication that
    did not overlap with compute; it is added to ``state.stats.wait_s``."""
    if state.last_launch:
        state.stats.wait_s += time.perf_counter() - state.last_launch
        state.last_launch = 0.0


def powersgd_state_dict(state) -> dict[str, Any]:
    """What a checkpoint keeps of a PowerSGDState: its iteration, error-feedback residuals
    and warm-start P and Q (by bucket index)."""
    return {
        "iter": state.iter,
        "error_dict": {int(k): v.clone() for k, v in state.error_dict.items()},
        "p_memory_dict": {int(k): v.clone() for k, v in state.p_memory_dict.items()},
        "q_memory_dict": {int(k): v.clone() for k, v in state.q_memory_dict.items()},
    }


def load_powersgd_state(state, saved: dict[str, Any]) -> None:
    state.iter = int(saved["iter"])
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        setattr(state, name, {int(k): v.clone() for k, v in saved[name].items()})


class TorchDataParallel:
    """DDP itself, with the counting (and, with ``--compress``, compressing) comm hook: the
    baseline must be DDP."""

    def __init__(self, model: torch.nn.Module, group, device: torch.device, state):
        self.state = state
        powersgd = state.compress.startswith("powersgd")
        hook = compressed_hook(state)
        self.ddp = counted_ddp(model, group, device, state, hook=hook, one_bucket=powersgd)
        self.module = self.ddp

    def after_backward(self) -> None:
        charge_unoverlapped_wait(self.state)

    def set_sync(self, enabled: bool) -> None:
        self.ddp.require_backward_grad_sync = enabled


def data_parallel(comm, model: torch.nn.Module, group, device: torch.device, state):
    """The synchronous gradient average of ``model`` over ``group``
    (:class:`~cloudburst.comm.transport.DataParallel`): the transport's own where it has one
    (the virtual cluster's), else DDP itself (:class:`TorchDataParallel`). ``state`` is the
    :class:`AllreduceHookState` that counts its traffic."""
    own = getattr(comm, "data_parallel", None)
    if own is not None:
        return own(model, group, device, state)
    return TorchDataParallel(model, group, device, state)
