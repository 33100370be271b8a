"""Where the job's ranks sit: the nodes torchrun started, the shard placement
(``--shard-placement``) on them, and the job rank each launch rank becomes.
"""

from __future__ import annotations

import os

from cloudburst.comm.link import Topology
from cloudburst.config import RunConfig


def launched_nodes(world: int) -> tuple[int, int]:
    """(nodes, ranks per node) as torchrun started them; (1, world) for one launch."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if "CLOUDBURST_LOCAL_JOB" not in os.environ and 0 < local < world and world % local == 0:
        return world // local, local
    return 1, world


def role_ranks(topology: Topology, ranks_per_node: int, placement: str = "spread") -> list[int]:
    """``role[r]``: the job rank (0..S-1 shards, then the workers) of torchrun's launch rank
    ``r``, which runs on node ``r // ranks_per_node`` (torchrun numbers each node's ranks
    contiguously). The job ranks of launch node ``n`` are exactly those ``topology`` puts on
    node ``n``, in increasing order. Raises ValueError (one line) when ``topology`` does not
    put ``ranks_per_node`` ranks on every node (``placement`` names it in the message)."""
    world, local = len(topology.node_of), ranks_per_node
    if local < 1 or world % local:
        raise ValueError(f"{world} ranks do not make nodes of {local} ranks each")
    on_node = [topology.ranks_on(n) for n in range(world // local)]
    counts = [len(ranks) for ranks in on_node]
    if any(c != local for c in counts):
        raise ValueError(
            f"shard_placement {placement!r} puts {','.join(map(str, counts))} ranks on nodes "
            f"0..{len(counts) - 1}, but torchrun started {local} on each; choose "
            "--shard-placement, --servers and --workers that put as many on every node"
        )
    return [rank for ranks in on_node for rank in ranks]


def _placed(cfg: RunConfig, nodes: int, ranks_per_node: int | None = None) -> Topology:
    """The job's layout on ``nodes`` nodes (:meth:`Topology.place`; torchrun's machines of
    ``ranks_per_node`` ranks each); RuntimeError (one line) where it cannot be."""
    try:
        return Topology.place(
            cfg.job.workers, cfg.job.servers, nodes, cfg.cluster.shard_placement, ranks_per_node
        )
    except ValueError as e:
        raise RuntimeError(f"shard_placement: {e}") from None


def shards_line(topology: Topology, servers: int, placement: str) -> str:
    """``"; shards on nodes 0,1 (spread)"`` for a start-up line; empty without shards."""
    if not servers:
        return ""
    nodes = ",".join(map(str, topology.shard_nodes(servers)))
    return f"; shards on nodes {nodes} ({placement})"


def placement_label(cfg: RunConfig, world: int) -> str:
    """How the shards were placed, for the start-up line: ``--shard-placement``, or torchrun's
    order under one agent per rank (:func:`resolve_topology`)."""
    nodes, local = launched_nodes(world)
    if nodes > 1 and local == 1:
        return "torchrun's order, one agent per rank"
    return cfg.cluster.shard_placement


def topology_mismatch(cfg: RunConfig, world: int) -> str | None:
    """A one-line message when ``--nodes`` disagrees with the nodes torchrun started, or when
    the shard placement does not put torchrun's ranks per node on every node."""
    nodes, local = launched_nodes(world)
    if nodes > 1 and cfg.cluster.nodes not in (None, nodes):
        return (
            f"nodes: the config says {cfg.cluster.nodes} nodes, but torchrun started {nodes} nodes "
            f"of {local} ranks each; drop --nodes or make them agree"
        )
    if nodes > 1 and local > 1 and world == cfg.world_size:
        try:
            role_ranks(_placed(cfg, nodes, local), local, cfg.cluster.shard_placement)
        except (RuntimeError, ValueError) as e:
            return str(e)
    return None


def resolve_topology(cfg: RunConfig, world: int) -> Topology:
    """The job's layout (:meth:`Topology.place`: shards where ``--shard-placement`` says,
    workers in contiguous blocks) on the nodes torchrun started (``LOCAL_WORLD_SIZE`` ranks
    each; each rank joined under its job rank, :func:`launch_rank_to_role`), or on ``--nodes
    N`` emulated nodes of one launch. One torchrun agent per rank (``LOCAL_WORLD_SIZE`` 1, as
    asgd is launched to survive a worker's death) tells nothing of the machines: each rank is
    a node of its own, in torchrun's order, as before shard placement."""
    problem = topology_mismatch(cfg, world)
    if problem:
        raise RuntimeError(problem)
    nodes, local = launched_nodes(world)
    if nodes > 1 and local == 1:
        return Topology(tuple(range(world)))
    if nodes > 1:
        return _placed(cfg, nodes, local)
    return _placed(cfg, cfg.cluster.nodes or 1)


def launch_rank_to_role(cfg: RunConfig, world: int) -> int:
    """This rank's job rank. Under a multi-node torchrun, torchrun's ``RANK`` (its launch
    rank, contiguous per node) becomes the job rank the shard placement puts on this node
    (:func:`role_ranks`): ``RANK`` is set to it before the world group is formed (torchrun's
    is kept in ``CLOUDBURST_LAUNCH_RANK``; ``LOCAL_RANK`` still picks the GPU). One node, or
    one agent per rank (:func:`resolve_topology`): ``RANK`` as it is."""
    launch = int(os.environ.get("CLOUDBURST_LAUNCH_RANK", os.environ["RANK"]))
    nodes, local = launched_nodes(world)
    if nodes < 2 or local == 1:
        return launch
    problem = topology_mismatch(cfg, world)
    if problem:
        raise RuntimeError(problem)
    roles = role_ranks(_placed(cfg, nodes, local), local, cfg.cluster.shard_placement)
    if roles.index(0) >= local and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        # env:// without the agent's store: rank 0 hosts the store on torchrun's node 0.
        raise RuntimeError(
            f"shard_placement {cfg.cluster.shard_placement!r} puts shard 0 off torchrun's node 0, "
            "where rank 0 must host the job's store here; unset "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE or use --shard-placement spread"
        )
    os.environ["CLOUDBURST_LAUNCH_RANK"] = str(launch)
    os.environ["RANK"] = str(roles[launch])
    return roles[launch]
