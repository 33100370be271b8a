"""A rank's view of its job (:class:`Context`): who it is, its groups, store, topology,
device, link and transport; and :class:`ReplicaView`, who the strategy runs between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cloudburst.comm import auth
from cloudburst.comm.link import LinkEmulator, Topology
from cloudburst.comm.liveness import Heartbeat
from cloudburst.comm.transport import REAL, Transport
from cloudburst.config import RunConfig
from cloudburst.runtime.rejoin import rejoin_group, rejoin_members, shard_pair_group


class ReplicaView:
    """Who the strategy runs between (a rank's replicas): every worker, or with ``--replica
    node`` each node's leader. Context's, and shared with the tests' stand-ins for it, which
    have ``worker_ranks``, ``num_servers``, ``workers_group`` and (for node replicas) the
    fields below."""

    replica_leaders: tuple[int, ...] | None = None
    replicas_group: Any = None
    node_replica_group: Any = None

    @property
    def replica_ranks(self) -> list[int]:
        """The ranks the strategy runs between: every worker, or each node's leader."""
        if self.replica_leaders is None:
            return self.worker_ranks
        return list(self.replica_leaders)

    @property
    def num_replicas(self) -> int:
        return len(self.replica_ranks)

    @property
    def leads_replica(self) -> bool:
        """True on a worker that runs the strategy: every worker, or a node's leader."""
        return not self.is_server and (
            self.replica_leaders is None or self.rank in self.replica_leaders
        )

    def replica_of(self, rank: int) -> int:
        """The replica of worker ``rank`` (its worker index with --replica rank, its node's
        place among the leaders with --replica node)."""
        if self.replica_leaders is None:
            return rank - self.num_servers
        node = self.topology.node_of[rank]
        nodes = [self.topology.node_of[r] for r in self.replica_leaders]
        return nodes.index(node)

    @property
    def replica_index(self) -> int:
        """This worker's replica (see :meth:`replica_of`)."""
        if self.replica_leaders is None:
            return self.worker_index
        return self.replica_of(self.rank)

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The group of the strategy's collectives: the workers', or the leaders' (None: the
        world's, as for ``workers_group``)."""
        return self.workers_group if self.replica_leaders is None else self.replicas_group


@dataclass(kw_only=True)
class Context(ReplicaView):
    """What one rank knows about the job it is part of (built with keywords only)."""

    cfg: RunConfig
    rank: int
    world_size: int
    num_servers: int
    num_workers: int
    workers_group: dist.ProcessGroup | None  # None when the workers are the whole world
    store: dist.Store
    t0: float  # wall-clock start of training, common to all ranks after start_clock()
    device: torch.device = torch.device("cpu")  # where this rank computes (servers: the CPU)
    backend: str = "gloo"  # of the workers' collectives (sync's all-reduce)
    topology: Topology | None = None  # which rank is on which node
    link: LinkEmulator | None = None  # the emulated inter-node link (inactive without one)
    # The strategy's own groups, by the names its spec's make_groups gives them (DASO's
    # "node" and "across", gossip's "requests" and "replies"); None where this rank is in none.
    groups: dict[str, Any] = field(default_factory=dict)
    # Parameter servers, when there are several: their final shards go to server 0 on it.
    servers_group: dist.ProcessGroup | None = None
    # --replica node: the ranks that lead a replica (each worker node's first worker: the
    # strategy's workers), their group, and this worker's node (its gradients are all-reduced
    # there every step; the leader's θ is broadcast there). None with --replica rank.
    replica_leaders: tuple[int, ...] | None = None
    replicas_group: dist.ProcessGroup | None = None
    node_replica_group: dist.ProcessGroup | None = None
    # A worker that rejoined a running asgd/easgd job after a restart talks to the servers on
    # a gloo group of its own (see rejoin_group); it never joined the world group.
    rejoin_group: dist.ProcessGroupGloo | None = None
    # A server shard that its agent restarted (its restart count; 0 in a first attempt): it
    # is in no group of the job, and talks to each peer on a pair group (shard_pair_group).
    shard_incarnation: int = 0
    # This rank's heartbeat (a rejoined worker's started before it rejoined), and the store
    # connection it and the watchdog use.
    heartbeat: Heartbeat | None = None
    liveness_store: dist.Store | None = None
    # How this rank communicates, waits and keeps time: torch.distributed and the wall clock,
    # or the virtual cluster's simulated transport (cloudburst.sim).
    comm: Transport = REAL

    @property
    def rejoined(self) -> bool:
        """True in a worker that rejoined the job after a restart (not in the world group)."""
        return self.rejoin_group is not None

    def transport(
        self, stats=None, group=None, members: list[int] | None = None, exact: bool = False
    ):
        """A point-to-point transport that knows which peers are on other nodes (for the
        byte accounting and the emulated inter-node link).

        On the world group by default; a rejoined worker's on its rejoin group. ``group`` and
        ``members`` pick another one (``members``: see :class:`PeerTransport`). ``exact``:
        payloads travel uncompressed whatever ``--compress`` says (a shard's standby copy).
        """
        from cloudburst.comm.p2p import PeerTransport

        if group is None and self.rejoin_group is not None:
            group, members = self.rejoin_group, rejoin_members(self.num_servers, self.rank)
        topo, rank = self.topology, self.rank
        crosses = (lambda peer: topo.crosses(rank, peer)) if topo is not None else None
        return PeerTransport(
            group=group,
            stats=stats,
            link=self.link,
            crosses=crosses,
            members=members,
            wire=self.comm,
            compress="none"
            if exact
            else self.cfg.strategy_spec.message_method(self.cfg.cluster.compress),
        )

    def rejoin_transport(self, worker_rank: int, incarnation: int, stats=None):
        """A server's transport to a worker that rejoined after restart ``incarnation``: a
        gloo group of its own with every server (:func:`rejoin_group`), built now by this
        server, the other servers and the worker together; raises RuntimeError if it cannot
        be built (the worker died again, or ``comm_timeout_s`` passed), and
        :class:`~cloudburst.comm.auth.PeerRefused` if a member does not prove the job secret (no
        byte of θ has moved then)."""
        group = rejoin_group(
            self.store,
            worker_rank,
            incarnation,
            self.num_servers,
            self.server_index,
            self.cfg.faults.comm_timeout_s,
            secret=auth.require_secret(f"admitting restarted worker rank {worker_rank}"),
        )
        return self.transport(
            stats, group=group, members=rejoin_members(self.num_servers, worker_rank)
        )

    def shard_link(self, shard: int, incarnation: int, peer: int, stats=None):
        """The transport between restarted shard ``shard`` (its restart ``incarnation``) and
        ``peer`` (a worker, or server 0 at the end): a pair group built now by both
        (:func:`shard_pair_group`); raises RuntimeError if the other side does not come
        within ``comm_timeout_s``, :class:`~cloudburst.comm.auth.PeerRefused` if it does not prove
        the job secret."""
        group = shard_pair_group(
            self.store,
            shard,
            incarnation,
            peer,
            self.rank == shard,
            self.cfg.faults.comm_timeout_s,
            secret=auth.require_secret(f"a link to restarted server shard {shard}"),
        )
        return self.transport(stats, group=group, members=[shard, peer])

    @property
    def node(self) -> int:
        return self.topology.node_of[self.rank] if self.topology else 0

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes if self.topology else 1

    @property
    def is_server(self) -> bool:
        return self.rank < self.num_servers

    @property
    def server_index(self) -> int:
        return self.rank

    @property
    def worker_index(self) -> int:
        return self.rank - self.num_servers

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.num_servers, self.world_size))

    @property
    def role(self) -> str:
        return f"server{self.server_index}" if self.is_server else f"worker{self.worker_index}"

    def elapsed_s(self) -> float:
        return self.comm.wall() - self.t0

    def start_clock(self, elapsed_s: float = 0.0) -> None:
        """Barrier, then a common origin for wall-clock times: rank 0's clock via the store.

        Every rank calls this once, after loading data and building its model, so that
        ``time_s`` in the metrics measures training, not start-up. A resumed run passes the
        training time already done (rank 0's value counts), so its clock continues. A worker
        that rejoined a running job takes the origin the others agreed on (no barrier: they
        are training).
        """
        if self.rejoined or self.shard_incarnation:
            self.t0 = float(self.store.get("t0").decode())
            return
        self.comm.barrier()
        if self.link is not None:
            self.link.release_name()  # every rank has the shared NIC record open by now
        if self.rank == 0:
            self.store.set("t0", repr(self.comm.wall() - elapsed_s))
        self.t0 = float(self.store.get("t0").decode())
