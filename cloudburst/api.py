"""The Python API: a strategy in your own training loop, under ``torchrun``.

::

    job = cloudburst.Job(cloudburst.RunConfig(strategy="asgd", workers=4, servers=1, n_sync=10))
    if job.is_server:
        job.serve(model)                      # holds one shard of θ until the workers finish
    else:
        model = job.wrap(model, optimizer)    # DDP for sync; the replica itself for asgd
        job.start()
        for x, y in my_batches(job.worker_index, job.num_workers):
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(); loss.backward(); job.after_backward(); optimizer.step()
            job.after_step(len(x))            # pushes / fetches when due
        job.finish()

The CLI's loop (:mod:`cloudburst.train`) is built from the same objects.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.config import RunConfig
from cloudburst.metrics import MetricsWriter
from cloudburst.runtime import Context, LivenessMonitor, init_distributed, shutdown
from cloudburst.server import ServerLoop
from cloudburst.strategies import Strategy, make_strategy


class Job:
    """One rank's handle on a cloudburst job started by torchrun."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.ctx: Context = init_distributed(cfg)
        self.metrics = MetricsWriter(cfg.out, self.ctx.rank, self.ctx.role)
        self.strategy: Strategy | None = None

    # ------------------------------------------------------------------ roles
    @property
    def is_server(self) -> bool:
        return self.ctx.is_server

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def worker_index(self) -> int:
        return self.ctx.worker_index

    @property
    def num_workers(self) -> int:
        return self.ctx.num_workers

    # ------------------------------------------------------------------ workers
    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        steps_per_epoch: int | None = None,
        total_steps: int | None = None,
    ) -> nn.Module:
        """Hand the replica to the strategy. DASO's warm-up/cool-down epochs need the run's
        length: give ``steps_per_epoch`` and ``total_steps`` (without them it cycles from the
        first step)."""
        if self.is_server:
            raise RuntimeError("wrap() is for workers; a server rank calls serve()")
        self.strategy = make_strategy(self.ctx)
        if steps_per_epoch is not None and total_steps is not None:
            self.strategy.configure(steps_per_epoch, total_steps)
        return self.strategy.wrap(model, optimizer)

    def start(self) -> None:
        self.ctx.start_clock()
        self._require_strategy().start()

    def after_backward(self) -> None:
        self._require_strategy().after_backward()

    def after_step(self, samples: int, loss: float | None = None) -> None:
        """After each optimizer step; ``loss`` (the step's training loss) feeds schedules
        that watch it (DASO's plateau rule)."""
        strategy = self._require_strategy()
        if loss is not None:
            strategy.record_loss(float(loss))
        strategy.after_step(samples)

    def global_params(self) -> tuple[torch.Tensor, int] | None:
        """(flat θ of the global model, samples behind it); asgd fetches it from the servers."""
        return self._require_strategy().fetch_global_params()

    def finish(self) -> dict[str, Any]:
        """Flush pending updates and leave; returns this worker's communication report."""
        strategy = self._require_strategy()
        strategy.finish()
        report = {"role": "worker", **strategy.report()}
        self.metrics.log("final", time_s=self.ctx.elapsed_s(), **report)
        self.close()
        return report

    # ------------------------------------------------------------------ servers
    def serve(self, model: nn.Module) -> nn.Module | None:
        """Serve θ's shard until every worker finished or was lost.

        ``model`` gives the shapes and the starting θ (the same on every rank). On server 0
        the final global θ is loaded into ``model`` and returned; other servers return None.
        """
        if not self.is_server:
            raise RuntimeError("serve() is for server ranks; a worker calls wrap()")
        liveness = LivenessMonitor(
            self.ctx.store, self.ctx.worker_ranks, self.cfg.heartbeat_timeout_s
        )
        loop = ServerLoop(self.ctx, flatten_params(model), self.metrics, liveness)
        self.ctx.start_clock()
        loop.run()
        self.metrics.log("final", time_s=self.ctx.elapsed_s(), role="server", **loop.stats())
        theta = loop.gather_final_theta()
        self.close()
        if theta is None:
            return None
        assign_flat(model, theta)
        return model

    # ------------------------------------------------------------------ helpers
    def close(self) -> None:
        self.metrics.close()
        shutdown(self.ctx)

    def _require_strategy(self) -> Strategy:
        if self.strategy is None:
            raise RuntimeError("call job.wrap(model, optimizer) first")
        return self.strategy
