"""Issue 30's physics in the shared cost model (cloudburst.comm.costs) and the virtual cluster,
each against a time computed here by hand from the formula docs/simulator.md gives: the
all-reduce algorithms and the choice among them by size, the hierarchical all-reduce, a node
NIC shared by its ranks (egress) and an ingress queue where messages from several nodes meet
(incast), and DDP's 25 MB buckets overlapped with backward. One rank per node without incast
costs what it did (tests/unit/test_sim_costs.py pins that)."""

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

LAT, BW = 0.002, 1e9  # --inter-node-link 8,2: 8 Gbit/s = 1e9 bytes/s, 2 ms
LAT_IN, BW_IN = 0.0005, 2e9  # --intra-node-link 16,0.5


# ---------------------------------------------------------------------------- formulas
def test_the_three_all_reduce_algorithms():
    # n = 8, 1 MB: ring 14 latencies + 14/8 MB; tree 2·3 latencies + 2 MB; halving/doubling
    # 2·3 latencies + 14/8 MB.
    assert ring_allreduce_s(1e6, 8, LAT, BW) == pytest.approx(14 * LAT + 1.75e-3, abs=1e-15)
    assert tree_allreduce_s(1e6, 8, LAT, BW) == pytest.approx(6 * LAT + 2e-3, abs=1e-15)
    assert halving_doubling_allreduce_s(1e6, 8, LAT, BW) == pytest.approx(
        6 * LAT + 1.75e-3, abs=1e-15
    )
    assert halving_doubling_allreduce_s(1e6, 6, LAT, BW) is None  # not a power of two
    for f in (ring_allreduce_s, tree_allreduce_s, halving_doubling_allreduce_s):
        assert f(1e6, 1, LAT, BW) == 0.0


def test_the_algorithm_is_chosen_by_size():
    # n = 6: ring 10 L + (10/6) B/β, tree 6 L + 2 B/β; tree is cheaper while 4 L > B/(3β),
    # i.e. below B = 12 L β = 24 MB.
    small, large = 1e6, 100e6
    assert best_allreduce_s(small, 6, LAT, BW) == (
        pytest.approx(6 * LAT + 2 * small / BW, abs=1e-15),
        "tree",
    )
    assert best_allreduce_s(large, 6, LAT, BW) == (
        pytest.approx(10 * LAT + 10 / 6 * large / BW, abs=1e-12),
        "ring",
    )
    # At the crossover both cost the same; a power of two takes halving/doubling (never worse).
    b = 12 * LAT * BW
    assert ring_allreduce_s(b, 6, LAT, BW) == pytest.approx(tree_allreduce_s(b, 6, LAT, BW))
    assert best_allreduce_s(large, 8, LAT, BW)[1] == "halving_doubling"
    # n = 2: ring and halving/doubling tie (2 L + B/β); the ring is named first.
    assert best_allreduce_s(small, 2, LAT, BW) == (pytest.approx(2 * LAT + small / BW), "ring")


def test_hierarchical_all_reduce():
    intra, inter = LinkSpec(16, 0.5), LinkSpec(8, 2)
    nbytes = 4e6
    # 2 nodes x 4 ranks: reduce-scatter + all-gather in the node, 2 · (3 L_in + 3/4 B / β_in);
    # between the 2 nodes the stripes together: ring of 2 (ties with halving/doubling),
    # 2 L + B / β.
    expected = 2 * (3 * LAT_IN + 0.75 * nbytes / BW_IN) + (2 * LAT + nbytes / BW)
    assert hierarchical_allreduce_s(nbytes, 2, 4, intra, inter) == pytest.approx(
        expected, abs=1e-15
    )
    # A free intra-node link: only the inter-node part; one rank per node: no intra part.
    assert hierarchical_allreduce_s(nbytes, 2, 4, None, inter) == pytest.approx(
        2 * LAT + nbytes / BW
    )
    assert hierarchical_allreduce_s(nbytes, 2, 1, intra, inter) == pytest.approx(
        2 * LAT + nbytes / BW
    )
    assert hierarchical_allreduce_s(nbytes, 2, 4, intra, None) == pytest.approx(
        2 * (3 * LAT_IN + 0.75 * nbytes / BW_IN)
    )


def test_nic_transfer_queues_at_the_ingress():
    one = LAT + 1e6 / BW  # 3 ms
    # Alone: latency + bytes / bandwidth, as a rank's link always charged.
    assert nic_transfer(0.0, 0.0, 1e6, LAT, BW, BW) == (pytest.approx(one), pytest.approx(one))
    # The ingress is busy until 3 ms: the bytes get in after it, 3 ms + 1 ms.
    assert nic_transfer(0.0, one, 1e6, LAT, BW, BW) == (pytest.approx(one), pytest.approx(0.004))
    # A slower ingress (0.5e9 B/s) limits even a message alone: 2 ms + 2 ms.
    assert nic_transfer(0.0, 0.0, 1e6, LAT, BW, 0.5e9)[1] == pytest.approx(0.004)


def test_ddp_overlap_by_hand():
    # forward 1 s, backward 2 s, 60 units of bytes in buckets of 25: 25, 25, 10, ready at
    # 1 + 2·25/60, 1 + 2·50/60, 3; an all-reduce costs 0.01 s per unit.
    cost = lambda b: 0.01 * b  # noqa: E731
    r0, r1, r2 = 1 + 50 / 60, 1 + 100 / 60, 3.0
    e0 = r0 + 0.25
    e1 = max(r1, e0) + 0.25
    e2 = max(r2, e1) + 0.10
    assert ddp_overlap_end_s(1.0, 2.0, 60, cost, bucket_bytes=25) == pytest.approx(e2)
    assert e2 == pytest.approx(3.1)  # only the last bucket is exposed
    # A slow link: each bucket 0.1 s per unit, the buckets queue behind each other.
    slow = lambda b: 0.1 * b  # noqa: E731
    assert ddp_overlap_end_s(1.0, 2.0, 60, slow, bucket_bytes=25) == pytest.approx(
        r0 + 2.5 + 2.5 + 1.0
    )
    # The link is busy until 10 s: everything after it.
    assert ddp_overlap_end_s(1.0, 2.0, 60, cost, 25, link_free_s=10.0) == pytest.approx(10.6)
    assert ddp_overlap_end_s(1.0, 2.0, 0, cost) == 3.0
    assert DDP_BUCKET_BYTES == 25 * 1024 * 1024


# ---------------------------------------------------------------------------- the cluster
def _run(script, workers, nodes, tmp_path, **sim_kw):
    from cloudburst.config import RunConfig
    from cloudburst.config.simulation import SimulationConfig
    from cloudburst.sim.run import run_ranks

    cfg = RunConfig(strategy="sync", workers=workers, nodes=nodes, dataset="synthetic",
                    inter_node_link="8,2", out=str(tmp_path))  # fmt: skip
    actual_params = sim_kw.pop("actual_params", 1)
    sim = SimulationConfig(**{"step_time_s": 0.3, **sim_kw})
    return run_ranks(cfg, script, sim=sim, actual_params=actual_params)


def _two_senders(ctx):
    """Ranks 0 and 1 (node 0) each send 1 MB, at 0, to ranks 2 and 3 (node 1)."""
    comm, rank = ctx.comm, ctx.rank
    if rank < 2:
        comm.send(torch.zeros(250_000), rank + 2, tag=3)
        return comm.now()
    comm.recv(torch.empty(250_000), rank - 2, tag=3)
    return comm.now()


def test_ranks_of_a_node_share_its_nic(tmp_path):
    one = LAT + 1e6 / BW
    t = _run(_two_senders, 4, 2, tmp_path)
    # Node 0's egress carries them one after the other: 3 ms, then 6 ms (each rank had a link
    # of its own before: both at 3 ms).
    assert sorted(t[2:]) == [pytest.approx(one, abs=1e-12), pytest.approx(2 * one, abs=1e-12)]
    assert sorted(t[:2]) == sorted(t[2:])  # a blocking send returns at the arrival


def _incast(ctx):
    """Ranks 1 and 2 (nodes 1, 2) each send 1 MB to rank 0 (node 0) at 0."""
    comm, rank = ctx.comm, ctx.rank
    if rank == 0:
        arrivals = []
        for _ in range(2):
            comm.recv(torch.empty(250_000), None, tag=5)
            arrivals.append(comm.now())
        return arrivals
    comm.send(torch.zeros(250_000), 0, tag=5)
    return comm.now()


def test_incast_queues_at_the_receivers_ingress(tmp_path):
    one = LAT + 1e6 / BW
    t = _run(_incast, 3, 3, tmp_path)
    # Two egresses, one ingress: the first at 3 ms, the second's bytes after it, 4 ms.
    assert t[0] == [pytest.approx(one, abs=1e-12), pytest.approx(one + 1e6 / BW, abs=1e-12)]
    # A 4 Gbit/s ingress (0.5e9 B/s): 2 ms + 2 ms, then 2 ms more.
    t = _run(_incast, 3, 3, tmp_path, nic_ingress_gbit_per_s=4.0)
    assert t[0] == [pytest.approx(0.004, abs=1e-12), pytest.approx(0.006, abs=1e-12)]


def _all_reduce(ctx):
    x = torch.ones(1_000_000)  # 4e6 bytes
    ctx.comm.all_reduce(x)
    return [ctx.comm.now(), x[0].item()]


def test_hierarchical_all_reduce_on_the_cluster(tmp_path):
    nbytes = 4e6
    # 8 ranks, 2 nodes x 4, --network-model nccl: the cheaper of flat halving/doubling over 8
    # on the NIC (6 L + 14/8 B/β = 19 ms) and hierarchical (2 (3 L_in + 3/4 B/β_in) + 2 L +
    # B/β = 3 ms + 3 ms + 4 ms + 4 ms = 14 ms): hierarchical.
    flat = 6 * LAT + 14 / 8 * nbytes / BW
    hier = 2 * (3 * LAT_IN + 0.75 * nbytes / BW_IN) + 2 * LAT + nbytes / BW
    assert hier < flat
    t = _run(_all_reduce, 8, 2, tmp_path, intra_node_link="16,0.5", network_model="nccl")
    assert t == [[pytest.approx(hier, abs=1e-12), 8.0]] * 8
    # --network-model flat (the default): the ring over 8 on the inter-node link, as before.
    t = _run(_all_reduce, 8, 2, tmp_path, intra_node_link="16,0.5", network_model="flat")
    assert t[0][0] == pytest.approx(14 * LAT + 14 / 8 * nbytes / BW, abs=1e-12)


def _ddp_step(ctx):
    from cloudburst.comm.stats import CommStats

    torch.manual_seed(0)
    model = torch.nn.Linear(99, 10)  # 1,000 parameters
    for p in model.parameters():
        p.grad = torch.full_like(p, float(ctx.rank + 1))
    state = SimpleNamespace(compress="none", stats=CommStats(), spans_nodes=True, feedback=None)
    dp = ctx.comm.data_parallel(model, None, None, state)
    dp.after_backward()
    return [ctx.comm.now(), model.bias.grad[0].item()]


def test_network_model_is_checked_and_described():
    from cloudburst.config import ConfigError, RunConfig
    from cloudburst.config.simulation import SimulationConfig
    from cloudburst.sim.clock import ClockModel

    with pytest.raises(ConfigError, match="network_model: 'ncl' is not allowed"):
        SimulationConfig(network_model="ncl")
    with pytest.raises(ConfigError, match="nic_ingress_gbit_per_s"):
        SimulationConfig(nic_ingress_gbit_per_s=0.0)
    # No flag: chosen by what the run models (flat for the CPU emulation; tests/unit/
    # test_placement.py has the GPU cases).
    assert SimulationConfig().network_model is None
    cfg = RunConfig.from_dict({"out": "unused", "inter_node_link": "8,2"})
    assert ClockModel(SimulationConfig(), cfg, 1, 0.1).describe()["network_model"] == "flat"
    sim = SimulationConfig(network_model="nccl", nic_ingress_gbit_per_s=4.0)
    d = ClockModel(sim, cfg, 1, 0.1).describe()
    assert (d["network_model"], d["nic_ingress_gbit_per_s"]) == ("nccl", 4.0)


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
