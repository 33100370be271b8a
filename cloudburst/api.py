"""The Python API: a strategy in your own training loop, under ``torchrun``.

::

    with cloudburst.Job(cloudburst.RunConfig(strategy="asgd", workers=4, servers=1)) as job:
        if job.is_server:
            job.serve(model)                    # holds one shard of θ until the workers finish
        else:
            model = job.wrap(model, optimizer)  # DDP for sync; the replica itself for asgd
            loader = DataLoader(job.shard(my_dataset), batch_size=64, shuffle=True)
            for x, y in loader:                 # an unchanged PyTorch loop
                loss = loss_fn(model(x), y)
                optimizer.zero_grad(); loss.backward(); optimizer.step()
    # leaving the block calls job.finish(): pending pushes are flushed, the worker leaves

``wrap`` hooks the model and the optimizer, so the loop needs no cloudburst call: the first
training forward pass starts the strategy (:meth:`Job.start`); the optimizer's step pre-hook
runs what belongs right after ``loss.backward()`` (:meth:`Job.after_backward`), its post-hook
what belongs after each step (:meth:`Job.after_step`, with the samples the training forward
passes saw since the last step). ``wrap(..., hooks=False)`` keeps the explicit calls instead;
DASO's adaptive schedule also wants each step's loss (:meth:`Job.record_loss`).

The CLI's loop (:mod:`cloudburst.loop.role`) takes the same path: the after-step call, the
strategy's finish and report, and a server's serving come from :mod:`cloudburst.loop`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from cloudburst.comm.flat import assign_flat
from cloudburst.config import RunConfig
from cloudburst.loop.budget import TimeBudget
from cloudburst.loop.finish import finish_strategy, serve
from cloudburst.loop.step import step_done
from cloudburst.records.metrics import MetricsWriter
from cloudburst.records.rundir import prepare_run_dir
from cloudburst.runtime import in_torchrun, init_distributed, shutdown
from cloudburst.runtime.context import Context
from cloudburst.strategies.base import Strategy
from cloudburst.strategies.replica import make_strategy


class NotUnderTorchrun(RuntimeError):
    """A :class:`Job` made in a process that torchrun did not start."""


class Job:
    """One rank's handle on a cloudburst job started by torchrun."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        if not in_torchrun():
            raise NotUnderTorchrun(
                f"cloudburst.Job is one rank of a job started by torchrun: run this script with "
                f"`.venv/bin/torchrun --standalone --nproc-per-node {cfg.world_size} SCRIPT` "
                "(RANK, WORLD_SIZE and MASTER_ADDR are not set)"
            )
        if int(os.environ.get("RANK", "0")) == 0:
            # Before the others join (they wait for rank 0 in init_distributed): a new,
            # empty or earlier run's directory, its old files removed by name.
            prepare_run_dir(
                cfg.output.out, resume=cfg.faults.resume, overwrite=cfg.output.overwrite
            )
        self.ctx: Context = init_distributed(cfg, cfg.strategy_spec)
        self.metrics = MetricsWriter(cfg.output.out, self.ctx.rank, self.ctx.role)
        self.strategy: Strategy | None = None
        self._hooks: _LoopHooks | None = None
        self._budget: TimeBudget | None = None
        self._steps = 0
        self._started = self._finished = self._closed = False

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """A worker that wrapped its replica finishes (after an error: only leaves)."""
        if exc_type is None and self.strategy is not None and not self._finished:
            self.finish()
        elif not self._closed:
            self.close()

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
        hooks: bool = True,
    ) -> nn.Module:
        """Hand the replica to the strategy; returns the module the loop should call.

        With ``hooks`` (the default) the model and the optimizer are hooked so that an
        unchanged loop drives the strategy (see the module's docstring); without, the loop
        calls :meth:`start`, :meth:`after_backward` and :meth:`after_step` itself. DASO's
        warm-up/cool-down epochs need the run's length: give ``steps_per_epoch`` and
        ``total_steps`` (without them it cycles from the first step)."""
        if self.is_server:
            raise RuntimeError("wrap() is for workers; a server rank calls serve()")
        if self.strategy is not None:
            raise RuntimeError("wrap() was called already; a job drives one replica")
        self.strategy = make_strategy(self.ctx)
        if steps_per_epoch is not None and total_steps is not None:
            self.strategy.configure(steps_per_epoch, total_steps)
        module = self.strategy.wrap(model, optimizer)
        self._budget = TimeBudget(self.ctx, self.strategy)
        if hooks:
            self._hooks = _LoopHooks(self, module, optimizer)
        return module

    def shard(self, dataset: Dataset, seed: int | None = 0) -> Subset:
        """This worker's part of ``dataset``: see :func:`shard_dataset`."""
        return shard_dataset(dataset, self.worker_index, self.num_workers, seed)

    def start(self) -> None:
        self._refuse_explicit("start")
        self._start()

    def after_backward(self) -> None:
        self._refuse_explicit("after_backward")
        self._require_strategy().after_backward()

    def after_step(self, samples: int, loss: float | None = None) -> None:
        """After each optimizer step; ``loss`` (the step's training loss) feeds schedules
        that watch it (DASO's plateau rule)."""
        self._refuse_explicit("after_step")
        self._step_done(samples, None if loss is None else float(loss))

    def should_stop(self) -> bool:
        """True once the config's ``max_train_time_s`` is spent (the clock since the first
        step; never without a budget): break out of the loop, and finish as usual. Under a
        lockstep strategy it turns True after the same step on every worker."""
        return self._budget is not None and self._budget.reached

    def record_loss(self, loss: float | torch.Tensor) -> None:
        """The step's training loss, for schedules that watch it (DASO's plateau rule)."""
        self._require_strategy().record_loss(float(loss))

    def _step_done(self, samples: int, loss: float | None = None) -> None:
        step_done(self._require_strategy(), samples, loss)
        self._steps += 1
        if self._budget is not None:
            self._budget.over(self._steps)

    def _start(self) -> None:
        self.ctx.start_clock()
        self._require_strategy().start()
        self._started = True

    def _refuse_explicit(self, name: str) -> None:
        if self._hooks is not None:
            raise RuntimeError(
                f"job.{name}() is called by the hooks job.wrap() installed; drop the explicit "
                "call, or use job.wrap(model, optimizer, hooks=False)"
            )

    def global_params(self) -> tuple[torch.Tensor, int] | None:
        """(flat θ of the global model, samples behind it); asgd fetches it from the servers."""
        return self._require_strategy().fetch_global_params()

    def finish(self) -> dict[str, Any]:
        """Flush pending updates and leave; returns this worker's communication report."""
        strategy = self._require_strategy()
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._finished:
            raise RuntimeError("finish() was called already")
        self._finished = True
        stopped_by = self._budget.stopped_by() if self._budget else "steps"
        report = finish_strategy(strategy, steps=self._steps, stopped_by=stopped_by)
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
        loop, report, wall_time_s = serve(self.ctx, model, self.metrics)
        self.metrics.log("final", time_s=wall_time_s, **report)
        theta = loop.gather_final_theta()
        self.close()
        if theta is None:
            return None
        assign_flat(model, theta)
        return model

    # ------------------------------------------------------------------ helpers
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.metrics.close()
        shutdown(self.ctx)

    def _require_strategy(self) -> Strategy:
        if self.strategy is None:
            raise RuntimeError("call job.wrap(model, optimizer) first")
        return self.strategy


class _LoopHooks:
    """What ``Job.wrap`` hooks into a plain loop: the first training forward pass starts the
    strategy, the optimizer's step pre-hook is the point right after ``backward()``, its
    post-hook the point after the step (with the samples of the forward passes since the last
    step, so gradient accumulation counts every micro-batch)."""

    def __init__(self, job: Job, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.job, self.samples = job, 0
        self.handles = [
            module.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation passes neither start the strategy nor count samples
        if not self.job._started:
            self.job._start()
        self.samples += _batch_size(args, kwargs)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.job._require_strategy().after_backward()

    def _after_step(self, optimizer, args, kwargs) -> None:
        samples, self.samples = self.samples, 0
        self.job._step_done(samples)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _batch_size(args: tuple, kwargs: dict) -> int:
    """The leading dimension of a forward pass's first tensor argument."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise RuntimeError(
        "job.wrap()'s hooks count samples from the model's first tensor argument, and this "
        "forward pass has none; use job.wrap(model, optimizer, hooks=False) and call "
        "job.after_step(samples) yourself"
    )


def shard_dataset(dataset: Dataset, worker: int, num_workers: int, seed: int | None = 0) -> Subset:
    """Worker ``worker``'s part of ``dataset``: equal, disjoint parts of one permutation that
    every rank computes alike (seeded by ``seed``; ``None``: contiguous, in order). The last
    ``len(dataset) % num_workers`` samples of that order are left out, so every worker has
    the same number of batches."""
    n = len(dataset)
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is not in 0..{num_workers - 1}")
    per = n // num_workers
    if per < 1:
        raise ValueError(f"{n} samples cannot be shared by {num_workers} workers")
    if seed is None:
        order = torch.arange(n)
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return Subset(dataset, order[worker * per : (worker + 1) * per].tolist())
