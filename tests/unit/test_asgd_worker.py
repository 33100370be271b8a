"""The asgd worker against real server shards over a fake, in-process comm layer (no processes).

``FakeNet`` (tests/support.py) stands in for gloo point-to-point: the worker's requests are
queued per shard and the shard's :class:`ServerLoop` handles them when the worker waits for an
answer, so the worker's push/fetch schedule, the overlapped replies and the rejection path run
exactly as in a job.
"""

from __future__ import annotations

import queue
import threading

import torch
from torch import nn

from cloudburst.comm.flat import flatten_params
from cloudburst.comm.messages import Header, Kind
from cloudburst.config import RunConfig
from cloudburst.data import BatchStream, synthetic
from cloudburst.models import build_model
from cloudburst.strategies.asgd.serve import Standby
from tests.support import asgd_cfg, train_asgd_worker


def reference(steps: int) -> nn.Module:
    data = synthetic(512, 10)
    model = build_model("mlp", 40, 10, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stream = BatchStream(data.x_train, data.y_train, 32, seed=1)
    for _ in range(steps):
        x, y = next(stream)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_one_worker_equals_sgd_for_every_schedule_and_rule():
    ref = flatten_params(reference(24))
    for kw in [
        dict(servers=1, n_sync=1),
        dict(servers=3, n_sync=4),  # overlapped replies on 3 shards
        dict(servers=2, n_fetch=2, n_push=3),  # fetches keep unpushed progress
        dict(servers=2, n_fetch=3, n_push=2),
        dict(servers=2, n_sync=4, server_rule="sgd", server_lr=1.0),  # replies after apply
    ]:
        model, _, loops = train_asgd_worker(asgd_cfg(**kw), 24)
        theta = torch.cat([loop.shard.theta for loop in loops])
        # step 24 is a push and a fetch for every schedule here: shards and replica agree
        torch.testing.assert_close(theta, ref, rtol=1e-5, atol=1e-6, msg=str(kw))
        torch.testing.assert_close(flatten_params(model), ref, rtol=1e-5, atol=1e-6, msg=str(kw))


def test_rejected_push_is_discarded_and_training_goes_on():
    # Push every step, fetch every 5: a NaN in the replica at step 7 is pushed at step 7, the
    # shard rejects it, and the worker starts again from the servers' θ.
    model, strategy, loops = train_asgd_worker(
        asgd_cfg(servers=2, n_push=1, n_fetch=5), 12, poison_at=7
    )
    assert strategy.pushes_rejected == 1
    assert sum(loop.shard.rejected_nonfinite for loop in loops) == 1  # shard 0 holds the NaN
    assert torch.isfinite(flatten_params(model)).all()
    assert all(torch.isfinite(loop.shard.theta).all() for loop in loops)
    assert loops[0].shard.version == 11 and loops[1].shard.version == 12


def test_after_every_push_the_worker_holds_the_servers_theta_whatever_its_staleness():
    # Between the worker's steps each shard takes 3 empty pushes from elsewhere (Δ = 0: θ
    # stays, the version moves on), so every push of the worker arrives 3 versions stale.
    # The worker rebuilds θ + λ·s·Δ from an overlapped reply itself: with the same s as the
    # shard's, under delay-adaptive (τ_C = W = 4: s = 1 at τ = 3) as under scale (s = 1/3).
    for compensation in ("delay-adaptive", "scale"):
        cfg = RunConfig(strategy="asgd", workers=4, dataset="synthetic", train_size=512,
                        servers=2, n_sync=1, server_lr=0.5,
                        staleness_compensation=compensation)  # fmt: skip

        def each(model, loops, compensation=compensation):
            servers = torch.cat([loop.shard.theta for loop in loops])
            assert torch.equal(flatten_params(model), servers), compensation
            for loop in loops:
                for _ in range(3):
                    loop.shard.apply_push(torch.zeros_like(loop.shard.theta), loop.shard.version)

        _, _, loops = train_asgd_worker(cfg, 6, each=each)
        # the worker's pushes after its first were 3 versions stale (the empty ones: 0)
        assert [loop.shard.staleness_hist for loop in loops] == [{0: 19, 3: 5}] * 2


class _Pair:
    """A primary's link to its standby and the standby's to it, as two in-process queues."""

    def __init__(self):
        self.forwards, self.acks = queue.Queue(), queue.Queue()

    def send(self, peer, header, payload=None):  # the primary forwards
        self.forwards.put((header, None if payload is None else payload.clone()))

    def recv_reply(self, peer, out=None):
        if out is None:  # the primary waits for the standby's answer
            return self.acks.get(timeout=30)
        header, payload = self.forwards.get(timeout=30)  # the standby receives a forward
        if payload is not None:
            out.copy_(payload)
        return header


class _StandbySide:
    def __init__(self, pair: _Pair):
        self.pair = pair

    def recv_reply(self, peer, out):
        return self.pair.recv_reply(peer, out)

    def send(self, peer, header, payload=None):
        self.pair.acks.put(header)


def test_a_standby_copy_holds_its_shards_theta_after_every_forwarded_push():
    # Shard 1's server forwards each applied push to its standby on server 0 before it
    # replies; the copy starts from shard 1's slice of θ0 and ends on shard 1's θ, bit for bit.
    pair, standby = _Pair(), []

    def setup(loops):
        loops[1].standby_link = pair
        standby.append(Standby(loops[0], 1, _StandbySide(pair)))
        assert torch.equal(standby[0].replica.theta, loops[1].shard.theta)
        standby.append(threading.Thread(target=standby[0]._run, daemon=True))
        standby[1].start()

    _, _, loops = train_asgd_worker(
        asgd_cfg(servers=2, n_sync=2, shard_standby=True), 8, setup=setup
    )
    standby, thread = standby
    pair.send(1, Header(Kind.REPLY, shard=1, aux=int(Kind.DONE)))  # the primary is done
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert loops[1].shard.version == 4
    assert torch.equal(standby.replica.theta, loops[1].shard.theta)
    assert standby.replica.stats() == loops[1].shard.stats()
