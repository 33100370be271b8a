"""DASO over real gloo groups: the merge and its rotation on scripted parameters, and
B = S = 0 (a blocking average every batch) against plain synchronous SGD."""

import pytest
import torch

from tests.dist.test_parity import COMMON, assert_same_params, reference, trained
from tests.helpers import cli, spawn

pytestmark = pytest.mark.dist


def _merge_rank(rank: int, out: str, nodes: int, s: int) -> dict:
    from torch import nn

    from cloudburst.comm.flat import flatten_params
    from cloudburst.config import RunConfig
    from cloudburst.runtime import init_distributed, shutdown
    from cloudburst.strategies.daso import DasoStrategy

    world = int(__import__("os").environ["WORLD_SIZE"])
    cfg = RunConfig(strategy="daso", workers=world, nodes=nodes, dataset="synthetic",
                    daso_downcast="none", out=out, comm_timeout_s=60)
    ctx = init_distributed(cfg)
    model = nn.Linear(2, 2)  # 6 parameters
    strategy = DasoStrategy(ctx)
    strategy.configure(steps_per_epoch=100, total_steps=1000)
    net = strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0))
    del net
    senders, results = [], []
    for k in range(2):  # two syncs in a row: the sending local rank rotates
        # Node n holds θ = n + 1 + 10k everywhere; later, before the merge, θ_local = -1.
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(ctx.node + 1 + 10 * k)
        strategy._start_sync(s=s)
        senders.append(strategy.pending.sender)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-1.0)
        strategy._merge()
        results.append(flatten_params(model).tolist())
    shutdown(ctx)
    return {"node": ctx.node, "senders": senders, "results": results}


@pytest.mark.parametrize("nodes, per_node, s", [(2, 2, 0), (2, 2, 2), (3, 1, 1)])
def test_merge_and_rotation_over_gloo(tmp_path, nodes, per_node, s):
    results = spawn(_merge_rank, nodes * per_node, tmp_path, str(tmp_path), nodes, s)
    for r in results:
        for k in range(2):
            sent_sum = sum(n + 1 + 10 * k for n in range(nodes))
            expected = (2 * s * -1.0 + sent_sum) / (2 * s + nodes)
            assert r["results"][k] == pytest.approx([expected] * 6)
        # The k-th sync of a node is sent by its local rank k mod G (global rank node·G + k).
        assert r["senders"] == [r["node"] * per_node + k % per_node for k in range(2)]


def test_daso_blocking_every_batch_equals_sync_sgd(tmp_path):
    out = tmp_path / "daso"
    cli("train", "--strategy", "daso", "--workers", "4", "--nodes", "2", "--steps", "30",
        "--daso-global-skip", "0", "--daso-batches-to-wait", "0", "--daso-warmup-epochs", "0",
        "--daso-cooldown-epochs", "0", "--daso-downcast", "none", "--out", str(out), *COMMON)
    assert_same_params(trained(out), reference(30, workers=4))


def test_daso_cycling_with_bf16_learns_and_counts_its_traffic(tmp_path):
    import json

    out = tmp_path / "daso-cycling"
    cli("train", "--strategy", "daso", "--workers", "4", "--nodes", "2", "--epochs", "6",
        "--daso-warmup-epochs", "1", "--daso-cooldown-epochs", "1", "--lr", "0.05",
        "--out", str(out), *COMMON)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_test_accuracy"] > 0.8
    assert summary["inter_node_bytes"] > 0 and summary["intra_node_bytes"] > 0
