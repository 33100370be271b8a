"""When a server shard acknowledges a push relative to the add that applies it.

A reply that carries no θ (a PUSH's ack, an overlapped PUSH_FETCH's: the worker already has θ
from before the push) depends only on whether the push is admitted: it leaves before θ moves,
so the worker's own θ + αΔ overlaps the server's add. A reply that carries θ (optimizer rules)
leaves after the apply. Either way the reply's version and samples are those after the push,
and the next request sees θ with the push applied.
"""

from __future__ import annotations

import torch

from cloudburst.comm.flat import flatten_params
from cloudburst.comm.messages import Kind, Status
from cloudburst.models import build_model
from tests.support import asgd_cfg, make_asgd_worker


def _one_round(cfg, push_only: bool = False):
    model = build_model("mlp", 40, 10, seed=0)
    strategy, loops = make_asgd_worker(cfg, model)
    strategy.start()
    shard, side = loops[0].shard, loops[0].transport
    before = shard.theta.clone()
    seen = []  # at each reply: its header, θ and the shard's version then
    send = side.send

    def recording_send(dst, header, payload=None, final=False):
        seen.append((header, shard.theta.clone(), shard.version))
        send(dst, header, payload, final)

    side.send = recording_send
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    strategy._round(push=True, fetch=not push_only)
    return strategy, shard, before, seen


def test_overlapped_reply_leaves_before_the_add():
    strategy, shard, before, seen = _one_round(asgd_cfg(servers=1, n_sync=1, server_lr=0.5))
    ((header, theta_then, version_then),) = seen
    assert header.kind == Kind.REPLY and header.status == Status.OK and header.numel == 0
    assert torch.equal(theta_then, before)  # θ had not moved when the ack left
    assert header.version == version_then == shard.version == 1  # ...but the push was counted
    delta = (before + 0.25) - before  # what the worker pushed (its replica started at θ)
    assert torch.equal(shard.theta, before.clone().add_(delta, alpha=0.5))
    assert torch.equal(flatten_params(strategy.model), shard.theta)  # worker and shard agree


def test_push_ack_leaves_before_the_add():
    _, shard, before, seen = _one_round(asgd_cfg(servers=1, n_push=1, n_fetch=2), push_only=True)
    ((header, theta_then, _),) = seen
    assert header.status == Status.OK and header.numel == 0 and header.version == 1
    assert torch.equal(theta_then, before)
    assert not torch.equal(shard.theta, before)


def test_reply_with_theta_leaves_after_the_apply():
    # An optimizer rule: θ after the apply travels in the reply, so the apply comes first.
    strategy, shard, before, seen = _one_round(
        asgd_cfg(servers=1, n_sync=1, server_rule="sgd", server_lr=1.0)
    )
    ((header, theta_then, _),) = seen
    assert header.numel == shard.theta.numel() and header.version == 1
    assert not torch.equal(theta_then, before)
    assert torch.equal(theta_then, shard.theta)
    assert torch.equal(flatten_params(strategy.model), shard.theta)
