"""The virtual cluster charges what its clock model says, exactly, on four ranks of two nodes:
a ring all-reduce 2(n−1) latencies + 2(n−1)/n × bytes / bandwidth, a broadcast ceil(log2 n)
latencies + bytes / bandwidth, a barrier an all-reduce of nothing, an all-gather the all-reduce
of half the n pieces, a message latency + bytes / bandwidth queued on its sender's link; a
collective starts when its last member calls it and every member's link is free."""

from __future__ import annotations

import math

import pytest
import torch

from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.sim.run import run_ranks

LAT, BW = 0.002, 1e9  # --inter-node-link 8,2: 8 Gbit/s = 1e9 bytes/s, 2 ms
LAT_IN, BW_IN = 0.0005, 2e9  # --intra-node-link 16,0.5
N = 4  # ranks 0, 1 on node 0; 2, 3 on node 1: every world collective spans nodes


def _ring(nbytes: float) -> float:
    return 2 * (N - 1) * LAT + 2 * (N - 1) / N * nbytes / BW


def _script(ctx) -> dict[str, list[float]]:
    comm, rank, t = ctx.comm, ctx.rank, {}
    comm.sleep(0.001 * rank)  # they arrive one after the other; the last one starts it
    x = torch.full((1000,), float(rank + 1))  # 4000 bytes of payload
    comm.all_reduce(x)
    t["all_reduce"] = [comm.now(), x[0].item()]
    y = torch.full((1000,), float(rank))
    comm.broadcast(y, src=1)
    t["broadcast"] = [comm.now(), y[0].item()]
    comm.barrier()
    t["barrier"] = [comm.now()]
    piece = torch.full((260,), rank, dtype=torch.uint8)  # a quantised block and its scale
    out = torch.empty(N * 260, dtype=torch.uint8)
    comm.all_gather(out, piece)
    t["all_gather"] = [comm.now(), *out[::260].tolist()]
    # Point to point: rank 0 sends 1 MB twice to rank 2 and once to rank 3 (one inter-node
    # link: queued) and once to rank 1 (the intra-node link: a queue of its own).
    start = comm.now()
    big = torch.zeros(250_000)  # 1e6 bytes
    if rank == 0:
        works = [comm.isend(big, dst, tag=7) for dst in (2, 2, 3, 1)]
        t["sender_after_isend"] = [comm.now() - start]
        for w in works:
            w.wait()
    else:
        arrivals = []
        for _ in range(2 if rank == 2 else 1):
            comm.recv(torch.empty(250_000), 0, tag=7)
            arrivals.append(comm.now() - start)
        t["arrivals"] = arrivals
    comm.barrier()  # waits for rank 0's inter-node link to be free
    t["barrier_after_p2p"] = [comm.now() - start]
    return t


def test_every_collective_and_a_shared_link_cost_what_the_clock_model_says(tmp_path):
    cfg = RunConfig(strategy="sync", workers=N, nodes=2, dataset="synthetic",
                    inter_node_link="8,2", out=str(tmp_path))  # fmt: skip
    sim = SimulationConfig(step_time_s=0.01, intra_node_link="16,0.5")
    runs = run_ranks(cfg, _script, sim=sim)

    t_ar = 0.003 + _ring(4000)  # the last rank arrives at 3 ms
    t_bc = t_ar + math.ceil(math.log2(N)) * LAT + 4000 / BW
    t_barrier = t_bc + _ring(0)
    t_gather = t_barrier + _ring(N * 260 / 2)  # = 2(n−1)·LAT + (n−1)·260 / BW
    assert t_gather - t_barrier == pytest.approx(2 * (N - 1) * LAT + (N - 1) * 260 / BW, abs=1e-15)
    one = LAT + 1e6 / BW  # 3 ms a message on the inter-node link
    for rank, r in enumerate(runs):
        assert r["all_reduce"] == [pytest.approx(t_ar, abs=1e-12), 10.0]
        assert r["broadcast"] == [pytest.approx(t_bc, abs=1e-12), 1.0]
        assert r["barrier"] == [pytest.approx(t_barrier, abs=1e-12)]
        assert r["all_gather"] == [pytest.approx(t_gather, abs=1e-12), 0, 1, 2, 3]
        # The barrier waits until rank 0's inter-node link has carried its three messages.
        assert r["barrier_after_p2p"] == [pytest.approx(3 * one + _ring(0), abs=1e-12)], rank
    assert runs[0]["sender_after_isend"] == [0.0]  # non-blocking sends return at once
    assert runs[2]["arrivals"] == [pytest.approx(one, abs=1e-12), pytest.approx(2 * one, abs=1e-12)]
    assert runs[3]["arrivals"] == [pytest.approx(3 * one, abs=1e-12)]
    assert runs[1]["arrivals"] == [pytest.approx(LAT_IN + 1e6 / BW_IN, abs=1e-12)]
