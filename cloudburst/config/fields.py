"""The building blocks of the config: the allowed values, the one-line error, :func:`option`
(a field with its help and flag spelling) and the checks every concern uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
