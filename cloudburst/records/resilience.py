"""Worker checkpoints: what a worker saves, where, and which one a resumed run starts from.

Every ``checkpoint_every`` steps each worker writes ``OUT/checkpoints/worker{i}-step{S}.pt``
(atomically, with a checksum: :mod:`cloudburst.records.checkpoint`) holding everything its future
depends on: the replica, the optimizer and learning-rate schedule, the strategy's state (DASO's
schedule, DiLoCo's outer optimizer, gossip's rounds and push-sum weight, ...), the data
stream's position, the RNG state, the counters and the evaluations so far. The last
``KEEP`` files of each worker are kept, so a worker killed while writing still has the one
before. Parameter-server shards checkpoint themselves (``server{k}.pt``,
cloudburst.strategies.asgd.server).

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

from cloudburst.config import ConfigError, RunConfig, refuse_code_from_file
from cloudburst.records.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from cloudburst.records.rundir import run_nonce
from cloudburst.runtime import restart_count

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
    return {**{k: cfg.get(k) for k in IDENTITY}, "run": run_nonce(cfg.output.out)}


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
    path = worker_checkpoint_path(cfg.output.out, worker, step)
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
    for step in worker_steps(cfg.output.out, worker):
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
    path = worker_checkpoint_path(cfg.output.out, worker, step)
    save_checkpoint(path, KIND, {"identity": identity(cfg), "step": step, **state})
    for old in worker_steps(cfg.output.out, worker)[:-KEEP]:
        worker_checkpoint_path(cfg.output.out, worker, old).unlink(missing_ok=True)
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
    found = {w: valid_steps(cfg, w, strict=True) for w in range(cfg.job.workers)}
    shards = [shard_checkpoint_path(cfg.output.out, k) for k in range(cfg.job.servers)]
    for path in shards:
        if path.is_file():
            load_shard_state(path, cfg)
    if not any(found.values()) and not any(p.is_file() for p in shards):
        raise CheckpointError(
            f"no checkpoints under {str(checkpoint_dir(cfg.output.out))!r} to resume"
        )
    if cfg.strategy_spec.lockstep or cfg.cluster.replica == "node":
        common = set.intersection(*(set(s) for s in found.values()))
        return f"resuming every worker from step {max(common, default=0)}"
    latest = {w: (s[-1] if s else 0) for w, s in found.items()}
    return "resuming workers from steps " + ", ".join(f"{w}:{s}" for w, s in latest.items())


def resume_worker(ctx, model, optimizer, scheduler, strategy, stream, evaluator):
    """Restore this worker from its checkpoint when the run resumes or was restarted.

    Returns the checkpoint's counters (``step``, ``samples``, ``skipped``, ``elapsed_s``), or
    None when there is nothing to resume (a first attempt, or a restart before the first
    checkpoint: the run starts over).
    """
    cfg = ctx.cfg
    if not (cfg.faults.resume or restart_count() > 0):
        clear_worker_checkpoints(cfg.output.out, ctx.worker_index)  # a new run: none of its own yet
        return None
    # The CLI validated every file before a --resume; a rank restarting by itself skips bad
    # ones (e.g. the one its predecessor was writing when it died).
    steps = valid_steps(cfg, ctx.worker_index, strict=False)
    if strategy.lockstep or cfg.cluster.replica == "node":  # a node's workers move together
        step = agree_on_step(
            ctx.store, ctx.worker_index, cfg.job.workers, steps, cfg.faults.comm_timeout_s
        )
    else:
        step = steps[-1] if steps else 0
    if step == 0:
        log.warning("no checkpoint to resume from: starting from step 0")
        return None
    state = load_worker_state(cfg, ctx.worker_index, step)
    model.load_state_dict({k: v.to(ctx.device) for k, v in state["model"].items()})
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    strategy.load_state_dict(state["strategy"])
    stream.load_state_dict(state["stream"])
    set_rng_state(state["rng"], ctx.device)
    if evaluator is not None:
        evaluator.history = [list(e) for e in state["evals"]]
    log.info(
        "resumed from step %d (%s)",
        step,
        worker_checkpoint_path(cfg.output.out, ctx.worker_index, step),
    )
    return {
        "step": step,
        "samples": int(state["samples"]),
        "skipped": int(state["skipped"]),
        "elapsed_s": float(state["elapsed_s"]),
    }


def capture_worker_state(
    ctx, samples, skipped, model, optimizer, scheduler, strategy, stream, evaluator
) -> dict[str, Any]:
    """Everything a worker checkpoint holds (what :func:`resume_worker` restores)."""
    return {
        "samples": samples,
        "skipped": skipped,
        "elapsed_s": ctx.elapsed_s(),
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "strategy": strategy.state_dict(),
        "stream": stream.state_dict(),
        "rng": rng_state(ctx.device),
        "evals": evaluator.history if evaluator else [],
    }


def resume_config(
    run_dir: str, flags: dict[str, Any], has_toml: bool, trust: bool = False
) -> RunConfig:
    """The config of the run in ``run_dir``, with ``flags`` applied, set to resume it."""
    import json
    from pathlib import Path

    from cloudburst.records.resilience import IDENTITY

    if has_toml:
        raise ConfigError(
            "resume: a resumed run takes its settings from DIR/config.json, not --config"
        )
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"resume: {str(path)!r} does not exist (not a cloudburst run directory)")
    try:
        values = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"resume: {str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"resume: {str(path)!r} does not hold a config")
    refuse_code_from_file(values, flags, f"--resume {run_dir} (its config.json)", trust)
    base = RunConfig.from_dict(values)
    for key in IDENTITY:
        if key in flags and flags[key] != base.get(key):
            raise ConfigError(
                f"resume: {key} cannot change when resuming ({base.get(key)!r} in "
                f"{str(path)!r}); start a new run instead"
            )
    if "out" in flags and Path(flags["out"]).resolve() != Path(run_dir).resolve():
        raise ConfigError("resume: a resumed run writes to its own directory; drop --out")
    return RunConfig.from_dict({**values, **flags, "out": str(run_dir), "resume": True})


def shard_checkpoint_path(out: str | Path, shard: int) -> Path:
    """Where parameter-server shard ``shard`` of the run under ``out`` keeps its checkpoint."""
    return Path(out) / "checkpoints" / f"server{shard}.pt"
