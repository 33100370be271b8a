"""A rank's device and backend, and the network interface gloo listens on."""

from __future__ import annotations

import logging
import os
import socket

import torch

from cloudburst.config import RunConfig

log = logging.getLogger(__name__)


def choose_gloo_interface(master_addr: str) -> None:
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
    return cfg.model.device == "cuda" or (cfg.model.device == "auto" and torch.cuda.is_available())


def _workers_on_this_node(cfg: RunConfig) -> int:
    # Our own local launcher puts every rank on this machine (one agent per rank for asgd,
    # so LOCAL_WORLD_SIZE would say 1); under torchrun, the ranks of this node.
    if "CLOUDBURST_LOCAL_JOB" in os.environ:
        return cfg.job.workers
    return min(cfg.job.workers, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def select_device(cfg: RunConfig, rank: int) -> torch.device:
    """A worker's device: its own GPU when there are enough, else GPUs shared round-robin."""
    if rank < cfg.job.servers or not cuda_wanted(cfg):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for, but torch sees no CUDA device here")
    count = torch.cuda.device_count()
    if "CLOUDBURST_LOCAL_JOB" in os.environ:
        index = (rank - cfg.job.servers) % count
    else:
        index = int(os.environ.get("LOCAL_RANK", "0")) % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def select_backend(cfg: RunConfig) -> str:
    """The workers' collective backend (the same answer on every rank of a homogeneous job)."""
    if not cuda_wanted(cfg):
        return "gloo"
    own_gpu = torch.cuda.device_count() >= _workers_on_this_node(cfg)
    if cfg.model.backend == "nccl":
        if not own_gpu:
            raise RuntimeError(
                f"backend: nccl needs one GPU per worker on a node; this node has "
                f"{torch.cuda.device_count()} for {_workers_on_this_node(cfg)} workers "
                "(NCCL cannot run two ranks on one GPU); use --backend gloo"
            )
        return "nccl"
    if cfg.model.backend == "gloo":
        return "gloo"
    return "nccl" if own_gpu and cfg.job.workers > 1 else "gloo"
