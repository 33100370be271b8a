"""The building blocks of the config: the allowed values, the one-line error, :func:`option`
(a field with its help, flag spelling and allowed range) and the checks every concern uses.

Every numeric field carries its :class:`Bounds` (``option(..., bounds=...)``), checked once by
:func:`check_bounds` before a concern's own checks: a value that passes cannot overflow what
is computed from it downstream (a sleep, a timedelta, a derived seed, an int64 step count).
A test walks the fields, so a numeric field without a range fails it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "cosine")
MODELS = ("mlp", "cnn", "resnet20", "convnet", "gpt")  # or a "package.module:function" factory
DATASETS = ("mnist1d", "synthetic", "cifar10:PATH", "imagefolder:PATH", "npz:PATH", "text:PATH")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
AUTOCASTS = ("none", "bf16")
# Built-in datasets' default sizes; a dataset read from a path uses all of it by default.
DEFAULT_SIZES = {"mnist1d": (4000, 1000), "synthetic": (4000, 1000)}


class ConfigError(ValueError):
    """An invalid run configuration. ``str(err)`` is a one-line message for the user."""


def _number_text(x: float) -> str:
    """``65_536`` or ``0.0``, ``86_400.0``, ``1e-06``: as a flag accepts it back."""
    return f"{x:_}"


@dataclass(frozen=True)
class Bounds:
    """The values a numeric setting allows: ``low`` .. ``high`` (each end closed unless
    ``*_open``), finite; an int field's value must also be an int (never a bool)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def allows(self, value: Any, integer: bool) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def text(self, integer: bool) -> str:
        """``an integer >= 1 and <= 65_536``, ``a number > 0.0 and <= 100.0``."""
        lo, hi = (self.low, self.high) if integer else (float(self.low), float(self.high))
        lo_op, hi_op = (">" if self.low_open else ">="), ("<" if self.high_open else "<=")
        kind = "an integer" if integer else "a number"
        return f"{kind} {lo_op} {_number_text(lo)} and {hi_op} {_number_text(hi)}"

    def check(self, name: str, value: Any, integer: bool) -> None:
        if not self.allows(value, integer):
            raise ConfigError(f"{name}: {value!r} is not allowed; use {self.text(integer)}")


# The ranges the fields share. Counts of steps (steps, periods, intervals) stay far below
# int64 even multiplied by a batch size (2^40 · 2^20 = 2^60); seconds stay below what a
# sleep, a socket or a timedelta takes; a learning rate of at most 100 cannot turn θ into inf
# in its first step the way 1e308 did (issue 44).
MAX_STEPS = 2**40
STEP_COUNT = Bounds(1, MAX_STEPS)  # steps, periods, every-N intervals
STEP_COUNT_OR_0 = Bounds(0, MAX_STEPS)  # the same, 0: off
MAX_WORKERS = 65_536
MAX_SAMPLES = 2**32
MAX_EPOCHS = 1_000_000.0
MAX_LR = 100.0
LR = Bounds(0.0, MAX_LR, low_open=True)
MOMENTUM = Bounds(0.0, 1.0, high_open=True)
FRACTION = Bounds(0.0, 1.0)
MAX_TIMEOUT_S = 86_400.0  # a day: comm and heartbeat timeouts, a step's emulated time
TIMEOUT_S = Bounds(0.0, MAX_TIMEOUT_S, low_open=True)
MAX_BUDGET_S = 1e8  # about 3 years: time budgets and evaluation intervals
# torch.manual_seed and numpy take seeds below 2^64 and 2^32; a worker's data order is seeded
# with (seed · 1000 + worker) · 1_000_003 + epoch (cloudburst.loop.role, cloudburst.data), which
# stays below 2^63 for a seed below 2^32.
SEED = Bounds(0, 2**32 - 1)
# Links: 1 kbit/s to 1 Pbit/s, latency up to a minute (a message's emulated time is a sleep).
MIN_GBIT_PER_S, MAX_GBIT_PER_S, MAX_LATENCY_MS = 1e-6, 1e6, 60_000.0
LINK_GBIT_PER_S = Bounds(MIN_GBIT_PER_S, MAX_GBIT_PER_S)
LINK_LATENCY_MS = Bounds(0.0, MAX_LATENCY_MS)
# A straggler's (and an injected slow fault's) slowdown: its step sleeps (factor - 1) times its
# compute; a worker's factors multiply, and their product is held to this too.
SLOWDOWN = Bounds(1.0, 1000.0)


def is_numeric(f: Any) -> bool:
    """A field whose value is a number: ``int``, ``float`` or either ``| None``."""
    return str(f.type).removesuffix(" | None") in ("int", "float")


def check_bounds(config: Any) -> None:
    """Each numeric field of the dataclass ``config`` within its :class:`Bounds` (None, where
    the field allows it, is left to its concern: a default decided later)."""
    flat = type(config).flat if isinstance(config, Section) else str
    for f in dataclasses.fields(config):
        bounds = f.metadata.get("bounds")
        value = getattr(config, f.name)
        if bounds is not None and value is not None:
            bounds.check(flat(f.name), value, str(f.type).startswith("int"))


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
    bounds: Bounds | None = None,
) -> Any:
    """A setting: its default and what ``cloudburst train --help`` says about it.

    ``flag``: the flag when it is not ``--field-name`` (a setting that defaults to True gets a
    switch that turns it off, ``--no-field-name`` unless named here); ``shown``: the default
    as the help prints it where the value alone does not say (None: decided later);
    ``aliases``: other keys accepted for it in files and dicts; ``factory``: a default made
    per config (lists); ``cli=False``: no generated flag; ``bounds``: the range of a numeric
    setting (required for one: :func:`check_bounds`).
    """
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "metavar": metavar,
        "shown": shown,
        "aliases": aliases,
        "cli": cli,
        "bounds": bounds,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------- the concerns
class Section:
    """A concern of the config: a dataclass of :func:`option` fields that is one section of a
    ``RunConfig`` (``cfg.<section>``), one ``[section]`` of a TOML file and one group of
    ``--help``.

    Each field also has a *flat* name, the one its flag, its top-level TOML key and a run's
    config.json use: the field's own name, or ``prefix`` + it (``[daso] global_skip`` is
    ``daso_global_skip``, ``cfg.daso.global_skip``), or what ``flat_names`` says. ``defaults``
    fills the values left open and ``validate`` checks the section; both are given the whole
    ``RunConfig`` (``cfg``), where a check that needs another concern's value (the number of
    workers, say) reads it.
    """

    section: ClassVar[str]
    title: ClassVar[str]
    prefix: ClassVar[str] = ""
    flat_names: ClassVar[dict[str, str]] = {}

    @classmethod
    def flat(cls, name: str) -> str:
        """The flat name of field ``name``."""
        return cls.flat_names.get(name, cls.prefix + name)

    def defaults(self, cfg: Any) -> None:
        """Fill the values left open that depend on other concerns (none by default)."""

    def validate(self, cfg: Any) -> None:
        """Check this section's values, beyond their ranges (none by default)."""


def field_message(field_name: str, err: Exception) -> str:
    """``field: message`` unless the message already starts with the field's name."""
    text = str(err)
    return text if text.startswith(field_name) else f"{field_name}: {text}"


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: {value!r} is not allowed; choose one of {', '.join(allowed)}")


def check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}: {value!r} is not allowed; use an integer >= {minimum}")


def check_float(
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
