"""The job: torchrun environment, process groups, roles, the job store, and local launches.

Ranks ``0 .. S-1`` are parameter-server shards, ranks ``S .. S+W-1`` are workers (``S`` = 0 for
strategies without servers). Rank 0 therefore hosts torchrun's store on node 0 and survives
the loss of any worker in asynchronous runs.

``cloudburst train`` outside torchrun starts a local job itself with torch's own launcher API
(:func:`torch.distributed.launcher.api.elastic_launch`): one agent for all ranks when the
strategy is synchronous (a dead rank ends the job, as it must), one agent per rank when the
strategy tolerates worker loss (an agent tears down only its own rank). Inside torchrun the
same entry point runs one rank.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

import torch
import torch.distributed as dist

from cloudburst.comm.link import LinkEmulator, LinkSpec, Topology
from cloudburst.config import RunConfig

log = logging.getLogger(__name__)

STORE_PREFIX = "cloudburst"


def in_torchrun() -> bool:
    """True when this process is a rank of a torchrun / torch elastic job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


@dataclass
class Context:
    """What one rank knows about the job it is part of."""

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
    node_group: dist.ProcessGroup | None = None  # DASO: this rank's node
    global_group: dist.ProcessGroup | None = None  # DASO: local rank g of every node
    # gossip: requests to the serving threads (only they receive on it), and their replies
    # (only the training threads receive on it); see cloudburst.comm.gossip.
    gossip_request_group: dist.ProcessGroup | None = None
    gossip_reply_group: dist.ProcessGroup | None = None

    def transport(self, stats=None):
        """A point-to-point transport that knows which peers are on other nodes (for the
        byte accounting and the emulated inter-node link)."""
        from cloudburst.comm.p2p import PeerTransport

        topo, rank = self.topology, self.rank
        crosses = (lambda peer: topo.crosses(rank, peer)) if topo is not None else None
        return PeerTransport(stats=stats, link=self.link, crosses=crosses)

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
        return time.time() - self.t0

    def start_clock(self) -> None:
        """Barrier, then a common origin for wall-clock times: rank 0's clock via the store.

        Every rank calls this once, after loading data and building its model, so that
        ``time_s`` in the metrics measures training, not start-up.
        """
        dist.barrier()
        if self.rank == 0:
            self.store.set("t0", repr(time.time()))
        self.t0 = float(self.store.get("t0").decode())


def init_distributed(cfg: RunConfig) -> Context:
    """Join the job started by torchrun: process groups with a timeout, roles, device, store.

    The world group is gloo (servers, point-to-point traffic, barriers). The workers' group
    carries their collectives: NCCL when they compute on GPUs and each has its own, else gloo
    (which also reduces CUDA tensors, through host memory).
    """
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if world != cfg.world_size:
        raise RuntimeError(
            f"torchrun started {world} ranks, the config needs {cfg.world_size} "
            f"({cfg.workers} workers + {cfg.servers} servers); set --nnodes/--nproc-per-node "
            "so that their product matches"
        )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = select_device(cfg, rank)
    backend = select_backend(cfg)
    timeout = datetime.timedelta(seconds=cfg.comm_timeout_s)
    _choose_gloo_interface(os.environ["MASTER_ADDR"])
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)
    workers_group = None
    if cfg.servers or backend != "gloo":
        # Every rank must take part in creating a group, servers included.
        workers_group = (
            dist.new_group(
                list(range(cfg.servers, world)),
                timeout=timeout,
                backend=backend,
                use_local_synchronization=True,
            )
            if rank >= cfg.servers
            else None
        )
    topology = resolve_topology(cfg, world)
    node_group = global_group = None
    if cfg.strategy == "daso":
        node_group, global_group = _daso_groups(topology, backend, timeout)
    gossip_groups: tuple[dist.ProcessGroup | None, ...] = (None, None)
    if cfg.strategy == "gossip":
        # Two gloo groups of the workers, created once by every rank in the same order.
        workers = list(range(cfg.servers, world))
        gossip_groups = tuple(
            dist.new_group(workers, timeout=timeout, backend="gloo") for _ in range(2)
        )
    store = _job_store(cfg)
    _configure_logging(rank, "server" if rank < cfg.servers else "worker")
    if rank == cfg.servers:
        log.info(
            "workers compute on %s; their collectives use %s; %d node(s)",
            device,
            backend,
            topology.num_nodes,
        )
    link = LinkEmulator(LinkSpec.parse(cfg.inter_node_link) if cfg.inter_node_link else None)
    return Context(
        cfg,
        rank,
        world,
        cfg.servers,
        cfg.workers,
        workers_group,
        store,
        time.time(),
        device,
        backend,
        topology,
        link,
        node_group,
        global_group,
        gossip_request_group=gossip_groups[0],
        gossip_reply_group=gossip_groups[1],
    )


def launched_nodes(world: int) -> tuple[int, int]:
    """(nodes, ranks per node) as torchrun started them; (1, world) for one launch."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if "CLOUDBURST_LOCAL_JOB" not in os.environ and 0 < local < world and world % local == 0:
        return world // local, local
    return 1, world


def topology_mismatch(cfg: RunConfig, world: int) -> str | None:
    """A one-line message when ``--nodes`` disagrees with the nodes torchrun started."""
    nodes, local = launched_nodes(world)
    if nodes > 1 and cfg.nodes not in (None, nodes):
        return (
            f"nodes: the config says {cfg.nodes} nodes, but torchrun started {nodes} nodes of "
            f"{local} ranks each; drop --nodes or make them agree"
        )
    return None


def resolve_topology(cfg: RunConfig, world: int) -> Topology:
    """Nodes from torchrun (``LOCAL_WORLD_SIZE`` ranks each, contiguous), or ``--nodes N``
    emulated nodes of one launch (contiguous blocks of ranks)."""
    problem = topology_mismatch(cfg, world)
    if problem:
        raise RuntimeError(problem)
    nodes, local = launched_nodes(world)
    if nodes > 1:
        return Topology(tuple(r // local for r in range(world)))
    return Topology.contiguous(world, cfg.nodes or 1)


def _daso_groups(
    topology: Topology, backend: str, timeout: datetime.timedelta
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """DASO's groups, built once: one per node, and one per local rank across the nodes."""
    nodes = [topology.ranks_on(n) for n in range(topology.num_nodes)]
    if len({len(r) for r in nodes}) != 1:
        raise RuntimeError(f"DASO needs the same number of ranks on every node, got {nodes}")
    per_node = len(nodes[0])
    across = [[ranks[g] for ranks in nodes] for g in range(per_node)]
    node_group, _ = dist.new_subgroups_by_enumeration(nodes, timeout=timeout, backend=backend)
    global_group, _ = dist.new_subgroups_by_enumeration(across, timeout=timeout, backend=backend)
    return node_group, global_group


def _choose_gloo_interface(master_addr: str) -> None:
    """Make gloo listen on the interface that reaches ``master_addr``.

    gloo binds to the address this host's name resolves to; where that is 127.0.0.1 (common
    on single-host images) ranks on other hosts or namespaces dial their own loopback and the
    job hangs. When the master is not local and ``GLOO_SOCKET_IFNAME`` is unset, set it to
    the interface of the route to the master.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME") or _is_loopback(master_addr):
        return
    try:
        if not _is_loopback(socket.gethostbyname(socket.gethostname())):
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


def _is_loopback(addr: str) -> bool:
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


def shutdown(ctx: Context | None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _job_store(cfg: RunConfig) -> dist.Store:
    """A client of torchrun's store (on MASTER_ADDR:MASTER_PORT), under a per-run prefix."""
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=cfg.comm_timeout_s),
        wait_for_workers=False,
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return dist.PrefixStore(f"{STORE_PREFIX}/{run_id}/", client)


def _configure_logging(rank: int, role: str) -> None:
    logging.basicConfig(
        level=os.environ.get("CLOUDBURST_LOG_LEVEL", "INFO"),
        format=f"[%(asctime)s rank{rank} {role}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


# ---------------------------------------------------------------------------- liveness
class Heartbeat:
    """A worker's liveness signal: a counter in the job store, bumped from a daemon thread."""

    def __init__(self, store: dist.Store, rank: int, interval_s: float):
        self._store, self._key, self._interval_s = store, f"hb/{rank}", interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cloudburst-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._store.add(self._key, 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s * 2)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._store.add(self._key, 1)
            except Exception as e:  # the store's host went away: the job is over
                log.warning("heartbeat stopped: %s", e)
                return


class LivenessMonitor:
    """Decides which workers are dead: their heartbeat counter stopped moving for too long."""

    def __init__(self, store: dist.Store, ranks: list[int], timeout_s: float):
        self._store, self._timeout_s = store, timeout_s
        now = time.monotonic()
        self._last = {r: (-1, now) for r in ranks}

    def dead(self, ranks: set[int] | list[int]) -> set[int]:
        now = time.monotonic()
        dead = set()
        for r in ranks:
            value = self._store.add(f"hb/{r}", 0)
            last_value, since = self._last[r]
            if value != last_value:
                self._last[r] = (value, now)
            elif now - since > self._timeout_s:
                dead.add(r)
        return dead


# ---------------------------------------------------------------------------- local launch
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class AgentSpec:
    nnodes: int
    node_rank: int
    nproc: int


def agent_layout(world_size: int, agent_per_rank: bool) -> list[AgentSpec]:
    """One agent for all ranks, or one agent per rank (so that a rank may die alone)."""
    if agent_per_rank:
        return [AgentSpec(world_size, i, 1) for i in range(world_size)]
    return [AgentSpec(1, 0, world_size)]


def start_local_job(
    cfg: RunConfig, entrypoint, agent_per_rank: bool, port: int | None = None
) -> list[mp.Process]:
    """Start the agents of a local job (127.0.0.1) as child processes; returns them."""
    port = port or free_port()
    run_id = uuid.uuid4().hex[:12]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["CLOUDBURST_LOCAL_JOB"] = "1"
    # Agents are forked (they inherit the imported torch instead of importing it again: about
    # 2 s of CPU per process, which on a 2-core machine dominates the start of a small job).
    # Their ranks come from one forkserver started here, which imports the training code once.
    if not torch.cuda.is_initialized():
        start_forkserver(entrypoint.__module__)
    ctx = mp.get_context("fork")
    procs = []
    for spec in agent_layout(cfg.world_size, agent_per_rank):
        p = ctx.Process(
            target=_run_agent,
            args=(cfg.to_dict(), spec, port, run_id, entrypoint),
            name=f"cloudburst-agent{spec.node_rank}",
        )
        p.start()
        procs.append(p)
    return procs


def start_forkserver(module: str = "cloudburst.train") -> None:
    """Start (once) the forkserver that local jobs' ranks are forked from, preloading
    ``module``; the CLI calls this early so that the server's imports overlap its checks."""
    mp.set_forkserver_preload([module, "torch.distributed.elastic.multiprocessing"])
    forkserver.ensure_running()


def _adopt_forkserver() -> None:
    """Let this forked agent start its ranks from the launcher's forkserver.

    multiprocessing checks that its forkserver is alive with ``waitpid``, which only the process
    that started it may call; a forked child has the server's address and its "alive" pipe, so
    it can use the server, it just cannot wait on it.
    """
    server = forkserver._forkserver
    if server._forkserver_pid is None:
        return
    try:
        os.waitpid(server._forkserver_pid, os.WNOHANG)
    except ChildProcessError:  # not ours: keep using it, without the liveness check
        server.ensure_running = resource_tracker.ensure_running


def _run_agent(cfg_dict: dict, spec: AgentSpec, port: int, run_id: str, entrypoint) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent's own error dump repeats the rank's traceback; the rank's log file has it.
    log_dir = Path(cfg_dict["out"]) / "logs" / f"agent{spec.node_rank}"
    log_dir.mkdir(parents=True, exist_ok=True)
    # The agent's own messages (and its dump of a failed rank's traceback) go to its log file;
    # the terminal gets one line per failed rank.
    terminal = os.fdopen(os.dup(2), "w")
    agent_log = open(log_dir / "agent.log", "a")
    os.dup2(agent_log.fileno(), 1)
    os.dup2(agent_log.fileno(), 2)
    # Ranks start from a forkserver that has imported the training code once: a plain fork
    # of this agent (which runs threads: its store and monitor) occasionally left a rank
    # stuck on a lock another thread held at fork time, and a CUDA context cannot cross a
    # fork at all. The server is single-threaded, and ranks still skip the torch import.
    start_method = "spawn" if torch.cuda.is_initialized() else "forkserver"
    if start_method == "forkserver":
        _adopt_forkserver()
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=run_id,
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": spec.node_rank, "timeout": 120},
        max_restarts=0,
        start_method=start_method,
        monitor_interval=0.1,
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
    )
    try:
        elastic_launch(config, entrypoint)(cfg_dict)
    except ChildFailedError as e:
        for global_rank, failure in e.failures.items():
            print(
                f"cloudburst: rank {global_rank} failed (exit code {failure.exitcode}); "
                f"see {log_dir}",
                file=terminal,
                flush=True,
            )
        raise SystemExit(1) from None
