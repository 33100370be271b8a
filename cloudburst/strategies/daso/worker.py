"""``daso``: Distributed Asynchronous and Selective Optimization (Coquelin et al. 2021).

Algorithm (docs/algorithms.md#daso, as in the authors' Heat implementation): ranks form P nodes of G
local ranks. Every batch, gradients are all-reduced inside the node (DDP on the node's group;
with ``local_skip`` L only every L batches). Every B batches one rank per node — local rank
``k mod G`` at the k-th global sync, rotating — flattens θ, casts it (bf16 by default), and
starts a *non-blocking* sum over its global group (local rank g of every node). Training goes
on; S batches later that rank waits for the sum and merges

    θ ← (2S·θ_local + Σ_nodes θ_sent) / (2S + P)        (S = 0: the plain average)

then broadcasts θ to its node. Warm-up and cool-down epochs average globally (blocking) every
batch, and so does the last batch of every cycling epoch (as Heat does). In between, B and S
follow the plateau rule of :class:`DasoSchedule`. Blocking averages are cast to
``daso_downcast`` (bf16), the non-blocking ones to ``daso_cycling_downcast`` (fp32): Heat's
choice, each configurable.

Synchronous inside a node; across nodes, a global sync is waited for S batches after it
started, so the θ merged is S batches stale. Staleness: S (in batches). A dead rank: its
node's and its global group's collectives raise, and the job stops, as for ``sync``.

``compress`` (docs/algorithms.md#compression): ``--compress bf16`` sends every global sync,
blocking and non-blocking, as bf16 (summed in bf16, no error feedback: what ``--daso-downcast
bf16`` does for the blocking ones); ``int8`` / ``fp8`` send θ quantised block-wise
(:func:`~cloudburst.comm.compress.compressed_all_reduce_sum`: from 3 nodes on a reduce-scatter
of quantised chunks, owners summing in fp32, and an all-gather; with 2 an all-gather) with error
feedback, the residuals kept per rank (each rank sends only at its own turns of the rotation)
and checkpointed. A non-blocking sync overlaps its first step with the S batches; the second
runs at the merge. A merge's
rounding stays in θ for good, so without feedback the roundings of successive syncs would add
up; with it each sync also sends what the rank's previous one left out. A quantised sync is one
quantised all-reduce (``daso_chunk_elements`` does not split it). ``--compress`` and a non-default
``--daso-downcast`` / ``--daso-cycling-downcast`` are refused together.

Differences from Heat: the cast is configurable for each kind of sync; the schedule is an
explicit, checkpointable object (Heat keeps loose counters and has no ``state_dict``); "stable"
means no relative improvement of ``stability_level`` for ``patience`` epochs in a row (Heat's
plateau detector waits one epoch more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cloudburst.comm.allreduce import AllreduceHookState, data_parallel
from cloudburst.comm.collectives import Pending, all_reduce_sum, broadcast, world_sum
from cloudburst.comm.compress import (
    Compression,
    ErrorFeedback,
    compressed_all_reduce_sum,
    payload_bytes,
)
from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.strategies.base import Strategy
from cloudburst.strategies.daso import Daso

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": torch.float32}

WARMUP, CYCLING, COOLDOWN = "warmup", "cycling", "cooldown"


def daso_merge(local: torch.Tensor, sent_sum: torch.Tensor, s: int, p: int) -> torch.Tensor:
    """DASO's merge: (2S·θ_local + Σ θ_sent) / (2S + P)."""
    return (2 * s * local + sent_sum) / (2 * s + p)


@dataclass
class DasoSchedule:
    """DASO's phases and its B (global skip) / S (batches to wait) schedule.

    ``phase(position)``: warm-up for the first ``warmup_epochs``, cool-down for the last
    ``cooldown_epochs`` (fractions of an epoch count in steps), cycling in between. At the
    end of each cycling epoch :meth:`end_epoch` receives the epoch's loss averaged over all
    ranks: when it has not improved by ``stability_level`` (relative) for ``patience`` epochs,
    B and S are divided by ``reduction_factor`` (floor 1); once B is 1 and the loss is stable
    again, B resets to
    ``max_global_skips`` and S to B/4. B = 0 means a blocking global average every batch.
    """

    total_epochs: float
    warmup_epochs: float = 4.0
    cooldown_epochs: float = 4.0
    global_skip: int = 4
    batches_to_wait: int = 1
    max_global_skips: int = 8
    stability_level: float = 0.05
    patience: int = 2
    reduction_factor: int = 2
    adaptive: bool = True
    # state
    epoch: int = 0
    best_loss: float = math.inf
    bad_epochs: int = 0

    def phase(self, position: float | None = None) -> str:
        """The phase at ``position`` epochs into the run (fractional: a step's start is
        step / steps_per_epoch); by default the middle of the current epoch."""
        e = self.epoch + 0.5 if position is None else position
        if e < self.warmup_epochs:
            return WARMUP
        if e >= self.total_epochs - self.cooldown_epochs:
            return COOLDOWN
        return CYCLING

    def blocking(self, position: float | None = None) -> bool:
        return self.phase(position) != CYCLING or self.global_skip == 0

    def end_epoch(self, loss: float) -> str | None:
        """Close the current epoch with its global mean loss; return the change made, if any.

        Only epochs whose middle lies in the cycling phase change B and S."""
        change = None
        if self.phase() == CYCLING and self.adaptive and self.global_skip > 0:
            if loss < self.best_loss * (1 - self.stability_level):
                self.best_loss, self.bad_epochs = loss, 0
            else:
                self.bad_epochs += 1
            if self.bad_epochs >= self.patience:
                self.bad_epochs = 0
                if self.global_skip > 1:
                    f = self.reduction_factor
                    self.global_skip = max(1, self.global_skip // f)
                    self.batches_to_wait = max(1, self.batches_to_wait // f)
                    change = "reduce"
                else:
                    self.global_skip = self.max_global_skips
                    self.batches_to_wait = max(1, self.max_global_skips // 4)
                    change = "reset"
        self.epoch += 1
        return change

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - set(self.__dict__)
        if unknown:
            raise ValueError(f"DASO schedule state has unknown fields {sorted(unknown)}")
        self.__dict__.update(state)


@dataclass
class _Pending:
    """A global sync in flight: the sum being formed, its works, and when to merge it."""

    buffer: torch.Tensor
    work: Pending | None  # None on the ranks that did not send
    merge_at: int  # the step after which it is merged
    s: int
    sender: int  # global rank that started it (it merges, then broadcasts to its node)


class DasoStrategy(Daso, Strategy):
    def __init__(self, ctx):
        super().__init__(ctx)
        topo = ctx.topology
        self.nodes = topo.num_nodes
        self.node_ranks = topo.ranks_on(ctx.node)
        self.per_node = len(self.node_ranks)
        self.local_rank = self.node_ranks.index(ctx.rank)
        self.blocking_dtype = DTYPES[self.cfg.daso.downcast]
        self.cycling_dtype = DTYPES[self.cfg.daso.cycling_downcast]
        self.compression = Compression.parse(self.cfg.cluster.compress)
        if self.compression.method == "bf16":  # both kinds of sync cast, as --daso-downcast
            self.blocking_dtype = self.cycling_dtype = torch.bfloat16
        self.feedback = ErrorFeedback()  # int8 / fp8: what this rank's last send left out
        self.schedule: DasoSchedule | None = None
        self.steps_per_epoch = 1
        self.syncs = 0  # global syncs started (all ranks count alike: the rotation)
        self.pending: _Pending | None = None
        self.epoch_loss_sum, self.epoch_loss_n = 0.0, 0
        self.global_bytes = 0  # bytes of θ put on the global all-reduces by this rank
        self.phase_steps = {WARMUP: 0, CYCLING: 0, COOLDOWN: 0}
        self.sync_log: list[tuple[int, str, int, int]] = []  # (step, phase, B, S) per sync

    # ------------------------------------------------------------------ set-up
    def configure(self, steps_per_epoch: int, total_steps: int) -> None:
        cfg = self.cfg
        self.steps_per_epoch = max(1, steps_per_epoch)
        self.schedule = DasoSchedule(
            total_epochs=total_steps / self.steps_per_epoch,
            warmup_epochs=cfg.daso.warmup_epochs,
            cooldown_epochs=cfg.daso.cooldown_epochs,
            global_skip=cfg.daso.global_skip,
            batches_to_wait=cfg.daso.batches_to_wait,
            max_global_skips=cfg.daso.max_global_skips,
            stability_level=cfg.daso.stability_level,
            patience=cfg.daso.patience,
            reduction_factor=cfg.daso.skip_reduction_factor,
            adaptive=cfg.daso.adaptive,
        )

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.model = model
        self.numel = sum(p.numel() for p in model.parameters())
        self._flat = torch.empty(self.numel, device=next(model.parameters()).device)
        self.hook_state = AllreduceHookState(self.ctx.groups["node"], self.stats)
        if self.schedule is None:  # used outside the CLI loop: epochs unknown, cycle always
            self.configure(1, 1 << 30)
            self.schedule.warmup_epochs = self.schedule.cooldown_epochs = 0
        if self.per_node == 1:
            return model
        self.dp = data_parallel(
            self.ctx.comm, model, self.ctx.groups["node"], self.ctx.device, self.hook_state
        )
        return self.dp.module

    def start(self) -> None:
        if self.per_node > 1:
            self.dp.set_sync(self._local_sync_due(1))

    # ------------------------------------------------------------------ per step
    def _local_sync_due(self, step: int) -> bool:
        return step % self.cfg.daso.local_skip == 0

    def after_backward(self) -> None:
        if self.per_node > 1:
            self.dp.after_backward()

    def record_loss(self, loss: float) -> None:
        self.epoch_loss_sum += loss
        self.epoch_loss_n += 1

    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        step = self.local_steps
        sched = self.schedule
        position = (step - 1) / self.steps_per_epoch  # where this step started, in epochs
        phase = sched.phase(position)
        blocking = sched.blocking(position)
        self.phase_steps[phase] += 1
        epoch_end = step % self.steps_per_epoch == 0
        if self.cfg.daso.epoch_end_sync and epoch_end and phase == CYCLING:
            blocking = True  # Heat: every epoch ends on a blocking global average
        if self.pending is not None and (blocking or step >= self.pending.merge_at):
            self._merge()
        if blocking:
            self._start_sync(s=0)
            self._merge()
        elif step % sched.global_skip == 0:
            if self.pending is not None:  # B shrank below the pending sync's S: merge it now
                self._merge()
            self._start_sync(s=sched.batches_to_wait)
            if self.pending.s == 0:
                self._merge()
        if epoch_end:
            self._end_epoch()
        if self.per_node > 1:
            self.dp.set_sync(self._local_sync_due(step + 1))

    def _start_sync(self, s: int) -> None:
        sender_local = self.syncs % self.per_node
        self.syncs += 1
        sender = self.node_ranks[sender_local]
        sched = self.schedule
        phase = sched.phase((self.local_steps - 1) / self.steps_per_epoch)
        self.sync_log.append((self.local_steps, phase, sched.global_skip, s))
        if self.local_rank != sender_local:
            self.pending = _Pending(torch.empty(0), None, self.local_steps + s, s, sender)
            return
        flat = flatten_params(self.model, out=self._flat)
        if self.compression.quantised:
            buffer = flat.clone()  # summed in place, in fp32, from every node's codes
            method = self.compression.method
            self.global_bytes += payload_bytes(buffer.numel(), method)
            work = compressed_all_reduce_sum(
                buffer,
                self.ctx.groups["across"],
                self.stats,
                method,
                feedback=self.feedback,
                key="theta",
                link=self.ctx.link,
                spans_nodes=self.nodes > 1,
                async_op=True,
                comm=self.ctx.comm,
            )
            self.pending = _Pending(buffer, work, self.local_steps + s, s, sender)
            return
        dtype = self.blocking_dtype if s == 0 else self.cycling_dtype
        buffer = flat.to(dtype) if dtype != torch.float32 else flat.clone()
        self.global_bytes += buffer.numel() * buffer.element_size()
        work = all_reduce_sum(
            buffer,
            self.ctx.groups["across"],
            self.stats,
            link=self.ctx.link,
            spans_nodes=self.nodes > 1,
            chunk_elements=self.cfg.daso.chunk_elements,
            async_op=True,
            comm=self.ctx.comm,
        )
        self.pending = _Pending(buffer, work, self.local_steps + s, s, sender)

    def _merge(self) -> None:
        pending, self.pending = self.pending, None
        flat = self._flat
        if self.ctx.rank == pending.sender:
            pending.work.wait()
            local = flatten_params(self.model, out=flat)
            merged = daso_merge(local, pending.buffer.to(torch.float32), pending.s, self.nodes)
            flat.copy_(merged)
        if self.per_node > 1:
            broadcast(
                flat,
                pending.sender,
                self.ctx.groups["node"],
                self.stats,
                self.ctx.rank,
                comm=self.ctx.comm,
            )
        assign_flat(self.model, flat)

    def _end_epoch(self) -> None:
        sched = self.schedule
        loss = math.nan
        if sched.phase() == CYCLING and sched.adaptive and sched.global_skip > 0:
            # The epoch loss averaged over every rank (a tiny blocking all-reduce).
            total, count = world_sum(
                [self.epoch_loss_sum, float(self.epoch_loss_n)],
                self.stats,
                link=self.ctx.link,
                spans_nodes=self.nodes > 1,
                comm=self.ctx.comm,
            )
            loss = total / count if count > 0 else math.nan
        sched.end_epoch(loss)
        self.epoch_loss_sum, self.epoch_loss_n = 0.0, 0

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The schedule, the rotation and (int8 / fp8) this rank's error-feedback residual (a
        checkpoint is taken with no sync in flight)."""
        if self.pending is not None:
            raise RuntimeError("DASO state is checkpointed between global syncs only")
        state = {}
        if self.compression.quantised:
            state["compress_feedback"] = self.feedback.state_dict()
        return {
            **state,
            **super().state_dict(),
            "schedule": self.schedule.state_dict(),
            "syncs": self.syncs,
            "epoch_loss": [self.epoch_loss_sum, self.epoch_loss_n],
            "phase_steps": dict(self.phase_steps),
            "global_bytes": self.global_bytes,
        }

    def checkpoint_ready(self) -> bool:
        return self.pending is None  # the same on every rank: all start and merge together

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stats" in state:
            super().load_state_dict(state)
        self.phase_steps.update(state.get("phase_steps", {}))
        self.global_bytes = int(state.get("global_bytes", self.global_bytes))
        self.schedule.load_state_dict(state["schedule"])
        self.syncs = int(state["syncs"])
        self.local_steps = int(state["local_steps"])
        self.epoch_loss_sum, self.epoch_loss_n = state["epoch_loss"]
        if "compress_feedback" in state:
            self.feedback.load_state_dict(state["compress_feedback"])

    # ------------------------------------------------------------------ reporting
    def step_info(self) -> dict[str, Any]:
        s = self.schedule
        phase = s.phase((self.local_steps - 1) / self.steps_per_epoch)
        return {"phase": phase, "B": s.global_skip, "S": s.batches_to_wait}

    def global_params(self) -> tuple[torch.Tensor, int] | None:
        """The model right after a merge is what every node agrees on most; between merges
        it is this node's replica (the evaluator's view of the global model)."""
        return self.replica_params()

    def finish(self) -> None:
        if self.pending is not None:
            self._merge()
        # A last blocking average, so every node ends with the same θ.
        self._start_sync(s=0)
        self._merge()

    def report(self) -> dict[str, Any]:
        r = super().report()
        r.update(
            global_syncs=self.syncs,
            global_bytes=self.global_bytes,
            phase_steps=self.phase_steps,
            final_B=self.schedule.global_skip,
            final_S=self.schedule.batches_to_wait,
            schedule=self.schedule.state_dict(),
            sync_log=self.sync_log,
        )
        return r
