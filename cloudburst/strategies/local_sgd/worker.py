"""``local_sgd`` (post-local SGD): average the replicas every H local steps.

Algorithm (docs/algorithms.md#local_sgd-and-diloco; Lin et al. 2020's post-local SGD): each
worker trains its own replica with its local optimizer; every H = ``period`` steps the workers
average their parameters (a blocking all-reduce). The first ``local_sgd_warmup_steps`` steps average
every step, which for SGD (with momentum and weight decay) is exactly synchronous SGD.
DiLoCo (:mod:`cloudburst.strategies.diloco`) is this worker with an outer optimizer.

``compress`` (docs/algorithms.md#compression): the averages send each replica's drift
θ_reference − θ_i from the last average compressed, with error feedback for int8/fp8
(residuals, the sender's and, from W = 3 on, the chunk owner's of
:func:`~cloudburst.comm.compress.compressed_all_reduce_sum`'s reduce-scatter, checkpointed;
its bytes 2(W−1)/W of the quantised vector). ``none`` sends θ_i in fp32 as ever.

Synchronous every H steps (a straggler stalls the others once per period); staleness 0.
A dead worker: the next average raises on every other rank and the job stops, as for sync.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cloudburst.comm.collectives import Pending, all_reduce_sum
from cloudburst.comm.compress import Compression, ErrorFeedback, compressed_all_reduce_sum
from cloudburst.comm.flat import adopt_flat, flatten_params
from cloudburst.strategies.base import Strategy
from cloudburst.strategies.local_sgd import LocalSgd


def split_fragments(params: list[torch.Tensor], fragments: int) -> list[list[torch.Tensor]]:
    """``params`` (module order) cut into ``fragments`` non-empty runs of whole tensors,
    balanced by element count: fragment k ends at the tensor boundary nearest to (k+1)/F of
    the elements (never leaving a later fragment empty)."""
    if not 1 <= fragments <= len(params):
        raise ValueError(
            f"fragments: {fragments} is not allowed for a model of {len(params)} parameter "
            f"tensors; use 1..{len(params)}"
        )
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    cuts, start, running = [], 0, 0
    ends = []  # cumulative element count after each tensor
    for n in sizes:
        running += n
        ends.append(running)
    for k in range(1, fragments):
        target = total * k / fragments
        lo, hi = start + 1, len(params) - (fragments - k)  # leave one tensor for each later one
        stop = min(range(lo, hi + 1), key=lambda i: (abs(ends[i - 1] - target), i))
        cuts.append(stop)
        start = stop
    bounds = [0, *cuts, len(params)]
    return [params[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class LocalSgdStrategy(LocalSgd, Strategy):
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.model = model
        self.optimizer = optimizer
        self._params = list(model.parameters())
        self._flat = flatten_params(self._params)
        self.averages = 0
        topo = self.ctx.topology
        self.spans_nodes = topo is not None and topo.spans_nodes(self.ctx.replica_ranks)
        self.compression = Compression.parse(self.cfg.cluster.compress)
        self.feedback = ErrorFeedback()
        # Compressed averages send the drift from θ_reference, the last average (identical on
        # every replica): small values quantise well, and θ = θ_reference − mean drift.
        self._reference = flatten_params(self._params).clone() if self.compression.active else None
        return model

    #: Averaging one replica is a no-op; DiLoCo's outer step is not.
    needs_peers = True

    def period(self) -> int:
        return self.cfg.local_sgd.period

    def _due(self, step: int) -> bool:
        if step <= self.cfg.local_sgd.warmup_steps:
            return True
        return step % self.period() == 0

    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        if (self.ctx.num_replicas > 1 or not self.needs_peers) and self._due(self.local_steps):
            self._synchronise()

    def _reduce(
        self, flat: torch.Tensor, key: str, async_op: bool = False, compress: bool = True
    ) -> Pending:
        """Sum ``flat`` over the workers (compressed as configured unless ``compress`` is
        False; residuals under ``key``)."""
        kw: dict[str, Any] = dict(
            link=self.ctx.link, spans_nodes=self.spans_nodes, comm=self.ctx.comm
        )
        if async_op:
            kw["async_op"] = True
        if compress and self.compression.active:
            return compressed_all_reduce_sum(
                flat,
                self.ctx.replica_group,
                self.stats,
                self.compression.method,
                feedback=self.feedback if self.compression.quantised else None,
                key=key,
                **kw,
            )
        return all_reduce_sum(flat, self.ctx.replica_group, self.stats, **kw)

    def _average(self, fresh: bool = False) -> torch.Tensor:
        """The average of the replicas' parameters (in ``self._flat``, or a new vector)."""
        if self._reference is not None:
            drift = self._reference - flatten_params(self._params)
            self._reduce(drift, "theta")
            self.averages += 1
            self._reference -= drift.div_(self.ctx.num_replicas)
            return self._reference.clone()
        flat = flatten_params(self._params, out=None if fresh else self._flat)
        self._reduce(flat, "theta")
        self.averages += 1
        return flat.div_(self.ctx.num_replicas)

    def _synchronise(self) -> None:
        # The parameters become views of the fresh averaged vector (no copy back).
        adopt_flat(self._params, self._average(fresh=True))

    def finish(self) -> None:
        # End on one model: average whatever the replicas did since the last period.
        if (self.ctx.num_replicas > 1 or not self.needs_peers) and not self._due(self.local_steps):
            self._synchronise()

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "averages": self.averages}
        if self.compression.active:
            state["compress_feedback"] = self.feedback.state_dict()
        if self._reference is not None:
            state["compress_reference"] = self._reference.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.averages = int(state["averages"])
        self._load_compression(state)

    def _load_compression(self, state: dict[str, Any]) -> None:
        if "compress_feedback" in state:
            self.feedback.load_state_dict(state["compress_feedback"])
        if self._reference is not None and "compress_reference" in state:
            self._reference.copy_(state["compress_reference"])

    def global_params(self) -> tuple[torch.Tensor, int] | None:
        return self.replica_params()

    def report(self) -> dict[str, Any]:
        r = super().report()
        r["averages"] = self.averages
        return r
