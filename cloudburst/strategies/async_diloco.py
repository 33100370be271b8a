"""``async_diloco``: asynchronous DiLoCo on the parameter-server shards (Liu et al. 2024,
"Asynchronous Local-SGD Training for Language Modeling", arXiv:2401.09135).

Algorithm (docs/algorithms.md#async_diloco): each worker runs H_i inner steps with the run's
optimizer (the inner optimizer, its state kept across rounds), then pushes its pseudo-gradient
Δ = θ_local − θ_fetched to the S shards and fetches θ in one round trip (asgd's PUSH_FETCH),
with no barrier: a fast worker never waits for a slow one. Each shard applies pushes one at a
time with the Delayed Nesterov outer optimizer (``cloudburst.shard.DelayedNesterov``): plain
SGD of lr η/N on each pseudo-gradient, and every N-th push a Nesterov momentum step on the
mean of the last N (η = ``diloco_outer_lr``, β = ``diloco_outer_momentum``, N = ``dn_period``,
W by default). H_i = H = ``period``, or under ``dylu`` (Dynamic Local Updates) H scaled by the
worker's speed relative to the fastest, so that slow workers push as often as fast ones
(``AsyncDilocoConfig.inner_steps``; the speed is the one the run models: 1 / the worker's
``--straggler`` factor, deterministic on the virtual cluster).

Everything else is asgd's (:class:`~cloudburst.strategies.asgd.AsgdStrategy`, whose transport,
shards, warm start, restarts, shard standby, checkpoints and compression with error feedback it
reuses unchanged): the shards' staleness clock, ``max_staleness`` and the staleness
compensators apply to its pushes as to asgd's. The PUSH_FETCH reply follows the apply (the
outer optimizer's state lives on the shards only). A dead worker: the others go on.
"""

from __future__ import annotations

from cloudburst.comm.quantise import message_method
from cloudburst.strategies.asgd import AsgdStrategy


class AsyncDilocoStrategy(AsgdStrategy):
    name = "async_diloco"

    def __init__(self, ctx):
        super().__init__(ctx)
        # asgd's pushes, compressed as asgd's are (with error feedback).
        self.compress = message_method(ctx.cfg.compress, AsgdStrategy.name)
        self.inner_steps = ctx.cfg.inner_steps(ctx.worker_index)

    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        self._samples_since_push += samples
        self._fresh = None
        if self.local_steps % self.inner_steps == 0:
            self._round(push=True, fetch=True)

    def _flush(self) -> None:
        """Push the inner steps not pushed yet (a last, shorter round)."""
        if self.local_steps % self.inner_steps != 0:
            self._round(push=True, fetch=False)

    def report(self) -> dict:
        r = super().report()
        r["inner_steps"] = self.inner_steps
        return r
