"""``async_diloco``: asynchronous DiLoCo on the parameter-server shards (Liu et al. 2024,
"Asynchronous Local-SGD Training for Language Modeling", arXiv:2401.09135).

Algorithm (docs/algorithms.md#async_diloco): each worker runs H_i inner steps with the run's
optimizer (the inner optimizer, its state kept across rounds), then pushes its pseudo-gradient
Δ = θ_local − θ_fetched to the S shards and fetches θ in one round trip (asgd's PUSH_FETCH),
with no barrier: a fast worker never waits for a slow one. Each shard applies pushes one at a
time with the Delayed Nesterov outer optimizer
(:class:`~cloudburst.strategies.async_diloco.rule.DelayedNesterov`): plain SGD of lr η/N on each
pseudo-gradient, and every N-th push a Nesterov momentum step on the mean of the last N (η =
``diloco_outer_lr``, β = ``diloco_outer_momentum``, N = ``dn_period``, W by default).

H_i = H = ``period``, or under ``dylu`` (Dynamic Local Updates) H scaled by the worker's
*measured* speed relative to the fastest one still publishing (:func:`dylu_inner_steps`,
:func:`fastest_fresh`), so that slow workers push as often as fast ones; speeds are timed on
the job's clock and shared through the job store, never waited for.

Everything else is asgd's (:class:`~cloudburst.strategies.asgd.AsgdStrategy`, whose transport,
shards, warm start, restarts, shard standby, checkpoints and compression with error feedback it
reuses unchanged): the shards' staleness clock, ``max_staleness`` and the staleness
compensators apply to its pushes as to asgd's. The PUSH_FETCH reply follows the apply (the
outer optimizer's state lives on the shards only). A dead worker: the others go on.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from cloudburst.strategies.asgd.worker import AsgdStrategy
from cloudburst.strategies.async_diloco import AsyncDiloco

SPEED_KEY = "async_diloco/speed/{}"  # worker i's measured steps per second, in the job store
STEP_WINDOW = 4  # DyLU's speed: the median of a worker's last STEP_WINDOW·H step times
STALE_ROUNDS = 4  # a published speed not renewed within this many of its worker's rounds is gone


def dylu_inner_steps(period: int, speed: float, fastest: float) -> int:
    """H_i = max(1, ⌊H·speed_i / fastest + ½⌋): Dynamic Local Updates' inner steps of a worker
    of speed ``speed`` when the fastest known runs ``fastest`` (the same unit)."""
    return max(1, math.floor(period * speed / fastest + 0.5))


def fastest_fresh(
    mine: float, seen: dict[int, tuple[str, float]], now: float, period: int
) -> float:
    """The fastest of ``mine`` and the others' fresh speeds. ``seen[w]`` = (worker w's
    publication ``"<speed> <seq>"``, the reader's clock when it last changed). A worker
    publishes once per round, and its round lasts at most H / its speed: a publication
    unchanged for ``STALE_ROUNDS`` such rounds is a dead (or stalled) worker's, whose speed
    would otherwise shrink every live worker's H_i for the rest of the run."""
    fastest = mine
    for raw, since in seen.values():
        speed = float(raw.split()[0])
        if speed > 0 and now - since <= STALE_ROUNDS * period / speed:
            fastest = max(fastest, speed)
    return fastest


class AsyncDilocoStrategy(AsyncDiloco, AsgdStrategy):
    def __init__(self, ctx):
        super().__init__(ctx)
        # asgd's pushes, compressed as asgd's are (with error feedback).
        self.compress = AsgdStrategy.message_method(ctx.cfg.cluster.compress)
        self.inner_steps = ctx.cfg.local_sgd.period  # H_i of the round under way
        self._since_push = 0  # inner steps of the round under way
        self._total_steps: int | None = None  # the run's last step, when the loop says
        # DyLU's measurement: this worker's last 4·H step times (the job's clock, its own round
        # trips left out; several rounds, so that one slow moment moves no H_i), and when its
        # last step or round ended.
        self._step_times: deque[float] = deque(maxlen=STEP_WINDOW * ctx.cfg.local_sgd.period)
        self._mark: float | None = None
        self._published = 0  # this worker's speed publications (their sequence number)
        self._seen: dict[int, tuple[str, float]] = {}  # the others': see fastest_fresh
        self.rounds: list[list[int]] = []  # [H_i, rounds], run-length, in order

    def configure(self, steps_per_epoch: int, total_steps: int) -> None:
        self._total_steps = total_steps

    def start(self) -> None:
        super().start()
        self._since_push = 0  # (a rejoined worker starts again from the servers' θ)
        self._mark = self.ctx.comm.now()

    def after_step(self, samples: int) -> None:
        now = self.ctx.comm.now()
        if self._mark is not None:
            self._step_times.append(now - self._mark)
        self.local_steps += 1
        self._since_push += 1
        self._samples_since_push += samples
        self._fresh = None
        if self.local_steps == self._total_steps:
            # The last round ends with the last step (shorter if need be), pushed now: not
            # after the evaluating worker has waited for the others, against a θ that old.
            self._end_round(fetch=False)
        elif self._since_push >= self.inner_steps:
            self._end_round(fetch=True)
            if self.cfg.async_diloco.dylu:
                self.inner_steps = self._next_inner_steps()
        self._mark = self.ctx.comm.now()

    def _end_round(self, fetch: bool) -> None:
        self._round(push=True, fetch=fetch)
        if self.rounds and self.rounds[-1][0] == self._since_push:
            self.rounds[-1][1] += 1
        else:
            self.rounds.append([self._since_push, 1])
        self._since_push = 0

    def measured_speed(self) -> float | None:
        """This worker's steps per second: 1 / the median of its last 4·H step times (an
        evaluation or a checkpoint between two steps does not move it); None before any."""
        if not self._step_times:
            return None
        median = statistics.median(self._step_times)
        return 1.0 / median if median > 0 else None

    def _next_inner_steps(self) -> int:
        """Publish this worker's speed, read the others' published so far (no waiting), and
        size the next round by DyLU's rule."""
        mine = self.measured_speed()
        if mine is None:
            return self.inner_steps
        store, me, now = self.ctx.store, self.ctx.replica_index, self.ctx.comm.now()
        self._published += 1
        store.set(SPEED_KEY.format(me), f"{mine!r} {self._published}")
        for w in range(self.ctx.num_replicas):
            key = SPEED_KEY.format(w)
            if w != me and store.check([key]):
                raw = bytes(store.get(key)).decode()
                if self._seen.get(w, ("",))[0] != raw:
                    self._seen[w] = (raw, now)
        return dylu_inner_steps(
            self.cfg.local_sgd.period,
            mine,
            fastest_fresh(mine, self._seen, now, self.cfg.local_sgd.period),
        )

    def _flush(self) -> None:
        """Push the inner steps not pushed yet (a last, shorter round)."""
        if self._since_push:
            self._end_round(fetch=False)

    def step_info(self) -> dict:
        info = super().step_info()
        info["inner_steps"] = self.inner_steps
        return info

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(inner_steps=self.inner_steps, inner_steps_rounds=self.rounds)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.inner_steps = int(state.get("inner_steps", self.cfg.local_sgd.period))
        self.rounds = [list(r) for r in state.get("inner_steps_rounds", [])]

    def report(self) -> dict:
        r = super().report()
        r["inner_steps"] = self.inner_steps
        r["inner_steps_rounds"] = [list(x) for x in self.rounds]
        speed = self.measured_speed()
        r["measured_steps_per_s"] = speed
        return r
