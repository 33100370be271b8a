"""Worker checkpoints: what a worker saves, where, and which one a resumed run starts from.

Every ``checkpoint_every`` steps each worker writes ``OUT/checkpoints/worker{i}-step{S}.pt``
(atomically, with a checksum: :mod:`cloudburst.checkpoint`) holding everything its future
depends on: the replica, the optimizer and learning-rate schedule, the strategy's state (DASO's
schedule, DiLoCo's outer optimizer, gossip's rounds and push-sum weight, ...), the data
stream's position, the RNG state, the counters and the evaluations so far. The last
``KEEP`` files of each worker are kept, so a worker killed while writing still has the one
before. Parameter-server shards checkpoint themselves (``server{k}.pt``, cloudburst.server).

A run resumes (``--resume OUT``, or by itself after a restart under ``--max-restarts``) from:

- *lockstep* strategies (sync, daso, local_sgd, diloco: the replicas move together): the
  latest step for which **every** worker has a valid checkpoint, agreed through the job store;
- the others (asgd, easgd, gossip): each worker's own latest valid checkpoint.

A checkpoint written by a different run (strategy, worker count, model, dataset, seed, batch
size) is refused with one line; a corrupt or truncated one is refused by the CLI before
launch, and skipped (with a warning) by a rank that is restarting on its own.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from cloudburst.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from cloudburst.config import RunConfig
from cloudburst.rundir import run_nonce
from cloudburst.shard import shard_checkpoint_path

log = logging.getLogger(__name__)

KEEP = 2
KIND = "worker-state"
_NAME = re.compile(r"^worker(\d+)-step(\d+)\.pt$")
# The settings a checkpoint must agree with to be resumed by this run.
IDENTITY = ("strategy", "workers", "servers", "model", "dataset", "seed", "batch_size")


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def worker_checkpoint_path(out: str | Path, worker: int, step: int) -> Path:
    return checkpoint_dir(out) / f"worker{worker}-step{step:08d}.pt"


def identity(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint must agree with: the settings above and the run directory's random
    identity (``run``, from its marker; None where the directory has none)."""
    return {**{k: getattr(cfg, k) for k in IDENTITY}, "run": run_nonce(cfg.out)}


def check_identity(path: Path, saved: dict[str, Any], cfg: RunConfig) -> None:
    if not isinstance(saved, dict) or not saved:
        raise CheckpointError(f"checkpoint {str(path)!r} carries no run identity (foreign)")
    for key, value in identity(cfg).items():
        if key == "run" and (value is None or saved.get(key) is None):
            continue  # a directory without a marker (another node of a torchrun job)
        if saved.get(key) != value:
            raise CheckpointError(
                f"checkpoint {str(path)!r} belongs to another run: its {key} is "
                f"{saved.get(key)!r}, this run's is {value!r}"
            )


def worker_steps(out: str | Path, worker: int) -> list[int]:
    """Steps with a checkpoint file of ``worker``, ascending (files not yet validated)."""
    steps = []
    for p in checkpoint_dir(out).glob(f"worker{worker}-step*.pt"):
        m = _NAME.match(p.name)
        if m and int(m.group(1)) == worker:
            steps.append(int(m.group(2)))
    return sorted(steps)


def load_worker_state(cfg: RunConfig, worker: int, step: int) -> dict[str, Any]:
    path = worker_checkpoint_path(cfg.out, worker, step)
    state = load_checkpoint(path, KIND)
    check_identity(path, state.get("identity", {}), cfg)
    if int(state.get("step", -1)) != step:
        raise CheckpointError(f"checkpoint {str(path)!r} holds step {state.get('step')}")
    return state


def valid_steps(cfg: RunConfig, worker: int, strict: bool) -> list[int]:
    """The steps of ``worker``'s checkpoints that load and belong to this run.

    ``strict``: raise on the first bad file (the CLI's check before launch) instead of
    skipping it with a warning (a rank restarting on its own).
    """
    good = []
    for step in worker_steps(cfg.out, worker):
        try:
            load_worker_state(cfg, worker, step)
        except CheckpointError as e:
            if strict:
                raise
            log.warning("skipping checkpoint: %s", e)
            continue
        good.append(step)
    return good


def save_worker_state(cfg: RunConfig, worker: int, step: int, state: dict[str, Any]) -> Path:
    path = worker_checkpoint_path(cfg.out, worker, step)
    save_checkpoint(path, KIND, {"identity": identity(cfg), "step": step, **state})
    for old in worker_steps(cfg.out, worker)[:-KEEP]:
        worker_checkpoint_path(cfg.out, worker, old).unlink(missing_ok=True)
    return path


def clear_worker_checkpoints(out: str | Path, worker: int) -> None:
    """Remove ``worker``'s checkpoints: a new run in a used directory must not resume (after
    a restart) from an earlier run's files. Each worker removes only its own."""
    for step in worker_steps(out, worker):
        worker_checkpoint_path(out, worker, step).unlink(missing_ok=True)


def agree_on_step(store, worker: int, workers: int, steps: list[int], timeout_s: float) -> int:
    """Lockstep strategies: the latest step every worker can resume from (0: none).

    Each worker publishes its valid steps in the job store and reads everyone's.
    """
    import datetime

    store.set(f"resume/steps/{worker}", json.dumps(steps))
    keys = [f"resume/steps/{w}" for w in range(workers)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    common = set(steps)
    for key in keys:
        common &= set(json.loads(store.get(key)))
    return max(common, default=0)


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def load_shard_state(path: Path, cfg: RunConfig) -> dict[str, Any]:
    """A server shard's checkpoint, refused unless it belongs to this run."""
    state = load_checkpoint(path, "server-shard")
    check_identity(path, state.get("identity", {}), cfg)
    return state


def check_resumable(cfg: RunConfig) -> str:
    """The CLI's check before ``--resume``: every checkpoint loads and belongs to this run.

    Returns a one-line description of what will be resumed; raises :class:`CheckpointError`.
    """
    from cloudburst.strategies import STRATEGY_CLASSES

    found = {w: valid_steps(cfg, w, strict=True) for w in range(cfg.workers)}
    shards = [shard_checkpoint_path(cfg.out, k) for k in range(cfg.servers)]
    for path in shards:
        if path.is_file():
            load_shard_state(path, cfg)
    if not any(found.values()) and not any(p.is_file() for p in shards):
        raise CheckpointError(f"no checkpoints under {str(checkpoint_dir(cfg.out))!r} to resume")
    if STRATEGY_CLASSES[cfg.strategy].lockstep:
        common = set.intersection(*(set(s) for s in found.values()))
        return f"resuming every worker from step {max(common, default=0)}"
    latest = {w: (s[-1] if s else 0) for w, s in found.items()}
    return "resuming workers from steps " + ", ".join(f"{w}:{s}" for w, s in latest.items())
