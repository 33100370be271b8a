"""Strategies: when to communicate, and with whom. The training loop is the same for all."""

from cloudburst.strategies.asgd import AsgdStrategy
from cloudburst.strategies.base import Strategy
from cloudburst.strategies.sync import SyncStrategy

STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    SyncStrategy.name: SyncStrategy,
    AsgdStrategy.name: AsgdStrategy,
}


def make_strategy(ctx) -> Strategy:
    return STRATEGY_CLASSES[ctx.cfg.strategy](ctx)


__all__ = ["STRATEGY_CLASSES", "AsgdStrategy", "Strategy", "SyncStrategy", "make_strategy"]
