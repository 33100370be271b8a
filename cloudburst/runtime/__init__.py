"""One rank's view of its job: the torchrun environment, roles, process groups (the world,
the workers', and those a strategy declares), the job store, topology, device and backend.

Ranks ``0 .. S-1`` are parameter-server shards, ranks ``S .. S+W-1`` are workers (``S`` = 0 for
strategies without servers). A local job (``cloudburst train`` outside torchrun) is started by
:mod:`cloudburst.launch`, whose launcher process serves the job's store; inside a user's
torchrun, torchrun's store is used. Liveness (heartbeats, watchdogs, rejoining) lives in
:mod:`cloudburst.comm.liveness`.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import logging
import os
import signal
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from cloudburst.comm import auth
from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import LinkEmulator, Topology
from cloudburst.comm.liveness import Heartbeat, RejoinBoard, heartbeat_interval_s
from cloudburst.comm.nic import NicState, nic_dir, shared_clock_ok
from cloudburst.comm.transport import REAL, Transport
from cloudburst.config import RunConfig
from cloudburst.runtime.context import Context
from cloudburst.runtime.devices import choose_gloo_interface, select_backend, select_device
from cloudburst.runtime.groups import GroupMaker, authenticate_startup, one_group_per, worker_nodes
from cloudburst.runtime.placement import (
    launch_rank_to_role,
    placement_label,
    resolve_topology,
    shards_line,
)
from cloudburst.runtime.rejoin import rejoin_group
from cloudburst.strategies.spec import StrategySpec

log = logging.getLogger(__name__)

STORE_PREFIX = "cloudburst"


def in_torchrun() -> bool:
    """True when this process is a rank of a torchrun / torch elastic job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


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
            f"({cfg.job.workers} workers + {cfg.job.servers} servers); set --nnodes/"
            "--nproc-per-node so that their product matches"
        )
    rank = launch_rank_to_role(cfg, world)  # where the shard placement puts this rank
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = select_device(cfg, rank)
    backend = select_backend(cfg)
    timeout = datetime.timedelta(seconds=cfg.faults.comm_timeout_s)
    choose_gloo_interface(os.environ["MASTER_ADDR"])
    if restart_count() > 0 and traits.survives_worker_loss:
        # This rank alone was restarted (one agent per rank); the others are still running
        # and will not enter init_process_group again.
        if rank < cfg.job.servers:
            if not traits.shards_restart_in_place:
                raise RuntimeError(
                    f"parameter-server rank {rank} was restarted, but a {cfg.job.strategy} shard "
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
    interval_s = heartbeat_interval_s(cfg.faults.heartbeat_timeout_s)
    ctx.heartbeat = Heartbeat(liveness_store, rank, interval_s).start()
    _configure_logging(rank, "server" if rank < cfg.job.servers else "worker")
    authenticate_startup(ctx, secret)
    if rank == cfg.job.servers:
        log.info(
            "workers compute on %s; their collectives use %s; %d node(s)%s",
            device,
            backend,
            topology.num_nodes,
            shards_line(topology, cfg.job.servers, placement_label(cfg, world)),
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
    world, timeout_s, backend = cfg.world_size, cfg.faults.comm_timeout_s, fields["backend"]
    workers = list(range(cfg.job.servers, world))
    is_worker = rank >= cfg.job.servers
    groups: dict[str, Any] = {"workers_group": None}
    if (cfg.job.servers or backend == "nccl") and is_worker:
        # Only the workers take part (on gloo without servers, the world is theirs).
        groups["workers_group"] = comm.new_group("workers", workers, timeout_s, backend)
    if cfg.job.servers > 1 and not is_worker:
        groups["servers_group"] = comm.new_group("servers", list(range(cfg.job.servers)), timeout_s)
    replicas = workers
    if cfg.cluster.replica == "node":
        # Each node's workers are one replica (the same node groups as DASO's: gradients every
        # step), and the nodes' leaders run the strategy on a group of their own.
        nodes = worker_nodes(fields["topology"], cfg.job.servers, "replica: node", least=2)
        replicas = [ranks[0] for ranks in nodes]
        groups["replica_leaders"] = tuple(replicas)
        groups["node_replica_group"] = one_group_per(
            comm, rank, "replica", nodes, timeout_s, backend
        )
        groups["replicas_group"] = one_group_per(
            comm, rank, "replicas", [replicas], timeout_s, backend
        )
    maker = GroupMaker(
        comm, rank, fields["topology"], cfg.job.servers, replicas, timeout_s, backend
    )
    groups["groups"] = traits.make_groups(cfg, maker)
    return _rank_context(cfg, rank, comm, **groups, **fields)


def _rank_context(cfg: RunConfig, rank: int, comm: Transport, **fields: Any) -> Context:
    return Context(
        cfg=cfg,
        rank=rank,
        world_size=cfg.world_size,
        num_servers=cfg.job.servers,
        num_workers=cfg.job.workers,
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
    spec = LinkSpec.parse(cfg.cluster.inter_node_link) if cfg.cluster.inter_node_link else None
    nic = shared_nic(cfg, store, topology) if share_nic and spec is not None else None
    link = LinkEmulator(spec, topology=topology, rank=rank, nic=nic)
    return dict(
        store=store, device=device, backend=backend, topology=topology, t0=time.time(), link=link
    )


#: The job-store key under which the ranks agree on the shared NIC record's name.
NIC_RECORD_KEY = "nic-record"


def shared_nic(cfg: RunConfig, store: dist.Store, topology: Topology) -> NicState | None:
    """The emulated NICs of the job's nodes, shared by the ranks of this machine
    (:class:`~cloudburst.comm.nic.NicState`); None on one node, or (with one warning line)
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
        return NicState(path, topology.num_nodes, lock_timeout_s=cfg.faults.comm_timeout_s)
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
    heartbeat = Heartbeat(store, rank, heartbeat_interval_s(cfg.faults.heartbeat_timeout_s)).start()
    try:
        RejoinBoard(store, cfg.faults.comm_timeout_s, secret=secret).announce(rank, incarnation)
        group = rejoin_group(
            store,
            rank,
            incarnation,
            cfg.job.servers,
            cfg.job.servers,
            cfg.faults.comm_timeout_s,
            secret=secret,
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
    if cfg.strategy_spec.has_standby(cfg) and rank != 0:
        # Its standby took over when it died (a shard has one owner); nothing is left to do.
        log.info("restart %d of server shard %d: its standby serves it", restart_count(), rank)
        raise SystemExit(0)
    auth.require_secret(f"restarted server shard {rank}, to rejoin the running job,")
    store = _job_store(cfg, survives_worker_loss=True)
    heartbeat = Heartbeat(store, rank, heartbeat_interval_s(cfg.faults.heartbeat_timeout_s)).start()
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
        timeout=datetime.timedelta(seconds=cfg.faults.comm_timeout_s),
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
