"""The virtual cluster's clock model (``cloudburst simulate`` only; not part of a run's
:class:`~cloudburst.config.RunConfig`): how long a step, a message, a collective and a
server's apply take in virtual seconds.

Step time comes from exactly one place, in this order: ``--step-time-s`` (or
``--step-time-per-sample-s`` x batch size, or the stand-in's ``--modelled-step-time-s``), then
``--calibrate``, then a ``--profile``'s published throughput, then the run's
``--min-step-time-s`` if it is > 0, and otherwise a calibration on this machine
(:func:`cloudburst.sim.clock.resolve_step_time`). An explicit flag always wins over a profile.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from cloudburst.config.fields import (
    LINK_GBIT_PER_S,
    MAX_STEPS,
    MAX_TIMEOUT_S,
    Bounds,
    ConfigError,
    check_bounds,
    option,
)

JITTER_KINDS = ("lognormal", "pareto")
NETWORK_MODELS = ("flat", "nccl")
# A modelled step of up to a day, per sample up to an hour.
STEP_TIME_S = Bounds(0.0, MAX_TIMEOUT_S, low_open=True)
# lognormal's coefficient of variation, Pareto's shape: beyond these the noise is no longer a
# device's (a CV of 10 is a step 100x its mean once in a few hundred).
MAX_JITTER_CV, MAX_PARETO_ALPHA = 10.0, 1000.0


@dataclass(frozen=True)
class StandInProfile:
    """A model the clock stands in for: its parameter count and a measured or published
    training throughput on one device (samples/s at ``batch_size``).

    A step of a run's batch B is charged B / ``samples_per_s`` seconds: the throughput is
    taken as independent of the batch size, which holds near the published batch only.
    """

    name: str
    params: int
    samples_per_s: float
    batch_size: int
    device: str
    source: str
    gpu: bool = True  # the device is a GPU (its collectives: NCCL's)

    def step_time_s(self, batch_size: int) -> float:
        return batch_size / self.samples_per_s


# torchvision's resnet50 has 25,557,032 parameters (ResNet-50 v1.5 has the same count).
_RESNET50_PARAMS = 25_557_032
# Throughputs: NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/
# README.md, "Training performance results" (pytorch-21.03 NGC container, 1 GPU):
# DGX-1 16GB (V100 16GB): 367 img/s FP32, 1200 img/s mixed precision;
# DGX A100 80GB: 2470 img/s mixed precision. Batch 256 per GPU (the README's default).
# ResNet-20 on an H100: this repository's benchmarks/results/throughput_cuda.md, "resnet20
# sync W=1", 15552 samples/s at batch 128 (fp32, 2 DataLoader processes; 269,722 parameters).
PROFILES: dict[str, StandInProfile] = {
    p.name: p
    for p in (
        StandInProfile(
            "resnet50-v100",
            _RESNET50_PARAMS,
            1200.0,
            256,
            "V100 16GB, mixed precision",
            "NVIDIA DeepLearningExamples ResNet50 v1.5 (PyTorch), DGX-1 1 GPU AMP: 1200 img/s",
        ),
        StandInProfile(
            "resnet50-v100-fp32",
            _RESNET50_PARAMS,
            367.0,
            256,
            "V100 16GB, fp32",
            "NVIDIA DeepLearningExamples ResNet50 v1.5 (PyTorch), DGX-1 1 GPU FP32: 367 img/s",
        ),
        StandInProfile(
            "resnet50-a100",
            _RESNET50_PARAMS,
            2470.0,
            256,
            "A100 80GB, mixed precision",
            "NVIDIA DeepLearningExamples ResNet50 v1.5 (PyTorch), DGX A100 1 GPU AMP: 2470 img/s",
        ),
        StandInProfile(
            "resnet20-h100",
            269_722,
            15552.0,
            128,
            "H100 80GB, fp32",
            "cloudburst benchmarks/results/throughput_cuda.md, resnet20 sync W=1: 15552 samples/s",
        ),
    )
}


@dataclass(frozen=True)
class Jitter:
    """A seeded multiplicative noise on each step's time, mean 1.

    ``lognormal:CV``: exp(N(μ, σ²)) with σ² = ln(1 + CV²), μ = −σ²/2 (mean 1, coefficient of
    variation CV). ``pareto:ALPHA``: a Pareto with shape α > 1 and scale (α−1)/α (mean 1;
    heavy-tailed, infinite variance for α ≤ 2).
    """

    kind: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Jitter:
        kind, sep, number = str(text).partition(":")
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if not sep or kind not in JITTER_KINDS or not math.isfinite(value):
            raise ConfigError(
                f"step_time_jitter: {text!r} is not lognormal:CV or pareto:ALPHA "
                "(e.g. lognormal:0.1 or pareto:3)"
            )
        if kind == "lognormal" and not 0 <= value <= MAX_JITTER_CV:
            raise ConfigError(
                f"step_time_jitter: {text!r}: the coefficient of variation must be >= 0 and "
                f"<= {MAX_JITTER_CV:g}"
            )
        if kind == "pareto" and not 1 < value <= MAX_PARETO_ALPHA:
            raise ConfigError(
                f"step_time_jitter: {text!r}: the Pareto shape ALPHA must be > 1 (its mean is "
                f"infinite otherwise) and <= {MAX_PARETO_ALPHA:g}; e.g. pareto:3"
            )
        return cls(kind, value)

    def sample(self, u: float) -> float:
        """The multiplier for a uniform ``u`` in (0, 1) (inverse transform: pure in ``u``)."""
        if self.kind == "lognormal":
            if self.value == 0:
                return 1.0
            from statistics import NormalDist

            sigma2 = math.log1p(self.value**2)
            return math.exp(-sigma2 / 2 + math.sqrt(sigma2) * NormalDist().inv_cdf(u))
        alpha = self.value
        return (alpha - 1) / alpha * (1.0 - u) ** (-1.0 / alpha)


@dataclass
class SimulationConfig:
    """The clock of a simulated run: step time, its noise, the links, the stand-in model."""

    section: ClassVar[str] = "simulation"
    title: ClassVar[str] = "simulation: the clock model (virtual seconds)"

    step_time_s: float | None = option(
        None,
        "modelled compute seconds of one training step on the modelled device",
        shown="the profile's, else --min-step-time-s if > 0, else calibrated",
        bounds=STEP_TIME_S,
    )
    step_time_per_sample_s: float | None = option(
        None,
        "modelled compute seconds per sample: a step costs this x --batch-size",
        shown="none",
        bounds=Bounds(0.0, 3600.0, low_open=True),
    )
    calibrate: bool = option(
        False,
        "measure the step time: real forward/backward/optimizer steps of the run's model and "
        "batch on this machine (warm-up excluded, median)",
    )
    step_time_jitter: str | None = option(
        None,
        "seeded noise multiplying each step: lognormal:CV (mean 1) or pareto:ALPHA "
        "(heavy-tailed, mean 1, ALPHA > 1)",
        metavar="KIND:VALUE",
        shown="none",
    )
    intra_node_link: str | None = option(
        None,
        "the link between ranks of one node",
        metavar="GBIT_PER_S[,LATENCY_MS]",
        shown="free, no cost",
    )
    nic_ingress_gbit_per_s: float | None = option(
        None,
        "a node NIC's ingress bandwidth (its egress is --inter-node-link's); messages into one "
        "node queue there (incast)",
        shown="--inter-node-link's",
        bounds=LINK_GBIT_PER_S,
    )
    network_model: str | None = option(
        None,
        "collectives: flat (a ring on the slowest link spanned; sync's all-reduce after "
        "backward) or nccl (hierarchical with several ranks per node, ring/tree/halving-"
        "doubling by size, DDP's 25 MB buckets overlapped with backward)",
        choices=NETWORK_MODELS,
        shown="nccl where the run models GPUs (a GPU --profile, or --device cuda), else flat",
    )
    server_apply_gbyte_per_s: float = option(
        10.0,
        "a parameter-server shard applies an update at this many GB/s (cost: the update's "
        "bytes / this; ~10 GB/s is one CPU core streaming through memory)",
        bounds=Bounds(1e-6, 1e6),
    )
    modelled_params: int | None = option(
        None,
        "stand-in model: messages carry this many parameters' worth of bytes (float payloads "
        "scaled by it / the run's parameters) while the run's small model does the maths",
        shown="the profile's, else the run's model",
        bounds=Bounds(1, MAX_STEPS),
    )
    modelled_step_time_s: float | None = option(
        None,
        "stand-in model: its seconds per step (the same as --step-time-s; give one)",
        shown="none",
        bounds=STEP_TIME_S,
    )
    profile: str | None = option(
        None,
        "a stand-in model from published figures: its parameters and its step time at "
        "--batch-size (explicit flags win)",
        choices=tuple(PROFILES),
        shown="none",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_bounds(self)
        given = [
            name
            for name in ("step_time_s", "step_time_per_sample_s", "modelled_step_time_s")
            if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise ConfigError(f"{given[1]}: cannot be combined with {given[0]}; give one step time")
        if self.calibrate and given:
            raise ConfigError(
                f"calibrate: cannot be combined with {given[0]}; measure the step time or give it"
            )
        if self.step_time_jitter is not None:
            Jitter.parse(self.step_time_jitter)
        if self.intra_node_link is not None:
            from cloudburst.config.cluster import check_link

            check_link("intra_node_link", self.intra_node_link)
        if self.network_model is not None and self.network_model not in NETWORK_MODELS:
            raise ConfigError(
                f"network_model: {self.network_model!r} is not allowed; choose flat or nccl"
            )
        if self.profile is not None and self.profile not in PROFILES:
            near = difflib.get_close_matches(str(self.profile), sorted(PROFILES), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"profile: {self.profile!r} is not allowed; choose one of "
                f"{', '.join(PROFILES)}{hint}"
            )

    # ------------------------------------------------------------------ derived values
    @property
    def jitter(self) -> Jitter | None:
        return None if self.step_time_jitter is None else Jitter.parse(self.step_time_jitter)

    @property
    def stand_in(self) -> StandInProfile | None:
        return None if self.profile is None else PROFILES[self.profile]

    def network_model_for(self, device: str) -> tuple[str, str]:
        """(the network model, why) for a run on ``device`` (its ``--device``): the flag, else
        ``nccl`` where the run models GPUs (a GPU ``--profile``, or ``cuda``), else ``flat``
        (the CPU emulation's collectives: gloo's ring)."""
        if self.network_model is not None:
            return self.network_model, "--network-model"
        stand_in = self.stand_in
        if stand_in is not None and stand_in.gpu:
            return "nccl", f"the run models GPUs: --profile {stand_in.name}"
        if device == "cuda":
            return "nccl", "the run models GPUs: --device cuda"
        return "flat", "the run models the CPU emulation"

    @property
    def stand_in_params(self) -> int | None:
        """The parameter count the clock charges bytes for: the flag, else the profile's."""
        if self.modelled_params is not None:
            return self.modelled_params
        return None if self.stand_in is None else self.stand_in.params

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SimulationConfig:
        from cloudburst.config import coerce_value

        values = {k.replace("-", "_"): v for k, v in values.items()}
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else " (see cloudburst simulate --help)"
            raise ConfigError(f"simulation: unknown field {unknown[0]!r}{hint}")
        return cls(**{k: coerce_value(k, known[k].type, v) for k, v in values.items()})
