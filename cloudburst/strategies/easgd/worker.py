"""``easgd``: elastic averaging SGD (Zhang et al. 2015), asynchronous, centre on the servers.

Algorithm (docs/algorithms.md#easgd): each worker trains its replica θ_i with its local optimizer;
every τ = ``easgd_tau`` steps it computes the elastic difference e = α(θ_i − θ̃) against the
centre variable θ̃ held by the parameter-server shards, moves θ_i ← θ_i − e, and the shards
move θ̃ ← θ̃ + e. α = ``easgd_alpha``, by default β/W with β = ``easgd_beta`` (0.9).

Transport: one round trip per shard (a PUSH_FETCH of the ``elastic`` server rule): the worker
sends θ_i while the shard sends θ̃ as it was before this push; both compute the same e with
:func:`~cloudburst.strategies.easgd.rule.elastic_step` on the same values. A shard handles one
request at a time, so each exchange is atomic per shard; shards are independent.

Synchronous: nothing between workers. Staleness: the shard versions that passed since this
worker's previous exchange (the centre it uses is current). The global model is θ̃ (worker 0
evaluates it with a read-only fetch). A dead worker: the servers keep serving the others,
as for ``asgd``; restarted by its agent, it rejoins as for ``asgd`` and starts again from the
centre θ̃ (θ_i ← θ̃, as at the start of a run), with its checkpoint's optimizer, data position
and step. A rejected push (non-finite θ_i) or a refused one (its elastic step too large,
``--max-push-ratio``) resets the replica to the centre.

Compressed (``--compress bf16|fp8|int8``): the worker sends the elastic difference against the
centre of its previous exchange, with error feedback, not θ_i; the shards add exactly what the
worker subtracts (docs/algorithms.md#compression).
"""

from __future__ import annotations

import torch

from cloudburst.comm.compress import ErrorFeedback
from cloudburst.comm.flat import assign_flat
from cloudburst.comm.messages import Header, Kind, Status
from cloudburst.strategies.asgd.compensation import add_rule_alpha
from cloudburst.strategies.asgd.worker import AsgdStrategy
from cloudburst.strategies.easgd import Easgd
from cloudburst.strategies.easgd.rule import elastic_step


class EasgdStrategy(Easgd, AsgdStrategy):
    def after_step(self, samples: int) -> None:
        self.local_steps += 1
        self._samples_since_push += samples
        self._fresh = None
        if self.local_steps % self.cfg.easgd.tau == 0:
            self._elastic_round()

    def _flush(self) -> None:
        if self.local_steps % self.cfg.easgd.tau != 0:
            self._elastic_round()

    def _exchange(self, payloads: list[torch.Tensor]) -> torch.Tensor:
        """Send shard k its PUSH_FETCH header and ``payloads[k]`` while its centre comes back;
        returns the centre's host buffer (the replies' headers are still to be read)."""
        centre = self._fetch_host if self.on_gpu else self._spare
        started = []
        for k, (a, b) in enumerate(self.bounds):
            header = Header(
                Kind.PUSH_FETCH,
                shard=k,
                version=self.versions[k],
                numel=b - a,
                samples=self._samples_since_push,
                aux=self.local_steps,
            )
            self.transport.send(k, header)
            started.append(self.transport.isend_payload(k, payloads[k], reply=False))
            started.append(self.transport.irecv_payload(k, centre[a:b], reply=True))
        self.transport.wait_all(started)
        return centre

    def _elastic_round(self) -> None:
        if self.compress != "none":
            self._compressed_elastic_round()
            return
        flat = self._params_flat()  # the parameters' own buffer
        theta = self._to_host(flat)  # θ_i in host memory (itself on a CPU replica)
        centre = self._exchange([theta[a:b] for a, b in self.bounds])
        alpha = self.cfg.easgd.alpha_value(self.cfg)
        for k, (a, b) in enumerate(self.bounds):
            reply = self.transport.recv_reply(k)
            self._check(reply, k)
            self._account_push(reply)
            if reply.status == Status.OK:
                theta[a:b].sub_(elastic_step(alpha, theta[a:b], centre[a:b]))
            elif reply.status in (Status.REJECTED, Status.REFUSED):
                # θ_i was not finite, or too far from the centre: restart from the centre
                theta[a:b].copy_(centre[a:b])
            self.versions[k] = reply.version
            if k == 0:
                self.global_samples = reply.samples
        self._samples_since_push = 0
        assign_flat(self.model, self._to_device(theta))

    def _compressed_elastic_round(self) -> None:
        """One exchange sending e = α(θ_i − θ̃') compressed (the module docstring)."""
        flat = self._params_flat()  # the parameters' own buffer
        # e on the replica's device, against the centre of the last exchange (self.reference).
        elastic = torch.sub(flat, self.reference, out=self._delta).mul_(
            self.cfg.easgd.alpha_value(self.cfg)
        )
        sent = self._to_host(elastic)
        packets = self._compress_push(sent)  # sent becomes what the shards will add
        centre = self._exchange(packets)
        moved, reset = [], []
        for k, (a, b) in enumerate(self.bounds):
            reply = self.transport.recv_reply(k)
            self._check(reply, k)
            self._account_push(reply)
            if reply.status == Status.OK:
                alpha = add_rule_alpha(1.0, reply.aux, self.cfg.asgd.staleness_compensation)
                centre[a:b].add_(sent[a:b], alpha=alpha)  # the shard's θ̃ after our push
                moved.append((a, b, alpha))
            elif reply.status in (Status.REJECTED, Status.REFUSED):
                reset.append((a, b))  # e was not finite, or too large: restart from the centre
            self.versions[k] = reply.version
            if k == 0:
                self.global_samples = reply.samples
        if reset:
            self.feedback = ErrorFeedback()
        self._samples_since_push = 0
        sent = self._delta.copy_(sent) if self.on_gpu else sent
        centre = self._to_device(centre)
        for a, b, alpha in moved:
            flat[a:b].sub_(sent[a:b], alpha=alpha)  # exactly what the centre added
        for a, b in reset:
            flat[a:b].copy_(centre[a:b])
        self.reference.copy_(centre)
        assign_flat(self.model, flat)
