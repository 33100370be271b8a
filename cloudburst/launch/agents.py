"""The local job's torch elastic agents: their layout (one for all ranks, or one per rank),
the store this process serves them through a static rendezvous on 127.0.0.1, and each agent's
life in its child process.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import multiprocessing as mp
import os
import signal
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from cloudburst.config import RunConfig
from cloudburst.forkserver import (
    adopt_forkserver,
    die_with_parent,
    raise_open_files_limit,
    start_forkserver,
)
from cloudburst.launch.failures import log_exception_line
from cloudburst.records.rundir import open_append_nofollow
from cloudburst.runtime.devices import is_loopback

log = logging.getLogger(__name__)


# The listening socket of a local job's store, bound before the agents are forked and handed
# to the first agent's store (no port is chosen, released and bound again: no other process
# can take it in between).
_held_listener: socket.socket | None = None
# Set in a launcher that serves its job's store itself (inherited by its forked agents).
_store_in_launcher = False


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
    cfg: RunConfig, entrypoint, agent_per_rank: bool
) -> tuple[list[mp.Process], dist.TCPStore]:
    """Start the agents of a local job (127.0.0.1) as child processes; returns them and the
    job's store, which this process serves (keep it referenced until the job is over)."""
    global _held_listener, _store_in_launcher
    # Every agent and rank holds store connections, and each connection to the store this
    # process serves holds one of its descriptors: the hard limit, for it and its children.
    raise_open_files_limit()
    _held_listener = loopback_listener(0)
    port = _held_listener.getsockname()[1]
    _store_in_launcher = True
    run_id = uuid.uuid4().hex[:12]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["CLOUDBURST_LOCAL_JOB"] = "1"
    # torch 2.13's agents cannot restart ranks when the rendezvous store is shared with them.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Agents are forked (they inherit the imported torch instead of importing it again: about
    # 2 s of CPU per process, which on a 2-core machine dominates the start of a small job).
    # Their ranks come from one forkserver started here, which imports the training code once.
    if not torch.cuda.is_initialized():
        start_forkserver(entrypoint.__module__)
    # A new job secret, handed to each rank with its entry point (pickled through the
    # forkserver's pipe), never through the store or the environment: cloudburst.comm.auth.
    from cloudburst.comm.auth import with_job_secret

    entrypoint = with_job_secret(entrypoint)
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
    # The store is served from here, started only now: the agents were forked from a process
    # without its server thread. They connect (and retry) until it listens; the socket has
    # been listening since before they started, so no other process can take the port.
    listener, _held_listener = _held_listener, None
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        cfg.world_size,
        True,
        datetime.timedelta(seconds=max(cfg.faults.comm_timeout_s, 60)),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
    )
    return procs, store


LOCAL_RDZV_BACKEND = "cloudburst-static"


def loopback_listener(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port`` for a TCPStore server (``master_listen_fd``):
    torch's own binds every interface, and a local job must not be reachable from outside."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


def _local_rendezvous(params):
    """torch's static rendezvous, with the host's store listening on 127.0.0.1 only."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
        create_rdzv_handler,
    )

    class LoopbackStaticRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return LOCAL_RDZV_BACKEND

    base = create_rdzv_handler(params)  # validates the parameters
    handler = LoopbackStaticRendezvous(
        base.master_addr,
        base.master_port,
        base.rank,
        base.world_size,
        base.run_id,
        int(base.timeout.total_seconds()),
    )
    if _store_in_launcher:
        # The launcher holds the job's store: every agent is a client, so the death of the
        # first agent (or of rank 0) does not take the store away from the others.
        handler._store = dist.TCPStore(
            handler.master_addr,
            handler.master_port,
            handler.world_size,
            False,
            handler.timeout,
            multi_tenant=True,
        )
    elif handler.rank == 0 and is_loopback(handler.master_addr):
        global _held_listener
        held, _held_listener = _held_listener, None
        if held is not None and held.getsockname()[1] == handler.master_port:
            listener = held  # inherited from the launcher, listening since before the fork
        else:
            listener = loopback_listener(handler.master_port)
        handler._store = dist.TCPStore(
            handler.master_addr,
            handler.master_port,
            handler.world_size,
            True,
            handler.timeout,
            multi_tenant=True,
            master_listen_fd=listener.detach(),
        )
    return handler


# How long this launcher's agents wait for a rank to exit after SIGTERM before SIGKILL (torch's
# default is 30 s): a SIGSTOPped rank ignores SIGTERM, and a restart of the job waits for it.
AGENT_STOP_GRACE_S = 3


def _shorten_agent_stop_grace() -> None:
    """In this (agent) process only: torch's agent stops its ranks with a shorter grace —
    when it shuts down, and when one of its ranks failed (``ProcessContext.join`` waits 30 s
    for the others to take SIGTERM before SIGKILL)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.multiprocessing.spawn import ProcessContext

    original = LocalElasticAgent._shutdown
    if getattr(original, "_cloudburst", False):
        return
    join = ProcessContext.join

    def _join(self, timeout=None, grace_period=None):
        return join(self, timeout, AGENT_STOP_GRACE_S if grace_period is None else grace_period)

    ProcessContext.join = _join

    # torch < 2.13's ``_shutdown(death_sig)`` has no timeout (its grace is ProcessContext's,
    # shortened above); a GPU machine's own torch may be one of those.
    takes_timeout = "timeout" in inspect.signature(original).parameters

    def _shutdown(self, death_sig=signal.SIGTERM, timeout: int = AGENT_STOP_GRACE_S) -> None:
        if takes_timeout:
            original(self, death_sig, min(timeout, AGENT_STOP_GRACE_S))
        else:
            original(self, death_sig)

    _shutdown._cloudburst = True
    LocalElasticAgent._shutdown = _shutdown


def _run_agent(cfg_dict: dict, spec: AgentSpec, port: int, run_id: str, entrypoint) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Killed with the launcher, however it ends (its ranks then die with the forkserver, or
    # with this agent when it spawned them).
    launcher = mp.parent_process()
    die_with_parent(launcher.pid if launcher is not None else None)
    rendezvous_handler_registry.register(LOCAL_RDZV_BACKEND, _local_rendezvous)
    _shorten_agent_stop_grace()

    # The agent's own error dump repeats the rank's traceback; the rank's log file has it.
    log_dir = Path(cfg_dict["out"]) / "logs" / f"agent{spec.node_rank}"
    log_dir.mkdir(parents=True, exist_ok=True)
    # The agent's own messages (and its dump of a failed rank's traceback) go to its log file;
    # the terminal gets one line per failed rank.
    terminal = os.fdopen(os.dup(2), "w")
    if _held_listener is not None and (_store_in_launcher or spec.node_rank != 0):
        _held_listener.close()  # the launcher (or only the first agent) serves the store
    agent_log = open_append_nofollow(log_dir / "agent.log")
    os.dup2(agent_log.fileno(), 1)
    os.dup2(agent_log.fileno(), 2)
    # Ranks start from a forkserver that has imported the training code once: a plain fork
    # of this agent (which runs threads: its store and monitor) occasionally left a rank
    # stuck on a lock another thread held at fork time, and a CUDA context cannot cross a
    # fork at all. The server is single-threaded, and ranks still skip the torch import.
    start_method = "spawn" if torch.cuda.is_initialized() else "forkserver"
    if start_method == "forkserver":
        adopt_forkserver()
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=run_id,
        rdzv_backend=LOCAL_RDZV_BACKEND,
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": spec.node_rank, "timeout": 120},
        max_restarts=int(cfg_dict.get("max_restarts", 0)),
        start_method=start_method,
        monitor_interval=0.1,
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
    )
    try:
        elastic_launch(config, entrypoint)(cfg_dict)
    except ChildFailedError as e:
        for global_rank, failure in e.failures.items():
            error = _failure_line(failure)
            print(
                f"cloudburst: rank {global_rank} failed (exit code {failure.exitcode})"
                f"{': ' + error if error else ''}; see {log_dir}",
                file=terminal,
                flush=True,
            )
        raise SystemExit(1) from None


def _failure_line(failure) -> str | None:
    """The first line of the exception a failed rank raised (torch's ``ProcessFailure``:
    from its error file, else from the tail of its ``stderr.log``), or None (a signal)."""
    if failure.error_file_data.get("message") not in (None, "<NONE>"):
        message = failure.message  # torch's newer error files nest it: {"message": ...}
        message = message.get("message") if isinstance(message, dict) else message
        lines = str(message).strip().splitlines()
        return lines[0][:500] if lines else None
    if not failure.error_file:
        return None
    try:
        return log_exception_line(Path(failure.error_file).parent / "stderr.log")
    except OSError:
        return None
