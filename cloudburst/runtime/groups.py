"""The process groups beyond the world's: those a strategy declares (:class:`GroupMaker`),
the pair and rejoin groups of restarted ranks and standby shards, and the start-up round that
authenticates every group with the job secret.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from cloudburst.comm import auth
from cloudburst.comm.link import Topology
from cloudburst.comm.transport import Transport
from cloudburst.runtime.context import Context

log = logging.getLogger(__name__)


@dataclass
class GroupMaker:
    """What a strategy's spec makes its own process groups with (``make_groups``): every
    rank calls it, in the same order; each method returns this rank's group, or None."""

    comm: Transport
    rank: int
    topology: Topology
    servers: int
    replicas: list[int]  # the ranks that run the strategy (the workers, or the node leaders)
    timeout_s: float
    backend: str  # of the workers' collectives

    def worker_nodes(self, who: str, least: int) -> list[list[int]]:
        """:func:`worker_nodes` of this job."""
        return worker_nodes(self.topology, self.servers, who, least)

    def one_per(self, kind: str, members: list[list[int]]) -> Any:
        """One group (``kind`` i) per rank list of ``members``, on the workers' backend."""
        return one_group_per(self.comm, self.rank, kind, members, self.timeout_s, self.backend)

    def among(self, name: str, ranks: list[int], backend: str) -> Any:
        """One group ``name`` of ``ranks`` on ``backend``."""
        group = self.comm.new_group(name, ranks, self.timeout_s, backend, every_rank=True)
        return group if self.rank in ranks else None


def worker_nodes(topology: Topology, servers: int, who: str, least: int) -> list[list[int]]:
    """The worker ranks of each node that has workers, in node order; RuntimeError (one line)
    unless every such node has the same number, at least ``least`` (``who`` needs them)."""
    nodes = [[r for r in topology.ranks_on(n) if r >= servers] for n in range(topology.num_nodes)]
    nodes = [ranks for ranks in nodes if ranks]
    if len({len(r) for r in nodes}) != 1 or len(nodes[0]) < least:
        raise RuntimeError(
            f"{who} needs the same number of workers (at least {least}) on every node, got {nodes}"
        )
    return nodes


def one_group_per(comm: Transport, rank: int, kind: str, members, timeout_s: float, backend: str):
    """One group per rank list of ``members``, made by every rank in the same order; this
    rank's (None if it is in none)."""
    mine = None
    for i, ranks in enumerate(members):
        group = comm.new_group(f"{kind}{i}", ranks, timeout_s, backend, every_rank=True)
        if rank in ranks:
            mine = group
    return mine


def standby_link(ctx: Context, primary: int, stats=None):
    """The exact transport between shard ``primary``'s server and its standby (the server
    after it, :func:`standby_of`), on a gloo pair group built by both (primary: group rank 0),
    with ``comm_timeout_s``; authenticated with the job secret when there is one (it is formed
    at start-up, like the world group: see :func:`authenticate_startup`)."""
    standby = standby_of(primary, ctx.num_servers)
    name = f"standby/{primary}/"
    prefixed = dist.PrefixStore(name, ctx.store.clone())
    group = dist.ProcessGroupGloo(
        prefixed,
        0 if ctx.rank == primary else 1,
        2,
        datetime.timedelta(seconds=ctx.cfg.faults.comm_timeout_s),
    )
    secret = auth.job_secret()
    if secret is not None:
        auth.authenticate_group(group, name, secret)
    return ctx.transport(stats, group=group, members=[primary, standby], exact=True)


def authenticate_startup(ctx: Context, secret: bytes | None) -> None:
    """Check that every member of each gloo group this rank formed at start-up (the world's,
    then the workers', the servers', the node replicas', the strategy's own, in that order on
    every rank) knows
    the job ``secret``: one round (two small all-gathers) per group, before any θ moves.

    These groups are formed through the job store while every genuine rank is there; a
    process that reaches the store could still race a rank for its place in a group, and would
    then receive what that rank receives (a resumed run's θ). The round closes that at a cost
    of milliseconds. A group on NCCL is not checked (its bootstrap is NCCL's; it carries only
    the workers' collectives). Without a secret (torchrun, none given): a warning, once."""
    if secret is None:
        if ctx.rank == 0 and "CLOUDBURST_LOCAL_JOB" not in os.environ:
            log.warning(
                "no job secret (%s or %s): the job's groups are not authenticated, and a "
                "restarted rank cannot rejoin; see docs/security.md",
                auth.ENV_SECRET_FILE,
                auth.ENV_SECRET,
            )
        return
    groups: list[tuple[str, Any]] = [("world", dist.group.WORLD)]
    job = ("workers_group", "servers_group", "node_replica_group", "replicas_group")
    named = [(n, getattr(ctx, n)) for n in job]
    named += [(f"{ctx.cfg.job.strategy}.{n}", g) for n, g in ctx.groups.items()]
    for name, group in named:
        if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            groups.append((name, group))
    # A group whose CPU tensors go to gloo (a user's own world group may be NCCL's alone).
    groups = [(n, g) for n, g in groups if "gloo" in str(dist.get_backend(g))]
    for name, group in groups:
        auth.authenticate_group(group, f"startup/{name}", secret)
    log.debug("every member of %s proved the job secret", ", ".join(n for n, _ in groups))


def standby_of(shard: int, num_servers: int) -> int:
    """The server rank that keeps shard ``shard``'s standby copy (``--shard-standby``): the
    next one, cyclically."""
    return (shard + 1) % num_servers
