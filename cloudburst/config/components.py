"""The concerns every run has: the job, the cluster (nodes, links, stragglers), data, model,
training, metrics, faults and checkpoints, output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from cloudburst.config.fields import (
    AUTOCASTS,
    BACKENDS,
    DATASETS,
    DEFAULT_SIZES,
    DEVICES,
    LINK_GBIT_PER_S,
    LINK_LATENCY_MS,
    LR,
    LR_SCHEDULES,
    MAX_BUDGET_S,
    MAX_EPOCHS,
    MAX_SAMPLES,
    MAX_TIMEOUT_S,
    MAX_WORKERS,
    MODELS,
    MOMENTUM,
    OPTIMIZERS,
    SEED,
    SLOWDOWN,
    STEP_COUNT,
    STEP_COUNT_OR_0,
    TIMEOUT_S,
    Bounds,
    ConfigError,
    Straggler,
    check_choice,
    option,
)
from cloudburst.strategies import BUILT_IN, REGISTRY


def check_link(name: str, text: str) -> None:
    """A ``GBIT_PER_S[,LATENCY_MS]`` link spec within 1 kbit/s .. 1 Pbit/s and 0 .. 60 s."""
    from cloudburst.comm.costs import LinkSpec

    try:
        spec = LinkSpec.parse(text)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
    if not LINK_GBIT_PER_S.allows(spec.gbit_per_s, False):
        raise ConfigError(
            f"{name}: {text!r}: a speed of {spec.gbit_per_s!r} Gbit/s is not allowed; use "
            f"{LINK_GBIT_PER_S.text(False)} Gbit/s (1 kbit/s to 1 Pbit/s)"
        )
    if not LINK_LATENCY_MS.allows(spec.latency_ms, False):
        raise ConfigError(
            f"{name}: {text!r}: a latency of {spec.latency_ms!r} ms is not allowed; use "
            f"{LINK_LATENCY_MS.text(False)} ms"
        )


# Language models on text (docs/lm.md): the budget and evaluation interval measured for the
# default GPT on text:stdlib; a test evaluation of the GPT takes about a second on a CPU.
TEXT_DEFAULT_STEPS = 300
TEXT_EVAL_EVERY_S = 15.0
PLAIN_RECIPE = {
    "batch_size": 64,
    "optimizer": "sgd",
    "lr": 0.1,
    "lr_schedule": "constant",
    "warmup_steps": 0,
    "clip_grad_norm": 0.0,
    "weight_decay": 0.0,
}
# AdamW, linear warm-up then cosine, clipping at 1 (nanoGPT's recipe; lr for a small model).
GPT_RECIPE = {
    "batch_size": 16,
    "optimizer": "adamw",
    "lr": 4.2e-3,
    "lr_schedule": "cosine",
    "warmup_steps": 30,
    "clip_grad_norm": 1.0,
    "weight_decay": 0.1,
}


@dataclass
class JobConfig:
    """What runs: the algorithm, W workers and S parameter-server shards."""

    section: ClassVar[str] = "job"
    title: ClassVar[str] = "job"

    strategy: str = option("sync", "the data-parallel algorithm", choices=BUILT_IN)
    workers: int = option(2, "W, training ranks", bounds=Bounds(1, MAX_WORKERS))
    servers: int | None = option(
        None,
        "S, parameter-server shards (asgd, easgd)",
        shown="1 for asgd and easgd, 0 otherwise",
        bounds=Bounds(0, MAX_WORKERS),
    )

    def _validate_job(self) -> None:
        check_choice("strategy", self.strategy, tuple(REGISTRY))
        if self.strategy_spec.needs_servers and self.servers < 1:
            raise ConfigError(
                f"servers: {self.servers} is not allowed for strategy {self.strategy!r}; "
                "use --servers 1 or more"
            )
        if not self.strategy_spec.needs_servers and self.servers != 0:
            raise ConfigError(
                f"servers: {self.servers} is not allowed for strategy {self.strategy!r}, "
                "which uses no parameter server; use --servers 0"
            )


@dataclass
class ClusterConfig:
    """The cluster, emulated on one machine where it is not real: nodes (torchrun's real ones
    otherwise), the link between them, slow workers and slow devices."""

    section: ClassVar[str] = "cluster"
    title: ClassVar[str] = "cluster: nodes, their link, slow workers (emulated)"

    nodes: int | None = option(
        None,
        "group this launch's ranks into N emulated nodes",
        shown="torchrun's nodes, or 1",
        bounds=Bounds(1, MAX_WORKERS),
    )
    replica: str = option(
        "rank",
        "what one replica of the relaxed strategy is: every worker rank, or every node's "
        "workers (synchronous inside the node, the strategy between nodes; needs --nodes)",
        choices=("rank", "node"),
    )
    shard_placement: str = option(
        "spread",
        "where the parameter-server shards run: shard k on node k mod N (spread), all on "
        "node 0 (first), together on the last node with no workers (own), or one node per "
        "shard (e.g. 0,0,1)",
        metavar="spread|first|own|NODE,...",
    )
    inter_node_link: str | None = option(
        None,
        "emulate a link of this speed between nodes (software delay; e.g. 1,1; 1 kbit/s to "
        "1 Pbit/s, latency up to 60 s)",
        metavar="GBIT_PER_S[,LATENCY_MS]",
        shown="none, no delay",
    )
    stragglers: list[Straggler] = option(
        help="worker WORKER sleeps (FACTOR-1)x its compute time each step (repeatable; "
        "FACTOR 1..1000)",
        flag="--straggler",
        metavar="WORKER:FACTOR",
        shown="none",
        aliases=("straggler",),
        factory=list,
    )
    min_step_time_s: float = option(
        0.0,
        "emulate a device: every step takes at least this many seconds (sleep; times a "
        "straggler's factor, below --comm-timeout-s)",
        bounds=Bounds(0.0, MAX_TIMEOUT_S),
    )
    compress: str = option(
        "none",
        "compress what is sent (docs/algorithms.md#compression): bf16, fp8 or int8 "
        "(block-wise scales, error feedback) for sync, local_sgd, diloco, asgd, easgd, "
        "gossip and daso's global syncs; powersgd[:RANK] "
        "for sync (PyTorch's DDP hook)",
        metavar="none|bf16|fp8|int8|powersgd[:RANK]",
    )

    def _validate_cluster(self) -> None:
        if self.nodes is not None:
            if self.nodes > self.world_size:
                raise ConfigError(
                    f"nodes: {self.nodes} is more than the job's {self.world_size} ranks"
                )
        self._validate_replicas()
        if self.inter_node_link is not None:
            check_link("inter_node_link", self.inter_node_link)
        for s in self.stragglers:
            if not 0 <= s.worker < self.workers:
                raise ConfigError(
                    f"straggler: worker {s.worker} does not exist; allowed 0..{self.workers - 1}"
                )
            SLOWDOWN.check("straggler factor", s.factor, integer=False)
        from cloudburst.comm.compress import Compression

        try:
            method = Compression.parse(self.compress).method
        except ValueError as e:
            raise ConfigError(f"compress: {e}") from None
        allowed = self.strategy_spec.compression
        if method not in allowed:
            raise ConfigError(
                f"compress: {self.compress!r} is not available for strategy {self.strategy!r}; "
                f"use {', '.join(allowed)}"
            )
        self.strategy_spec.validate_compress(self, method)

    @property
    def replicas(self) -> int:
        """How many replicas the strategy runs between: the workers, or the nodes (--replica
        node)."""
        if self.replica == "node" and self.nodes:
            return min(self.worker_nodes, self.workers)
        return self.workers

    @property
    def worker_nodes(self) -> int:
        """The nodes that run workers: every node, less the shards' own under ``own``."""
        nodes = self.nodes or 1
        return nodes - 1 if self.shard_placement == "own" and self.servers and nodes > 1 else nodes

    @property
    def ranks_per_replica(self) -> int:
        """Worker ranks in one replica (G): 1, or a node's workers."""
        return self.workers // self.replicas if self.workers >= self.replicas else 1

    def _validate_replicas(self) -> None:
        check_choice("replica", self.replica, ("rank", "node"))
        if self.replica == "node":
            spec = self.strategy_spec
            if spec.node_replicas_refused:
                raise ConfigError(
                    f"replica: node is not allowed for strategy {self.strategy!r} "
                    f"({spec.node_replicas_refused}); use --replica rank"
                )
            if not self.nodes or self.nodes < 2:
                raise ConfigError(
                    "replica: node needs --nodes N (N >= 2): each node's workers make one replica"
                )
            if spec.survives_worker_loss and getattr(self, "max_restarts", 0):
                raise ConfigError(
                    f"replica: node with --max-restarts {self.max_restarts} is not allowed for "
                    f"strategy {self.strategy!r}: a restarted worker cannot rejoin its node's "
                    "group; use --max-restarts 0 (resume the job with --resume OUT)"
                )
            nodes = self.worker_nodes
            if self.workers % nodes:
                raise ConfigError(
                    f"replica: node needs the same number of workers on every node; "
                    f"{self.workers} workers do not split evenly over {nodes} worker nodes"
                )
            if self.workers // nodes < 2:
                raise ConfigError(
                    f"replica: node with {self.workers} workers on {nodes} nodes puts one "
                    "worker on each node, which is --replica rank; use more workers per node"
                )
        from cloudburst.comm.link import Topology

        try:
            Topology.place(self.workers, self.servers, self.nodes or 1, self.shard_placement)
        except ValueError as e:
            raise ConfigError(f"shard_placement: {e}") from None


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
        None,
        "training samples",
        shown="4000 for mnist1d and synthetic, else all",
        bounds=Bounds(10, MAX_SAMPLES),
    )
    test_size: int | None = option(
        None,
        "test samples",
        shown="1000 for mnist1d and synthetic, else all",
        bounds=Bounds(10, MAX_SAMPLES),
    )
    image_size: int = option(
        32, "imagefolder: resize and center-crop images to this", bounds=Bounds(8, 1024)
    )
    augment: bool = option(True, "images: no random crop (padding 4) and flip", flag="--no-augment")
    data_workers: int | None = option(
        None,
        "DataLoader processes per worker",
        shown="2 for images, 0 otherwise",
        bounds=Bounds(0, 64),
    )
    context: int = option(
        64, "text: tokens (bytes) per window, the GPT's context length", bounds=Bounds(1, 65_536)
    )
    max_dataset_gib: float = option(
        2.0,
        "the most memory a dataset from a path may take on a rank (npz arrays, a text corpus, "
        "an image folder's decoded test split); checked from headers and file sizes first",
        bounds=Bounds(0.0, 1024.0, low_open=True),
    )

    @property
    def max_dataset_bytes(self) -> int:
        """``max_dataset_gib`` in bytes (cloudburst.datasets.MAX_DATASET_BYTES by default)."""
        return int(self.max_dataset_gib * 2**30)

    def _validate_data(self) -> None:
        kind, path = self.dataset_kind_path()
        if kind == "text" and path == "stdlib":
            pass  # the running interpreter's standard library (cloudburst.datasets.text)
        elif path is not None and not Path(path).expanduser().exists():
            raise ConfigError(
                f"dataset: {path!r} does not exist (datasets are read from local paths)"
            )
        if kind in DEFAULT_SIZES:
            default_train, default_test = DEFAULT_SIZES[kind]
            self.train_size = default_train if self.train_size is None else self.train_size
            self.test_size = default_test if self.test_size is None else self.test_size
        if self.train_size is not None and self.train_size < self.workers:
            raise ConfigError(
                f"train_size: {self.train_size} is not allowed with {self.workers} workers; use "
                f"at least one sample per worker (>= {self.workers})"
            )


@dataclass
class ModelConfig:
    """The model and where it computes."""

    section: ClassVar[str] = "model"
    title: ClassVar[str] = "model and device"

    model: str = option(
        "cnn",
        f"one of {', '.join(MODELS)} (32x32 images: resnet20, convnet; text: "
        "gpt[:layers=L,width=D,heads=H]), or package.module:function",
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

    def _validate_model(self) -> None:
        from cloudburst.gpt import is_gpt_spec, parse_gpt_spec
        from cloudburst.models import ModelError, is_factory_spec

        if is_gpt_spec(self.model):
            try:
                parse_gpt_spec(self.model)
            except ModelError as e:
                raise ConfigError(f"model: {e}") from None
            if self.dataset_kind_path()[0] != "text":
                raise ConfigError(
                    f"model: {self.model!r} is a language model; use --dataset text:PATH "
                    "(e.g. text:stdlib)"
                )
        elif self.model in MODELS and self.dataset_kind_path()[0] == "text":
            raise ConfigError(
                f"model: {self.model!r} is not a language model; text datasets need --model gpt "
                "(or a package.module:function factory of your own)"
            )
        elif self.model not in MODELS and not is_factory_spec(self.model):
            raise ConfigError(
                f"model: {self.model!r} is not allowed; choose one of {', '.join(MODELS)} "
                "or name a factory as package.module:function"
            )
        check_choice("device", self.device, DEVICES)
        check_choice("backend", self.backend, BACKENDS)
        if self.backend == "nccl" and self.device == "cpu":
            raise ConfigError("backend: 'nccl' needs --device cuda (or auto on a GPU machine)")
        check_choice("autocast", self.autocast, AUTOCASTS)


@dataclass
class TrainingConfig:
    """Each worker's own training: its budget, its optimizer, and how it starts."""

    section: ClassVar[str] = "training"
    title: ClassVar[str] = "training"

    epochs: float | None = option(
        None,
        "passes of each worker over its own shard",
        shown="64 unless --steps is given (text: --steps)",
        bounds=Bounds(0.0, MAX_EPOCHS, low_open=True),
    )
    steps: int | None = option(
        None,
        "local steps per worker (overrides --epochs)",
        shown=f"from --epochs (text: {TEXT_DEFAULT_STEPS})",
        bounds=STEP_COUNT,
    )
    max_train_time_s: float = option(
        0.0,
        "end training once its clock (evaluations left out; simulate: virtual seconds) "
        "reaches this, then finish as after the last step (0: no budget)",
        bounds=Bounds(0.0, MAX_BUDGET_S),
    )
    batch_size: int | None = option(
        None,
        "samples (text: windows) per step, per worker",
        shown="64 (gpt: 16)",
        bounds=Bounds(1, 2**20),
    )
    optimizer: str | None = option(
        None, "the local (worker) optimizer", choices=OPTIMIZERS, shown="sgd (gpt: adamw)"
    )
    lr: float | None = option(
        None, "the local optimizer's learning rate", shown="0.1 (gpt: 4.2e-3)", bounds=LR
    )
    lr_schedule: str | None = option(
        None,
        "constant, or cosine decay to 0 over each worker's steps (after --warmup-steps)",
        choices=LR_SCHEDULES,
        shown="constant (gpt: cosine)",
    )
    warmup_steps: int | None = option(
        None,
        "the lr rises linearly from lr/N to lr over the first N steps (then the schedule)",
        shown="0 (gpt: 30)",
        bounds=STEP_COUNT_OR_0,
    )
    clip_grad_norm: float | None = option(
        None,
        "clip each step's gradient to this global L2 norm (0: off)",
        shown="0 (gpt: 1)",
        bounds=Bounds(0.0, 1e6),
    )
    momentum: float = option(0.9, "the local optimizer's momentum (adam: β1)", bounds=MOMENTUM)
    weight_decay: float | None = option(
        None,
        "weight decay of the local optimizer (adamw: decoupled, else L2)",
        shown="0 (gpt: 0.1)",
        bounds=Bounds(0.0, 100.0),
    )
    seed: int = option(
        0, "seeds the model, the data order and the shards (0 .. 2^32-1)", bounds=SEED
    )
    warm_start_steps: int = option(
        0,
        "K: worker 0 trains alone for K steps, then all start from its θ",
        bounds=STEP_COUNT_OR_0,
    )
    init_from: str | None = option(
        None,
        "start every replica (and the servers) from this model checkpoint (model.pt)",
        shown="none",
    )

    def _training_defaults(self) -> None:
        """The defaults left open: the GPT's recipe (docs/lm.md) for a gpt model, else SGD's."""
        from cloudburst.gpt import is_gpt_spec

        lm = isinstance(self.model, str) and is_gpt_spec(self.model)
        recipe = GPT_RECIPE if lm else PLAIN_RECIPE
        for name, value in recipe.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    def _validate_training(self) -> None:
        self._training_defaults()
        if self.steps is None and self.epochs is None:
            if self.dataset_kind_path()[0] == "text":
                self.steps = TEXT_DEFAULT_STEPS  # docs/lm.md: the GPT's measured budget
            else:
                self.epochs = 64.0  # MNIST-1D's CNN reaches ≥ 90 % with every strategy
        shard = (self.train_size or 0) // self.workers
        if self.train_size is not None and self.batch_size > shard:
            raise ConfigError(
                f"batch_size: {self.batch_size} is larger than each worker's shard of "
                f"{shard} samples (train_size {self.train_size} / {self.workers} workers)"
            )
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
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
        None,
        "report the time to reach this test accuracy (0..1)",
        shown="none",
        bounds=Bounds(0.0, 1.0, low_open=True),
    )
    target_loss: float | None = option(
        None,
        "report the time to reach this test loss (nats per token, language models)",
        shown="none",
        bounds=Bounds(0.0, 1e6, low_open=True),
    )
    eval_every_s: float | None = option(
        None,
        "evaluate on the test set every this many seconds",
        shown=f"1, text: {TEXT_EVAL_EVERY_S:g}",
        bounds=Bounds(0.0, MAX_BUDGET_S, low_open=True),
    )
    log_every_steps: int = option(
        10, "workers log one step record every this many steps", bounds=STEP_COUNT
    )
    # Bounded files; the staleness statistics in the summary count every push regardless.
    push_log_every: int = option(
        10,
        "servers log one push record every N applied pushes, and one for each push not applied",
        bounds=STEP_COUNT,
    )
    tensorboard: bool = option(False, "also write TensorBoard events under OUT/tensorboard")

    def _validate_metrics(self) -> None:
        if self.eval_every_s is None:
            text = self.dataset_kind_path()[0] == "text"
            self.eval_every_s = TEXT_EVAL_EVERY_S if text else 1.0


@dataclass
class FaultConfig:
    """Checkpoints, restarts, injected faults and the timeouts that detect a lost rank."""

    section: ClassVar[str] = "faults"
    title: ClassVar[str] = "fault tolerance"

    checkpoint_every: int = option(
        100,
        "workers checkpoint every this many steps, servers every this many pushes, under "
        "OUT/checkpoints (0: off)",
        bounds=STEP_COUNT_OR_0,
    )
    # Set by ``--resume DIR`` (cloudburst.resilience.resume_config), which is no field's flag.
    resume: bool = option(False, "continue from the checkpoints under OUT", cli=False)
    max_restarts: int = option(
        0,
        "restart failed ranks this many times (sync/daso/local_sgd/diloco/gossip: the whole "
        "job, from its last checkpoint; asgd/easgd: the rank rejoins)",
        bounds=Bounds(0, 1000),
    )
    inject_fault: list[str] = option(
        help="kill:RANK@STEP | stop:RANK@STEP | nan:RANK@STEP | slow:RANK:FACTOR (repeatable; "
        "cloudburst.faults; first attempt only)",
        metavar="SPEC",
        shown="none",
        factory=list,
    )
    comm_timeout_s: float = option(
        300.0, "seconds before a blocking communication fails", bounds=TIMEOUT_S
    )
    heartbeat_timeout_s: float = option(
        10.0, "seconds without a heartbeat before a rank is taken for lost", bounds=TIMEOUT_S
    )

    def _validate_faults(self) -> None:
        slow: dict[int, float] = {}  # worker index: the product of its slow faults' factors
        if self.inject_fault:
            from cloudburst.faults import FaultError, parse_faults

            try:
                faults = parse_faults(self.inject_fault, self.servers, self.world_size)
            except FaultError as e:
                raise ConfigError(f"inject_fault: {e}") from None
            for fault in faults:
                if fault.kind == "slow":
                    index = fault.rank - self.servers
                    slow[index] = slow.get(index, 1.0) * fault.factor
        # A slow worker's step sleeps (factor - 1) x its compute, and a step of the emulated
        # device at least min_step_time_s x factor: bounded, and below the time the other
        # ranks wait for it (comm_timeout_s).
        slowed = {s.worker for s in self.stragglers} | set(slow)
        factors = {i: self.straggler_factor(i) * slow.get(i, 1.0) for i in sorted(slowed)}
        for index, factor in factors.items():
            if not SLOWDOWN.allows(factor, integer=False):
                raise ConfigError(
                    f"straggler: worker {index} would be slowed {factor:g}x (its --straggler "
                    f"factor times its slow: faults); allowed up to {SLOWDOWN.high:g}x"
                )
        most = max(factors.values(), default=1.0)
        if self.min_step_time_s * most >= self.comm_timeout_s:
            raise ConfigError(
                f"min_step_time_s: {self.min_step_time_s:g} s x a slowdown of {most:g} is not "
                f"below comm_timeout_s {self.comm_timeout_s:g} s: the other ranks would time "
                "out waiting for its step; lower it or raise --comm-timeout-s"
            )


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


# A dataclass collects its bases' fields from the last base to the first: listed in reverse,
# JobConfig's come first.
