"""Strategies: when to communicate, and with whom. The training loop is the same for all.

The registry: one line per strategy, its package's :class:`StrategySpec` (torch-free, so the CLI
can validate a config before torch is imported); the worker classes are imported when a rank
builds one (:func:`cloudburst.strategies.replica.make_strategy`). Adding a strategy: its folder
``strategies/<name>/`` and one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from cloudburst.strategies.asgd import Asgd
from cloudburst.strategies.async_diloco import AsyncDiloco
from cloudburst.strategies.daso import Daso
from cloudburst.strategies.diloco import Diloco
from cloudburst.strategies.easgd import Easgd
from cloudburst.strategies.gossip import Gossip
from cloudburst.strategies.local_sgd import LocalSgd
from cloudburst.strategies.spec import StrategySpec
from cloudburst.strategies.sync import Sync

#: Every strategy by name, in the order ``--help`` lists them; plug-ins are added by
#: :func:`register_strategy`.
REGISTRY: dict[str, type[StrategySpec]] = {
    spec.name: spec
    for spec in (
        Sync,
        Asgd,
        Daso,
        LocalSgd,
        Diloco,
        Easgd,
        Gossip,
        AsyncDiloco,
    )
}
BUILT_IN = tuple(REGISTRY)


def strategy_spec(name: str) -> type[StrategySpec]:
    """The registered strategy ``name``; for a name nobody registered, the defaults (no
    servers, no compression: the config then refuses the name)."""
    return REGISTRY.get(name, StrategySpec)


def settings_classes() -> tuple[type, ...]:
    """The built-in strategies' settings dataclasses, each once, in registry order."""
    return tuple(dict.fromkeys(s for name in BUILT_IN for s in REGISTRY[name].settings))


def register_strategy(cls: type) -> type:
    """Make ``cls`` (a :class:`StrategySpec` naming its worker, or a :class:`Strategy`, which
    is its own spec; with a unique ``name``) available as
    ``--strategy NAME`` in this process and the ranks it launches (they are forked from it).
    Usable as a class decorator."""
    if cls.name in BUILT_IN:
        raise ValueError(f"strategy {cls.name!r} is built in")
    REGISTRY[cls.name] = cls
    return cls


class _WorkerClasses(Mapping):
    """The registry's worker classes by name, each imported when first looked up."""

    def __getitem__(self, name: str) -> type:
        return REGISTRY[name].worker_class()

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY)

    def __len__(self) -> int:
        return len(REGISTRY)

    def __repr__(self) -> str:
        return repr(tuple(REGISTRY))


STRATEGY_CLASSES: Mapping[str, type] = _WorkerClasses()


def __getattr__(name: str) -> Any:
    """``Strategy`` and the worker classes (``AsgdStrategy``, ...), imported on first use."""
    if name == "Strategy":
        return importlib.import_module("cloudburst.strategies.base").Strategy
    for spec in REGISTRY.values():
        if spec.worker.endswith(f":{name}"):
            return spec.worker_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILT_IN",
    "REGISTRY",
    "STRATEGY_CLASSES",
    "StrategySpec",
    "register_strategy",
    "settings_classes",
    "strategy_spec",
]
