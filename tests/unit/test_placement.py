"""Shard placement over nodes: the layouts, torchrun's launch ranks turned into job ranks, each
node's NIC bytes on the virtual cluster, and the network model chosen by what the run models."""

from __future__ import annotations

import os
import re

import pytest

from cloudburst.comm.link import Topology
from cloudburst.config import ConfigError, RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.runtime.placement import (
    launch_rank_to_role,
    placement_label,
    resolve_topology,
    role_ranks,
    shards_line,
    topology_mismatch,
)
from cloudburst.sim.clock import ClockModel
from cloudburst.sim.run import simulate


# ---------------------------------------------------------------------------- layouts
@pytest.mark.parametrize(
    "args, node_of",
    [
        ((8, 4, 4, "spread"), (0, 1, 2, 3, 0, 0, 1, 1, 2, 2, 3, 3)),  # shard k on node k mod N
        ((4, 3, 2), (0, 1, 0, 0, 0, 1, 1)),  # spread is the default; workers in blocks
        ((4, 2, 2, "first"), (0, 0, 0, 0, 1, 1)),
        ((4, 2, 3, "own"), (2, 2, 0, 0, 1, 1)),  # the shards on the last node, without workers
        ((4, 2, 2, " 1,0 "), (1, 0, 0, 0, 1, 1)),
        ((3, 0, 1), (0, 0, 0)),  # no shards, one node
        # on torchrun's machines of R ranks, workers fill the places the shards leave
        ((3, 1, 2, "spread", 2), (0, 0, 1, 1)),
        ((4, 2, 2, "spread", 3), (0, 1, 0, 0, 1, 1)),
    ],
)
def test_a_placement_puts_the_shards_and_the_workers_on_their_nodes(args, node_of):
    topo = Topology.place(*args)
    assert topo.node_of == node_of
    assert topo.shard_nodes(args[1]) == list(node_of[: args[1]])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, 2, 1, "own"), "'own' needs 2 or more nodes"),
        ((4, 2, 2, "near"), "'near' is not spread, first, own or a list of node numbers"),
        ((4, 2, 2, "0"), "'0' names 1 node(s) for 2 shard(s); give one node per shard"),
        ((4, 2, 2, "0,2"), "'0,2' names node 2, which does not exist; the job's nodes are 0..1"),
        ((1, 1, 3, "own"), "1 workers cannot fill 2 worker node(s)"),
        ((2, 1, 3, "spread"), "2 workers cannot fill 3 worker node(s)"),
    ],
)
def test_impossible_placements_raise_one_line(args, message):
    with pytest.raises(ValueError) as e:
        Topology.place(*args)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_the_config_refuses_an_impossible_placement_in_one_line():
    with pytest.raises(ConfigError, match=r"^shard_placement: '0,5' names node 5"):
        RunConfig(strategy="asgd", workers=4, servers=2, nodes=2, shard_placement="0,5")


def test_the_start_up_line_says_where_each_shard_is():
    assert shards_line(Topology.place(4, 2, 2), 2, "spread") == "; shards on nodes 0,1 (spread)"
    assert shards_line(Topology.place(4, 2, 3, "own"), 2, "own") == "; shards on nodes 2,2 (own)"
    assert shards_line(Topology.place(4, 0, 2), 0, "spread") == ""


# ---------------------------------------------------------------------------- torchrun
def test_role_ranks_follow_the_placement_node_by_node_in_increasing_order():
    # spread, 2 shards + 4 workers on 2 nodes of 3: node 0 holds shard 0 and workers 2, 3;
    # node 1 shard 1 and workers 4, 5. torchrun's ranks 0..2 are node 0's, 3..5 node 1's.
    topo = Topology.place(4, 2, 2, "spread")
    assert topo.node_of == (0, 1, 0, 0, 1, 1)
    roles = role_ranks(topo, 3)
    assert roles == [0, 2, 3, 1, 4, 5]
    assert [topo.node_of[role] for role in roles] == [0, 0, 0, 1, 1, 1]
    # own, 2 shards + 4 workers on 3 nodes of 2: the shards are launch node 2's ranks
    assert role_ranks(Topology.place(4, 2, 3, "own"), 2, "own") == [2, 3, 4, 5, 0, 1]
    assert role_ranks(Topology.place(4, 0, 2), 2) == [0, 1, 2, 3]  # no shards: the identity


def test_role_ranks_refuse_a_placement_that_torchrun_cannot_start():
    with pytest.raises(ValueError) as e:
        role_ranks(Topology.place(4, 2, 2, "first"), 3, "first")
    assert str(e.value) == (
        "shard_placement 'first' puts 4,2 ranks on nodes 0..1, but torchrun started 3 on "
        "each; choose --shard-placement, --servers and --workers that put as many on every "
        "node"
    )


def _torchrun(monkeypatch, rank: int, world: int, local: int) -> None:
    for var in ("CLOUDBURST_LOCAL_JOB", "CLOUDBURST_LAUNCH_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local)):
        monkeypatch.setenv(var, str(value))


def _asgd(placement: str = "spread", **kw) -> RunConfig:
    return RunConfig(strategy="asgd", workers=4, servers=2, shard_placement=placement, **kw)


def test_a_torchrun_rank_joins_under_the_job_rank_its_node_holds(monkeypatch):
    cfg = _asgd()
    _torchrun(monkeypatch, 3, 6, 3)  # the first rank of torchrun's node 1
    assert launch_rank_to_role(cfg, 6) == 1  # shard 1 is on node 1
    assert (os.environ["RANK"], os.environ["CLOUDBURST_LAUNCH_RANK"]) == ("1", "3")
    assert launch_rank_to_role(cfg, 6) == 1  # again: from torchrun's rank, not the new one
    assert resolve_topology(cfg, 6).node_of == (0, 1, 0, 0, 1, 1)
    assert topology_mismatch(cfg, 6) is None


def test_one_node_keeps_torchruns_rank(monkeypatch):
    _torchrun(monkeypatch, 3, 6, 6)
    assert launch_rank_to_role(_asgd("first"), 6) == 3
    assert os.environ["RANK"] == "3" and "CLOUDBURST_LAUNCH_RANK" not in os.environ
    # emulated nodes of one launch: the placement's layout
    assert resolve_topology(_asgd(nodes=2), 6).node_of == (0, 1, 0, 0, 1, 1)


def test_one_agent_per_rank_keeps_torchruns_order_one_node_each(monkeypatch):
    # asgd's launch that survives a worker's death: LOCAL_WORLD_SIZE 1 says nothing of the
    # machines, so each rank is a node of its own, as before shard placement.
    cfg = RunConfig(strategy="asgd", workers=2, servers=1)
    _torchrun(monkeypatch, 2, 3, 1)
    assert topology_mismatch(cfg, 3) is None
    assert launch_rank_to_role(cfg, 3) == 2 and os.environ["RANK"] == "2"
    assert resolve_topology(cfg, 3).node_of == (0, 1, 2)
    assert placement_label(cfg, 3) == "torchrun's order, one agent per rank"
    _torchrun(monkeypatch, 2, 3, 3)
    assert placement_label(cfg, 3) == "spread"


def test_without_the_agents_store_shard_0_stays_on_torchruns_node_0(monkeypatch):
    # env:// then has rank 0 host the store at MASTER_ADDR, torchrun's node 0.
    cfg = RunConfig(strategy="asgd", workers=4, servers=2, nodes=3, shard_placement="own")
    _torchrun(monkeypatch, 0, 6, 2)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with pytest.raises(RuntimeError, match="puts shard 0 off torchrun's node 0"):
        launch_rank_to_role(cfg, 6)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert launch_rank_to_role(cfg, 6) == 2  # node 0 holds workers 2, 3; the shards node 2


def test_a_placement_torchrun_cannot_start_is_one_line(monkeypatch):
    # 4 shards on torchrun's node 0 of 3 ranks: no layout (workers fill what shards leave).
    cfg = RunConfig(strategy="asgd", workers=2, servers=4, shard_placement="first")
    _torchrun(monkeypatch, 0, 6, 3)
    line = "shard_placement: 'first' puts 4,0 shard(s) on nodes 0..1"
    assert (topology_mismatch(cfg, 6) or "").startswith(line)
    with pytest.raises(RuntimeError, match=re.escape(line)):
        launch_rank_to_role(cfg, 6)
    with pytest.raises(RuntimeError, match=re.escape(line)):
        resolve_topology(cfg, 6)
    assert os.environ["RANK"] == "0"


# ---------------------------------------------------------------------------- NIC bytes
def _run(tmp_path, placement: str) -> dict:
    cfg = RunConfig(strategy="asgd", workers=8, servers=4, nodes=4, shard_placement=placement,
                    steps=8, dataset="synthetic", model="mlp", batch_size=16, train_size=200,
                    test_size=50, eval_every_s=1000.0, out=str(tmp_path / placement))  # fmt: skip
    return simulate(cfg, SimulationConfig(step_time_s=0.01))


def _balanced(per_node: list[int]) -> bool:
    return max(per_node) <= 1.1 * sum(per_node) / len(per_node)


def test_spread_shards_balance_every_node_nic_and_first_loads_node_0(tmp_path):
    spread, first = _run(tmp_path, "spread"), _run(tmp_path, "first")
    assert spread["shard_nodes"] == [0, 1, 2, 3] and first["shard_nodes"] == [0, 0, 0, 0]
    for summary in (spread, first):
        assert summary["nodes"] == 4
        assert [summary[k] for k in ("replica", "replicas", "ranks_per_replica")] == ["rank", 8, 1]
        assert len(summary["node_nic_bytes"]) == len(summary["simulated_node_nic_bytes"]) == 4
        assert sum(summary["node_nic_bytes"]) == summary["inter_node_bytes"]
    assert _balanced(spread["node_nic_bytes"])
    assert _balanced(spread["simulated_node_nic_bytes"])
    for key in ("node_nic_bytes", "simulated_node_nic_bytes"):
        node0, *others = first[key]
        assert node0 >= 2.5 * max(others)  # every shard's replies leave node 0


# ---------------------------------------------------------------------------- network model
CPU, GPU = "the run models the CPU emulation", "the run models GPUs:"


@pytest.mark.parametrize(
    "sim, device, chosen",
    [
        ({}, "cpu", ("flat", CPU)),
        ({}, "auto", ("flat", CPU)),
        ({}, "cuda", ("nccl", f"{GPU} --device cuda")),
        ({"profile": "resnet50-a100"}, "cpu", ("nccl", f"{GPU} --profile resnet50-a100")),
        ({"network_model": "flat"}, "cuda", ("flat", "--network-model")),
    ],
)
def test_the_network_model_follows_what_the_run_models(sim, device, chosen):
    """No flag: nccl where the run models GPUs (--device cuda, a GPU profile), else flat."""
    assert SimulationConfig().network_model is None
    assert SimulationConfig(**sim).network_model_for(device) == chosen


def test_the_clock_resolves_the_model_and_the_summary_says_which():
    cuda = RunConfig(strategy="sync", workers=2, device="cuda")
    clock = ClockModel(SimulationConfig(), cuda, 1000, 0.1)
    assert clock.nccl and clock.network_model_reason == "the run models GPUs: --device cuda"
    described = clock.describe()
    assert described["network_model"] == described["settings"]["network_model"] == "nccl"
    cpu = ClockModel(SimulationConfig(), RunConfig(strategy="sync", workers=2), 1000, 0.1)
    assert not cpu.nccl and cpu.describe()["network_model"] == "flat"
