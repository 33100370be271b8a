"""The asgd worker's overlapped PUSH_FETCH writes θ + αΔ into its parameters chunk by chunk
(``ADD_CHUNK_NUMEL``): with chunks that do not divide the shards, the replica, its reference
and every shard must still agree bit for bit (the server applies the same αΔ in one pass)."""

from __future__ import annotations

import torch

import cloudburst.strategies.asgd.worker as asgd
from cloudburst.comm.flat import flatten_params
from tests.support import asgd_cfg, train_asgd_worker


def test_chunked_add_matches_the_shards_bit_for_bit(monkeypatch):
    monkeypatch.setattr(asgd, "ADD_CHUNK_NUMEL", 7)  # many chunks, none aligned to a shard
    # λ = 0.5: the replica's θ + αΔ differs from the plain sum, so a chunk added twice, missed,
    # or added with another α would show
    model, strategy, loops = train_asgd_worker(asgd_cfg(servers=3, n_sync=3, server_lr=0.5), 12)
    theta = torch.cat([loop.shard.theta for loop in loops])
    assert strategy.pushes == 4 * 3 and strategy.pushes_rejected == 0
    assert all(loop.shard.version == 4 for loop in loops)
    assert torch.equal(flatten_params(model), theta)
    assert torch.equal(strategy.reference, theta)
