"""Run configuration: one dataclass, validated once, before any process starts.

A bad value raises :class:`ConfigError` whose message is one line naming the field, the value
and what is allowed; the CLI prints it and exits with code 2 without launching anything.
Config files are TOML (parsed with :mod:`tomllib`, which never executes code); command-line
flags override file values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STRATEGIES = ("sync", "asgd", "daso", "local_sgd", "diloco", "easgd", "gossip")
# Names added by cloudburst.strategies.register_strategy (plug-ins, benchmark adapters).
REGISTERED_STRATEGIES: list[str] = []
SERVER_RULES = ("add", "sgd", "adagrad")
OPTIMIZERS = ("sgd", "adam")
LR_SCHEDULES = ("constant", "cosine")
MODELS = ("mlp", "cnn", "resnet20", "convnet")  # or a "package.module:function" factory
DATASETS = ("mnist1d", "synthetic", "cifar10:PATH", "imagefolder:PATH", "npz:PATH")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
AUTOCASTS = ("none", "bf16")
DOWNCASTS = ("bf16", "fp16", "none")
# Built-in datasets' default sizes; a dataset read from a path uses all of it by default.
DEFAULT_SIZES = {"mnist1d": (4000, 1000), "synthetic": (4000, 1000)}
# Strategies whose workers talk to parameter-server shards.
SERVER_STRATEGIES = ("asgd", "easgd")
GOSSIP_VARIANTS = ("pull", "push")
GOSSIP_SCHEDULES = ("random", "ring", "exponential")


class ConfigError(ValueError):
    """An invalid run configuration. ``str(err)`` is a one-line message for the user."""


@dataclass(frozen=True)
class Straggler:
    """Worker ``worker`` (0-based worker index) runs ``factor`` times slower than it would."""

    worker: int
    factor: float

    @classmethod
    def parse(cls, text: str) -> Straggler:
        try:
            worker_text, factor_text = text.split(":")
            straggler = cls(int(worker_text), float(factor_text))
        except ValueError:
            raise ConfigError(
                f"straggler: {text!r} is not WORKER:FACTOR (e.g. 3:2.0 makes worker 3 2x slower)"
            ) from None
        return straggler


@dataclass
class RunConfig:
    """Everything one training run needs. Paper symbols appear next to descriptive names."""

    strategy: str = "sync"
    workers: int = 2
    # S, parameter-server shards (asgd, easgd). None: 1 for those strategies, 0 otherwise.
    servers: int | None = None
    # GPU A-SGD: every n_fetch local steps fetch θ, every n_push steps push Δ; n_sync sets
    # both, unless one is given explicitly (None: n_sync, or 1).
    n_sync: int | None = None
    n_fetch: int | None = None
    n_push: int | None = None
    server_rule: str = "add"  # add: θ ← θ + λΔ; sgd / adagrad treat −Δ as a pseudo-gradient
    # λ for "add"; the learning rate of the server optimizer otherwise. None: 1/W.
    server_lr: float | None = None
    server_momentum: float = 0.0  # momentum of the "sgd" server rule
    max_staleness: int | None = None  # drop pushes staler than this many shard versions
    staleness_scaling: bool = False  # scale each push by 1/staleness (staleness-aware A-SGD)
    warm_start_steps: int = 0  # K: the first worker trains alone for K steps first
    init_from: str | None = None  # start every replica (and the servers) from this checkpoint

    # DASO (ALGORITHMS.md §3; Heat's DASO knobs): B = global_skip batches between global
    # syncs, waited for S = batches_to_wait batches later; blocking warm-up and cool-down.
    daso_global_skip: int = 4  # B at the start of the cycling phase (0: blocking every batch)
    daso_batches_to_wait: int = 1  # S at the start of the cycling phase
    daso_local_skip: int = 1  # L: node-local gradient all-reduce every L batches
    daso_max_global_skips: int = 8  # B after a reset
    daso_warmup_epochs: float = 4.0  # blocking global average every batch at first ...
    daso_cooldown_epochs: float = 4.0  # ... and at the end
    daso_stability_level: float = 0.05  # relative improvement that counts as "not stable"
    daso_patience: int = 2  # epochs without such improvement before B and S shrink
    daso_skip_reduction_factor: int = 2  # B and S are divided by this on a plateau
    daso_adaptive: bool = True  # False: B and S stay at their starting values
    daso_downcast: str = "bf16"  # dtype of blocking global averages: bf16, fp16, none
    daso_cycling_downcast: str = "none"  # dtype of the non-blocking syncs (Heat: fp32)
    daso_epoch_end_sync: bool = True  # Heat: a blocking average on each epoch's last batch
    daso_chunk_elements: int = 10_000_000  # global all-reduces in chunks of this many values

    # local_sgd / diloco (ALGORITHMS.md §5): average the replicas every H = period steps.
    period: int = 8
    local_sgd_warmup_steps: int = 0  # post-local SGD: average every step for this many first
    # None: 0.7 (the paper's) over an Adam inner optimizer, 0.1 over SGD — 0.7 over SGD
    # diverged (benchmarks/results/defaults.md).
    diloco_outer_lr: float | None = None
    diloco_outer_momentum: float = 0.9
    diloco_nesterov: bool = True

    # easgd (ALGORITHMS.md §4): every tau steps e = alpha (θ_i − θ̃); θ_i −= e; θ̃ += e on the
    # servers. alpha defaults to beta / W.
    easgd_tau: int = 10
    easgd_alpha: float | None = None
    easgd_beta: float = 0.9

    # gossip (ALGORITHMS.md §4): pairwise averaging with a peer every gossip_every steps.
    gossip_variant: str = "pull"  # pull: fetch a peer's θ and average; push: send ours
    gossip_schedule: str = "random"  # random peer, ring, or time-varying exponential graph
    gossip_every: int = 1
    gossip_push_sum: bool = False  # push-sum weights (Stochastic Gradient Push), push only
    consensus_every_steps: int = 50  # log the consensus distance every this many steps

    # Topology: --nodes groups one launch's ranks into N emulated nodes (torchrun's real
    # nodes otherwise); --inter-node-link delays traffic between nodes as such a link would.
    nodes: int | None = None
    inter_node_link: str | None = None  # "GBIT_PER_S[,LATENCY_MS]", e.g. "1,1"

    dataset: str = "mnist1d"  # or cifar10:PATH, imagefolder:PATH, npz:PATH (local files only)
    train_size: int | None = None  # None: 4000 for mnist1d/synthetic, all of a path dataset
    test_size: int | None = None  # None: 1000 for mnist1d/synthetic, all of a path dataset
    image_size: int = 32  # imagefolder images are resized and center-cropped to this
    augment: bool = True  # random crop (padding 4) and horizontal flip, image datasets only
    data_workers: int | None = None  # DataLoader processes per worker; None: 2 for images, else 0
    model: str = "cnn"  # mlp, cnn (1-D), resnet20, convnet (32x32 images), or pkg.module:fn
    device: str = "auto"  # workers' compute device; auto: cuda when a GPU is present
    backend: str = "auto"  # workers' collectives; auto: nccl when each worker has its own GPU
    autocast: str = "none"  # bf16: autocast the forward pass (and loss) to bfloat16
    epochs: float | None = None  # passes of each worker over its own shard
    steps: int | None = None  # local steps per worker (overrides epochs)
    batch_size: int = 64  # per worker
    optimizer: str = "sgd"  # the local (worker) optimizer
    lr: float = 0.1
    lr_schedule: str = "constant"  # or "cosine": to 0 over each worker's steps
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0

    target_accuracy: float | None = None
    stragglers: list[Straggler] = field(default_factory=list)
    min_step_time_s: float = 0.0  # emulated device: each step takes at least this long (sleep)
    eval_every_s: float = 1.0
    log_every_steps: int = 10
    tensorboard: bool = False  # also write the metrics as TensorBoard events under OUT/tensorboard
    # Workers checkpoint every this many steps, servers their shard every this many applied
    # pushes (0: off), under OUT/checkpoints.
    checkpoint_every: int = 100
    # Servers log one ``push`` metrics record every this many applied pushes (bounded files;
    # the staleness statistics in the summary count every push regardless).
    push_log_every: int = 10
    resume: bool = False  # continue from the checkpoints under OUT (``--resume OUT``)
    max_restarts: int = 0  # the launcher restarts a failed rank this many times (torchrun's)
    # Faults to inject, "kill:RANK@STEP", "stop:RANK@STEP", "nan:RANK@STEP", "slow:RANK:FACTOR"
    # (cloudburst.faults); they fire in a run's first attempt only.
    inject_fault: list[str] = field(default_factory=list)
    comm_timeout_s: float = 300.0
    heartbeat_timeout_s: float = 10.0
    out: str = "runs/latest"
    overwrite: bool = False  # write into a non-empty directory that is not a cloudburst run
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.inject_fault, str):
            self.inject_fault = [self.inject_fault]
        if self.n_sync is not None:
            _check_int("n_sync", self.n_sync, 1)
        if self.servers is None:
            self.servers = 1 if self.strategy in SERVER_STRATEGIES else 0
        default_period = self.n_sync if self.n_sync is not None else 1
        if self.n_fetch is None:
            self.n_fetch = default_period
        if self.n_push is None:
            self.n_push = default_period
        if self.diloco_outer_lr is None:
            self.diloco_outer_lr = 0.7 if self.optimizer == "adam" else 0.1
        if self.server_lr is None:
            # ALGORITHMS §2: the W workers' pushes are averaged (λ = 1/W), not summed.
            self.server_lr = (
                1.0 / self.workers if isinstance(self.workers, int) and (self.workers > 0) else 1.0
            )
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES + tuple(REGISTERED_STRATEGIES))
        _check_int("workers", self.workers, 1)
        _check_int("servers", self.servers, 0)
        if self.strategy in SERVER_STRATEGIES and self.servers < 1:
            raise ConfigError(
                f"servers: {self.servers} is not allowed for strategy {self.strategy!r}; "
                "use --servers 1 or more"
            )
        if self.strategy not in SERVER_STRATEGIES and self.servers != 0:
            raise ConfigError(
                f"servers: {self.servers} is not allowed for strategy {self.strategy!r}, "
                "which uses no parameter server; use --servers 0"
            )
        _check_int("n_fetch", self.n_fetch, 1)
        _check_int("n_push", self.n_push, 1)
        _check_choice("server_rule", self.server_rule, SERVER_RULES)
        _check_float("server_lr", self.server_lr, 0.0, None, low_open=True)
        _check_float("server_momentum", self.server_momentum, 0.0, 1.0, high_open=True)
        if self.max_staleness is not None:
            _check_int("max_staleness", self.max_staleness, 0)
        _check_int("warm_start_steps", self.warm_start_steps, 0)
        if self.warm_start_steps and self.init_from:
            raise ConfigError(
                "warm_start_steps: cannot be combined with init_from; choose one warm start"
            )
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise ConfigError(f"init_from: {self.init_from!r} is not a file")
        kind, path = self.dataset_kind_path()
        if path is not None and not Path(path).exists():
            raise ConfigError(
                f"dataset: {path!r} does not exist (datasets are read from local paths)"
            )
        if kind in DEFAULT_SIZES:
            default_train, default_test = DEFAULT_SIZES[kind]
            self.train_size = default_train if self.train_size is None else self.train_size
            self.test_size = default_test if self.test_size is None else self.test_size
        if self.train_size is not None:
            _check_int("train_size", self.train_size, max(self.workers, 10))
        if self.test_size is not None:
            _check_int("test_size", self.test_size, 10)
        _check_int("image_size", self.image_size, 8)
        if self.data_workers is not None:
            _check_int("data_workers", self.data_workers, 0)
        from cloudburst.models import is_factory_spec

        if self.model not in MODELS and not is_factory_spec(self.model):
            raise ConfigError(
                f"model: {self.model!r} is not allowed; choose one of {', '.join(MODELS)} "
                "or name a factory as package.module:function"
            )
        _check_choice("device", self.device, DEVICES)
        _check_choice("backend", self.backend, BACKENDS)
        if self.backend == "nccl" and self.device == "cpu":
            raise ConfigError("backend: 'nccl' needs --device cuda (or auto on a GPU machine)")
        _check_choice("autocast", self.autocast, AUTOCASTS)
        self._validate_topology_and_daso()
        if self.steps is None and self.epochs is None:
            self.epochs = 64.0  # MNIST-1D's CNN reaches ≥ 90 % with every strategy
        if self.steps is not None:
            _check_int("steps", self.steps, 1)
        if self.epochs is not None:
            _check_float("epochs", self.epochs, 0.0, None, low_open=True)
        _check_int("batch_size", self.batch_size, 1)
        shard = (self.train_size or 0) // self.workers
        if self.train_size is not None and self.batch_size > shard:
            raise ConfigError(
                f"batch_size: {self.batch_size} is larger than each worker's shard of "
                f"{shard} samples (train_size {self.train_size} / {self.workers} workers)"
            )
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_float("lr", self.lr, 0.0, None, low_open=True)
        _check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check_float("momentum", self.momentum, 0.0, 1.0, high_open=True)
        _check_float("weight_decay", self.weight_decay, 0.0, None)
        _check_int("seed", self.seed, 0)
        if self.target_accuracy is not None:
            _check_float("target_accuracy", self.target_accuracy, 0.0, 1.0, low_open=True)
        for s in self.stragglers:
            if not 0 <= s.worker < self.workers:
                raise ConfigError(
                    f"straggler: worker {s.worker} does not exist; allowed 0..{self.workers - 1}"
                )
            _check_float("straggler factor", s.factor, 1.0, None)
        _check_float("min_step_time_s", self.min_step_time_s, 0.0, None)
        _check_float("eval_every_s", self.eval_every_s, 0.0, None, low_open=True)
        _check_int("log_every_steps", self.log_every_steps, 1)
        _check_int("checkpoint_every", self.checkpoint_every, 0)
        _check_int("push_log_every", self.push_log_every, 1)
        _check_int("max_restarts", self.max_restarts, 0)
        if self.inject_fault:
            from cloudburst.faults import FaultError, parse_faults

            try:
                parse_faults(self.inject_fault, self.servers, self.world_size)
            except FaultError as e:
                raise ConfigError(f"inject_fault: {e}") from None
        _check_float("comm_timeout_s", self.comm_timeout_s, 0.0, None, low_open=True)
        _check_float("heartbeat_timeout_s", self.heartbeat_timeout_s, 0.0, None, low_open=True)

    def _validate_topology_and_daso(self) -> None:
        if self.nodes is not None:
            _check_int("nodes", self.nodes, 1)
            if self.nodes > self.world_size:
                raise ConfigError(
                    f"nodes: {self.nodes} is more than the job's {self.world_size} ranks"
                )
        if self.inter_node_link is not None:
            from cloudburst.comm.link import LinkSpec

            try:
                LinkSpec.parse(self.inter_node_link)
            except ValueError as e:
                raise ConfigError(f"inter_node_link: {e}") from None
        _check_int("period", self.period, 1)
        _check_int("local_sgd_warmup_steps", self.local_sgd_warmup_steps, 0)
        if self.strategy == "diloco" and self.local_sgd_warmup_steps:
            raise ConfigError(
                "local_sgd_warmup_steps: diloco has no synchronous warm-up (it is local_sgd's "
                "post-local SGD); leave it at 0"
            )
        _check_float("diloco_outer_lr", self.diloco_outer_lr, 0.0, None, low_open=True)
        _check_float("diloco_outer_momentum", self.diloco_outer_momentum, 0.0, 1.0, high_open=True)
        _check_int("easgd_tau", self.easgd_tau, 1)
        if self.easgd_alpha is not None:
            _check_float("easgd_alpha", self.easgd_alpha, 0.0, 1.0, low_open=True)
        _check_float("easgd_beta", self.easgd_beta, 0.0, None, low_open=True)
        _check_choice("gossip_variant", self.gossip_variant, GOSSIP_VARIANTS)
        _check_choice("gossip_schedule", self.gossip_schedule, GOSSIP_SCHEDULES)
        _check_int("gossip_every", self.gossip_every, 1)
        if self.gossip_push_sum and self.gossip_variant != "push":
            raise ConfigError("gossip_push_sum: push-sum weights need --gossip-variant push")
        _check_int("consensus_every_steps", self.consensus_every_steps, 1)
        if self.strategy == "gossip" and self.workers < 2:
            raise ConfigError("workers: gossip needs at least 2 workers (a peer to average with)")
        _check_int("daso_global_skip", self.daso_global_skip, 0)
        _check_int("daso_batches_to_wait", self.daso_batches_to_wait, 0)
        if self.daso_global_skip == 0 and self.daso_batches_to_wait != 0:
            raise ConfigError(
                "daso_batches_to_wait: must be 0 when daso_global_skip is 0 (blocking every batch)"
            )
        if self.daso_batches_to_wait > max(self.daso_global_skip, 1):
            raise ConfigError(
                f"daso_batches_to_wait: {self.daso_batches_to_wait} is more than "
                f"daso_global_skip {self.daso_global_skip}; a sync must be merged before the next"
            )
        _check_int("daso_local_skip", self.daso_local_skip, 1)
        _check_int("daso_max_global_skips", self.daso_max_global_skips, 1)
        _check_float("daso_warmup_epochs", self.daso_warmup_epochs, 0.0, None)
        _check_float("daso_cooldown_epochs", self.daso_cooldown_epochs, 0.0, None)
        _check_float("daso_stability_level", self.daso_stability_level, 0.0, 1.0, high_open=True)
        _check_int("daso_patience", self.daso_patience, 1)
        _check_int("daso_skip_reduction_factor", self.daso_skip_reduction_factor, 2)
        _check_choice("daso_downcast", self.daso_downcast, DOWNCASTS)
        _check_choice("daso_cycling_downcast", self.daso_cycling_downcast, DOWNCASTS)
        _check_int("daso_chunk_elements", self.daso_chunk_elements, 1)
        if self.strategy == "daso":
            nodes = self.nodes or 1
            if self.workers % nodes:
                raise ConfigError(
                    f"nodes: {self.workers} workers do not split evenly over {nodes} nodes "
                    "(DASO needs the same number of ranks on every node)"
                )

    def warnings(self) -> list[str]:
        """Valid settings that are known to train badly (printed by the CLI, one line each)."""
        out = []
        if (
            self.strategy == "asgd"
            and self.server_rule == "add"
            and self.workers >= 2
            and self.server_lr * self.workers > 1.5
        ):
            out.append(
                f"asgd: server lr λ = {self.server_lr:g} with {self.workers} workers adds up "
                f"their pushes ({self.server_lr * self.workers:g}x one worker's step) and "
                f"diverged in our measurements (benchmarks/results/defaults.md); the default "
                f"λ = 1/W = {1 / self.workers:g} averages them"
            )
        if (
            self.strategy == "diloco"
            and self.optimizer == "sgd"
            and self.diloco_outer_lr * (1 + self.diloco_outer_momentum) > 1.0
        ):
            out.append(
                f"diloco: outer lr {self.diloco_outer_lr:g} with momentum "
                f"{self.diloco_outer_momentum:g} over an SGD inner optimizer diverged in our "
                "measurements (benchmarks/results/local_sgd.md); DiLoCo's defaults assume an "
                "Adam inner optimizer (--optimizer adam), or use --diloco-outer-lr 0.1"
            )
        return out

    @property
    def shard_rule(self) -> tuple[str, float]:
        """(rule, lr) of the parameter-server shards: EASGD's elastic centre (α), or asgd's."""
        if self.strategy == "easgd":
            return "elastic", self.easgd_alpha_value
        return self.server_rule, self.server_lr

    @property
    def easgd_alpha_value(self) -> float:
        """α of EASGD: as given, else β / W."""
        return self.easgd_alpha if self.easgd_alpha is not None else self.easgd_beta / self.workers

    # ------------------------------------------------------------------ derived values
    @property
    def world_size(self) -> int:
        return self.workers + self.servers

    def straggler_factor(self, worker: int) -> float:
        factors = [s.factor for s in self.stragglers if s.worker == worker]
        return factors[-1] if factors else 1.0

    def dataset_kind_path(self) -> tuple[str, str | None]:
        """("mnist1d", None) or ("cifar10", "/path"): the dataset spec, checked."""
        from cloudburst.datasets import DatasetError, parse_dataset_spec

        try:
            return parse_dataset_spec(self.dataset)
        except DatasetError as e:
            raise ConfigError(field_message("dataset", e)) from None

    def steps_per_worker(self, train_size: int | None = None) -> int:
        """Local steps each worker takes: ``steps``, or ``epochs`` passes over its shard.

        ``train_size`` is the loaded dataset's size when the config leaves it open (a
        dataset read from a path); without either, an epoch count cannot be turned into steps.
        """
        if self.steps is not None:
            return self.steps
        size = self.train_size if train_size is None else train_size
        if size is None:
            raise ValueError("steps_per_worker: the dataset's size is not known yet")
        per_epoch = (size // self.workers) // self.batch_size
        return max(1, math.ceil(float(self.epochs) * per_epoch))

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stragglers"] = [f"{s.worker}:{s.factor}" for s in self.stragglers]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        values = dict(values)
        # Flags and TOML may spell names with dashes.
        values = {k.replace("-", "_"): v for k, v in values.items()}
        if "straggler" in values:
            values["stragglers"] = values.pop("straggler")
        unknown = sorted(set(values) - known)
        if unknown:
            import difflib

            near = difflib.get_close_matches(unknown[0], sorted(known | {"straggler"}), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else " (see cloudburst train --help)"
            raise ConfigError(f"config: unknown field {unknown[0]!r}{hint}")
        raw_stragglers = values.get("stragglers") or []
        if isinstance(raw_stragglers, str):
            raw_stragglers = [raw_stragglers]
        values["stragglers"] = [
            s if isinstance(s, Straggler) else Straggler.parse(str(s)) for s in raw_stragglers
        ]
        for f in dataclasses.fields(cls):
            if f.name in values and f.name != "stragglers":
                values[f.name] = _coerce(f.name, f.type, values[f.name])
        return cls(**values)

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
        return cls.from_dict({**load_toml(path), **(overrides or {})})


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file; a ``[train]`` table is accepted as well as top-level keys."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config: file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config: {str(p)!r} is not valid TOML ({e})") from None
    if "train" in data and isinstance(data["train"], dict):
        data = {**{k: v for k, v in data.items() if k != "train"}, **data["train"]}
    return data


def _coerce(name: str, type_text: Any, value: Any) -> Any:
    """Convert TOML/CLI values to the annotated type, with a one-line error on mismatch."""
    text = str(type_text)
    if value is None:
        if "None" in text:
            return None
        raise ConfigError(f"{name}: a value is required")
    try:
        if text.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if text.startswith("float"):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if text == "bool":
            if isinstance(value, str):
                if value.lower() in ("true", "1", "yes"):
                    return True
                if value.lower() in ("false", "0", "no"):
                    return False
                raise ValueError
            if not isinstance(value, bool):
                raise ValueError
            return value
        if text.startswith("str"):
            if not isinstance(value, str):
                raise ValueError
            return value
        if text == "list[str]":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError
            return list(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name}: {value!r} is not a valid {text.replace(' | None', '')}"
        ) from None
    return value


def field_message(field_name: str, err: Exception) -> str:
    """``field: message`` unless the message already starts with the field's name."""
    text = str(err)
    return text if text.startswith(field_name) else f"{field_name}: {text}"


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: {value!r} is not allowed; choose one of {', '.join(allowed)}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}: {value!r} is not allowed; use an integer >= {minimum}")


def _check_float(
    name: str,
    value: Any,
    low: float | None,
    high: float | None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        rng = " and ".join(x for x in (lo, hi) if x)
        raise ConfigError(f"{name}: {value!r} is not allowed; use a number {rng}")


def refuse_code_from_file(
    values: dict[str, Any], flags: dict[str, Any], source: str, trust: bool
) -> None:
    """Code runs only when the user names it on the command line: a model factory
    (``package.module:function``) read from a file is refused unless ``--trust-config`` is
    given or ``--model`` repeats the same value. Checked before anything is imported."""
    from cloudburst.models import is_factory_spec

    model = values.get("model")
    if not isinstance(model, str) or not is_factory_spec(model) or trust:
        return
    if flags.get("model") == model:
        return
    raise ConfigError(
        f"model: {source} names the factory {model!r}, which would import and run that code; "
        f"pass --model {model} (or --trust-config) if you mean to run it"
    )
