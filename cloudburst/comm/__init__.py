"""Communication: flatten/shard, point-to-point messages, counted all-reduce.

This package and :mod:`cloudburst.runtime` are the only modules that import
``torch.distributed``; strategies go through them.
"""

from cloudburst.comm.flat import (
    assign_flat,
    flatten_params,
    join_shards,
    shard_bounds,
    split_shards,
)
from cloudburst.comm.messages import Header, Kind, Status
from cloudburst.comm.p2p import PeerTransport
from cloudburst.comm.stats import CommStats

__all__ = [
    "CommStats",
    "Header",
    "Kind",
    "PeerTransport",
    "Status",
    "assign_flat",
    "flatten_params",
    "join_shards",
    "shard_bounds",
    "split_shards",
]
