"""What the config, the launcher and the runtime know of a strategy before torch is imported.

Each strategy package (``strategies/<name>/``) declares one :class:`StrategySpec` subclass in
its ``__init__.py``: its name, its settings (config sections), its traits, and the checks and
defaults that depend on which strategy runs. Its worker class (``worker.py``) inherits it, so
the traits are the worker class's attributes too, written once. Torch-free: the CLI validates a
config with it before the forkserver imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar

#: The ``--compress`` methods a point-to-point message (θ, Δ) can travel in.
MESSAGE_METHODS = ("bf16", "fp8", "int8")


class StrategySpec:
    name: ClassVar[str]
    #: "module:Class" of the worker class, imported (with torch) when a rank builds it.
    worker: ClassVar[str] = ""
    #: "module:function" that builds its shards' server rule from the config (``needs_servers``;
    #: imported with torch when a shard starts): :meth:`server_rule`.
    rule: ClassVar[str] = ""
    #: "module:function" that serves one shard on a server rank until the workers are done
    #: (``needs_servers``): :meth:`serve_shard`.
    server: ClassVar[str] = ""
    #: "module:function" that turns its shards' reports into ``summary.json`` fields
    #: (``needs_servers``): :meth:`summary_fields`.
    summary: ClassVar[str] = ""
    #: Columns it adds to the table the CLI prints of a run: (heading, summary key, format).
    report_columns: ClassVar[tuple[tuple[str, str, str], ...]] = ()
    #: The settings dataclasses (config sections, flags) this strategy brings; RunConfig is
    #: composed of every registered strategy's.
    settings: ClassVar[tuple[type, ...]] = ()
    #: Its workers talk to parameter-server shards (``--servers`` 1 or more; 0 otherwise).
    needs_servers: ClassVar[bool] = False
    #: The ``--compress`` methods it supports (the rest of the strategies send fp32).
    compression: ClassVar[tuple[str, ...]] = ("none",)
    #: Its point-to-point messages (θ, Δ) travel compressed under ``--compress``.
    compresses_messages: ClassVar[bool] = False
    #: True when the job keeps going if a worker dies (launched with one agent per rank).
    survives_worker_loss: ClassVar[bool] = False
    #: A shard that its agent restarts (--max-restarts) restores its checkpoint, and the
    #: workers reconnect to it instead of failing.
    shards_restart_in_place: ClassVar[bool] = False
    #: Its shards can keep a hot standby copy (``--shard-standby``).
    standby_shards: ClassVar[bool] = False
    #: Why its shards refuse a staleness compensator other than none and scale ("" if not).
    compensation_refused: ClassVar[str] = ""
    #: True when the replicas move together (every worker at the same step is needed to
    #: resume): a resumed run starts every worker from the latest step all of them saved.
    lockstep: ClassVar[bool] = False
    #: True when replicas may still differ at the end (gossip): the loop then reports each
    #: replica's test accuracy and makes the final model their average.
    decentralised: ClassVar[bool] = False
    #: Why ``--replica node`` means nothing for it ("" when a node's workers can be one
    #: replica: the strategy then runs between the nodes, synchronous inside each).
    node_replicas_refused: ClassVar[str] = ""

    @classmethod
    def worker_class(cls) -> type:
        """The worker class (a :class:`~cloudburst.strategies.base.Strategy`)."""
        return load(cls.worker)

    @classmethod
    def changes_optimizer_state(cls, cfg: Any) -> bool:
        """Whether its worker may change its optimizer's state after a step (and then says so
        in ``optimizer_state_changed``): a node replica's leader then sends it to its node."""
        return False

    @classmethod
    def make_groups(cls, cfg: Any, maker: Any) -> dict[str, Any]:
        """The extra process groups it needs, made once by every rank when the job starts
        (:func:`cloudburst.runtime.build_context`, real and virtual) with ``maker`` (a
        :class:`cloudburst.runtime.groups.GroupMaker`), in the same order on every rank: name →
        this rank's group (None where it is in none), its workers' ``ctx.groups``."""
        return {}

    @classmethod
    def message_method(cls, compress: str) -> str:
        """How its point-to-point payloads travel under ``--compress compress``: bf16, fp8 or
        int8, or ``none`` (fp32) for a strategy that sends no such messages."""
        method = compress.partition(":")[0]
        return method if cls.compresses_messages and method in MESSAGE_METHODS else "none"

    @classmethod
    def has_standby(cls, cfg: Any) -> bool:
        """Whether this run's shards keep a hot standby copy (``--shard-standby``): a restarted
        shard then has nothing to do, its standby took it over."""
        return False

    @classmethod
    def shard_rule(cls, cfg: Any) -> tuple[str, float]:
        """(rule, lr) of its parameter-server shards (``needs_servers``), for the config and
        the summary; :meth:`server_rule` builds it."""
        raise NotImplementedError(f"{cls.name} has no parameter-server shards")

    @classmethod
    def server_rule(cls, cfg: Any) -> Any:
        """The :class:`~cloudburst.strategies.asgd.rules.ServerRule` its shards apply pushes
        by (``needs_servers``): :attr:`rule` called with ``cfg``."""
        return cls._servers_part(cls.rule)(cfg)

    @classmethod
    def serve_shard(cls, ctx: Any, theta0: Any, metrics: Any) -> Any:
        """Serve this server rank's shard of θ (``theta0``: the whole starting θ) until every
        worker finished or was lost; the server loop (its ``stats()`` is the rank's report,
        ``gather_final_theta()`` the final θ): :attr:`server` called with the arguments."""
        return cls._servers_part(cls.server)(ctx, theta0, metrics)

    @classmethod
    def summary_fields(cls, servers: list[dict[str, Any]]) -> dict[str, Any]:
        """``summary.json``'s fields from its shards' reports: :attr:`summary` called with
        them ({} for a strategy without shards)."""
        return cls._servers_part(cls.summary)(servers) if cls.summary else {}

    @classmethod
    def _servers_part(cls, ref: str) -> Any:
        if not ref:
            raise NotImplementedError(f"{cls.name} has no parameter-server shards")
        return load(ref)

    @classmethod
    def validate(cls, cfg: Any) -> None:
        """Its own rules on the whole run configuration (called by ``RunConfig.validate`` for
        the strategy that runs, after every concern's checks); raises ConfigError."""

    @classmethod
    def validate_compress(cls, cfg: Any, method: str) -> None:
        """Its own rules on ``--compress`` (``method``, already allowed); raises ConfigError."""

    @classmethod
    def warnings(cls, cfg: Any) -> list[str]:
        """Valid settings known to train badly with it (the CLI prints each, one line)."""
        return []

    @classmethod
    def run_label(cls, summary: dict[str, Any]) -> str:
        """What a plot's legend adds to "strategy W=…" for one of its runs' summary.json."""
        return ""


def load(ref: str) -> Any:
    """The object a "module:name" reference names, its module imported on first use."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def worker_attributes(package: str) -> Callable[[str], Any]:
    """A strategy package's ``__getattr__``: the names of its ``worker`` module (the worker
    class and its helpers), imported with torch on first use, so that importing the package
    for its spec and settings stays torch-free."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(f"{package}.worker"), name)

    return __getattr__
