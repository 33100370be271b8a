"""Issue 30's physics in the cost model (comm/costs.py) and the virtual cluster against times
worked out by hand from docs/simulator.md: the all-reduce algorithms, hierarchical all-reduce,
a node's NIC shared by its ranks, incast, DDP's buckets overlapped with backward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cloudburst.comm.costs import (
    DDP_BUCKET_BYTES,
    LinkSpec,
    best_allreduce_s,
    ddp_overlap_end_s,
    halving_doubling_allreduce_s,
    hierarchical_allreduce_s,
    nic_transfer,
    ring_allreduce_s,
    tree_allreduce_s,
)
from cloudburst.comm.stats import CommStats
from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.sim.run import run_ranks
from tests.support import close

LAT, BW = 0.002, 1e9  # --inter-node-link 8,2: 8 Gbit/s = 1e9 bytes/s, 2 ms
LAT_IN, BW_IN = 0.0005, 2e9  # --intra-node-link 16,0.5


# ---------------------------------------------------------------------------- formulas
def test_the_three_all_reduce_algorithms():
    # n = 8, 1 MB: ring 14 latencies + 14/8 MB; tree 2·3 latencies + 2 MB.
    assert ring_allreduce_s(1e6, 8, LAT, BW) == pytest.approx(14 * LAT + 1.75e-3, abs=1e-15)
    assert tree_allreduce_s(1e6, 8, LAT, BW) == pytest.approx(6 * LAT + 2e-3, abs=1e-15)
    # halving/doubling: powers of two only, 2·log2 n latencies + 2(n−1)/n of the bytes.
    for n in (3, 5, 6, 7, 9, 10, 12, 15):
        assert halving_doubling_allreduce_s(1e6, n, LAT, BW) is None, n
    for n, log2n in ((2, 1), (4, 2), (8, 3), (16, 4)):
        expected = 2 * log2n * LAT + 2 * (n - 1) / n * 1e6 / BW
        assert halving_doubling_allreduce_s(1e6, n, LAT, BW) == pytest.approx(expected, abs=1e-15)
    for f in (ring_allreduce_s, tree_allreduce_s, halving_doubling_allreduce_s):
        assert f(1e6, 1, LAT, BW) == 0.0


def test_the_algorithm_is_chosen_by_size():
    # n = 6: ring 10 L + (10/6) B/β, tree 6 L + 2 B/β; tree is cheaper while 4 L > B/(3β),
    # i.e. below B = 12 L β = 24 MB.
    small, large = 1e6, 100e6
    tree, ring = 6 * LAT + 2 * small / BW, 10 * LAT + 10 / 6 * large / BW
    assert best_allreduce_s(small, 6, LAT, BW) == (pytest.approx(tree, abs=1e-15), "tree")
    assert best_allreduce_s(large, 6, LAT, BW) == (pytest.approx(ring, abs=1e-12), "ring")
    # At the crossover both cost the same; a power of two takes halving/doubling (never worse).
    b = 12 * LAT * BW
    assert ring_allreduce_s(b, 6, LAT, BW) == pytest.approx(tree_allreduce_s(b, 6, LAT, BW))
    assert best_allreduce_s(large, 8, LAT, BW)[1] == "halving_doubling"
    # n = 2: ring and halving/doubling tie (2 L + B/β); the ring is named first.
    assert best_allreduce_s(small, 2, LAT, BW) == (pytest.approx(2 * LAT + small / BW), "ring")


IN_NODE = 2 * (3 * LAT_IN + 0.75 * 4e6 / BW_IN)  # 4 MB reduce-scattered + gathered in a node of 4
ACROSS = 2 * LAT + 4e6 / BW  # 4 MB, a ring of 2 nodes (ties with halving/doubling)


@pytest.mark.parametrize(
    "nodes, per_node, intra, inter, cost",
    [
        (2, 4, LinkSpec(16, 0.5), LinkSpec(8, 2), IN_NODE + ACROSS),
        # 2 · (1 · 0.5 ms + 1/2 · 4 MB / 2e9) = 3 ms in the node, 2 ms · 2 + 4 ms between.
        (2, 2, LinkSpec(16, 0.5), LinkSpec(8, 2), 0.011),
        (1, 2, LinkSpec(16, 0.5), LinkSpec(8, 2), 0.003),  # one node: its part only
        (1, 1, LinkSpec(16, 0.5), LinkSpec(8, 2), 0.0),
        (2, 4, None, LinkSpec(8, 2), ACROSS),  # a free intra-node link: only the inter part
        (2, 1, LinkSpec(16, 0.5), LinkSpec(8, 2), ACROSS),  # one rank per node: no intra part
        (2, 4, LinkSpec(16, 0.5), None, IN_NODE),  # a free inter-node link: only the intra part
    ],
)
def test_hierarchical_all_reduce(nodes, per_node, intra, inter, cost):
    """Reduce-scatter + all-gather in each node, 2 · ((r−1) L_in + (r−1)/r · B / β_in), then
    the nodes' stripes together on the inter-node link, the cheapest algorithm."""
    got = hierarchical_allreduce_s(4e6, nodes, per_node, intra, inter)
    assert got == (pytest.approx(cost, abs=1e-15) if cost else 0.0)


@pytest.mark.parametrize(
    "leave, ingress_free, ingress_bw, egress_end, arrival",
    [
        (0.0, 0.0, BW, 0.003, 0.003),  # alone: latency + bytes / bandwidth, as a rank's link
        (0.0, 0.003, BW, 0.003, 0.004),  # the ingress busy until 3 ms: the bytes after it, 1 ms
        (0.0, 0.0, 0.5e9, 0.003, 0.004),  # a slower ingress limits even a message alone
        (5.0, 0.0, 0.5e9, 5.003, 5.004),  # egress held 2 ms + 1 ms; arrives 2 ms + 2 ms
        (5.0, 5.01, 0.5e9, 5.003, 5.012),  # behind an ingress busy until 5.01: 2 ms after it
    ],
)
def test_nic_transfer_queues_at_the_ingress(leave, ingress_free, ingress_bw, egress_end, arrival):
    """1 MB on a 2 ms link, egress 1e9 B/s: (when the egress is free, when the bytes are in)."""
    got = nic_transfer(leave, ingress_free, 1e6, LAT, BW, ingress_bw)
    assert got == (close(egress_end), close(arrival))


@pytest.mark.parametrize(
    "forward, backward, total, unit_s, link_free, end",
    [
        # 60 bytes in buckets of 25 (25, 25, 10) ready at 1 + 2·25/60, 1 + 2·50/60 and 3 s, an
        # all-reduce 0.01 s a byte: each ends before the next is ready, only the last is exposed.
        (1.0, 2.0, 60, 0.01, None, 3.1),
        (1.0, 2.0, 60, 0.1, None, 1 + 50 / 60 + 2.5 + 2.5 + 1.0),  # slow: they queue
        (1.0, 2.0, 60, 0.01, 10.0, 10.6),  # the link busy until 10 s: everything after it
        (1.0, 2.0, 0, 0.01, None, 3.0),  # nothing to send: forward + backward
        (1.0, 2.0, 0, 0.01, 10.0, 10.0),  # ... or when the link is free, if later
        (0.1, 0.2, 1, 0.001, None, 0.301),  # one byte is one bucket, sent once backward is done
    ],
)
def test_ddp_overlap_by_hand(forward, backward, total, unit_s, link_free, end):
    """Bucket j is ready at forward + backward × min((j+1)·bucket, total) / total; its
    all-reduce starts at max(ready, the previous bucket's end, the link's free time (0 by
    default) for the first)."""
    kw = {} if link_free is None else {"link_free_s": link_free}
    got = ddp_overlap_end_s(forward, backward, total, lambda b: unit_s * b, 25, **kw)
    assert got == close(end)
    assert DDP_BUCKET_BYTES == 25 * 1024 * 1024  # DDP's bucket_cap_mb=25, the default


# ---------------------------------------------------------------------------- the cluster
def _run(script, workers, nodes, tmp_path, *args, **sim_kw):
    cfg = RunConfig(strategy="sync", workers=workers, nodes=nodes, dataset="synthetic",
                    inter_node_link="8,2", out=str(tmp_path))  # fmt: skip
    actual_params = sim_kw.pop("actual_params", 1)
    sim = SimulationConfig(**{"step_time_s": 0.3, **sim_kw})
    return run_ranks(cfg, script, *args, sim=sim, actual_params=actual_params)


def _sends(ctx, dsts):
    """Each rank r in ``dsts`` sends 1 MB to rank dsts[r] at 0; the others receive theirs."""
    comm, rank = ctx.comm, ctx.rank
    if rank in dsts:
        comm.send(torch.zeros(250_000), dsts[rank], tag=3)
        return [comm.now()]
    return [(comm.recv(torch.empty(250_000), None, tag=3), comm.now())[1]
            for _ in range(list(dsts.values()).count(rank))]  # fmt: skip


ONE = LAT + 1e6 / BW  # 1 MB alone on the NIC: 3 ms


@pytest.mark.parametrize(
    "workers, nodes, dsts, ingress, arrivals",
    [
        # Ranks 0 and 1 (node 0) to node 1: one after the other on node 0's egress.
        (4, 2, {0: 2, 1: 3}, None, [ONE, 2 * ONE]),
        # Incast: ranks 1 and 2 (nodes 1, 2) to rank 0: the second's bytes after the first's.
        (3, 3, {1: 0, 2: 0}, None, [ONE, ONE + 1e6 / BW]),
        (3, 3, {1: 0, 2: 0}, 4.0, [0.004, 0.006]),  # a 0.5e9 B/s ingress: 2 + 2 ms, 2 ms more
    ],
    ids=["one-egress", "incast", "incast-slow-ingress"],
)
def test_a_nodes_ranks_share_its_egress_and_messages_into_a_node_queue_at_its_ingress(
    tmp_path, workers, nodes, dsts, ingress, arrivals
):
    """A blocking send returns when its message has arrived."""
    t = _run(_sends, workers, nodes, tmp_path, dsts, nic_ingress_gbit_per_s=ingress)
    received = sorted(x for r, times in enumerate(t) if r not in dsts for x in times)
    assert received == [close(a) for a in arrivals]
    assert sorted(t[r][0] for r in dsts) == received


def _all_reduce(ctx):
    x = torch.ones(1_000_000)  # 4e6 bytes
    ctx.comm.all_reduce(x)
    return [ctx.comm.now(), x[0].item()]


def test_hierarchical_all_reduce_on_the_cluster(tmp_path):
    # 8 ranks, 2 nodes x 4, --network-model nccl: the cheaper of flat halving/doubling over 8
    # on the NIC (6 L + 14/8 B/β = 19 ms) and hierarchical (2 (3 L_in + 3/4 B/β_in) + 2 L +
    # B/β = 3 ms + 3 ms + 4 ms + 4 ms = 14 ms): hierarchical.
    flat, hier = 6 * LAT + 14 / 8 * 4e6 / BW, IN_NODE + ACROSS
    assert hier < flat
    t = _run(_all_reduce, 8, 2, tmp_path, intra_node_link="16,0.5", network_model="nccl")
    assert t == [[pytest.approx(hier, abs=1e-12), 8.0]] * 8
    # (--network-model flat, the default, charges the ring on the NIC: test_sim_costs.py.)


def _ddp_step(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(99, 10)  # 1,000 parameters
    for p in model.parameters():
        p.grad = torch.full_like(p, float(ctx.rank + 1))
    state = SimpleNamespace(compress="none", stats=CommStats(), spans_nodes=True, feedback=None)
    dp = ctx.comm.data_parallel(model, None, None, state)
    dp.after_backward()
    return [ctx.comm.now(), model.bias.grad[0].item()]


def test_ddp_buckets_overlap_with_backward(tmp_path):
    # 2 ranks on 2 nodes; 1,000 parameters standing for 25 M: 1e8 bytes of gradients, 4
    # buckets of 26,214,400 bytes (the last 21,356,800). Step 0.3 s: forward 0.1 s, backward
    # 0.2 s; bucket j is ready at 0.1 + 0.2·min((j+1)·C, M)/M and costs 2 L + bytes / β
    # (a ring of 2).
    C, M = 25 * 1024 * 1024, 1e8
    end = 0.0
    for j in range(4):
        ready = 0.1 + 0.2 * min((j + 1) * C, M) / M
        end = max(ready, end) + 2 * LAT + min(C, M - j * C) / BW
    assert end == pytest.approx(0.3 + 2 * LAT + (M - 3 * C) / BW)  # only the last is exposed
    kw = {"modelled_params": 25_000_000, "actual_params": 1000}
    t = _run(_ddp_step, 2, 2, tmp_path, network_model="nccl", **kw)
    assert t == [[pytest.approx(end, abs=1e-12), 1.5]] * 2
    # flat: one all-reduce of all 1e8 bytes after the step, 0.3 + 2 L + 1e8 / β.
    t = _run(_ddp_step, 2, 2, tmp_path, network_model="flat", **kw)
    assert t[0] == [pytest.approx(0.3 + 2 * LAT + M / BW, abs=1e-12), 1.5]
