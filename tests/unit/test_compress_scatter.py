"""The quantised all-reduce whose bytes do not grow with W (ALGORITHMS.md §8): the reduce-scatter
of quantised chunks, the owners' fp32 sums re-quantised with their own residuals, the
all-gather. Against the independent plain-PyTorch reference (tests/reference.py), bit for bit;
every rank's bytes exact; both residuals through a checkpoint; and the virtual cluster's
charged time for the two all-to-alls, computed by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cloudburst.comm.compress import (
    BLOCK,
    GATHER_MAX_W,
    OWNER,
    ErrorFeedback,
    chunk_blocks,
    compressed_all_reduce_sum,
    packed_bytes,
    quantised_sent_bytes,
)
from cloudburst.comm.link import Topology
from cloudburst.comm.stats import CommStats
from cloudburst.config.simulation import SimulationConfig
from cloudburst.sim.clock import ClockModel
from cloudburst.sim.network import SimNetwork
from cloudburst.sim.scheduler import Scheduler
from cloudburst.sim.transport import SimTransport
from tests import reference as ref
from tests.support import clock_run_config, compress_vector, on_comm_threads


def _reduce(size: int, n: int, method: str, rounds: int, feedbacks=None, seed: int = 0):
    """``rounds`` quantised all-reduces of fresh vectors on ``size`` threads; per rank: the
    inputs, the results, the bytes counted, the transport's calls and its ErrorFeedback."""

    def rank_fn(rank: int, comm):
        feedback = feedbacks[rank] if feedbacks is not None else ErrorFeedback()
        stats, inputs, outputs = CommStats(), [], []
        for k in range(rounds):
            x = compress_vector(n, seed=seed + 100 * k + rank) * (1 + rank)
            y = x.clone()
            compressed_all_reduce_sum(y, None, stats, method, feedback=feedback, key="t", comm=comm)
            inputs.append(x)
            outputs.append(y)
        return inputs, outputs, stats.sent_bytes, comm.calls, feedback

    return on_comm_threads(size, rank_fn)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize(("size", "n"), [(3, 1000), (4, 1000), (5, 1000), (4, 3000)])
def test_the_reduce_scatter_is_the_reference_bit_for_bit_on_every_rank(method, size, n):
    # (5, 1000): 4 blocks for 5 ranks, one rank owns none; (4, 3000): a padded last block.
    results = _reduce(size, n, method, rounds=3)
    sent: list = [None] * size
    owner: list = [None] * size
    for k in range(3):
        expected, sent, owner = ref.quantised_all_reduce(
            [r[0][k] for r in results], method, sent, owner
        )
        for r in results:
            assert torch.equal(r[1][k], expected)  # the same bits on every rank
    for rank, r in enumerate(results):
        assert torch.equal(r[4].residuals["t"], sent[rank])
        assert torch.equal(r[4].residuals["t" + OWNER], owner[rank])
    # every rank took part in two all-to-alls a round, each waited for, nothing else
    assert all([c[0] for c in r[3]] == ["all_to_all", "wait"] * 6 for r in results)
    # the sum is the true sum within two roundings of each block
    true = sum(r[0][2] for r in results)
    assert float((results[0][1][2] - true).abs().max()) < 0.1 * float(true.abs().max())


def test_each_rank_sends_its_share_exactly_and_the_total_is_2_w_minus_1_packed_vectors():
    # 1000 values = 4 blocks of 256 codes + a 4-byte scale (260 bytes); W = 3 owns [2, 1, 1]:
    # rank 0 sends 2 blocks of others' chunks, then its 2 blocks to 2 ranks: 6 × 260; ranks 1
    # and 2: 3 blocks, then 1 block to 2 ranks: 5 × 260.
    assert chunk_blocks(1000, 3) == [2, 1, 1]
    results = _reduce(3, 1000, "int8", rounds=1)
    assert [r[2] for r in results] == [1560, 1300, 1300]
    assert [quantised_sent_bytes(1000, 3, p) for p in range(3)] == [1560, 1300, 1300]
    # the splits each rank gave its transport (first the scatter, then the gather)
    assert [c for c in results[0][3] if c[0] == "all_to_all"] == [
        ("all_to_all", [520, 260, 260], [520, 520, 520], True),
        ("all_to_all", [520, 520, 520], [520, 260, 260], True),
    ]
    for size in (3, 8, 64, 256):
        for n in (1000, 10_000, 123_457):
            total = sum(quantised_sent_bytes(n, size, p) for p in range(size))
            assert total == 2 * (size - 1) * packed_bytes(n, "int8")
    # W ≤ GATHER_MAX_W: one all-gather, (W − 1) packed vectors, nothing to own
    assert GATHER_MAX_W == 2
    pair = _reduce(2, 1000, "int8", rounds=1)
    assert [r[2] for r in pair] == [packed_bytes(1000, "int8")] * 2
    gather = [("all_gather", packed_bytes(1000, "int8"), True), ("wait",)]
    assert all(r[3] == gather and set(r[4].residuals) == {"t"} for r in pair)


def test_both_residuals_round_trip_through_a_checkpoint_and_an_old_one_resumes():
    first = _reduce(4, 1000, "int8", rounds=2)
    saved = [copy.deepcopy(r[4].state_dict()) for r in first]
    assert all(set(s) == {"t", "t" + OWNER} for s in saved)
    restored = [ErrorFeedback() for _ in saved]
    for fb, state in zip(restored, saved, strict=True):
        fb.load_state_dict(state)
    go_on = _reduce(4, 1000, "int8", rounds=2, feedbacks=[r[4] for r in first], seed=7)
    again = _reduce(4, 1000, "int8", rounds=2, feedbacks=restored, seed=7)
    for a, b in zip(go_on, again, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    # A checkpoint of the all-gather form holds the sender's residual only: the owner's
    # starts at zero (that form rounded once), which is the reference with none.
    old = [ErrorFeedback() for _ in saved]
    for fb, state in zip(old, saved, strict=True):
        fb.load_state_dict({"t": state["t"]})
    resumed = _reduce(4, 1000, "int8", rounds=1, feedbacks=old, seed=7)
    expected, _, _ = ref.quantised_all_reduce(
        [r[0][0] for r in resumed], "int8", [s["t"] for s in saved], [None] * 4
    )
    assert torch.equal(resumed[0][1][0], expected)
    # ... and a residual of another size (another W, another model) is refused in one line
    wrong = ErrorFeedback()
    wrong.load_state_dict({"t": torch.zeros(999)})
    with pytest.raises(ValueError, match=r"^error feedback 't': the residual holds 999 values"):
        wrong.compensate("t", torch.zeros(1000))


def test_the_virtual_cluster_charges_two_all_to_alls_by_hand():
    # 4 ranks on 2 nodes, a 1 Gbit/s link (125,000,000 bytes/s) with 1 ms latency; 5 blocks
    # (1280 values) owned [2, 1, 1, 1]. An all-to-all costs (W − 1) latencies + the busiest
    # rank's bytes to the others / bandwidth:
    #   scatter: ranks 1-3 send 4 blocks (1040 bytes): 3 ms + 1040 / 1.25e8 s
    #   gather: rank 0 sends its 2 blocks to 3 ranks (1560 bytes): 3 ms + 1560 / 1.25e8 s
    expected = 0.003 + 1040 / 1.25e8 + 0.003 + 1560 / 1.25e8
    cfg = clock_run_config(inter_node_link="1,1", workers=4)
    clock = ClockModel(SimulationConfig(), cfg, actual_params=1280, step_time_s=0.1)
    sched = Scheduler()
    net = SimNetwork(sched, clock, Topology.contiguous(4, 2), timeout_s=60.0)
    comms = [SimTransport(net, r, r) for r in range(4)]
    seen: dict[int, tuple[float, torch.Tensor, int]] = {}

    def rank_fn(rank: int) -> None:
        y = compress_vector(1280, seed=rank)
        stats = CommStats()
        compressed_all_reduce_sum(y, None, stats, "int8", feedback=ErrorFeedback(), key="g",
                                  spans_nodes=True, comm=comms[rank])  # fmt: skip
        seen[rank] = (comms[rank].now(), y, stats.inter_node_bytes)

    for r in range(4):
        sched.spawn(lambda r=r: rank_fn(r), f"rank{r}", r)
    sched.run()
    assert [seen[r][0] for r in range(4)] == [pytest.approx(expected, rel=1e-12)] * 4
    assert all(torch.equal(seen[r][1], seen[0][1]) for r in range(4))
    assert [seen[r][2] for r in range(4)] == [quantised_sent_bytes(1280, 4, r) for r in range(4)]
    assert net.collectives == 2
    assert 5 * BLOCK == 1280
