"""The quantised all-reduce whose bytes do not grow with W (ALGORITHMS.md §8): the reduce-scatter
of quantised chunks, the owners' fp32 sums re-quantised with their own residuals, the all-gather
(at W = 2 one all-gather), against tests/reference.py bit for bit, bytes and link charges exact."""

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
from cloudburst.comm.stats import CommStats
from cloudburst.config.simulation import SimulationConfig
from cloudburst.sim.run import run_ranks
from tests import reference as ref
from tests.support import (
    RecordingLink,
    ThreadComm,
    ThreadGroup,
    clock_run_config,
    compress_vector,
    on_comm_threads,
    prior_stats,
)

GROUP = object()  # the group handle: the only one the transports below accept


def _on_threads(size: int, fn) -> list:
    """``fn(rank, comm)`` on ``size`` threads whose transports accept only :data:`GROUP`, their
    clocks reading 10, 10.5, 11, ... (one reading a call)."""
    return on_comm_threads(size, fn, handle=GROUP, start=10.0, tick=0.5)


def _reduce(size: int, n: int, method: str, rounds: int, feedbacks=None, seed: int = 0):
    """``rounds`` quantised all-reduces of fresh vectors over :data:`GROUP`, under a ``meta``
    default device (the owners' temporaries must live on the tensor's device); per rank: the
    inputs, the results, the transport's calls and its ErrorFeedback."""

    def rank_fn(rank: int, comm):
        feedback = feedbacks[rank] if feedbacks is not None else ErrorFeedback()
        inputs, outputs = [], []
        for k in range(rounds):
            x = compress_vector(n, seed=seed + 100 * k + rank) * (1 + rank)
            y = x.clone()
            with torch.device("meta"):
                compressed_all_reduce_sum(
                    y, GROUP, CommStats(), method, feedback, key="t", comm=comm
                )
            inputs.append(x)
            outputs.append(y)
        return inputs, outputs, comm.calls, feedback

    return _on_threads(size, rank_fn)


def test_a_method_without_an_all_reduce_is_refused_by_name():
    """PowerSGD (a DDP hook) or an unknown name is refused by name before any transport call."""
    comm = ThreadComm(ThreadGroup(1), 0, handle=GROUP)
    for method in ("powersgd", "int4"):
        refused = rf"^compressed all-reduce: '{method}' is not bf16, fp8 or int8$"
        with pytest.raises(ValueError, match=refused):
            compressed_all_reduce_sum(torch.zeros(2), GROUP, CommStats(), method, comm=comm)
    assert comm.calls == []


def _hand_off(method: str, mine: torch.Tensor, peers: torch.Tensor, cost: float, **kw):
    """A compressed all-reduce over GROUP on 4 threads, each link charging ``cost``, of ``mine``
    (rank 0), ``peers`` (rank 1), zeros; rank 0's (pending, tensor, transport, link, stats)."""

    def rank_fn(rank: int, comm: ThreadComm):
        y = mine if rank == 0 else peers.clone() if rank == 1 else torch.zeros_like(mine)
        link, stats = RecordingLink(allreduce_cost_s=cost), prior_stats()
        pending = compressed_all_reduce_sum(y, GROUP, stats, method, link=link, comm=comm, **kw)
        return pending, y, comm, link, stats

    return _on_threads(4, rank_fn)[0]


def test_none_passes_the_link_the_span_async_op_and_the_group_to_the_plain_all_reduce():
    """``none``: the plain fp32 all-reduce (a ring: 2·3/4 · 12 = 18 bytes), unwaited till wait."""
    y = torch.tensor([0.5, 0.25, -1.0])
    pending, y, comm, link, stats = _hand_off(
        "none", y, torch.tensor([1.0, 2.0, 3.0]), 0.0625, spans_nodes=True, async_op=True
    )
    assert torch.equal(y, torch.tensor([1.5, 2.25, 2.0]))
    assert comm.calls == [("all_reduce", torch.float32, 3, True)]
    assert stats.wait_s == 1.0  # not waited yet
    assert link.asked == [(12, 4)] and link.booked == [(0.0625, GROUP)]
    assert stats.emulated_link_s == 0.25 + 0.0625
    assert stats.inter_node_bytes == 3000 + 18 and stats.intra_node_bytes == 4000
    pending.wait()
    assert stats.wait_s == 1.0 + 0.5 and comm.calls[-1] == ("wait",)


def test_bf16_sums_in_bf16_on_the_group_and_link_times_its_wait_and_copies_back_once():
    """``bf16``: a bf16 all-reduce (2·3/4 · 8 = 12 bytes), timed; a second wait copies nothing."""
    y = torch.tensor([1.0, 2.0, -0.5, 3.0])
    pending, y, comm, link, stats = _hand_off(
        "bf16", y, torch.full((4,), 0.5), 0.125, spans_nodes=True
    )
    assert torch.equal(y, torch.tensor([1.5, 2.5, 0.0, 3.5]))
    assert comm.calls == [("all_reduce", torch.bfloat16, 4, True), ("wait",)]
    assert link.asked == [(8, 4)] and link.booked == [(0.125, GROUP)]
    assert stats.emulated_link_s == 0.25 + 0.125
    assert stats.inter_node_bytes == 3000 + 12 and stats.intra_node_bytes == 4000
    assert stats.sent_bytes == 1000 + 12 and stats.wait_s == 1.0 + 0.5
    y.zero_()
    pending.wait()
    assert torch.equal(y, torch.zeros(4)) and stats.wait_s == 1.0 + 2 * 0.5


def test_an_async_quantised_all_reduce_starts_the_scatter_and_wait_runs_the_rest_timed_once():
    """W = 3, ``async_op``: the call starts only the scatter; ``wait`` runs the gather, writes the
    reference's sum and adds one clock interval (0.5 s) to wait_s; a second ``wait`` nothing."""

    def rank_fn(rank: int, comm: ThreadComm):
        stats, x = prior_stats(), compress_vector(1000, seed=rank)
        y = x.clone()
        pending = compressed_all_reduce_sum(
            y, GROUP, stats, "int8", ErrorFeedback(), key="g", async_op=True, comm=comm
        )
        started = (list(comm.calls), torch.equal(y, x), stats.wait_s)
        pending.wait()
        after = (len(comm.calls), stats.wait_s, comm.clock, y.clone())
        pending.wait()
        again = (len(comm.calls), stats.wait_s, comm.clock)
        return x, started, after, again, stats

    results = _on_threads(3, rank_fn)
    expected = ref.quantised_all_reduce([r[0] for r in results], "int8", [None] * 3, [None] * 3)[0]
    for _, started, after, again, stats in results:
        calls, untouched, wait_s = started
        assert [c[0] for c in calls] == ["all_to_all"] and untouched and wait_s == 1.0
        assert after[0] == 4 and after[1] == 1.0 + 0.5 and after[2] == 10.0 + 2 * 0.5
        assert torch.equal(after[3], expected)
        assert again == after[:3]
        assert stats.emulated_link_s == 0.25


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize(("size", "n"), [(3, 1000), (4, 1000), (5, 1000), (4, 3000)])
def test_the_reduce_scatter_is_the_reference_bit_for_bit_on_every_rank(method, size, n):
    """3 rounds with error feedback over a group of its own. (5, 1000): 4 blocks for 5 ranks,
    one rank owns none; (4, 3000): a padded last block."""
    results = _reduce(size, n, method, rounds=3)
    sent, owner = [None] * size, [None] * size
    for k in range(3):
        expected, sent, owner = ref.quantised_all_reduce(
            [r[0][k] for r in results], method, sent, owner
        )
        for r in results:
            assert torch.equal(r[1][k], expected)  # the same bits on every rank
    for rank, r in enumerate(results):
        assert torch.equal(r[3].residuals["t"], sent[rank])
        assert torch.equal(r[3].residuals["t" + OWNER], owner[rank])
    assert all([c[0] for c in r[2]] == ["all_to_all", "wait"] * 6 for r in results)  # 2 a round
    # the sum is the true sum within two roundings of each block
    true = sum(r[0][2] for r in results)
    assert float((results[0][1][2] - true).abs().max()) < 0.1 * float(true.abs().max())


def test_each_rank_sends_its_share_exactly_and_the_total_is_2_w_minus_1_packed_vectors():
    """1000 values = 4 blocks of 260 bytes; W = 3 owns [2, 1, 1]: rank 0 sends 2 blocks of the
    others' chunks, then its 2 blocks to 2 ranks (6 × 260), ranks 1 and 2 3 + 2 × 1 blocks."""
    assert chunk_blocks(1000, 3) == [2, 1, 1]
    assert [quantised_sent_bytes(1000, 3, p) for p in range(3)] == [1560, 1300, 1300]
    for size in (3, 4, 5, 7, 8, 64, 256):
        for n in (1, 300, 1000, 5000, 10_000, 123_457):
            total = sum(quantised_sent_bytes(n, size, p) for p in range(size))
            assert total == 2 * (size - 1) * packed_bytes(n, "int8")
    # W ≤ GATHER_MAX_W: one all-gather, (W − 1) packed vectors for every rank; none for W = 1
    assert GATHER_MAX_W == 2
    assert [quantised_sent_bytes(1000, 2, p) for p in range(2)] == [4 * 260] * 2
    assert quantised_sent_bytes(1000, 1, 0) == 0


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_pair_all_gathers_over_the_group_and_keeps_the_residual_under_the_default_key(method):
    """W = 2: one all-gather of the packed vectors, the reference's rank-order sum of the two
    round trips; the sender's residual kept under "" (no owner's); one packed vector counted."""
    n = 700  # 3 blocks, the last one padded

    def rank_fn(rank: int, comm: ThreadComm):
        feedback, stats = ErrorFeedback(), prior_stats()
        x = compress_vector(n, seed=10 + rank) * (1 + rank)
        y = x.clone()
        compressed_all_reduce_sum(y, GROUP, stats, method, feedback, comm=comm)
        return x, y, feedback, comm.calls, stats

    results = _on_threads(2, rank_fn)
    expected = ref.QuantisedSum(method)([r[0] for r in results])
    for x, y, feedback, calls, stats in results:
        assert torch.equal(y, expected)
        assert set(feedback.residuals) == {""}
        assert torch.equal(feedback.residuals[""], x - ref.quantise_round_trip(x, method))
        assert calls == [("all_gather", 3 * BLOCK + 3 * 4, True), ("wait",)]
        assert stats.sent_bytes == 1000 + 3 * 260
        assert stats.intra_node_bytes == 4000 + 3 * 260 and stats.inter_node_bytes == 3000


def test_both_residuals_round_trip_through_a_checkpoint_and_an_old_one_resumes():
    first = _reduce(4, 1000, "int8", rounds=2)
    saved = [copy.deepcopy(r[3].state_dict()) for r in first]
    assert all(set(s) == {"t", "t" + OWNER} for s in saved)
    restored = [ErrorFeedback() for _ in saved]
    for fb, state in zip(restored, saved, strict=True):
        fb.load_state_dict(state)
    go_on = _reduce(4, 1000, "int8", rounds=2, feedbacks=[r[3] for r in first], seed=7)
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


def test_each_all_to_all_is_charged_to_the_emulated_link_on_the_group_for_this_ranks_bytes():
    """W = 3 across nodes, 1000 values owned [2, 1, 1]: the scatter (the others' chunks out) is
    charged 2 latencies + the bytes this rank sends, the gather 2 latencies + its chunk to 2 ranks,
    each booked on the group and counted as sent; without a key, residuals are "" and ":owner"."""
    blocks = [2, 1, 1]
    link_of = [RecordingLink() for _ in range(3)]

    def rank_fn(rank: int, comm: ThreadComm):
        stats, feedback = prior_stats(), ErrorFeedback()
        y = compress_vector(1000, seed=rank)
        compressed_all_reduce_sum(
            y, GROUP, stats, "int8", feedback, link=link_of[rank], spans_nodes=True, comm=comm
        )
        return stats, comm.calls, set(feedback.residuals)

    for rank, (stats, calls, keys) in enumerate(_on_threads(3, rank_fn)):
        assert keys == {"", OWNER}
        mine = blocks[rank]
        scatter = 2 * 0.125 + (4 - mine) * 260 / 1024
        gather = 2 * 0.125 + 2 * mine * 260 / 1024
        assert link_of[rank].booked == [(scatter, GROUP), (gather, GROUP)]
        assert stats.emulated_link_s == 0.25 + scatter + gather
        splits = ([520, 260, 260], [260 * mine] * 3)
        assert calls == [("all_to_all", *splits, True), ("wait",),
                         ("all_to_all", *splits[::-1], True), ("wait",)]  # fmt: skip
        moved = quantised_sent_bytes(1000, 3, rank)
        assert stats.sent_bytes == 1000 + moved
        assert stats.inter_node_bytes == 3000 + moved and stats.intra_node_bytes == 4000


@pytest.mark.parametrize(("sizes", "active", "spans_nodes"), [
    ((2, 3), True, False),  # an active link within a node
    ((2, 3), False, True),  # an inactive link across nodes
    ((1,), True, True),  # a group of one across nodes on an active link
])  # fmt: skip
def test_the_link_is_not_charged_unless_active_and_spanning_nodes_of_two_or_more(
    sizes, active, spans_nodes
):
    """The link is booked only when active, spanning nodes and shared by 2 or more ranks:
    otherwise nothing is booked and emulated_link_s keeps its earlier total."""
    for size in sizes:
        links = [RecordingLink(active=active) for _ in range(size)]

        def rank_fn(rank: int, comm: ThreadComm, links=links):
            stats = prior_stats()
            compressed_all_reduce_sum(
                compress_vector(600, seed=rank), GROUP, stats, "int8", link=links[rank],
                spans_nodes=spans_nodes, comm=comm,
            )  # fmt: skip
            return stats.emulated_link_s

        assert _on_threads(size, rank_fn) == [0.25] * size
        assert all(link.booked == [] for link in links)


def _on_the_cluster(ctx) -> tuple[float, torch.Tensor, int, int]:
    y, stats = compress_vector(1280, seed=ctx.rank), CommStats()
    compressed_all_reduce_sum(y, None, stats, "int8", feedback=ErrorFeedback(), key="g",
                              spans_nodes=True, comm=ctx.comm)  # fmt: skip
    return ctx.comm.now(), y, stats.inter_node_bytes, ctx.comm.net.collectives


def test_the_virtual_cluster_charges_two_all_to_alls_by_hand():
    # 4 ranks on 2 nodes, 1 Gbit/s (1.25e8 bytes/s) and 1 ms; 5 blocks (1280 values) owned
    # [2, 1, 1, 1]. An all-to-all costs (W − 1) latencies + the busiest rank's bytes / bandwidth:
    #   scatter: ranks 1-3 send 4 blocks (1040 bytes): 3 ms + 1040 / 1.25e8 s
    #   gather: rank 0 sends its 2 blocks to 3 ranks (1560 bytes): 3 ms + 1560 / 1.25e8 s
    expected = 0.003 + 1040 / 1.25e8 + 0.003 + 1560 / 1.25e8
    cfg = clock_run_config(inter_node_link="1,1", workers=4, nodes=2)
    sim = SimulationConfig(step_time_s=0.1)
    seen = run_ranks(cfg, _on_the_cluster, sim=sim, actual_params=1280)
    assert [s[0] for s in seen] == [pytest.approx(expected, rel=1e-12)] * 4
    assert all(torch.equal(s[1], seen[0][1]) for s in seen)
    assert [s[2] for s in seen] == [quantised_sent_bytes(1280, 4, r) for r in range(4)]
    assert [s[3] for s in seen] == [2] * 4
    assert 5 * BLOCK == 1280
