"""``--replica node``: a node's workers are one replica (gradients averaged every step) and the
strategy runs between the nodes, against tests/reference.py's node replicas."""

import pytest
import torch

from cloudburst.config import ConfigError, RunConfig
from cloudburst.records.checkpoint import load_checkpoint
from cloudburst.records.resilience import worker_checkpoint_path
from tests.support import cli, final_record, read_summary, simulated
from tests.reference import (
    COMMON,
    asgd_one_round,
    assert_params_differ,
    assert_same_params,
    parity_diloco,
    parity_local_sgd,
    parity_numel,
    trained,
)

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("desloc", ["1", "0"])
def test_desloc_node_replicas_send_the_averaged_moments_to_their_followers(tmp_path, desloc):
    # DES-LOC: the leaders average Adam's moments at step 12, each follower takes its leader's;
    # without it the nodes' differ. (No reference: Adam magnifies a node gradient's rounding.)
    out = simulated(["--strategy", "diloco", "--workers", "4", "--nodes", "2", "--replica",
        "node", "--period", "4", "--steps", "14", "--optimizer", "adamw", "--checkpoint-every",
        "12", "--desloc-first-every", desloc, "--desloc-second-every", desloc, "--out",
        str(tmp_path / "desloc"), *COMMON])  # fmt: skip
    states = [load_checkpoint(worker_checkpoint_path(out, w, 12))["optimizer"]["state"]
              for w in range(4)]  # fmt: skip
    for key in ("exp_avg", "exp_avg_sq"):
        moments = [torch.cat([s[i][key].flatten() for i in sorted(s)]) for s in states]
        assert torch.equal(moments[0], moments[1]) and torch.equal(moments[2], moments[3])
        assert torch.equal(moments[0], moments[2]) == (desloc == "1"), key


def test_diloco_between_two_nodes_of_two_workers(tmp_path):
    # 2 replicas of 2 workers; 5 outer steps (every 4, and at 18), between the 2 node leaders.
    out = tmp_path / "diloco"
    args = ["--strategy", "diloco", "--workers", "4", "--nodes", "2", "--replica", "node",
        "--period", "4", "--steps", "18", "--diloco-outer-lr", "0.7",
        "--diloco-outer-momentum", "0.9", "--out", str(out), *COMMON]  # fmt: skip
    cli("train", *args)
    sim = simulated(args)  # the same job on the virtual cluster
    settings = dict(period=4, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    expected, outer_steps = parity_diloco(18, 2, ranks_per_replica=2, **settings)
    assert outer_steps == 5
    assert_same_params(trained(out), expected)
    assert_same_params(trained(sim), trained(out))  # the simulator == gloo
    # per-rank replicas of the same 4 workers train another model
    assert_params_differ(expected, parity_diloco(18, 4, **settings)[0])

    s, numel = read_summary(out), parity_numel()
    assert (s["replica"], s["replicas"], s["ranks_per_replica"]) == ("node", 2, 2)
    # only the leaders cross nodes: |θ|·4 bytes each per outer step
    assert s["inter_node_bytes"] == 2 * outer_steps * numel * 4
    assert read_summary(sim)["inter_node_bytes"] == s["inter_node_bytes"]
    # inside a node every step's gradients are all-reduced (|θ|·4 bytes each)
    assert s["intra_node_bytes"] >= 4 * 18 * numel * 4
    leader, follower = final_record(out, 0), final_record(out, 1)
    assert leader["replica"] == follower["replica"] == 0
    # θ goes to the follower at the start, after the 4 outer steps in training, and at the end
    assert leader["node_broadcasts"] == follower["node_broadcasts"] == 1 + 4 + 1


def test_local_sgd_node_replicas_on_the_virtual_cluster(tmp_path):
    # 3 replicas of 2 workers, averaged every 3 steps after 2 synchronous ones
    args = ["--strategy", "local_sgd", "--workers", "6", "--nodes", "3", "--replica", "node",
        "--period", "3", "--local-sgd-warmup-steps", "2", "--steps", "11",
        "--out", str(tmp_path / "local"), *COMMON]  # fmt: skip
    sim = simulated(args)
    expected, averages = parity_local_sgd(11, 3, period=3, warmup_steps=2, ranks_per_replica=2)
    assert averages == 6
    assert_same_params(trained(sim), expected)
    assert read_summary(sim)["inter_node_bytes"] == 3 * averages * int(4 / 3 * parity_numel() * 4)


def test_asgd_node_replicas_push_once_each_as_the_reference(tmp_path):
    # 2 replicas of 2 workers push once after 6 steps: θ0 + ½(Δ_0 + Δ_1)
    args = ["--strategy", "asgd", "--workers", "4", "--servers", "1", "--nodes", "2",
        "--replica", "node", "--n-sync", "6", "--steps", "6",
        "--out", str(tmp_path / "one"), *COMMON]  # fmt: skip
    sim = simulated(args)
    expected = asgd_one_round(6, 2, ranks_per_replica=2, server_lr=0.5)
    assert_same_params(trained(sim), expected)
    assert_params_differ(expected, asgd_one_round(6, 4, ranks_per_replica=1, server_lr=0.25))


def test_asgd_shards_see_one_replica_per_node(tmp_path):
    # 2 shards serve 2 node replicas (default λ 1/2) and count every worker's samples
    steps, n_sync = 12, 3
    args = ["--strategy", "asgd", "--workers", "4", "--servers", "2", "--nodes", "2",
        "--replica", "node", "--n-sync", str(n_sync), "--steps", str(steps),
        "--out", str(tmp_path / "asgd"), *COMMON]  # fmt: skip
    sim = simulated(args)
    s = read_summary(sim)
    assert (s["config"]["server_lr"], s["replicas"], s["shard_nodes"]) == (0.5, 2, [0, 1])
    assert s["samples"] == 4 * steps * 16
    # each leader pushes every n_sync steps to each shard; followers never do
    workers = {r: final_record(sim, r) for r in range(2, 6)}
    assert [workers[r].get("pushes", 0) for r in (2, 4)] == [2 * steps // n_sync] * 2
    assert [workers[r].get("pushes", 0) for r in (3, 5)] == [0, 0]
    # the leader's θ goes to its node at the start, after each fetch and at the end
    for leader, follower in ((2, 3), (4, 5)):
        sent = workers[leader]["node_broadcasts"]
        assert sent == workers[follower]["node_broadcasts"] == 1 + steps // n_sync + 1


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(strategy="diloco", workers=4), "replica: node needs --nodes N"),
        (dict(strategy="diloco", workers=2, nodes=2), "puts one worker on each node"),
        (dict(strategy="diloco", workers=5, nodes=2), "do not split evenly over 2"),
        (dict(strategy="sync", workers=4, nodes=2), "not allowed for strategy 'sync'"),
        (dict(strategy="daso", workers=4, nodes=2), "not allowed for strategy 'daso'"),
        (dict(strategy="asgd", workers=4, nodes=2, max_restarts=1), "cannot rejoin its node"),
    ],
)
def test_node_replicas_that_mean_nothing_are_refused_in_one_line(kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        RunConfig(replica="node", **kw)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="names node 2, which does not exist"):
        RunConfig(strategy="asgd", workers=4, servers=2, nodes=2, shard_placement="0,2")
