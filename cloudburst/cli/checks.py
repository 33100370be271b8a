"""Checks before anything is launched that need more than the config itself: the dataset is
read, the model is built for it and run on two samples, devices and backends exist, an
``--init-from`` checkpoint fits, a ``--resume`` directory's checkpoints load, and a local job's
ranks fit this machine (:func:`check_local_job_fits`: processes, memory, descriptors). Each
failure is a :class:`~cloudburst.config.ConfigError`: one line, exit code 2, nothing started.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

from cloudburst.config import ConfigError, RunConfig, field_message

# What one local rank costs, measured on a CPU-only job of the smallest models (asgd, W = 4,
# S = 1, MNIST-1D's CNN): a worker rank has 9 threads, 35 descriptors and about 30 MB of
# private memory (75 MB proportional), its agent 1 thread, about 20 descriptors and 47 MB;
# the launcher holds about 9 descriptors per rank (56 for 6 ranks). Rounded up: a rank with its
# agent is 12 tasks (processes and threads count alike against RLIMIT_NPROC) and 128 MiB, a
# bigger model or dataset more. A process's descriptors grow with the ranks it talks to
# (gloo connects every pair), so one process of a job of N ranks needs about 64 + 10·N.
TASKS_PER_RANK = 12
TASKS_PER_DATA_WORKER = 4  # a DataLoader process and its threads
MEMORY_PER_RANK_BYTES = 128 * 2**20
MEMORY_PER_DATA_WORKER_BYTES = 64 * 2**20
FDS_BASE, FDS_PER_RANK = 64, 10
ALLOW_LARGE_JOB = "--allow-large-job"


def preflight(cfg: RunConfig) -> None:
    """Checks that need more than the config itself, done before anything is launched.

    The dataset is read (a missing or malformed one fails here, in one line), the model is
    built for it (a bad factory or a model that does not fit the data fails here) and an
    ``init_from`` checkpoint is loaded into it.
    """
    from cloudburst.data import load_run_dataset
    from cloudburst.data.datasets import DatasetError
    from cloudburst.models import ModelError, build_run_model
    from cloudburst.records.checkpoint import CheckpointError, load_model_into
    from cloudburst.runtime import in_torchrun

    if cfg.model.device == "cuda" and not _cuda_available():
        raise ConfigError("device: cuda was asked for, but torch sees no CUDA device here")
    if cfg.model.backend == "nccl" and not in_torchrun() and _cuda_available():
        import torch

        if torch.cuda.device_count() < cfg.job.workers:
            raise ConfigError(
                f"backend: nccl needs one GPU per worker; this machine has "
                f"{torch.cuda.device_count()} for {cfg.job.workers} workers (NCCL cannot run two "
                "ranks on one GPU); use --backend gloo or auto"
            )
    if cfg.metrics.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "tensorboard: the tensorboard package is not installed "
                "(pip install 'cloudburst[tensorboard]')"
            ) from None
    try:
        data = load_run_dataset(cfg)
    except DatasetError as e:
        raise ConfigError(field_message("dataset", e)) from None
    if cfg.data.train_size is None:
        shard = len(data.train) // cfg.job.workers
        if cfg.training.batch_size > shard:
            raise ConfigError(
                f"batch_size: {cfg.training.batch_size} is larger than each worker's shard of "
                f"{shard} samples ({len(data.train)} training samples / {cfg.job.workers} workers)"
            )
    try:
        model = build_run_model(cfg, data)
    except ModelError as e:
        raise ConfigError(field_message("model", e)) from None
    _check_forward(cfg, model, data)
    if cfg.training.init_from:
        try:
            load_model_into(cfg.training.init_from, model)
        except CheckpointError as e:
            raise ConfigError(f"init_from: {e}") from None
    if cfg.faults.resume:
        from cloudburst.records.resilience import check_resumable

        try:
            what = check_resumable(cfg)
        except CheckpointError as e:
            raise ConfigError(f"resume: {e}") from None
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"cloudburst: {what}", file=sys.stderr)


def _check_forward(cfg: RunConfig, model, data) -> None:
    """One forward pass on two test samples: the model must take this data's input."""
    import torch

    from cloudburst.data import in_memory

    x, _ = in_memory(data.test).get_batch(torch.arange(min(2, len(data.test))))
    pre = data.preprocess(augment=False)
    if pre is not None:
        x = pre(x)
    try:
        with torch.no_grad():
            out = model.eval()(x)
    except Exception as e:  # noqa: BLE001 - any failure means "does not fit"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"model: {cfg.model.model!r} fails on this dataset's input of shape "
            f"{tuple(x.shape[1:])}: {first[:200]}"
        ) from None
    # A language model (text datasets) predicts every position: [B, T, vocabulary].
    lm = getattr(data, "is_lm", False)
    expected = (*x.shape, data.num_classes) if lm else (x.shape[0], data.num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model: {cfg.model.model!r} returns {shape} for a batch of {x.shape[0]}; this dataset "
            f"needs logits of shape {expected}"
        )


def _cuda_available() -> bool:
    import os

    # NVML's answer does not initialise CUDA in this process, which forks the job's ranks.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------- capacity
@dataclass(frozen=True)
class Capacity:
    """What this machine offers one more local job (None: no limit found).

    ``tasks``: processes and threads this user may still start (the least of RLIMIT_NPROC and
    the kernel's threads-max and pid_max, less the tasks running now, and of the cgroup's
    pids.max less pids.current); ``memory_bytes``: memory
    available (MemAvailable, within the cgroup's limit); ``fds``: the descriptors one process
    may hold (RLIMIT_NOFILE's hard limit: the launcher raises its soft limit to it).
    """

    tasks: int | None
    memory_bytes: int | None
    fds: int | None


def machine_capacity() -> Capacity:
    """This machine's :class:`Capacity`, read from ``resource`` and ``/proc`` (Linux; None
    for what cannot be read)."""
    limits = []
    nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if nproc != resource.RLIM_INFINITY:
        limits.append(nproc)
    for name in ("threads-max", "pid_max"):
        value = _read_int(Path("/proc/sys/kernel") / name)
        if value is not None:
            limits.append(value)
    running = None
    try:  # /proc/loadavg's 4th field: running/total scheduling entities (threads) right now
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        pass
    tasks = None if not limits else max(0, min(limits) - (running or 0))
    # A container's cgroup (v2) may allow fewer tasks: pids.max ("max": none) less pids.current.
    pids_max = _read_int(Path("/sys/fs/cgroup/pids.max"))
    pids_now = _read_int(Path("/sys/fs/cgroup/pids.current"))
    if pids_max is not None and pids_now is not None:
        room = max(0, pids_max - pids_now)
        tasks = room if tasks is None else min(tasks, room)
    _, nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds = None if nofile == resource.RLIM_INFINITY else nofile
    return Capacity(tasks, _available_memory(), fds)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None


def _available_memory() -> int | None:
    """MemAvailable, or less where this process's cgroup (v2, else v1) allows less."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(Path(limit_file)), _read_int(Path(usage_file))
        if limit is not None and usage is not None and limit < 2**60:  # "max": no limit
            room = max(0, limit - usage)
            available = room if available is None else min(available, room)
            break
    return available


def local_job_needs(cfg: RunConfig) -> Capacity:
    """About what ``cfg`` needs as a local job: every rank on this machine, each with its
    agent and its DataLoader processes (:data:`TASKS_PER_RANK` and the other estimates)."""
    ranks = cfg.world_size
    kind = cfg.dataset_kind_path()[0]
    loaders = (
        cfg.data.workers
        if cfg.data.workers is not None
        else (2 if kind in ("cifar10", "imagefolder") else 0)
    )
    loader_procs = loaders * cfg.job.workers
    return Capacity(
        tasks=ranks * TASKS_PER_RANK + loader_procs * TASKS_PER_DATA_WORKER,
        memory_bytes=ranks * MEMORY_PER_RANK_BYTES + loader_procs * MEMORY_PER_DATA_WORKER_BYTES,
        fds=FDS_BASE + FDS_PER_RANK * ranks,
    )


def check_local_job_fits(cfg: RunConfig, capacity: Capacity | None = None) -> None:
    """Refuse a local job (``cloudburst train`` outside torchrun) whose ranks this machine
    cannot hold, before anything is forked: one line naming the limit, the job's need and
    the override (``--allow-large-job``, for a machine the estimate is wrong about)."""
    have = machine_capacity() if capacity is None else capacity
    need = local_job_needs(cfg)
    ranks = f"a local job of {cfg.world_size} ranks"
    fix = (
        f"use fewer --workers, run it under torchrun on several machines, or pass "
        f"{ALLOW_LARGE_JOB} to launch it anyway"
    )
    if have.tasks is not None and need.tasks > have.tasks:
        raise ConfigError(
            f"workers: {ranks} needs about {need.tasks} processes and threads "
            f"({TASKS_PER_RANK} a rank); this user may start {have.tasks} more here "
            f"(RLIMIT_NPROC, the kernel's threads-max and pid_max, the cgroup's pids.max); {fix}"
        )
    if have.memory_bytes is not None and need.memory_bytes > have.memory_bytes:
        raise ConfigError(
            f"workers: {ranks} needs about {_gib(need.memory_bytes)} of memory "
            f"({MEMORY_PER_RANK_BYTES // 2**20} MiB a rank); {_gib(have.memory_bytes)} is "
            f"available here; {fix}"
        )
    if have.fds is not None and need.fds > have.fds:
        raise ConfigError(
            f"workers: {ranks} needs about {need.fds} open files in one process "
            f"({FDS_PER_RANK} a rank); RLIMIT_NOFILE's hard limit here is {have.fds} "
            f"(ulimit -Hn); {fix}"
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"
