"""Strategies: when to communicate, and with whom. The training loop is the same for all."""

from cloudburst.strategies.asgd import AsgdStrategy
from cloudburst.strategies.async_diloco import AsyncDilocoStrategy
from cloudburst.strategies.base import Strategy
from cloudburst.strategies.daso import DasoSchedule, DasoStrategy
from cloudburst.strategies.easgd import EasgdStrategy
from cloudburst.strategies.gossip import GossipStrategy
from cloudburst.strategies.local_sgd import DilocoStrategy, LocalSgdStrategy
from cloudburst.strategies.sync import SyncStrategy

STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    SyncStrategy.name: SyncStrategy,
    AsgdStrategy.name: AsgdStrategy,
    DasoStrategy.name: DasoStrategy,
    LocalSgdStrategy.name: LocalSgdStrategy,
    DilocoStrategy.name: DilocoStrategy,
    GossipStrategy.name: GossipStrategy,
    EasgdStrategy.name: EasgdStrategy,
    AsyncDilocoStrategy.name: AsyncDilocoStrategy,
}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Make ``cls`` (a :class:`Strategy` with a unique ``name``) available as
    ``--strategy NAME`` in this process and the ranks it launches (they are forked from it).
    Usable as a class decorator."""
    from cloudburst.config import REGISTERED_STRATEGIES, STRATEGIES

    if cls.name in STRATEGIES:
        raise ValueError(f"strategy {cls.name!r} is built in")
    STRATEGY_CLASSES[cls.name] = cls
    if cls.name not in REGISTERED_STRATEGIES:
        REGISTERED_STRATEGIES.append(cls.name)
    return cls


def make_strategy(ctx) -> Strategy:
    return STRATEGY_CLASSES[ctx.cfg.strategy](ctx)


__all__ = [
    "STRATEGY_CLASSES",
    "AsgdStrategy",
    "AsyncDilocoStrategy",
    "DasoSchedule",
    "DasoStrategy",
    "DilocoStrategy",
    "EasgdStrategy",
    "LocalSgdStrategy",
    "Strategy",
    "SyncStrategy",
    "make_strategy",
    "register_strategy",
]
