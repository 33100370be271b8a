"""The job and the cluster it runs on: world size and roles (:class:`JobConfig`), and the nodes,
their links, shard placement, device emulation and stragglers (:class:`ClusterConfig`);
:func:`check_link`, the check of a ``GBIT_PER_S[,LATENCY_MS]`` link the simulator's settings
share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cloudburst.config.fields import (
    LINK_GBIT_PER_S,
    LINK_LATENCY_MS,
    MAX_TIMEOUT_S,
    MAX_WORKERS,
    SLOWDOWN,
    Bounds,
    ConfigError,
    Section,
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


@dataclass
class JobConfig(Section):
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

    def validate(self, cfg: Any) -> None:
        check_choice("strategy", self.strategy, tuple(REGISTRY))
        if cfg.strategy_spec.needs_servers and self.servers < 1:
            raise ConfigError(
                f"servers: {self.servers} is not allowed for strategy {self.strategy!r}; "
                "use --servers 1 or more"
            )
        if not cfg.strategy_spec.needs_servers and self.servers != 0:
            raise ConfigError(
                f"servers: {self.servers} is not allowed for strategy {self.strategy!r}, "
                "which uses no parameter server; use --servers 0"
            )


@dataclass
class ClusterConfig(Section):
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
        "gossip and daso's global syncs; powersgd[:RANK[:START]] (start: the first compressed "
        "step, after a warm-up of plain all-reduce) "
        "for sync (PyTorch's DDP hook)",
        metavar="none|bf16|fp8|int8|powersgd[:RANK[:START]]",
    )

    def validate(self, cfg: Any) -> None:
        if self.nodes is not None:
            if self.nodes > cfg.world_size:
                raise ConfigError(
                    f"nodes: {self.nodes} is more than the job's {cfg.world_size} ranks"
                )
        self._validate_replicas(cfg)
        if self.inter_node_link is not None:
            check_link("inter_node_link", self.inter_node_link)
        for s in self.stragglers:
            if not 0 <= s.worker < cfg.job.workers:
                raise ConfigError(
                    f"straggler: worker {s.worker} does not exist; allowed 0..{cfg.job.workers - 1}"
                )
            SLOWDOWN.check("straggler factor", s.factor, integer=False)
        from cloudburst.comm.compress import Compression

        try:
            method = Compression.parse(self.compress).method
        except ValueError as e:
            raise ConfigError(f"compress: {e}") from None
        allowed = cfg.strategy_spec.compression
        if method not in allowed:
            raise ConfigError(
                f"compress: {self.compress!r} is not available for strategy {cfg.job.strategy!r}; "
                f"use {', '.join(allowed)}"
            )
        cfg.strategy_spec.validate_compress(cfg, method)

    def _validate_replicas(self, cfg: Any) -> None:
        check_choice("replica", self.replica, ("rank", "node"))
        if self.replica == "node":
            spec = cfg.strategy_spec
            if spec.node_replicas_refused:
                raise ConfigError(
                    f"replica: node is not allowed for strategy {cfg.job.strategy!r} "
                    f"({spec.node_replicas_refused}); use --replica rank"
                )
            if not self.nodes or self.nodes < 2:
                raise ConfigError(
                    "replica: node needs --nodes N (N >= 2): each node's workers make one replica"
                )
            if spec.survives_worker_loss and cfg.faults.max_restarts:
                raise ConfigError(
                    f"replica: node with --max-restarts {cfg.faults.max_restarts} is not allowed "
                    f"for strategy {cfg.job.strategy!r}: a restarted worker cannot rejoin its "
                    "node's group; use --max-restarts 0 (resume the job with --resume OUT)"
                )
            nodes = cfg.worker_nodes
            if cfg.job.workers % nodes:
                raise ConfigError(
                    f"replica: node needs the same number of workers on every node; "
                    f"{cfg.job.workers} workers do not split evenly over {nodes} worker nodes"
                )
            if cfg.job.workers // nodes < 2:
                raise ConfigError(
                    f"replica: node with {cfg.job.workers} workers on {nodes} nodes puts one "
                    "worker on each node, which is --replica rank; use more workers per node"
                )
        from cloudburst.comm.link import Topology

        try:
            Topology.place(cfg.job.workers, cfg.job.servers, self.nodes or 1, self.shard_placement)
        except ValueError as e:
            raise ConfigError(f"shard_placement: {e}") from None
