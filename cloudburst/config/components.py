"""The concerns every run has beside its job and cluster (``cluster.py``): data, model,
training, metrics, faults and checkpoints, output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from cloudburst.config.fields import (
    AUTOCASTS,
    BACKENDS,
    DATASETS,
    DEFAULT_SIZES,
    DEVICES,
    LR,
    LR_SCHEDULES,
    MAX_BUDGET_S,
    MAX_EPOCHS,
    MAX_SAMPLES,
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
    Section,
    check_choice,
    option,
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
class DataConfig(Section):
    """The dataset, read from local files only (never downloaded), and its loading."""

    section: ClassVar[str] = "data"
    title: ClassVar[str] = "data"
    flat_names: ClassVar[dict[str, str]] = {"workers": "data_workers"}

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
    workers: int | None = option(
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
        """``max_dataset_gib`` in bytes (cloudburst.data.datasets.MAX_DATASET_BYTES by default)."""
        return int(self.max_dataset_gib * 2**30)

    def validate(self, cfg: Any) -> None:
        kind, path = cfg.dataset_kind_path()
        if kind == "text" and path == "stdlib":
            pass  # the running interpreter's standard library (cloudburst.data.datasets.text)
        elif path is not None and not Path(path).expanduser().exists():
            raise ConfigError(
                f"dataset: {path!r} does not exist (datasets are read from local paths)"
            )
        if kind in DEFAULT_SIZES:
            default_train, default_test = DEFAULT_SIZES[kind]
            self.train_size = default_train if self.train_size is None else self.train_size
            self.test_size = default_test if self.test_size is None else self.test_size
        if self.train_size is not None and self.train_size < cfg.job.workers:
            raise ConfigError(
                f"train_size: {self.train_size} is not allowed with {cfg.job.workers} workers; use "
                f"at least one sample per worker (>= {cfg.job.workers})"
            )


@dataclass
class ModelConfig(Section):
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

    def validate(self, cfg: Any) -> None:
        from cloudburst.models import ModelError, is_factory_spec
        from cloudburst.models.gpt import is_gpt_spec, parse_gpt_spec

        if is_gpt_spec(self.model):
            try:
                parse_gpt_spec(self.model)
            except ModelError as e:
                raise ConfigError(f"model: {e}") from None
            if cfg.dataset_kind_path()[0] != "text":
                raise ConfigError(
                    f"model: {self.model!r} is a language model; use --dataset text:PATH "
                    "(e.g. text:stdlib)"
                )
        elif self.model in MODELS and cfg.dataset_kind_path()[0] == "text":
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
class TrainingConfig(Section):
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

    def defaults(self, cfg: Any) -> None:
        """The defaults left open: the GPT's recipe (docs/lm.md) for a gpt model, else SGD's."""
        from cloudburst.models.gpt import is_gpt_spec

        lm = isinstance(cfg.model.model, str) and is_gpt_spec(cfg.model.model)
        recipe = GPT_RECIPE if lm else PLAIN_RECIPE
        for name, value in recipe.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    def validate(self, cfg: Any) -> None:
        self.defaults(cfg)
        if self.steps is None and self.epochs is None:
            if cfg.dataset_kind_path()[0] == "text":
                self.steps = TEXT_DEFAULT_STEPS  # docs/lm.md: the GPT's measured budget
            else:
                self.epochs = 64.0  # MNIST-1D's CNN reaches ≥ 90 % with every strategy
        shard = (cfg.data.train_size or 0) // cfg.job.workers
        if cfg.data.train_size is not None and self.batch_size > shard:
            raise ConfigError(
                f"batch_size: {self.batch_size} is larger than each worker's shard of "
                f"{shard} samples (train_size {cfg.data.train_size} / {cfg.job.workers} workers)"
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
class MetricsConfig(Section):
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

    def validate(self, cfg: Any) -> None:
        if self.eval_every_s is None:
            text = cfg.dataset_kind_path()[0] == "text"
            self.eval_every_s = TEXT_EVAL_EVERY_S if text else 1.0


@dataclass
class FaultConfig(Section):
    """Checkpoints, restarts, injected faults and the timeouts that detect a lost rank."""

    section: ClassVar[str] = "faults"
    title: ClassVar[str] = "fault tolerance"

    checkpoint_every: int = option(
        100,
        "workers checkpoint every this many steps, servers every this many pushes, under "
        "OUT/checkpoints (0: off)",
        bounds=STEP_COUNT_OR_0,
    )
    # Set by ``--resume DIR`` (records.resilience.resume_config), which is no field's flag.
    resume: bool = option(False, "continue from the checkpoints under OUT", cli=False)
    max_restarts: int = option(
        0,
        "restart failed ranks this many times (sync/daso/local_sgd/diloco/gossip: the whole "
        "job, from its last checkpoint; asgd/easgd: the rank rejoins)",
        bounds=Bounds(0, 1000),
    )
    inject_fault: list[str] = option(
        help="kill:RANK@STEP | stop:RANK@STEP | nan:RANK@STEP | slow:RANK:FACTOR (repeatable; "
        "cloudburst.config.faults; first attempt only)",
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

    def validate(self, cfg: Any) -> None:
        slow: dict[int, float] = {}  # worker index: the product of its slow faults' factors
        if self.inject_fault:
            from cloudburst.config.faults import FaultError, parse_faults

            try:
                faults = parse_faults(self.inject_fault, cfg.job.servers, cfg.world_size)
            except FaultError as e:
                raise ConfigError(f"inject_fault: {e}") from None
            for fault in faults:
                if fault.kind == "slow":
                    index = fault.rank - cfg.job.servers
                    slow[index] = slow.get(index, 1.0) * fault.factor
        # A slow worker's step sleeps (factor - 1) x its compute, and a step of the emulated
        # device at least min_step_time_s x factor: bounded, and below the time the other
        # ranks wait for it (comm_timeout_s).
        slowed = {s.worker for s in cfg.cluster.stragglers} | set(slow)
        factors = {i: cfg.straggler_factor(i) * slow.get(i, 1.0) for i in sorted(slowed)}
        for index, factor in factors.items():
            if not SLOWDOWN.allows(factor, integer=False):
                raise ConfigError(
                    f"straggler: worker {index} would be slowed {factor:g}x (its --straggler "
                    f"factor times its slow: faults); allowed up to {SLOWDOWN.high:g}x"
                )
        most = max(factors.values(), default=1.0)
        floor = cfg.cluster.min_step_time_s
        if floor * most >= self.comm_timeout_s:
            raise ConfigError(
                f"min_step_time_s: {floor:g} s x a slowdown of {most:g} is not "
                f"below comm_timeout_s {self.comm_timeout_s:g} s: the other ranks would time "
                "out waiting for its step; lower it or raise --comm-timeout-s"
            )


@dataclass
class OutputConfig(Section):
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
