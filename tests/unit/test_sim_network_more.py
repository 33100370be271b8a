"""More of the virtual cluster's collectives, exactly: when an all-gather ends and what each
member receives, when DDP's overlapped all-reduce ends (whose step it overlaps, and the links
it waits for), against virtual times computed here by hand from the clock model's formulas;
and what :func:`cloudburst.comm.collectives.all_reduce_sum` asks of its transport and link.

The cluster: 8 ranks on 2 nodes (ranks 0-3 on node 0), the intra-node link 16 Gbit/s with
0.5 ms latency (2e9 bytes/s). A payload's bytes are scaled by modelled_params / actual_params.
"""

from __future__ import annotations

import pytest
import torch

from cloudburst.comm.collectives import all_reduce_sum
from cloudburst.comm.costs import DDP_BUCKET_BYTES
from cloudburst.comm.stats import CommStats
from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.sim.run import run_ranks
from tests.fakes import RecordingLink
from tests.support import on_comm_threads

LAT_IN, BW_IN = 0.0005, 2e9  # --intra-node-link 16,0.5
SCALE = 3  # modelled_params per actual parameter
WORLD = 8


def close(x: float) -> pytest.approx:
    return pytest.approx(x, abs=1e-12)


def _run(tmp_path, script, *args, scale: int = SCALE):
    cfg = RunConfig(strategy="sync", workers=WORLD, nodes=2, dataset="synthetic",
                    inter_node_link="8,2", out=str(tmp_path))  # fmt: skip
    sim = SimulationConfig(step_time_s=0.01, intra_node_link="16,0.5", modelled_params=scale)
    return run_ranks(cfg, script, *args, sim=sim, actual_params=1)


# ---------------------------------------------------------------------------- all-gather
def _gather(ctx, members, dtype):
    """Member k (position) calls an all-gather of [10k, 10k + 1, 10k + 2] at (k + 1) ms."""
    comm = ctx.comm
    group = comm.new_group("gather", members, 60.0)
    if ctx.rank not in members:
        return None
    pos = members.index(ctx.rank)
    piece = torch.tensor([10 * pos + k for k in range(3)]).to(dtype)
    out = torch.full((3 * len(members),), -1).to(dtype)
    comm.sleep(0.001 * (pos + 1))
    comm.all_gather(out, piece, group)
    return comm.now(), out.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=["float32", "int64"])
def test_an_all_gather_of_two_costs_a_ring_on_half_the_scaled_pieces(tmp_path, dtype):
    """Two members on node 0 (positions 0, 1 called at 1 ms, 2 ms): each receives both pieces
    in member order and leaves at the last call + 2 latencies + one piece's bytes / bandwidth
    (a ring all-reduce of n = 2 over n/2 pieces: 2(n−1)/n × (n/2 × piece) = piece). The piece
    counts as a payload whatever its dtype: its bytes scaled by 3."""
    element = 4 if dtype == torch.float32 else 8
    end = 0.002 + 2 * LAT_IN + 3 * element * SCALE / BW_IN
    runs = _run(tmp_path, _gather, [2, 1], dtype)
    want = [0, 1, 2, 10, 11, 12]
    assert runs[2] == (close(end), want) and runs[1] == (close(end), want)


def test_an_all_gather_of_one_member_returns_its_piece_at_no_cost(tmp_path):
    """A group of one: the output is its own piece, and no time passes beyond its call."""
    runs = _run(tmp_path, _gather, [5], torch.float32)
    assert runs[5] == (close(0.001), [0.0, 1.0, 2.0])


# ---------------------------------------------------------------------------- DDP all-reduce
def _ddp(ctx, calls, numel, busy_bytes):
    """Ranks 1 and 2 (node 0) call DDP's all-reduce of ``numel`` float32 (rank + 1)s: rank r at
    ``calls[r] = (time, step)`` with its step's compute time. With ``busy_bytes``, rank 1 first
    sends that many int64 bytes to rank 3 (not waited for), holding its intra-node link."""
    comm, net = ctx.comm, ctx.comm.net
    group = comm.new_group("ddp", [1, 2], 60.0)
    if busy_bytes and ctx.rank == 1:
        comm.isend(torch.zeros(busy_bytes // 8, dtype=torch.int64), 3, tag=1)
    if busy_bytes and ctx.rank == 3:
        comm.recv(torch.zeros(busy_bytes // 8, dtype=torch.int64), 1, tag=1)
    if ctx.rank not in calls:
        return None
    at, step = calls[ctx.rank]
    comm.sleep(at)
    flat = torch.ones(numel) * (ctx.rank + 1)
    op = net.collective("all_reduce", group, ctx.rank, flat, step_s=step)
    net.wait_collective(op, "DDP all-reduce")
    return comm.now(), flat.tolist()


def test_ddp_overlaps_the_all_reduce_with_the_step_of_the_member_that_called_last(tmp_path):
    """Rank 1 calls last (1 ms, a step of 1.5 ms; rank 2 at 0.5 ms, a step of 0.3 ms), so the
    all-reduce overlaps rank 1's backward, its step having begun at 1 − 1.5 = −0.5 ms. One
    float32 scaled by 2 buckets / 4 bytes is 2 full DDP buckets of B bytes, each a ring of 2 on
    the intra-node link: c = 2 latencies + B / bandwidth. Forward = step/3, backward = 2·step/3:
    bucket 0 ready at 1 ms after the step's start, bucket 1 at 1.5 ms; bucket 0 ends at 1 + c,
    bucket 1 (c > 0.5 ms) at 1 + 2c. Both members leave at −0.5 + 1 + 2c ms, holding 2 + 3."""
    c = 2 * LAT_IN + DDP_BUCKET_BYTES / BW_IN
    end = -0.0005 + 0.001 + 2 * c
    calls = {1: (0.001, 0.0015), 2: (0.0005, 0.0003)}
    runs = _run(tmp_path, _ddp, calls, 1, 0, scale=2 * DDP_BUCKET_BYTES // 4)
    assert runs[1] == (close(end), [5.0]) and runs[2] == (close(end), [5.0])


def test_ddp_waits_for_a_member_link_still_busy_after_the_last_call(tmp_path):
    """Rank 1's intra-node link carries 4e6 bytes (control data, unscaled) from t = 0 until
    0.5 ms + 4e6 / 2e9 = 2.5 ms. The members call at 0.5 ms and 1 ms (the last with a step of
    2 ms) an all-reduce of nothing: DDP's end is when the link is free, 2.5 ms, not the end of
    the step (1 ms)."""
    calls = {1: (0.001, 0.002), 2: (0.0005, 0.004)}
    runs = _run(tmp_path, _ddp, calls, 0, 4_000_000)
    assert runs[1] == (close(0.0025), []) and runs[2] == (close(0.0025), [])


# ---------------------------------------------------------------------------- all_reduce_sum
GROUP = object()  # an opaque group handle: passed through, never looked inside
HUNDREDS = 100.0  # what the group's other ranks contribute to each element, together


def _all_reduce_sums(size: int, t: torch.Tensor, **kw) -> list[tuple]:
    """``all_reduce_sum`` over GROUP on ``size`` threads, each transport a ThreadComm that
    accepts only GROUP (the caller's group reaches the transport), its clock reading 10, 10.5,
    11, ..., and each link a RecordingLink charging 0.25 s: rank 0 sums ``t``, the others
    ``HUNDREDS`` between them (rank 1 all, the rest zeros). Each rank's (pending, tensor,
    transport, link, stats)."""

    def rank_fn(rank, comm):
        mine = t if rank == 0 else torch.full_like(t, HUNDREDS if rank == 1 else 0.0)
        link, stats = RecordingLink(allreduce_cost_s=0.25), CommStats()
        pending = all_reduce_sum(mine, GROUP, stats, link=link, comm=comm, **kw)
        return pending, mine, comm, link, stats

    return on_comm_threads(size, rank_fn, handle=GROUP, start=10.0, tick=0.5)


def test_all_reduce_sum_counts_a_ring_within_a_node_by_default_and_reduces_over_its_group():
    """Without ``spans_nodes`` the group is taken as within a node: an active link is not
    emulated and the ring's bytes (2(n−1)/n × 4 floats × 4 bytes = 24 for n = 4) count as
    intra-node; the one blocking transport call gets the caller's group; the seconds between
    its clock readings count as waiting; the returned pending waits on the same transport."""
    pending, t, comm, link, stats = _all_reduce_sums(4, torch.tensor([1.0, 2.0, 3.0, 4.0]))[0]
    assert t.tolist() == [101.0, 102.0, 103.0, 104.0]
    assert comm.calls == [("all_reduce", torch.float32, 4, False)] and link.asked == []
    assert (stats.intra_node_bytes, stats.inter_node_bytes) == (24, 0)
    assert (stats.wait_s, stats.emulated_link_s) == (0.5, 0.0)
    pending.wait()  # nothing left to wait for: two more readings of the same clock
    assert stats.wait_s == 1.0 and comm.clock == 12.0


def test_a_group_of_one_across_nodes_does_not_emulate_the_link():
    """A group of one rank has nothing to carry over the link, even marked as spanning nodes:
    the link is not asked, no time is added for it, and the all-reduce is the blocking one
    (its sum, over the one rank, the tensor itself)."""
    _, t, comm, link, stats = _all_reduce_sums(1, torch.tensor([1.0, 2.0]), spans_nodes=True)[0]
    assert link.asked == [] and link.booked == [] and stats.emulated_link_s == 0.0
    assert comm.calls == [("all_reduce", torch.float32, 2, False)] and t.tolist() == [1.0, 2.0]


def test_an_emulated_all_reduce_waits_for_the_transport_work_it_wraps():
    """Across nodes on an active link the all-reduce is asynchronous, its work wrapped to end
    no earlier than the link allows: waiting for it also waits for the transport's work (its
    wait recorded), so the sum is in the tensor when ``all_reduce_sum`` returns; 0.25 s is
    added for the link."""
    t = torch.tensor([1.0, 2.0, 3.0])
    _, t, comm, link, stats = _all_reduce_sums(2, t, spans_nodes=True)[0]
    assert comm.calls == [("all_reduce", torch.float32, 3, True), ("wait",)]
    assert link.asked == [(12, 2)]
    assert t.tolist() == [101.0, 102.0, 103.0] and stats.emulated_link_s == 0.25
