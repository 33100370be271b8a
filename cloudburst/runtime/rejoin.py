"""The gloo groups a restarted rank rejoins a running job on: a restarted worker's with every
server, a restarted shard's with each peer. Built through the job store, outside
torch.distributed's registry, and authenticated with the job secret.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from cloudburst.comm import auth


def shard_pair_group(
    store: dist.Store,
    shard: int,
    incarnation: int,
    peer: int,
    is_shard: bool,
    timeout_s: float,
    *,
    secret: bytes,
) -> dist.ProcessGroupGloo:
    """The gloo group of restarted shard ``shard`` (restart ``incarnation``; group rank 0) and
    one ``peer`` (group rank 1), outside torch.distributed's registry: built by the two of
    them through the job ``store`` within ``timeout_s``, which every operation on it has too,
    and authenticated with ``secret`` (:class:`~cloudburst.comm.auth.PeerRefused`). One pair per
    peer, so that a dead or finished worker holds up no other's."""
    name = f"shardpair/{shard}/{incarnation}/{peer}/"
    prefixed = dist.PrefixStore(name, store.clone())
    group = dist.ProcessGroupGloo(
        prefixed, 0 if is_shard else 1, 2, datetime.timedelta(seconds=timeout_s)
    )
    auth.authenticate_group(group, name, secret)
    return group


def rejoin_group(
    store: dist.Store,
    worker_rank: int,
    incarnation: int,
    num_servers: int,
    group_rank: int,
    timeout_s: float,
    *,
    secret: bytes,
) -> dist.ProcessGroupGloo:
    """The gloo group of one rejoining worker and every server (outside torch.distributed's
    registry): servers keep their ranks 0..S-1, the worker is rank S.

    Every member builds it at about the same time: it connects all pairs through the job
    ``store``, under keys of this worker's restart (``incarnation``), within ``timeout_s``,
    and every operation on it times out after the same. Then every member proves that it
    knows ``secret`` (:func:`cloudburst.comm.auth.authenticate_group`; raises
    :class:`~cloudburst.comm.auth.PeerRefused`): the store is open to anyone who reaches it, so a
    process that took the worker's place in the group is refused before θ moves.
    """
    # A store connection of its own: building the group waits in the store for the other
    # members, and a store client answers one request at a time (heartbeats would wait).
    name = f"rejoin/{worker_rank}/{incarnation}/"
    prefixed = dist.PrefixStore(name, store.clone())
    group = dist.ProcessGroupGloo(
        prefixed, group_rank, num_servers + 1, datetime.timedelta(seconds=timeout_s)
    )
    auth.authenticate_group(group, name, secret)
    return group


def rejoin_members(num_servers: int, worker_rank: int) -> list[int]:
    """The global rank of each rank of a rejoin group."""
    return [*range(num_servers), worker_rank]
