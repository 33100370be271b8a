"""One rank's view of its job: the torchrun environment, roles, process groups (the world,
the workers', and those a strategy declares), the job store, topology, device and backend.

Ranks ``0 .. S-1`` are parameter-server shards, ranks ``S .. S+W-1`` are workers (``S`` = 0 for
strategies without servers). A local job (``cloudburst train`` outside torchrun) is started by
:mod:`cloudburst.launch`, whose launcher process serves the job's store; inside a user's
torchrun, torchrun's store is used. Liveness (heartbeats, watchdogs, rejoining) lives in
:mod:`cloudburst.liveness`.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cloudburst import auth
from cloudburst.comm.link import (
    LinkEmulator,
    LinkSpec,
    NicState,
    Topology,
    nic_dir,
    shared_clock_ok,
)
from cloudburst.comm.transport import REAL, Transport
from cloudburst.config import RunConfig
from cloudburst.liveness import (  # noqa: F401 - also importable from here
    Heartbeat,
    LivenessMonitor,
    RejoinBoard,
    RejoinRefused,
    heartbeat_interval_s,
)
from cloudburst.strategies.spec import StrategySpec

log = logging.getLogger(__name__)

STORE_PREFIX = "cloudburst"


def in_torchrun() -> bool:
    """True when this process is a rank of a torchrun / torch elastic job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


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
            compress="none" if exact else self.cfg.strategy_spec.message_method(self.cfg.compress),
        )

    def rejoin_transport(self, worker_rank: int, incarnation: int, stats=None):
        """A server's transport to a worker that rejoined after restart ``incarnation``: a
        gloo group of its own with every server (:func:`rejoin_group`), built now by this
        server, the other servers and the worker together; raises RuntimeError if it cannot
        be built (the worker died again, or ``comm_timeout_s`` passed), and
        :class:`~cloudburst.auth.PeerRefused` if a member does not prove the job secret (no
        byte of θ has moved then)."""
        group = rejoin_group(
            self.store,
            worker_rank,
            incarnation,
            self.num_servers,
            self.server_index,
            self.cfg.comm_timeout_s,
            secret=auth.require_secret(f"admitting restarted worker rank {worker_rank}"),
        )
        return self.transport(
            stats, group=group, members=rejoin_members(self.num_servers, worker_rank)
        )

    def shard_link(self, shard: int, incarnation: int, peer: int, stats=None):
        """The transport between restarted shard ``shard`` (its restart ``incarnation``) and
        ``peer`` (a worker, or server 0 at the end): a pair group built now by both
        (:func:`shard_pair_group`); raises RuntimeError if the other side does not come
        within ``comm_timeout_s``, :class:`~cloudburst.auth.PeerRefused` if it does not prove
        the job secret."""
        group = shard_pair_group(
            self.store,
            shard,
            incarnation,
            peer,
            self.rank == shard,
            self.cfg.comm_timeout_s,
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


def init_distributed(cfg: RunConfig, strategy_cls: type[StrategySpec] | None = None) -> Context:
    """Join the job started by torchrun: process groups with a timeout, roles, device, store.

    The world group is gloo (servers, point-to-point traffic, barriers). The workers' group
    carries their collectives: NCCL when they compute on GPUs and each has its own, else gloo
    (which also reduces CUDA tensors, through host memory).

    A worker of an asgd/easgd job that its agent restarted alone (``TORCHELASTIC_RESTART_COUNT``
    > 0) cannot re-enter the world group the others still hold: it rejoins on a group with the
    servers instead (:func:`_rejoin_job`). A restarted server shard restores its checkpoint
    and talks to each worker on a pair group of its own (:func:`_restart_shard`).

    Every gloo group formed here is authenticated with the job secret
    (:func:`authenticate_startup`) before anything else moves on it; under a torchrun given
    none, with a warning.
    """
    traits = strategy_cls if strategy_cls is not None else cfg.strategy_spec
    secret = auth.job_secret()  # a secret file that others can read is refused here
    world = int(os.environ["WORLD_SIZE"])
    if world != cfg.world_size:
        raise RuntimeError(
            f"torchrun started {world} ranks, the config needs {cfg.world_size} "
            f"({cfg.workers} workers + {cfg.servers} servers); set --nnodes/--nproc-per-node "
            "so that their product matches"
        )
    rank = launch_rank_to_role(cfg, world)  # where the shard placement puts this rank
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = select_device(cfg, rank)
    backend = select_backend(cfg)
    timeout = datetime.timedelta(seconds=cfg.comm_timeout_s)
    _choose_gloo_interface(os.environ["MASTER_ADDR"])
    if restart_count() > 0 and traits.survives_worker_loss:
        # This rank alone was restarted (one agent per rank); the others are still running
        # and will not enter init_process_group again.
        if rank < cfg.servers:
            if not traits.shards_restart_in_place:
                raise RuntimeError(
                    f"parameter-server rank {rank} was restarted, but a {cfg.strategy} shard "
                    "cannot rejoin a running job; restart the whole job from its checkpoints "
                    "with --resume OUT"
                )
            return _restart_shard(cfg, rank, world, device, backend)
        return _rejoin_job(cfg, rank, world, device, backend)
    if not dist.is_initialized():
        _init_world_group(rank, world, timeout)
    topology = resolve_topology(cfg, world)
    store = _job_store(cfg, traits.survives_worker_loss)
    # Liveness on a connection of its own: the training thread's long store waits (a final
    # report, a checkpoint agreement) hold its client, and heartbeats must not wait for them.
    liveness_store = _job_store(cfg, traits.survives_worker_loss)
    fields = _real_rank(cfg, rank, store, device, backend, topology, share_nic=True)
    ctx = build_context(cfg, rank, REAL, traits=traits, liveness_store=liveness_store, **fields)
    interval_s = heartbeat_interval_s(cfg.heartbeat_timeout_s)
    ctx.heartbeat = Heartbeat(liveness_store, rank, interval_s).start()
    _configure_logging(rank, "server" if rank < cfg.servers else "worker")
    authenticate_startup(ctx, secret)
    if rank == cfg.servers:
        log.info(
            "workers compute on %s; their collectives use %s; %d node(s)%s",
            device,
            backend,
            topology.num_nodes,
            shards_line(topology, cfg.servers, placement_label(cfg, world)),
        )
    return ctx


def build_context(
    cfg: RunConfig,
    rank: int,
    comm: Transport,
    *,
    traits: type[StrategySpec] | None = None,
    **fields: Any,
) -> Context:
    """Rank ``rank``'s Context, with the process groups the job needs (the workers', the
    servers', and those its strategy declares), made through ``comm.new_group`` in the same
    order on every rank: one set-up for the real job (:func:`init_distributed`) and the
    virtual cluster (:mod:`cloudburst.sim.run`). ``fields``: the rest of the Context (store,
    device, backend, topology, t0, link, heartbeat, ...)."""
    traits = traits if traits is not None else cfg.strategy_spec
    world, timeout_s, backend = cfg.world_size, cfg.comm_timeout_s, fields["backend"]
    workers = list(range(cfg.servers, world))
    is_worker = rank >= cfg.servers
    groups: dict[str, Any] = {"workers_group": None}
    if (cfg.servers or backend == "nccl") and is_worker:
        # Only the workers take part (on gloo without servers, the world is theirs).
        groups["workers_group"] = comm.new_group("workers", workers, timeout_s, backend)
    if cfg.servers > 1 and not is_worker:
        groups["servers_group"] = comm.new_group("servers", list(range(cfg.servers)), timeout_s)
    replicas = workers
    if cfg.replica == "node":
        # Each node's workers are one replica (the same node groups as DASO's: gradients every
        # step), and the nodes' leaders run the strategy on a group of their own.
        nodes = worker_nodes(fields["topology"], cfg.servers, "replica: node", least=2)
        replicas = [ranks[0] for ranks in nodes]
        groups["replica_leaders"] = tuple(replicas)
        groups["node_replica_group"] = _one_per(comm, rank, "replica", nodes, timeout_s, backend)
        groups["replicas_group"] = _one_per(comm, rank, "replicas", [replicas], timeout_s, backend)
    maker = GroupMaker(comm, rank, fields["topology"], cfg.servers, replicas, timeout_s, backend)
    groups["groups"] = traits.make_groups(cfg, maker)
    return _rank_context(cfg, rank, comm, **groups, **fields)


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
        return _one_per(self.comm, self.rank, kind, members, self.timeout_s, self.backend)

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


def _one_per(comm: Transport, rank: int, kind: str, members, timeout_s: float, backend: str):
    """One group per rank list of ``members``, made by every rank in the same order; this
    rank's (None if it is in none)."""
    mine = None
    for i, ranks in enumerate(members):
        group = comm.new_group(f"{kind}{i}", ranks, timeout_s, backend, every_rank=True)
        if rank in ranks:
            mine = group
    return mine


def _rank_context(cfg: RunConfig, rank: int, comm: Transport, **fields: Any) -> Context:
    return Context(
        cfg=cfg,
        rank=rank,
        world_size=cfg.world_size,
        num_servers=cfg.servers,
        num_workers=cfg.workers,
        comm=comm,
        **fields,
    )


def _real_rank(
    cfg: RunConfig,
    rank: int,
    store,
    device,
    backend: str,
    topology: Topology,
    share_nic: bool = False,
) -> dict[str, Any]:
    """A real rank's Context fields: the clock's start now, the emulated inter-node link
    (``share_nic``: each node's NIC shared by its ranks, :func:`shared_nic`)."""
    spec = LinkSpec.parse(cfg.inter_node_link) if cfg.inter_node_link else None
    nic = shared_nic(cfg, store, topology) if share_nic and spec is not None else None
    link = LinkEmulator(spec, topology=topology, rank=rank, nic=nic)
    return dict(
        store=store, device=device, backend=backend, topology=topology, t0=time.time(), link=link
    )


#: The job-store key under which the ranks agree on the shared NIC record's name.
NIC_RECORD_KEY = "nic-record"


def shared_nic(cfg: RunConfig, store: dist.Store, topology: Topology) -> NicState | None:
    """The emulated NICs of the job's nodes, shared by the ranks of this machine
    (:class:`~cloudburst.comm.link.NicState`); None on one node, or (with one warning line)
    where it cannot be opened: each rank then keeps a link of its own.

    Its name, ``cloudburst-nic-<uid>-<nonce>`` in ``/dev/shm`` (else the temp dir): the nonce
    is the first one any rank put under :data:`NIC_RECORD_KEY` in the job store (the store is
    per run and attempt, so every rank of one attempt, on any machine, agrees on it, and no
    other job or earlier attempt shares it). The name goes once every rank has the record
    open (:meth:`Context.start_clock`'s barrier) and again at :func:`shutdown`."""
    if topology.num_nodes < 2:
        return None
    try:
        if not shared_clock_ok():
            raise OSError("time.perf_counter is not the machine-wide CLOCK_MONOTONIC here")
        nonce = store.compare_set(NIC_RECORD_KEY, "", uuid.uuid4().hex).decode()
        path = os.path.join(nic_dir(), f"cloudburst-nic-{os.getuid()}-{nonce}")
        return NicState(path, topology.num_nodes, lock_timeout_s=cfg.comm_timeout_s)
    except (OSError, RuntimeError, ValueError) as err:
        log.warning("emulated link: each rank keeps its own (no shared node NIC: %s)", err)
        return None


def _context(cfg, rank, store, device, backend, topology, **groups) -> Context:
    """A real rank's Context outside the job's groups (rejoining it after a restart): its
    emulated link is its own (the others' shared NIC record is gone by then)."""
    return _rank_context(
        cfg, rank, REAL, **_real_rank(cfg, rank, store, device, backend, topology), **groups
    )


def _rejoin_job(
    cfg: RunConfig, rank: int, world: int, device: torch.device, backend: str
) -> Context:
    """A restarted worker of an asgd/easgd job: join the servers, not the world group.

    The surviving ranks never call ``init_process_group`` again, and gloo cannot reconnect a
    dead rank's place in their world group. So the restarted worker announces itself on the
    job store's :class:`RejoinBoard`, and it and every server build a gloo group of their own
    (:func:`rejoin_group`), on which the servers serve it from then on. It keeps its rank and
    worker index; it has no workers' group (asgd and easgd use none). Its announcement is
    signed, and the group authenticated, with the job secret: without one it is refused.
    """
    _configure_logging(rank, "worker")
    secret = auth.require_secret(f"restarted worker rank {rank}, to rejoin the running job,")
    store = _job_store(cfg, survives_worker_loss=True)
    incarnation = restart_count()
    # Heartbeats from now on: the servers reset this worker's liveness clock when they admit
    # it, and it has data and a model to load before its strategy starts.
    heartbeat = Heartbeat(store, rank, heartbeat_interval_s(cfg.heartbeat_timeout_s)).start()
    try:
        RejoinBoard(store, cfg.comm_timeout_s, secret=secret).announce(rank, incarnation)
        group = rejoin_group(
            store, rank, incarnation, cfg.servers, cfg.servers, cfg.comm_timeout_s, secret=secret
        )
    except BaseException:
        heartbeat.stop()
        raise
    log.info("restart %d: rejoined the running job on a group with the servers", incarnation)
    return _context(
        cfg,
        rank,
        store,
        device,
        backend,
        resolve_topology(cfg, world),
        workers_group=None,
        rejoin_group=group,
        heartbeat=heartbeat,
        liveness_store=store,
    )


def _restart_shard(
    cfg: RunConfig, rank: int, world: int, device: torch.device, backend: str
) -> Context:
    """A restarted server shard of an asgd/easgd job: heartbeats at once (its watchers give it
    ``heartbeat_timeout_s`` to beat again), no process group; the shard loop announces it once
    its checkpoint is restored, and builds a pair group with each worker that reconnects
    (:func:`shard_pair_group`)."""
    _configure_logging(rank, "server")
    if cfg.shard_standby and rank != 0:
        # Its standby took over when it died (a shard has one owner); nothing is left to do.
        log.info("restart %d of server shard %d: its standby serves it", restart_count(), rank)
        raise SystemExit(0)
    auth.require_secret(f"restarted server shard {rank}, to rejoin the running job,")
    store = _job_store(cfg, survives_worker_loss=True)
    heartbeat = Heartbeat(store, rank, heartbeat_interval_s(cfg.heartbeat_timeout_s)).start()
    log.info("restart %d of server shard %d: rejoining the running job", restart_count(), rank)
    return _context(
        cfg,
        rank,
        store,
        device,
        backend,
        resolve_topology(cfg, world),
        workers_group=None,
        shard_incarnation=restart_count(),
        heartbeat=heartbeat,
        liveness_store=store,
    )


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
    and authenticated with ``secret`` (:class:`~cloudburst.auth.PeerRefused`). One pair per
    peer, so that a dead or finished worker holds up no other's."""
    name = f"shardpair/{shard}/{incarnation}/{peer}/"
    prefixed = dist.PrefixStore(name, store.clone())
    group = dist.ProcessGroupGloo(
        prefixed, 0 if is_shard else 1, 2, datetime.timedelta(seconds=timeout_s)
    )
    auth.authenticate_group(group, name, secret)
    return group


def standby_link(ctx: Context, primary: int, stats=None):
    """The exact transport between shard ``primary``'s server and its standby (the server
    after it, :func:`standby_of`), on a gloo pair group built by both (primary: group rank 0),
    with ``comm_timeout_s``; authenticated with the job secret when there is one (it is formed
    at start-up, like the world group: see :func:`authenticate_startup`)."""
    from cloudburst.strategies.asgd.shard import standby_of

    standby = standby_of(primary, ctx.num_servers)
    name = f"standby/{primary}/"
    prefixed = dist.PrefixStore(name, ctx.store.clone())
    group = dist.ProcessGroupGloo(
        prefixed,
        0 if ctx.rank == primary else 1,
        2,
        datetime.timedelta(seconds=ctx.cfg.comm_timeout_s),
    )
    secret = auth.job_secret()
    if secret is not None:
        auth.authenticate_group(group, name, secret)
    return ctx.transport(stats, group=group, members=[primary, standby], exact=True)


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
    knows ``secret`` (:func:`cloudburst.auth.authenticate_group`; raises
    :class:`~cloudburst.auth.PeerRefused`): the store is open to anyone who reaches it, so a
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
    named += [(f"{ctx.cfg.strategy}.{n}", g) for n, g in ctx.groups.items()]
    for name, group in named:
        if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            groups.append((name, group))
    # A group whose CPU tensors go to gloo (a user's own world group may be NCCL's alone).
    groups = [(n, g) for n, g in groups if "gloo" in str(dist.get_backend(g))]
    for name, group in groups:
        auth.authenticate_group(group, f"startup/{name}", secret)
    log.debug("every member of %s proved the job secret", ", ".join(n for n, _ in groups))


def rejoin_members(num_servers: int, worker_rank: int) -> list[int]:
    """The global rank of each rank of a rejoin group."""
    return [*range(num_servers), worker_rank]


def launched_nodes(world: int) -> tuple[int, int]:
    """(nodes, ranks per node) as torchrun started them; (1, world) for one launch."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if "CLOUDBURST_LOCAL_JOB" not in os.environ and 0 < local < world and world % local == 0:
        return world // local, local
    return 1, world


def role_ranks(topology: Topology, ranks_per_node: int, placement: str = "spread") -> list[int]:
    """``role[r]``: the job rank (0..S-1 shards, then the workers) of torchrun's launch rank
    ``r``, which runs on node ``r // ranks_per_node`` (torchrun numbers each node's ranks
    contiguously). The job ranks of launch node ``n`` are exactly those ``topology`` puts on
    node ``n``, in increasing order. Raises ValueError (one line) when ``topology`` does not
    put ``ranks_per_node`` ranks on every node (``placement`` names it in the message)."""
    world, local = len(topology.node_of), ranks_per_node
    if local < 1 or world % local:
        raise ValueError(f"{world} ranks do not make nodes of {local} ranks each")
    on_node = [topology.ranks_on(n) for n in range(world // local)]
    counts = [len(ranks) for ranks in on_node]
    if any(c != local for c in counts):
        raise ValueError(
            f"shard_placement {placement!r} puts {','.join(map(str, counts))} ranks on nodes "
            f"0..{len(counts) - 1}, but torchrun started {local} on each; choose "
            "--shard-placement, --servers and --workers that put as many on every node"
        )
    return [rank for ranks in on_node for rank in ranks]


def _placed(cfg: RunConfig, nodes: int, ranks_per_node: int | None = None) -> Topology:
    """The job's layout on ``nodes`` nodes (:meth:`Topology.place`; torchrun's machines of
    ``ranks_per_node`` ranks each); RuntimeError (one line) where it cannot be."""
    try:
        return Topology.place(cfg.workers, cfg.servers, nodes, cfg.shard_placement, ranks_per_node)
    except ValueError as e:
        raise RuntimeError(f"shard_placement: {e}") from None


def shards_line(topology: Topology, servers: int, placement: str) -> str:
    """``"; shards on nodes 0,1 (spread)"`` for a start-up line; empty without shards."""
    if not servers:
        return ""
    nodes = ",".join(map(str, topology.shard_nodes(servers)))
    return f"; shards on nodes {nodes} ({placement})"


def placement_label(cfg: RunConfig, world: int) -> str:
    """How the shards were placed, for the start-up line: ``--shard-placement``, or torchrun's
    order under one agent per rank (:func:`resolve_topology`)."""
    nodes, local = launched_nodes(world)
    if nodes > 1 and local == 1:
        return "torchrun's order, one agent per rank"
    return cfg.shard_placement


def topology_mismatch(cfg: RunConfig, world: int) -> str | None:
    """A one-line message when ``--nodes`` disagrees with the nodes torchrun started, or when
    the shard placement does not put torchrun's ranks per node on every node."""
    nodes, local = launched_nodes(world)
    if nodes > 1 and cfg.nodes not in (None, nodes):
        return (
            f"nodes: the config says {cfg.nodes} nodes, but torchrun started {nodes} nodes of "
            f"{local} ranks each; drop --nodes or make them agree"
        )
    if nodes > 1 and local > 1 and world == cfg.world_size:
        try:
            role_ranks(_placed(cfg, nodes, local), local, cfg.shard_placement)
        except (RuntimeError, ValueError) as e:
            return str(e)
    return None


def resolve_topology(cfg: RunConfig, world: int) -> Topology:
    """The job's layout (:meth:`Topology.place`: shards where ``--shard-placement`` says,
    workers in contiguous blocks) on the nodes torchrun started (``LOCAL_WORLD_SIZE`` ranks
    each; each rank joined under its job rank, :func:`launch_rank_to_role`), or on ``--nodes
    N`` emulated nodes of one launch. One torchrun agent per rank (``LOCAL_WORLD_SIZE`` 1, as
    asgd is launched to survive a worker's death) tells nothing of the machines: each rank is
    a node of its own, in torchrun's order, as before shard placement."""
    problem = topology_mismatch(cfg, world)
    if problem:
        raise RuntimeError(problem)
    nodes, local = launched_nodes(world)
    if nodes > 1 and local == 1:
        return Topology(tuple(range(world)))
    if nodes > 1:
        return _placed(cfg, nodes, local)
    return _placed(cfg, cfg.nodes or 1)


def launch_rank_to_role(cfg: RunConfig, world: int) -> int:
    """This rank's job rank. Under a multi-node torchrun, torchrun's ``RANK`` (its launch
    rank, contiguous per node) becomes the job rank the shard placement puts on this node
    (:func:`role_ranks`): ``RANK`` is set to it before the world group is formed (torchrun's
    is kept in ``CLOUDBURST_LAUNCH_RANK``; ``LOCAL_RANK`` still picks the GPU). One node, or
    one agent per rank (:func:`resolve_topology`): ``RANK`` as it is."""
    launch = int(os.environ.get("CLOUDBURST_LAUNCH_RANK", os.environ["RANK"]))
    nodes, local = launched_nodes(world)
    if nodes < 2 or local == 1:
        return launch
    problem = topology_mismatch(cfg, world)
    if problem:
        raise RuntimeError(problem)
    roles = role_ranks(_placed(cfg, nodes, local), local, cfg.shard_placement)
    if roles.index(0) >= local and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        # env:// without the agent's store: rank 0 hosts the store on torchrun's node 0.
        raise RuntimeError(
            f"shard_placement {cfg.shard_placement!r} puts shard 0 off torchrun's node 0, "
            "where rank 0 must host the job's store here; unset "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE or use --shard-placement spread"
        )
    os.environ["CLOUDBURST_LAUNCH_RANK"] = str(launch)
    os.environ["RANK"] = str(roles[launch])
    return roles[launch]


def _choose_gloo_interface(master_addr: str) -> None:
    """Make gloo listen on the interface that reaches ``master_addr`` (loopback for a local
    master, even when ``GLOO_SOCKET_IFNAME`` is set).

    gloo binds to the address this host's name resolves to; where that is 127.0.0.1 (common
    on single-host images) ranks on other hosts or namespaces dial their own loopback and the
    job hangs. When the master is not local and ``GLOO_SOCKET_IFNAME`` is unset, set it to
    the interface of the route to the master; when the master is local, the loopback one.
    """
    if is_loopback(master_addr):
        # A job on this host listens on the loopback interface only, whatever the environment
        # says (a cluster's preset GLOO_SOCKET_IFNAME would expose it on the network).
        name = _interface_with_address("127.0.0.1")
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name
        else:
            raise RuntimeError("no network interface has 127.0.0.1: cannot bind a local job")
        return
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        if not is_loopback(socket.gethostbyname(socket.gethostname())):
            return  # gloo's own choice reaches the network
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master_addr), 9))  # no packet is sent
            local_ip = s.getsockname()[0]
    except OSError:
        return
    name = _interface_with_address(local_ip)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("gloo uses interface %s (%s) to reach %s", name, local_ip, master_addr)


def is_loopback(addr: str) -> bool:
    try:
        return socket.gethostbyname(addr).startswith("127.")
    except OSError:
        return False


def _interface_with_address(ip: str) -> str | None:
    import fcntl
    import struct

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(
                    s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode())
                )
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def cuda_wanted(cfg: RunConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def _workers_on_this_node(cfg: RunConfig) -> int:
    # Our own local launcher puts every rank on this machine (one agent per rank for asgd,
    # so LOCAL_WORLD_SIZE would say 1); under torchrun, the ranks of this node.
    if "CLOUDBURST_LOCAL_JOB" in os.environ:
        return cfg.workers
    return min(cfg.workers, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def select_device(cfg: RunConfig, rank: int) -> torch.device:
    """A worker's device: its own GPU when there are enough, else GPUs shared round-robin."""
    if rank < cfg.servers or not cuda_wanted(cfg):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for, but torch sees no CUDA device here")
    count = torch.cuda.device_count()
    if "CLOUDBURST_LOCAL_JOB" in os.environ:
        index = (rank - cfg.servers) % count
    else:
        index = int(os.environ.get("LOCAL_RANK", "0")) % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def select_backend(cfg: RunConfig) -> str:
    """The workers' collective backend (the same answer on every rank of a homogeneous job)."""
    if not cuda_wanted(cfg):
        return "gloo"
    own_gpu = torch.cuda.device_count() >= _workers_on_this_node(cfg)
    if cfg.backend == "nccl":
        if not own_gpu:
            raise RuntimeError(
                f"backend: nccl needs one GPU per worker on a node; this node has "
                f"{torch.cuda.device_count()} for {_workers_on_this_node(cfg)} workers "
                "(NCCL cannot run two ranks on one GPU); use --backend gloo"
            )
        return "nccl"
    if cfg.backend == "gloo":
        return "gloo"
    return "nccl" if own_gpu and cfg.workers > 1 else "gloo"


#: The process groups DDP may run on, kept from a finished job until the process exits (let go
#: at its start, while the interpreter is whole and their work threads long idle).
_RETIRED_GROUPS: list[Any] = []
atexit.register(_RETIRED_GROUPS.clear)


def shutdown(ctx: Context | None) -> None:
    if ctx is not None and ctx.heartbeat is not None:
        ctx.heartbeat.stop()
    if ctx is not None and ctx.link is not None:
        ctx.link.release_name()
    if dist.is_initialized():
        # A DDP model (sync's, DASO's in a node) that outlives its job holds its group; freed
        # after destroy_process_group, its Reducer would drop the group's last reference with
        # the GIL held, and ProcessGroupGloo's destructor joins its work threads, one of which
        # may still need the GIL to free the last collective's tensors: a deadlock (torch
        # 2.13; tests/dist/test_api_hooks.py hung on it). Kept here, the groups go at exit.
        groups = [dist.group.WORLD]
        if ctx is not None:
            groups += [ctx.workers_group, ctx.node_replica_group, *ctx.groups.values()]
        _RETIRED_GROUPS.extend(g for g in groups if g is not None)
        dist.destroy_process_group()


def _job_store(cfg: RunConfig, survives_worker_loss: bool) -> dist.Store:
    """A client of torchrun's store (on MASTER_ADDR:MASTER_PORT), under a per-run prefix."""
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=cfg.comm_timeout_s),
        wait_for_workers=False,
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    # A restart of the whole job (every rank restarts together) gets keys of its own; a rank
    # of an asynchronous job that restarts alone rejoins the others' keys.
    attempt = "" if survives_worker_loss else f"attempt{restart_count()}/"
    return dist.PrefixStore(f"{STORE_PREFIX}/{run_id}/{attempt}", client)


def _init_world_group(rank: int, world: int, timeout: datetime.timedelta) -> None:
    """The default (world) gloo group.

    Under an agent that shares its store with the ranks (static rendezvous: cloudburst's local
    launcher and torchrun's ``--rdzv-backend static``), the same store outlives a restart under
    ``--max-restarts``, and torch's ``env://`` initialisation would read the previous attempt's
    addresses: join through that store under a prefix of this attempt instead. Otherwise
    (torchrun's c10d rendezvous, a new store per attempt) ``env://``.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo", timeout=timeout)
        return
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    store = dist.PrefixStore(f"{STORE_PREFIX}/world/{run_id}/attempt{restart_count()}/", client)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def restart_count() -> int:
    """How many times torchrun's agent has restarted this rank (0 in a first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _configure_logging(rank: int, role: str) -> None:
    logging.basicConfig(
        level=os.environ.get("CLOUDBURST_LOG_LEVEL", "INFO"),
        format=f"[%(asctime)s rank{rank} {role}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # `kill -USR1 <pid>` prints every thread's stack to the rank's log (a hung rank, live).
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
