"""Run configuration: one small dataclass per concern, composed into :class:`RunConfig`,
validated once, before any process starts.

Each concern (the job, A-SGD's parameter server, DASO, the data, faults, ...) is a dataclass
whose fields carry their help in ``field(metadata=...)`` (written with :func:`option`) and whose
``_validate_<concern>`` sits next to them. ``cloudburst train``'s flags are generated from these
fields (:mod:`cloudburst.cli`), so a new setting is one field (and its check). :class:`RunConfig`
inherits every concern: its attributes stay flat (``cfg.daso_global_skip``, ``cfg.lr``), and so
do :meth:`RunConfig.to_dict` and a run's config.json.

A bad value raises :class:`ConfigError` whose message is one line naming the field, the value
and what is allowed; the CLI prints it and exits with code 2 without launching anything.
Config files are TOML (parsed with :mod:`tomllib`, which never executes code): flat keys
(``daso_global_skip = 4``), a ``[train]`` table of them, or one section per concern
(``[daso]`` with ``global_skip = 4``); command-line flags override file values.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

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


def option(
    default: Any = None,
    help: str = "",
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    shown: str | None = None,
    aliases: tuple[str, ...] = (),
    factory: Callable[[], Any] | None = None,
    cli: bool = True,
) -> Any:
    """A setting: its default and what ``cloudburst train --help`` says about it.

    ``flag``: the flag when it is not ``--field-name`` (a setting that defaults to True gets a
    switch that turns it off, ``--no-field-name`` unless named here); ``shown``: the default
    as the help prints it where the value alone does not say (None: decided later);
    ``aliases``: other keys accepted for it in files and dicts; ``factory``: a default made
    per config (lists); ``cli=False``: no generated flag.
    """
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "metavar": metavar,
        "shown": shown,
        "aliases": aliases,
        "cli": cli,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------- the concerns
# Each concern names its TOML section and its group in --help. Its _validate_<concern> runs as
# part of a RunConfig (``self: RunConfig``): a check that needs another concern's value (the
# number of workers, say) reads it from there.


@dataclass
class JobConfig:
    """What runs: the algorithm, W workers and S parameter-server shards."""

    section: ClassVar[str] = "job"
    title: ClassVar[str] = "job"

    strategy: str = option("sync", "the data-parallel algorithm", choices=STRATEGIES)
    workers: int = option(2, "W, training ranks")
    servers: int | None = option(
        None, "S, parameter-server shards (asgd, easgd)", shown="1 for asgd and easgd, 0 otherwise"
    )

    def _validate_job(self: RunConfig) -> None:
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


@dataclass
class AsgdConfig:
    """GPU A-SGD (docs/algorithms.md#asgd): every n_fetch local steps a worker fetches θ from
    the shards, every n_push steps it pushes its Δ; the shards apply each push by their rule."""

    section: ClassVar[str] = "asgd"
    title: ClassVar[str] = "A-SGD parameter server (--strategy asgd, with --servers)"

    n_sync: int | None = option(
        None, "GPU A-SGD n_sync: sets --n-fetch and --n-push", shown="none, so both are 1"
    )
    n_fetch: int | None = option(
        None, "fetch θ every this many local steps", shown="--n-sync, or 1"
    )
    n_push: int | None = option(None, "push Δ every this many local steps", shown="--n-sync, or 1")
    server_rule: str = option(
        "add",
        "add: θ ← θ + λΔ; sgd and adagrad treat −Δ as a pseudo-gradient",
        choices=SERVER_RULES,
    )
    server_lr: float | None = option(
        None,
        "λ of the add rule; the server optimizer's lr otherwise",
        shown="1/W, which averages the workers' pushes",
    )
    server_momentum: float = option(0.0, "momentum of the sgd server rule")
    max_staleness: int | None = option(
        None,
        "drop pushes staler than this many shard versions",
        shown="none, every push is applied",
    )
    staleness_scaling: bool = option(
        False, "scale each push by 1/staleness (staleness-aware A-SGD)"
    )

    def _validate_asgd(self: RunConfig) -> None:
        _check_int("n_fetch", self.n_fetch, 1)
        _check_int("n_push", self.n_push, 1)
        _check_choice("server_rule", self.server_rule, SERVER_RULES)
        _check_float("server_lr", self.server_lr, 0.0, None, low_open=True)
        _check_float("server_momentum", self.server_momentum, 0.0, 1.0, high_open=True)
        if self.max_staleness is not None:
            _check_int("max_staleness", self.max_staleness, 0)


@dataclass
class DasoConfig:
    """DASO (docs/algorithms.md#daso; Heat's DASO knobs): B = global_skip batches between
    global syncs, each waited for S = batches_to_wait batches later; blocking warm-up and
    cool-down."""

    section: ClassVar[str] = "daso"
    title: ClassVar[str] = "DASO (--strategy daso)"

    daso_global_skip: int = option(4, "B at the start of cycling (0: blocking every batch)")
    daso_batches_to_wait: int = option(1, "S at the start of cycling")
    daso_local_skip: int = option(1, "L: node-local gradient all-reduce every L batches")
    daso_max_global_skips: int = option(8, "B after a reset")
    daso_warmup_epochs: float = option(4.0, "epochs of a blocking global average every batch")
    daso_cooldown_epochs: float = option(4.0, "the same at the end")
    daso_stability_level: float = option(
        0.05, "plateau threshold: a relative improvement below it is not one"
    )
    daso_patience: int = option(2, "epochs without improvement before B and S shrink")
    daso_skip_reduction_factor: int = option(2, "B and S are divided by this on a plateau")
    daso_adaptive: bool = option(True, "keep B and S at their starting values", flag="--daso-fixed")
    daso_downcast: str = option("bf16", "blocking averages' dtype", choices=DOWNCASTS)
    daso_cycling_downcast: str = option(
        "none", "non-blocking syncs' dtype (none = fp32, as Heat)", choices=DOWNCASTS
    )
    daso_epoch_end_sync: bool = option(
        True,
        "no blocking average on the last batch of each cycling epoch (Heat has one)",
        flag="--daso-no-epoch-end-sync",
    )
    daso_chunk_elements: int = option(
        10_000_000, "global all-reduces go in chunks of this many values"
    )

    def _validate_daso(self: RunConfig) -> None:
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


_LOCAL_SGD_TITLE = "local SGD and DiLoCo (--strategy local_sgd | diloco)"


@dataclass
class LocalSgdConfig:
    """local_sgd (docs/algorithms.md#local_sgd-and-diloco): average the replicas every
    H = period local steps."""

    section: ClassVar[str] = "local_sgd"
    title: ClassVar[str] = _LOCAL_SGD_TITLE

    period: int = option(8, "H: average every H local steps (diloco: an outer step)")
    local_sgd_warmup_steps: int = option(
        0, "post-local SGD: average every step for this many steps first"
    )

    def _validate_local_sgd(self: RunConfig) -> None:
        _check_int("period", self.period, 1)
        _check_int("local_sgd_warmup_steps", self.local_sgd_warmup_steps, 0)
        if self.strategy == "diloco" and self.local_sgd_warmup_steps:
            raise ConfigError(
                "local_sgd_warmup_steps: diloco has no synchronous warm-up (it is local_sgd's "
                "post-local SGD); leave it at 0"
            )


@dataclass
class DilocoConfig:
    """DiLoCo (docs/algorithms.md#local_sgd-and-diloco): every H steps the averaged Δ is an
    outer optimizer's gradient (SGD with Nesterov momentum)."""

    section: ClassVar[str] = "diloco"
    title: ClassVar[str] = _LOCAL_SGD_TITLE

    # 0.7 (the paper's) over SGD diverged (benchmarks/results/defaults.md).
    diloco_outer_lr: float | None = option(
        None, "outer SGD lr", shown="0.7 over --optimizer adam, 0.1 over sgd"
    )
    diloco_outer_momentum: float = option(0.9, "outer momentum")
    diloco_nesterov: bool = option(
        True, "plain momentum in the outer optimizer", flag="--diloco-no-nesterov"
    )

    def _validate_diloco(self: RunConfig) -> None:
        _check_float("diloco_outer_lr", self.diloco_outer_lr, 0.0, None, low_open=True)
        _check_float("diloco_outer_momentum", self.diloco_outer_momentum, 0.0, 1.0, high_open=True)


@dataclass
class EasgdConfig:
    """EASGD (docs/algorithms.md#easgd): every τ steps e = α (θ_i − θ̃); θ_i −= e; θ̃ += e on the
    servers."""

    section: ClassVar[str] = "easgd"
    title: ClassVar[str] = "EASGD (--strategy easgd, with --servers)"

    easgd_tau: int = option(10, "τ: an elastic step every τ local steps")
    easgd_alpha: float | None = option(None, "α, the elastic force", shown="β/W")
    easgd_beta: float = option(0.9, "β")

    def _validate_easgd(self: RunConfig) -> None:
        _check_int("easgd_tau", self.easgd_tau, 1)
        if self.easgd_alpha is not None:
            _check_float("easgd_alpha", self.easgd_alpha, 0.0, 1.0, low_open=True)
        _check_float("easgd_beta", self.easgd_beta, 0.0, None, low_open=True)


@dataclass
class GossipConfig:
    """Gossip (docs/algorithms.md#gossip): pairwise averaging with a peer every gossip_every
    steps."""

    section: ClassVar[str] = "gossip"
    title: ClassVar[str] = "gossip (--strategy gossip)"

    gossip_variant: str = option(
        "pull", "pull: fetch a peer's θ and average; push: send ours", choices=GOSSIP_VARIANTS
    )
    gossip_schedule: str = option(
        "random",
        "a random peer, a ring, or the time-varying exponential graph",
        choices=GOSSIP_SCHEDULES,
    )
    gossip_every: int = option(1, "gossip every k local steps")
    gossip_push_sum: bool = option(
        False, "push-sum weights (Stochastic Gradient Push), with a push variant only"
    )
    consensus_every_steps: int = option(50, "log the consensus distance every this many steps")

    def _validate_gossip(self: RunConfig) -> None:
        _check_choice("gossip_variant", self.gossip_variant, GOSSIP_VARIANTS)
        _check_choice("gossip_schedule", self.gossip_schedule, GOSSIP_SCHEDULES)
        _check_int("gossip_every", self.gossip_every, 1)
        if self.gossip_push_sum and self.gossip_variant != "push":
            raise ConfigError("gossip_push_sum: push-sum weights need --gossip-variant push")
        _check_int("consensus_every_steps", self.consensus_every_steps, 1)
        if self.strategy == "gossip" and self.workers < 2:
            raise ConfigError("workers: gossip needs at least 2 workers (a peer to average with)")


@dataclass
class ClusterConfig:
    """The cluster, emulated on one machine where it is not real: nodes (torchrun's real ones
    otherwise), the link between them, slow workers and slow devices."""

    section: ClassVar[str] = "cluster"
    title: ClassVar[str] = "cluster: nodes, their link, slow workers (emulated)"

    nodes: int | None = option(
        None, "group this launch's ranks into N emulated nodes", shown="torchrun's nodes, or 1"
    )
    inter_node_link: str | None = option(
        None,
        "emulate a link of this speed between nodes (software delay; e.g. 1,1)",
        metavar="GBIT_PER_S[,LATENCY_MS]",
        shown="none, no delay",
    )
    stragglers: list[Straggler] = option(
        help="worker WORKER sleeps (FACTOR-1)x its compute time each step (repeatable)",
        flag="--straggler",
        metavar="WORKER:FACTOR",
        shown="none",
        aliases=("straggler",),
        factory=list,
    )
    min_step_time_s: float = option(
        0.0, "emulate a device: every step takes at least this many seconds (sleep)"
    )

    def _validate_cluster(self: RunConfig) -> None:
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
        for s in self.stragglers:
            if not 0 <= s.worker < self.workers:
                raise ConfigError(
                    f"straggler: worker {s.worker} does not exist; allowed 0..{self.workers - 1}"
                )
            _check_float("straggler factor", s.factor, 1.0, None)
        _check_float("min_step_time_s", self.min_step_time_s, 0.0, None)


@dataclass
class DataConfig:
    """The dataset, read from local files only (never downloaded), and its loading."""

    section: ClassVar[str] = "data"
    title: ClassVar[str] = "data"

    dataset: str = option(
        "mnist1d",
        f"one of {', '.join(DATASETS)} (paths are read, never downloaded)",
        metavar="SPEC",
    )
    train_size: int | None = option(
        None, "training samples", shown="4000 for mnist1d and synthetic, else all"
    )
    test_size: int | None = option(
        None, "test samples", shown="1000 for mnist1d and synthetic, else all"
    )
    image_size: int = option(32, "imagefolder: resize and center-crop images to this")
    augment: bool = option(True, "images: no random crop (padding 4) and flip", flag="--no-augment")
    data_workers: int | None = option(
        None, "DataLoader processes per worker", shown="2 for images, 0 otherwise"
    )

    def _validate_data(self: RunConfig) -> None:
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


@dataclass
class ModelConfig:
    """The model and where it computes."""

    section: ClassVar[str] = "model"
    title: ClassVar[str] = "model and device"

    model: str = option(
        "cnn",
        f"one of {', '.join(MODELS)} (32x32 images: resnet20, convnet), or package.module:function",
        metavar="NAME",
    )
    device: str = option(
        "auto", "workers' compute device; auto: cuda when a GPU is present", choices=DEVICES
    )
    backend: str = option(
        "auto",
        "workers' collectives; auto: nccl when each worker has its own GPU, else gloo",
        choices=BACKENDS,
    )
    autocast: str = option(
        "none", "bf16: autocast the forward pass and the loss to bfloat16", choices=AUTOCASTS
    )

    def _validate_model(self: RunConfig) -> None:
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


@dataclass
class TrainingConfig:
    """Each worker's own training: its budget, its optimizer, and how it starts."""

    section: ClassVar[str] = "training"
    title: ClassVar[str] = "training"

    epochs: float | None = option(
        None, "passes of each worker over its own shard", shown="64 unless --steps is given"
    )
    steps: int | None = option(
        None, "local steps per worker (overrides --epochs)", shown="from --epochs"
    )
    batch_size: int = option(64, "samples per step, per worker")
    optimizer: str = option("sgd", "the local (worker) optimizer", choices=OPTIMIZERS)
    lr: float = option(0.1, "the local optimizer's learning rate")
    lr_schedule: str = option(
        "constant", "constant, or cosine decay to 0 over each worker's steps", choices=LR_SCHEDULES
    )
    momentum: float = option(0.9, "the local optimizer's momentum (adam: β1)")
    weight_decay: float = option(0.0, "L2 weight decay of the local optimizer")
    seed: int = option(0, "seeds the model, the data order and the shards")
    warm_start_steps: int = option(
        0, "K: worker 0 trains alone for K steps, then all start from its θ"
    )
    init_from: str | None = option(
        None,
        "start every replica (and the servers) from this model checkpoint (model.pt)",
        shown="none",
    )

    def _validate_training(self: RunConfig) -> None:
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
        _check_int("warm_start_steps", self.warm_start_steps, 0)
        if self.warm_start_steps and self.init_from:
            raise ConfigError(
                "warm_start_steps: cannot be combined with init_from; choose one warm start"
            )
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise ConfigError(f"init_from: {self.init_from!r} is not a file")


@dataclass
class MetricsConfig:
    """What a run measures and how often it writes it down."""

    section: ClassVar[str] = "metrics"
    title: ClassVar[str] = "metrics"

    target_accuracy: float | None = option(
        None, "report the time to reach this test accuracy (0..1)", shown="none"
    )
    eval_every_s: float = option(1.0, "evaluate on the test set every this many seconds")
    log_every_steps: int = option(10, "workers log one step record every this many steps")
    # Bounded files; the staleness statistics in the summary count every push regardless.
    push_log_every: int = option(
        10, "servers log one push record every N applied pushes, and one for each push not applied"
    )
    tensorboard: bool = option(False, "also write TensorBoard events under OUT/tensorboard")

    def _validate_metrics(self: RunConfig) -> None:
        if self.target_accuracy is not None:
            _check_float("target_accuracy", self.target_accuracy, 0.0, 1.0, low_open=True)
        _check_float("eval_every_s", self.eval_every_s, 0.0, None, low_open=True)
        _check_int("log_every_steps", self.log_every_steps, 1)
        _check_int("push_log_every", self.push_log_every, 1)


@dataclass
class FaultConfig:
    """Checkpoints, restarts, injected faults and the timeouts that detect a lost rank."""

    section: ClassVar[str] = "faults"
    title: ClassVar[str] = "fault tolerance"

    checkpoint_every: int = option(
        100,
        "workers checkpoint every this many steps, servers every this many pushes, under "
        "OUT/checkpoints (0: off)",
    )
    # Set by ``--resume DIR`` (cloudburst.resilience.resume_config), which is no field's flag.
    resume: bool = option(False, "continue from the checkpoints under OUT", cli=False)
    max_restarts: int = option(
        0,
        "restart failed ranks this many times (sync/daso/local_sgd/diloco/gossip: the whole "
        "job, from its last checkpoint; asgd/easgd: the rank rejoins)",
    )
    inject_fault: list[str] = option(
        help="kill:RANK@STEP | stop:RANK@STEP | nan:RANK@STEP | slow:RANK:FACTOR (repeatable; "
        "cloudburst.faults; first attempt only)",
        metavar="SPEC",
        shown="none",
        factory=list,
    )
    comm_timeout_s: float = option(300.0, "seconds before a blocking communication fails")
    heartbeat_timeout_s: float = option(
        10.0, "seconds without a heartbeat before a rank is taken for lost"
    )

    def _validate_faults(self: RunConfig) -> None:
        _check_int("checkpoint_every", self.checkpoint_every, 0)
        _check_int("max_restarts", self.max_restarts, 0)
        if self.inject_fault:
            from cloudburst.faults import FaultError, parse_faults

            try:
                parse_faults(self.inject_fault, self.servers, self.world_size)
            except FaultError as e:
                raise ConfigError(f"inject_fault: {e}") from None
        _check_float("comm_timeout_s", self.comm_timeout_s, 0.0, None, low_open=True)
        _check_float("heartbeat_timeout_s", self.heartbeat_timeout_s, 0.0, None, low_open=True)


@dataclass
class OutputConfig:
    """Where a run writes, and what it shows while it runs."""

    section: ClassVar[str] = "output"
    title: ClassVar[str] = "output"

    out: str = option("runs/latest", "output directory", shown="runs/<strategy>-<time>-<random>")
    overwrite: bool = option(
        False,
        "write into an existing directory that is not a cloudburst run (only the run's own "
        "files are ever replaced)",
    )
    progress: bool = option(True, "no progress bar", flag="--no-progress")


# The concerns in --help's order; RunConfig's fields (and to_dict) follow the same order.
COMPONENTS: tuple[type, ...] = (
    JobConfig,
    AsgdConfig,
    DasoConfig,
    LocalSgdConfig,
    DilocoConfig,
    EasgdConfig,
    GossipConfig,
    ClusterConfig,
    DataConfig,
    ModelConfig,
    TrainingConfig,
    MetricsConfig,
    FaultConfig,
    OutputConfig,
)


# A dataclass collects its bases' fields from the last base to the first: listed in reverse,
# JobConfig's come first.
@dataclass
class RunConfig(
    OutputConfig,
    FaultConfig,
    MetricsConfig,
    TrainingConfig,
    ModelConfig,
    DataConfig,
    ClusterConfig,
    GossipConfig,
    EasgdConfig,
    DilocoConfig,
    LocalSgdConfig,
    DasoConfig,
    AsgdConfig,
    JobConfig,
):
    """Everything one training run needs: every concern's fields, flat (``cfg.lr``)."""

    def __post_init__(self) -> None:
        if isinstance(self.inject_fault, str):
            self.inject_fault = [self.inject_fault]
        # Defaults that depend on another concern's value.
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
            # docs/algorithms.md#asgd: the W workers' pushes are averaged (λ = 1/W), not summed.
            self.server_lr = (
                1.0 / self.workers if isinstance(self.workers, int) and (self.workers > 0) else 1.0
            )
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Each concern's checks, in this order (a later one may rely on an earlier one's
        defaults: the batch size on the data's size)."""
        self._validate_job()
        self._validate_asgd()
        self._validate_data()
        self._validate_model()
        self._validate_cluster()
        self._validate_local_sgd()
        self._validate_diloco()
        self._validate_easgd()
        self._validate_gossip()
        self._validate_daso()
        self._validate_training()
        self._validate_metrics()
        self._validate_faults()

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
        aliases = _aliases()
        # Flags and TOML may spell names with dashes; an alias (``straggler``) wins over the
        # field's own name, as it did when it was the only one.
        values = {k.replace("-", "_"): v for k, v in values.items()}
        for alias, name in aliases.items():
            if alias in values:
                values[name] = values.pop(alias)
        unknown = sorted(set(values) - known)
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(known | set(aliases)), n=1)
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


def _field_names(part: type) -> set[str]:
    return {f.name for f in dataclasses.fields(part)}


@functools.cache
def _aliases() -> dict[str, str]:
    """Other keys accepted for a field in files and dicts: ``{"straggler": "stragglers"}``."""
    return {
        alias: f.name
        for f in dataclasses.fields(RunConfig)
        for alias in f.metadata.get("aliases", ())
    }


# ---------------------------------------------------------------------------- config files
def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file into flat field names (``daso_global_skip``).

    Accepted: top-level keys, a ``[train]`` table of them (its values win over top-level
    ones), and one section per concern whose keys may drop the concern's prefix (``[daso]``
    ``global_skip``). A key set twice, or unknown in a section, is a one-line error.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config: file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config: {str(p)!r} is not valid TOML ({e})") from None
    flat = _flatten_sections({k: v for k, v in data.items() if k != "train"})
    if isinstance(data.get("train"), dict):
        flat.update(_flatten_sections(data["train"]))
    elif "train" in data:
        flat["train"] = data["train"]  # from_dict names it as an unknown field
    return flat


def _flatten_sections(table: dict[str, Any]) -> dict[str, Any]:
    sections = {part.section: part for part in COMPONENTS}
    aliases = _aliases()
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}

    def put(name: str, value: Any, place: str) -> None:
        name = aliases.get(name, name)
        if name in flat:
            raise ConfigError(f"config: {name} is set twice ({where[name]} and {place}); keep one")
        flat[name], where[name] = value, place

    for key, value in table.items():
        key = key.replace("-", "_")
        if not isinstance(value, dict):
            put(key, value, "the top level")
        elif key in sections:
            for sub, sub_value in value.items():
                put(_section_field(sections[key], sub.replace("-", "_")), sub_value, f"[{key}]")
        else:
            near = difflib.get_close_matches(key, sorted(sections), n=1)
            hint = f"; did you mean [{near[0]}]?" if near else f" ({', '.join(sections)})"
            raise ConfigError(f"config: unknown section [{key}]{hint}")
    return flat


def _section_field(part: type, key: str) -> str:
    """The field a key of ``part``'s section names: ``global_skip`` in [daso] is
    ``daso_global_skip``; a field's full name is accepted too."""
    own = _field_names(part)
    own_aliases = {a: f.name for f in dataclasses.fields(part) for a in f.metadata["aliases"]}
    for name in (f"{part.section}_{key}", key):
        if name in own:
            return name
        if name in own_aliases:
            return own_aliases[name]
    name = _aliases().get(key, key)
    homes = [other.section for other in COMPONENTS if name in _field_names(other)]
    if homes:
        raise ConfigError(
            f"config: {key!r} is not a [{part.section}] setting; it belongs in [{homes[0]}] "
            "(or at the top level)"
        )
    short = sorted(n.removeprefix(f"{part.section}_") for n in own | set(own_aliases))
    near = difflib.get_close_matches(key, short, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f" (allowed: {', '.join(short)})"
    raise ConfigError(f"config: unknown field {key!r} in [{part.section}]{hint}")


# ---------------------------------------------------------------------------- values
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
