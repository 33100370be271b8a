"""``gossip``: pairwise averaging with one peer at a time, asynchronously, no global barrier.

Algorithm (docs/algorithms.md#gossip; Jin, Yuan, Iandola, Keutzer 2016, "How to scale distributed
deep learning?"; push-sum from Assran et al. 2019, Stochastic Gradient Push): every worker trains
its own replica; every k = ``gossip_every`` steps it gossips with one peer j given by the schedule.
*Pull*: fetch θ_j, set θ_i ← (θ_i^b + θ_j)/2 + (θ_i − θ_i^b). *Push*: send θ_i to j, which folds
all it received at its next step boundary: θ_j ← (θ_j^b + Σ received)/(1 + n) + (θ_j − θ_j^b).
θ^b is a worker's replica as it last published it (its last step boundary): a served θ_j is
from j's last boundary, so the boundaries are averaged and the local step since is kept in
full (``gossip_full_step``; without it, θ_i ← (θ_i + θ_j)/2 keeps half of every local step in
the replicas' mean, docs/algorithms.md#gossip). *Push-sum* (SGP): each worker carries a
weight w (1 at the start); sending, it keeps w/2 and sends the numerator θ·w/2 with the weight w/2;
a receiver adds numerators (to its θ·w) and weights, and trains on the de-biased θ = numerator / w;
Σ_i w_i = W and Σ_i w_i θ_i are kept exactly (messages in flight included), so the replicas agree on
the true average.

Three parts, as in SGP's code: who talks to whom (:class:`PeerSchedule`: random, ring, or the
time-varying exponential graph), with which weights (:func:`pull_average`, :func:`push_fold`,
:func:`push_sum_split`, :func:`push_sum_fold`), and the transport
(:mod:`cloudburst.comm.gossip`: a serving thread per worker answers peers while it computes;
its docstring describes the groups and the shutdown).

Synchronous: nothing during training; a pull waits for the peer's serving thread (not its
step), a push for the peer to receive it. The consensus distance mean_i ‖θ_i − θ̄‖, measured
every ``consensus_every_steps`` steps and at the end, is the one collective: two all-reduces
over the workers (θ̄, then the distances). It waits for the slowest worker, so keep it rare; it
is counted apart (``consensus_bytes``), not in the gossip bytes. ``finish`` waits until every
peer has finished (they may still pull from this worker) and does not average the replicas:
they stay as gossip left them.
Staleness: a pulled θ_j is j's θ at its last step boundary (at most one of j's steps old);
pushed θ are folded at the receiver's next step boundary (at most one of its steps late).
A dead worker: a pull from it times out (``comm_timeout_s``) and a push to it fails; peers'
serving threads time out waiting for its messages, the next consensus all-reduce times out;
the workers that notice raise and the launcher ends the job, as for sync.
Hostile or broken peers (:mod:`cloudburst.comm.gossip`, "Checks"): a bad push is never folded
in, a bad pulled θ (non-finite, wrong worker, refused) never averaged in; either is counted
(``requests_rejected``, ``replies_rejected``) and the round goes on without it. A peer dropped
for bad replies is no longer pulled from: its rounds are skipped (``rounds_skipped``).
Differences from the papers: parameters only are gossiped (batch-norm statistics and optimizer
state stay local, as in SGP); rounds are counted per worker (each worker's own time), so the
exponential graph's rounds of different workers are not aligned. Push-sum runs without SGP's
bounded delay (τ-overlap): a worker that runs ahead halves its weight at every push without
receiving, so weights drift apart when workers run at different speeds (their sum stays W);
a worker's gradient steps then count in the average in proportion to its weight.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any

import torch
from torch import nn

from cloudburst.comm.collectives import all_reduce_sum
from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.comm.gossip import GossipTransport, Mailbox, Snapshot
from cloudburst.comm.stats import CommStats
from cloudburst.strategies.base import Strategy
from cloudburst.strategies.gossip import Gossip
from cloudburst.strategies.gossip.settings import GOSSIP_SCHEDULES

log = logging.getLogger(__name__)

SCHEDULES = GOSSIP_SCHEDULES  # the config's choices: one tuple


# ---------------------------------------------------------------------------- graph: who
class PeerSchedule:
    """Whom worker ``i`` gossips with in its round ``r`` (pure, deterministic, never itself).

    - random: uniform over the W − 1 others, seeded by (seed, i, r);
    - ring: i + 1 mod W;
    - exponential: i + 2^(r mod ⌈log2 W⌉) mod W (SGP's time-varying one-peer exponential
      graph: over ⌈log2 W⌉ rounds i talks to i+1, i+2, i+4, ...).
    """

    def __init__(self, schedule: str, workers: int, seed: int = 0):
        if schedule not in SCHEDULES:
            raise ValueError(f"gossip_schedule: {schedule!r} is not one of {SCHEDULES}")
        if workers < 2:
            raise ValueError(f"gossip needs at least 2 workers, got {workers}")
        self.schedule, self.workers, self.seed = schedule, workers, seed
        self.exponents = max(1, math.ceil(math.log2(workers)))

    def peer(self, worker: int, round_: int) -> int:
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is not in 0..{self.workers - 1}")
        w = self.workers
        if self.schedule == "ring":
            return (worker + 1) % w
        if self.schedule == "exponential":
            return (worker + 2 ** (round_ % self.exponents)) % w
        # A string seed is hashed with SHA-512 by random.Random: the same on every machine.
        j = random.Random(f"gossip:{self.seed}:{worker}:{round_}").randrange(w - 1)
        return j + 1 if j >= worker else j


# ---------------------------------------------------------------------------- mixing: weights
def pull_average(
    own: torch.Tensor, peer: torch.Tensor, own_published: torch.Tensor | None = None
) -> torch.Tensor:
    """Pull: (θ_i + θ_j) / 2 (in place into ``own``).

    With ``own_published`` (θ_i^b, this replica at its last step boundary, the point a
    peer's served θ_j is from): (θ_i^b + θ_j) / 2 + (θ_i − θ_i^b) = θ_i + (θ_j − θ_i^b) / 2,
    the boundaries averaged and the local step since kept in full."""
    peer = peer.to(own.device)
    if own_published is None:
        return own.add_(peer).mul_(0.5)
    return own.add_(peer, alpha=0.5).sub_(own_published, alpha=0.5)


def push_fold(
    own: torch.Tensor,
    received_sum: torch.Tensor,
    count: int,
    own_published: torch.Tensor | None = None,
) -> torch.Tensor:
    """Push: (θ_j + Σ received) / (1 + n) (in place into ``own``; no-op when n = 0).

    With ``own_published`` (θ_j^b, this replica at its last step boundary):
    (θ_j^b + Σ received) / (1 + n) + (θ_j − θ_j^b), the local step since kept in full."""
    if count == 0:
        return own
    received_sum = received_sum.to(own.device)
    if own_published is None:
        return own.add_(received_sum).div_(1 + count)
    return own.add_(received_sum, alpha=1 / (1 + count)).sub_(
        own_published, alpha=count / (1 + count)
    )


def push_sum_split(weight: float) -> tuple[float, float]:
    """Push-sum, sending: (weight kept, weight sent) = (w/2, w/2). The numerator sent is
    θ·w/2; the de-biased θ of the sender does not change (θ·(w/2) / (w/2) = θ)."""
    return weight / 2, weight / 2


def push_sum_fold(
    own: torch.Tensor, weight: float, numerator_sum: torch.Tensor, weight_sum: float
) -> tuple[torch.Tensor, float]:
    """Push-sum, receiving: numerator θ·w + Σ numerators over weight w + Σ weights.
    Returns (de-biased θ, in place into ``own``; new weight)."""
    if weight_sum == 0:
        return own, weight
    total = weight + weight_sum
    own.mul_(weight).add_(numerator_sum.to(own.device)).div_(total)
    return own, total


# ---------------------------------------------------------------------------- the strategy
class GossipStrategy(Gossip, Strategy):
    # lockstep (Gossip): resumed from a common step, as the consensus measurements are
    # all-reduces matched by count.

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.cfg
        self.graph = PeerSchedule(cfg.gossip.schedule, ctx.num_replicas, cfg.training.seed)
        self.variant = cfg.gossip.variant
        self.push_sum = cfg.gossip.push_sum
        # Average the replicas as published (step boundaries), the local step kept in full.
        self.full_step = cfg.gossip.full_step and not self.push_sum
        self.measure_stats = CommStats()  # the consensus all-reduces, apart from gossip
        self.weight = 1.0  # push-sum weight w
        self.rounds = 0
        self.last_peer: int | None = None
        self.last_peer_lag_steps: int | None = None  # pull: our step − the pulled θ's step
        self.rounds_skipped = 0  # pull rounds with a peer whose reply was refused or dropped
        self.messages_folded = 0
        self.consensus_history: list[list[float]] = []  # [step, mean_i ‖θ_i − θ̄‖]
        self.final_consensus_distance: float | None = None
        self._unreported: list[float] | None = None
        self.transport: GossipTransport | None = None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        ctx = self.ctx
        requests, replies = ctx.groups.get("requests"), ctx.groups.get("replies")
        if requests is None or replies is None:
            raise RuntimeError(
                "gossip: the context has no gossip groups; build_context makes them with "
                "the gossip spec's make_groups"
            )
        self.model = model
        self._flat = flatten_params(model)  # on the replica's device
        # θ_i as last published (its last step boundary), what its peers average with.
        self._published = self._flat.clone() if self.full_step else None
        numel = self._flat.numel()
        # Host buffers for gloo: what a pull brings, what a push sends.
        self._host = torch.empty(numel, dtype=torch.float32)
        self.snapshot = Snapshot(numel)
        self.mailbox = Mailbox(numel) if self.variant == "push" else None
        topo, rank = ctx.topology, ctx.rank
        self.transport = GossipTransport(
            requests,
            replies,
            rank,
            [r for r in ctx.replica_ranks if r != rank],
            numel,
            self.stats,
            worker_of=ctx.replica_of,
            timeout_s=self.cfg.faults.comm_timeout_s,
            link=ctx.link,
            crosses=(lambda peer: topo.crosses(rank, peer)) if topo is not None else None,
            wire=ctx.comm,
            compress=self.message_method(self.cfg.cluster.compress),
        )
        self.spans_nodes = topo is not None and topo.spans_nodes(ctx.replica_ranks)
        return model

    def start(self) -> None:
        self._publish(flatten_params(self.model, out=self._flat))
        self.transport.start(self.snapshot, self.mailbox)

    # ------------------------------------------------------------------ training
    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        self.transport.check()
        flat = flatten_params(self.model, out=self._flat)
        changed = self._fold_mailbox(flat)
        if self.local_steps % self.cfg.gossip.every == 0:
            peer = self.graph.peer(self.ctx.replica_index, self.rounds)
            self.rounds += 1
            self.last_peer = peer
            if self.variant == "pull":
                changed |= self._pull(flat, peer)
            else:
                self._push(flat, peer)
        if changed:
            assign_flat(self.model, flat)
        self._publish(flat)
        self.transport.keepalive()
        self.transport.merge_serving_stats()
        if self.local_steps % self.cfg.gossip.consensus_every_steps == 0:
            distance = self.consensus_distance()
            self.consensus_history.append([self.local_steps, distance])
            self._unreported = [self.local_steps, distance]

    def _publish(self, flat: torch.Tensor) -> None:
        """Serve ``flat`` to pullers from now on (this step boundary's θ_i), and keep it."""
        self.snapshot.publish(flat, self.local_steps)
        if self._published is not None:
            self._published.copy_(flat)

    def _peer_rank(self, worker: int) -> int:
        return self.ctx.replica_ranks[worker]

    def _pull(self, flat: torch.Tensor, peer: int) -> bool:
        """Average ``peer``'s θ into ``flat``; False (nothing changed) when its reply was
        refused or it is no longer pulled from (the transport counted and logged why)."""
        peer_step = self.transport.pull(self._peer_rank(peer), self._host, self.local_steps)
        if peer_step is None:
            self.rounds_skipped += 1
            return False
        self.last_peer_lag_steps = self.local_steps - peer_step
        pull_average(flat, self._host, self._published)
        return True

    def _push(self, flat: torch.Tensor, peer: int) -> None:
        if self.push_sum:
            self.weight, sent = push_sum_split(self.weight)
            payload = torch.mul(flat, sent, out=self._host) if flat.is_cpu else flat.cpu() * sent
        else:
            sent, payload = 1.0, flat.cpu()
        self.transport.push(self._peer_rank(peer), payload, sent, self.local_steps)

    def _fold_mailbox(self, flat: torch.Tensor) -> bool:
        """Fold what peers pushed since the last step boundary into ``flat``."""
        if self.mailbox is None:
            return False
        received, count, weight_sum = self.mailbox.take()
        if count == 0:
            return False
        if self.push_sum:
            _, self.weight = push_sum_fold(flat, self.weight, received, weight_sum)
        else:
            push_fold(flat, received, count, self._published)
        self.messages_folded += count
        return True

    # ------------------------------------------------------------------ measurement
    def consensus_distance(self) -> float:
        """mean_i ‖θ_i − θ̄‖ over the workers: two all-reduces (θ̄, then the distances), in
        ``measure_stats``. Every worker must call it at the same point (the loop's steps)."""
        flat = flatten_params(self.model, out=self._flat)
        group, link, comm = self.ctx.replica_group, self.ctx.link, self.ctx.comm
        spans = self.spans_nodes
        mean = flat.clone()
        all_reduce_sum(mean, group, self.measure_stats, link=link, spans_nodes=spans, comm=comm)
        mean.div_(self.ctx.num_replicas)
        distance = torch.linalg.vector_norm(flat.double() - mean.double()).reshape(1)
        all_reduce_sum(distance, group, self.measure_stats, link=link, spans_nodes=spans, comm=comm)
        return distance.item() / self.ctx.num_replicas

    def step_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"peer": self.last_peer}
        if self.last_peer_lag_steps is not None:
            info["peer_lag_steps"] = self.last_peer_lag_steps
        if self._unreported is not None:
            # The loop asks only on the steps it logs: a measurement made since the last of
            # them is reported now, with the step it was made at.
            info["consensus_step"], info["consensus_distance"] = self._unreported
            self._unreported = None
        return info

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Tell every peer this worker is done, serve them until they all are, fold what
        they pushed meanwhile, and measure the final consensus distance. Returns on any worker
        only when every worker's serving thread has exited (the measurement follows each
        worker's join)."""
        self.transport.finish()
        flat = flatten_params(self.model, out=self._flat)
        if self._fold_mailbox(flat):
            assign_flat(self.model, flat)
        self._publish(flat)
        self.final_consensus_distance = self.consensus_distance()
        if self.ctx.replica_index == 0:
            log.info("gossip: final consensus distance %.3g", self.final_consensus_distance)

    def state_dict(self) -> dict[str, Any]:
        # The peer schedule is a function of (seed, round): the round count restores it.
        return {
            **super().state_dict(),
            "rounds": self.rounds,
            "weight": self.weight,
            "messages_folded": self.messages_folded,
            "rounds_skipped": self.rounds_skipped,
            "consensus_history": [list(x) for x in self.consensus_history],
            "measure_stats": self.measure_stats.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rounds = int(state["rounds"])
        self.weight = float(state["weight"])
        self.messages_folded = int(state["messages_folded"])
        self.rounds_skipped = int(state.get("rounds_skipped", 0))
        self.consensus_history = [list(x) for x in state["consensus_history"]]
        self.measure_stats.load_state_dict(state["measure_stats"])

    def global_params(self) -> tuple[torch.Tensor, int]:
        """This worker's replica (gossip has no global model); samples: all workers' so far."""
        return self.replica_params()

    def report(self) -> dict[str, Any]:
        r = super().report()
        counters = self.transport.counters if self.transport is not None else None
        r.update(
            gossip_rounds=self.rounds,
            fetches_served=counters.fetches_served if counters else 0,
            pushes_received=counters.pushes_received if counters else 0,
            pings_received=counters.pings_received if counters else 0,
            requests_rejected=counters.requests_rejected if counters else 0,
            replies_rejected=counters.replies_rejected if counters else 0,
            rounds_skipped=self.rounds_skipped,
            dropped_peers=self.transport.dropped_peers() if self.transport else [],
            messages_folded=self.messages_folded,
            final_consensus_distance=self.final_consensus_distance,
            consensus_history=self.consensus_history,
            consensus_bytes=self.measure_stats.sent_bytes,
        )
        if self.push_sum:
            r["push_sum_weight"] = self.weight
        return r

    def replica_weight(self) -> float:
        return self.weight if self.push_sum else 1.0
