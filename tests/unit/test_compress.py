"""Compressed communication (cloudburst/comm/compress.py): the formats' round trips, error
feedback, the compressed all-reduce on W threads, and compressed runs on the virtual cluster.
PowerSGD through our hook against torch's hook is a real gloo test (tests/dist/test_compress.py).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from cloudburst.comm.allreduce import ring_bytes
from cloudburst.comm.compress import (
    BLOCK,
    Compression,
    ErrorFeedback,
    compressed_all_reduce_sum,
    packed_bytes,
    quantise,
    quantised_sent_bytes,
    round_trip,
)
from cloudburst.comm.link import Topology
from cloudburst.comm.stats import CommStats
from cloudburst.config import ConfigError, RunConfig
from cloudburst.strategies.daso import DasoStrategy
from cloudburst.strategies.diloco import DilocoStrategy
from tests import reference as ref
from tests.reference import trained
from tests.support import (
    LocalSgdCtx,
    RecordingLink,
    ThreadComm,
    ThreadGroup,
    compress_vector,
    on_comm_threads,
    prior_stats,
    run_sim,
    sim_cfg,
    survivor_cfg,
)

GROUP = object()  # a group handle of its own: the only one the transports below accept


# ---------------------------------------------------------------------------- the formats
def test_parse_names_the_method_and_powersgd_rank():
    assert Compression.parse("none") == Compression("none", 1)
    assert Compression.parse("powersgd:4") == Compression("powersgd", 4)
    assert Compression.parse("int8").quantised and not Compression.parse("bf16").quantised
    for bad in ("int4", "bf16:2", "powersgd:x", "powersgd:0"):
        with pytest.raises(ValueError):
            Compression.parse(bad)


def test_each_method_round_trips_within_its_format_bound():
    x = compress_vector()
    assert torch.equal(round_trip(x, "none"), x)
    # bf16: 8 significant bits, round to nearest: relative error ≤ 2⁻⁸ (normal values)
    err = (round_trip(x, "bf16") - x).abs()
    assert bool((err <= x.abs() * 2**-8).all())
    # int8: a step of absmax/127 per block, round to nearest: ≤ absmax/254
    err = (round_trip(x, "int8") - x).abs()
    assert bool((err <= ref.rounding_bound(x, "int8") * (1 + 1e-6)).all())
    assert err.max() > 0
    # fp8 e4m3 scaled so the block absmax is 448: 3 mantissa bits, relative ≤ 2⁻⁴, and
    # below the smallest normal (2⁻⁶ of the scale unit) an absolute 2⁻¹⁰ units
    unit = ref.rounding_bound(x, "fp8") * 16 / 448
    err = (round_trip(x, "fp8") - x).abs()
    assert bool((err <= x.abs() * 2**-4 + unit * 2**-10 + 1e-12).all())
    # a zero block stays exactly zero in every format
    for method in ("bf16", "int8", "fp8"):
        assert not round_trip(x, method)[BLOCK : 2 * BLOCK].any()


def test_quantised_payload_is_one_byte_a_value_plus_a_scale_a_block():
    codes, scales = quantise(compress_vector(1000), "int8")
    assert codes.dtype == torch.int8 and codes.numel() == 1024 and scales.numel() == 4
    assert packed_bytes(1000, "int8") == 1024 + 16
    codes, _ = quantise(compress_vector(1000), "fp8")
    assert codes.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_error_feedback_keeps_the_sum_of_k_sends_within_one_rounding(method):
    # Σ sent = Σ x − e_k: the sums differ by the last residual, bounded by one rounding of
    # the last compensated vector — without feedback the errors of k sends add up.
    feedback, k = ErrorFeedback(), 50
    true_sum, sent_sum, plain_sum = torch.zeros(600), torch.zeros(600), torch.zeros(600)
    for step in range(k):
        x = compress_vector(600, seed=step) * 1e-2 + 1e-3  # a bias every step: errors would add up
        compensated = feedback.compensate("g", x)
        sent = round_trip(compensated, method)
        feedback.remember("g", compensated, sent)
        true_sum += x
        sent_sum += sent
        plain_sum += round_trip(x, method)
    gap = (sent_sum - true_sum).abs()
    assert torch.allclose(sent_sum + feedback.residuals["g"], true_sum, atol=1e-5)
    bound = ref.rounding_bound(compensated, method) + 1e-6
    assert bool((gap <= bound).all())
    assert (plain_sum - true_sum).abs().sum() > 3 * gap.sum()
    # the residuals are state: they round-trip through a state dict
    twin = ErrorFeedback()
    twin.load_state_dict(copy.deepcopy(feedback.state_dict()))
    assert torch.equal(twin.residuals["g"], feedback.residuals["g"])


# ---------------------------------------------------------------------------- the all-reduce


@pytest.mark.parametrize("method", ["none", "bf16", "int8", "fp8"])
def test_a_compressed_all_reduce_gives_every_rank_the_same_sum_counted_as_sent(method):
    size, n = 3, 1000

    def rank_fn(rank: int, comm: ThreadComm):
        x = compress_vector(n, seed=rank)
        stats = CommStats()
        y = x.clone()
        pending = compressed_all_reduce_sum(
            y, None, stats, method, feedback=ErrorFeedback(), key="k", async_op=True, comm=comm
        )
        pending.wait()
        return x, y, stats.sent_bytes

    results = on_comm_threads(size, rank_fn)
    true = sum(r[0] for r in results)
    for _, y, _ in results:
        assert torch.equal(y, results[0][1])  # the same bits everywhere
    err = (results[0][1] - true).abs()
    if method == "none":
        assert torch.allclose(results[0][1], true)
    elif method == "int8":  # W = 3: each sender's rounding, then the owner's of the sum
        bound = sum(ref.rounding_bound(r[0], "int8") for r in results)
        assert bool((err <= bound + ref.rounding_bound(true + bound, "int8") + 1e-6).all())
    else:
        assert float(err.max()) < 0.1 * float(true.abs().max())
    if method in ("none", "bf16"):  # a ring of fp32 or bf16 values
        sent = [ring_bytes(n, 4 if method == "none" else 2, size)] * size
    else:
        sent = [quantised_sent_bytes(n, size, p) for p in range(size)]
    assert [r[2] for r in results] == sent


def test_a_method_without_an_all_reduce_is_refused_by_name():
    """PowerSGD (a DDP hook) or an unknown name is refused by name before any transport call."""
    comm = ThreadComm(ThreadGroup(1), 0, handle=GROUP)
    for method in ("powersgd", "int4"):
        with pytest.raises(
            ValueError, match=rf"^compressed all-reduce: '{method}' is not bf16, fp8 or int8$"
        ):
            compressed_all_reduce_sum(torch.zeros(2), GROUP, CommStats(), method, comm=comm)
    assert comm.calls == []


def _hand_off(method: str, mine: torch.Tensor, peers: torch.Tensor, cost: float, **kw):
    """A compressed all-reduce over GROUP on 4 threads (clock 10, 10.5, ...), each link charging
    ``cost``: rank 0 sums ``mine``, rank 1 ``peers``, the rest zeros. Rank 0's (pending,
    tensor, transport, link, stats)."""

    def rank_fn(rank: int, comm: ThreadComm):
        y = mine if rank == 0 else peers.clone() if rank == 1 else torch.zeros_like(mine)
        link, stats = RecordingLink(allreduce_cost_s=cost), prior_stats()
        pending = compressed_all_reduce_sum(y, GROUP, stats, method, link=link, comm=comm, **kw)
        return pending, y, comm, link, stats

    return on_comm_threads(4, rank_fn, handle=GROUP, start=10.0, tick=0.5)[0]


def test_none_passes_the_link_the_span_async_op_and_the_group_to_the_plain_all_reduce():
    """``none`` across nodes: the plain fp32 all-reduce over the group, counted as a ring
    (2·3/4 · 12 = 18 bytes); with ``async_op`` nothing is waited for until ``wait``."""
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
    """``bf16`` across nodes: a bf16 all-reduce over the group (2·3/4 · 8 = 12 bytes), its wait
    timed on the transport's clock; waiting again does not copy the result back again."""
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
    """W = 3 with ``async_op``: only the scatter has started when the call returns; ``wait``
    runs the gather, writes the reference's sum and adds one clock interval (0.5 s) to wait_s;
    a second ``wait`` does nothing."""

    def rank_fn(rank: int, comm: ThreadComm):
        stats = prior_stats()
        x = compress_vector(1000, seed=rank)
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

    results = on_comm_threads(3, rank_fn, handle=GROUP, start=10.0, tick=0.5)
    expected, _, _ = ref.quantised_all_reduce(
        [r[0] for r in results], "int8", [None] * 3, [None] * 3
    )
    for _, started, after, again, stats in results:
        calls, untouched, wait_s = started
        assert [c[0] for c in calls] == ["all_to_all"] and untouched and wait_s == 1.0
        assert after[0] == 4 and after[1] == 1.0 + 0.5 and after[2] == 10.0 + 2 * 0.5
        assert torch.equal(after[3], expected)
        assert again == after[:3]
        assert stats.emulated_link_s == 0.25


def test_each_wait_adds_its_own_interval_of_the_transports_clock_once():
    """Two asynchronous quantised all-reduces on one stats (a group of one), waited in turn:
    each wait adds one interval (0.5 s), a second wait of one nothing, a blocking one one."""
    comm, stats = ThreadComm(ThreadGroup(1), 0, handle=GROUP, start=10.0, tick=0.5), prior_stats()
    pending = [
        compressed_all_reduce_sum(
            compress_vector(300, seed=s), GROUP, stats, method, async_op=True, comm=comm
        )
        for s, method in ((1, "int8"), (2, "fp8"))
    ]
    assert stats.wait_s == 1.0 and comm.clock == 10.0
    pending[0].wait()
    assert stats.wait_s == 1.0 + 0.5 and comm.clock == 11.0
    pending[1].wait()
    assert stats.wait_s == 2.0 and comm.clock == 12.0
    pending[1].wait()
    assert stats.wait_s == 2.0 and comm.clock == 12.0
    compressed_all_reduce_sum(compress_vector(600, seed=3), GROUP, stats, "fp8", comm=comm)
    assert stats.wait_s == 2.5 and comm.clock == 13.0


def test_calls_without_a_key_share_one_residual_under_the_empty_key():
    """Without a key the residual is kept under "", added back by the next call without a key
    or naming "" (a group of one sums its own round trip); a named key starts from zero."""
    x1, x2, x3 = (compress_vector(600, seed=s) for s in (3, 4, 5))
    feedback = ErrorFeedback()

    def reduce(y: torch.Tensor, **key) -> torch.Tensor:
        comm = ThreadComm(ThreadGroup(1), 0, handle=GROUP)
        compressed_all_reduce_sum(y, GROUP, CommStats(), "int8", feedback, comm=comm, **key)
        return y

    e1 = x1 - ref.quantise_round_trip(x1, "int8")
    reduce(x1.clone())
    assert set(feedback.residuals) == {""} and torch.equal(feedback.residuals[""], e1)
    c2 = x2 + e1
    y2 = reduce(x2.clone())
    assert torch.equal(y2, ref.quantise_round_trip(c2, "int8"))
    assert not torch.equal(y2, ref.quantise_round_trip(x2, "int8"))
    e2 = c2 - ref.quantise_round_trip(c2, "int8")
    assert set(feedback.residuals) == {""} and torch.equal(feedback.residuals[""], e2)
    assert torch.equal(reduce(x3.clone(), key=""), ref.quantise_round_trip(x3 + e2, "int8"))
    assert set(feedback.residuals) == {""}
    assert torch.equal(reduce(x3.clone(), key="b"), ref.quantise_round_trip(x3, "int8"))
    assert set(feedback.residuals) == {"", "b"}


# ---------------------------------------------------------------------------- the config
def test_compress_is_refused_where_it_is_not_built():
    assert (
        RunConfig(strategy="sync", workers=2, compress="powersgd:2").cluster.compress
        == "powersgd:2"
    )
    assert RunConfig(strategy="daso", workers=2, compress="int8").cluster.compress == "int8"
    with pytest.raises(ConfigError, match="compress: 'powersgd' is not available for strategy"):
        RunConfig(strategy="daso", workers=2, compress="powersgd")
    with pytest.raises(ConfigError, match="--daso-downcast fp16 / --daso-cycling-downcast none"):
        RunConfig(strategy="daso", workers=2, compress="int8", daso_downcast="fp16")
    with pytest.raises(ConfigError, match="apply only with --compress none"):
        RunConfig(strategy="daso", workers=2, compress="bf16", daso_cycling_downcast="bf16")
    with pytest.raises(ConfigError, match="compress: 'powersgd' is not available"):
        RunConfig(strategy="diloco", workers=2, compress="powersgd")
    with pytest.raises(ConfigError, match="compress: 'zip' is not allowed"):
        RunConfig(strategy="sync", workers=2, compress="zip")


# ---------------------------------------------------------------------------- strategies
def _train(pairs, steps: range) -> None:
    for step in steps:
        for replicas, strategy in pairs:
            replicas.step(0, step)
            strategy.after_step(8)


def _restored_twin_continues_alike(build, saved: dict, replicas, strategy, steps: range) -> None:
    """A twin built from another seed, given the replica, its optimizer and ``saved``, then
    trained on as the original is, ends with the same bits."""
    twin_replicas, twin = build(3)
    ref.set_flat(twin_replicas.models[0], ref.flat(replicas.models[0]))
    twin_replicas.optimizers[0].load_state_dict(copy.deepcopy(replicas.optimizers[0].state_dict()))
    twin.load_state_dict(saved)
    _train([(replicas, strategy), (twin_replicas, twin)], steps)
    assert torch.equal(ref.flat(replicas.models[0]), ref.flat(twin_replicas.models[0]))


def test_diloco_checkpoints_its_residuals_and_a_restored_worker_continues_alike():
    # One worker over a group of one: the int8 round trip and its residual are still real.
    kw = dict(period=2, fragments=2, diloco_outer_lr=0.7, compress="int8")

    def build(seed: int):
        replicas = ref.Replicas(1, ref.sgd(), seed=seed)
        ctx = LocalSgdCtx(survivor_cfg("diloco", 1, **kw), 0, comm=ThreadComm(ThreadGroup(1), 0))
        strategy = DilocoStrategy(ctx)
        strategy.wrap(replicas.models[0], replicas.optimizers[0])
        return replicas, strategy

    replicas, strategy = build(0)
    _train([(replicas, strategy)], range(1, 6))
    saved = copy.deepcopy(strategy.state_dict())
    assert set(saved["compress_feedback"]) == {"fragment0", "fragment1"}
    assert any(r.abs().sum() > 0 for r in saved["compress_feedback"].values())
    _restored_twin_continues_alike(build, saved, replicas, strategy, range(6, 12))


def test_daso_checkpoints_its_residual_and_a_restored_rank_continues_alike():
    # One rank, one node: DASO's int8 global sync over a group of one (the merge
    # (2S·θ + C(θ + e)) / (2S + 1)) still rounds, and leaves a residual.
    def build(seed: int):
        replicas = ref.Replicas(1, ref.sgd(), seed=seed)
        cfg = survivor_cfg("daso", 1, compress="int8", daso_global_skip=2,
                           daso_batches_to_wait=1, daso_adaptive=False,
                           daso_epoch_end_sync=False)  # fmt: skip
        ctx = SimpleNamespace(
            cfg=cfg, topology=Topology((0,)), node=0, rank=0, groups={"node": None,
            "across": None}, comm=ThreadComm(ThreadGroup(1), 0), link=None,
            device=torch.device("cpu"),
        )  # fmt: skip
        strategy = DasoStrategy(ctx)
        strategy.wrap(replicas.models[0], replicas.optimizers[0])
        return replicas, strategy

    replicas, strategy = build(0)
    _train([(replicas, strategy)], range(1, 7))  # syncs start at steps 2, 4, 6 ...
    strategy._merge()  # ... and merge a step later: the one of step 6 now
    saved = copy.deepcopy(strategy.state_dict())
    assert set(saved["compress_feedback"]) == {"theta"}
    assert saved["compress_feedback"]["theta"].abs().sum() > 0
    assert strategy.global_bytes == 3 * packed_bytes(strategy.numel, "int8")
    _restored_twin_continues_alike(build, saved, replicas, strategy, range(7, 14))


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """``plain_run(name, make_cfg)``: ``(summary, out)`` of ``run_sim(make_cfg(out))``, the
    uncompressed reference run made once per module."""
    runs: dict[str, tuple[dict, object]] = {}

    def get(name: str, make_cfg) -> tuple[dict, object]:
        if name not in runs:
            out = tmp_path_factory.mktemp(f"plain-{name}")
            runs[name] = (run_sim(make_cfg(out)), out)
        return runs[name]

    return get


def _daso_cfg(out, steps: int = 40, **kw) -> RunConfig:
    # 40 steps of 21 an epoch (1,344 samples / 64 a step; the same 1.9 epochs for other steps):
    # warm-up, cycling, an epoch end, cool-down. They learn to ~0.99 (all three of the fp32,
    # int8 and bf16 runs), far above the floor.
    schedule = dict(daso_warmup_epochs=0.25, daso_cooldown_epochs=0.25, daso_global_skip=4)
    train_size = steps * 1344 // 40
    return sim_cfg(out, "daso", 4, steps, nodes=2, train_size=train_size, **schedule, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "bf16"])
def test_compressed_daso_learns_and_sends_its_global_syncs_compressed(tmp_path, plain_run, method):
    # fp32 global syncs (both kinds) against the compressed ones: the inter-node bytes are
    # DASO's global syncs (and the epoch-loss all-reduces, 8 bytes each). The fp32 run is
    # shared by both methods.
    plain, plain_out = plain_run("daso", lambda out: _daso_cfg(out, daso_downcast="none"))
    packed = run_sim(_daso_cfg(tmp_path / "packed", compress=method))
    assert packed["final_test_accuracy"] >= plain["final_test_accuracy"] - 0.05
    assert packed["final_test_accuracy"] > 0.5
    ratio = packed["inter_node_bytes"] / plain["inter_node_bytes"]
    numel = sum(p.numel() for p in trained(plain_out).parameters())
    per_value = 0.5 if method == "bf16" else packed_bytes(numel, method) / (4 * numel)
    assert per_value * 0.99 < ratio < per_value * 1.01


def test_none_is_the_uncompressed_run_bit_for_bit(tmp_path):
    """--compress none is the run without the flag, bit for bit (sync, local SGD, DASO)."""
    # DASO: 24 steps, 1.9 epochs as in the others: every phase; nothing to learn here
    builders = {s: (lambda out, s=s, **kw: sim_cfg(out, s, 2, 12, period=4, **kw))
                for s in ("sync", "local_sgd")}  # fmt: skip
    builders["daso"] = lambda out, **kw: _daso_cfg(out, steps=24, **kw)
    for strategy, build in builders.items():
        run_sim(build(tmp_path / f"{strategy}-default"))
        run_sim(build(tmp_path / f"{strategy}-none", compress="none"))
        a = trained(tmp_path / f"{strategy}-default")
        b = trained(tmp_path / f"{strategy}-none")
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "method", "extra"),
    [
        ("sync", "bf16", {}),
        ("sync", "int8", {}),
        ("local_sgd", "int8", {"period": 4}),
        ("diloco", "int8", {"period": 4, "fragments": 2, "fragment_delay": 1}),
        ("diloco", "fp8", {"period": 4}),
    ],
)
def test_compressed_runs_learn_and_count_compressed_bytes(
    tmp_path, plain_run, strategy, method, extra
):
    # 40 steps learn to ~0.97 (sync, local SGD), DiLoCo's outer steps at period 4 to ~0.78
    # at 40 and ~0.9 at 60, compressed or not: well above the floor of 0.5 either way.
    steps, workers = (60 if strategy == "diloco" else 40), 2
    kw = dict(nodes=2, **extra)
    # The uncompressed run of the same settings (sync's is shared by bf16 and int8)
    plain, plain_out = plain_run(
        f"{strategy}-{sorted(extra.items())}",
        lambda out: sim_cfg(out, strategy, workers, steps, **kw),
    )
    packed = run_sim(sim_cfg(tmp_path / "packed", strategy, workers, steps, compress=method, **kw))
    assert packed["final_test_accuracy"] >= plain["final_test_accuracy"] - 0.05
    assert packed["final_test_accuracy"] > 0.5  # synthetic data, 10 classes: chance is 0.1
    ratio = packed["inter_node_bytes"] / plain["inter_node_bytes"]
    if method == "bf16":
        assert ratio == pytest.approx(0.5, rel=1e-3)
    else:  # all-gather of W = 2: one quantised copy against a ring's one fp32 copy
        numel = sum(p.numel() for p in trained(plain_out).parameters())
        per_value = packed_bytes(numel, method) / (4 * numel)
        # (each fragment pads its last block: a little more with several)
        assert per_value * 0.999 < ratio < per_value * 1.06
    assert packed["inter_node_bytes"] == packed["sent_bytes"]


# --------------------------------------------------- error feedback over rounds of the all-reduce
# Error feedback through the quantised all-reduce over several rounds on the virtual cluster: the
# running sum tracks the true one within one rounding per quantisation (the senders' and, from W =
# 3, the chunk owner's), where without feedback it drifts by one rounding per round.
ROUNDS = 8


def _inputs(rank: int, numel: int) -> torch.Tensor:
    # The same vector every round, with a bias: a rounding error repeats instead of averaging out.
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g) * (1.0 + rank) + 0.3


def _rounds(ctx, method: str, feedback: bool, numel: int) -> list[list[float]]:
    from cloudburst.comm.compress import ErrorFeedback, compressed_all_reduce_sum
    from cloudburst.comm.stats import CommStats

    state = ErrorFeedback() if feedback else None
    stats, outs = CommStats(), []
    for _ in range(ROUNDS):
        y = _inputs(ctx.rank, numel).clone()
        compressed_all_reduce_sum(y, None, stats, method, feedback=state, key="g", comm=ctx.comm)
        outs.append(y.tolist())
    return outs


# 1100 values: 5 blocks of 256, the last partial (at W = 3 chunks of 2, 1, 1 blocks); 700 at
# W = 4: 3 blocks, so one rank owns no chunk.
@pytest.mark.parametrize("workers, numel", [(2, 1100), (3, 1100), (4, 700)])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_error_feedback_keeps_the_running_sum_within_one_rounding(tmp_path, method, workers, numel):
    from cloudburst.config import RunConfig
    from cloudburst.sim.run import run_ranks

    cfg = RunConfig(strategy="sync", workers=workers, dataset="synthetic", out=str(tmp_path))
    with_ef = run_ranks(cfg, _rounds, method, True, numel)
    without = run_ranks(cfg, _rounds, method, False, numel)
    for runs in (with_ef, without):
        assert all(r == runs[0] for r in runs), "every rank gets the same bits every round"
    inputs = [_inputs(r, numel) for r in range(workers)]
    true = torch.stack(inputs).sum(0)
    # Σ_k out_k = k·Σx − (the last residuals): each sender's (one rounding of its vector)
    # and, where the sum is re-quantised by a chunk owner, the owner's (one of the sum).
    bound = 1.05 * (sum(ref.rounding_bound(x, method) for x in inputs)
                    + ref.rounding_bound(true, method)) + 1e-5  # fmt: skip
    running_ef, running_plain = torch.zeros(numel), torch.zeros(numel)
    for k in range(ROUNDS):
        running_ef += torch.tensor(with_ef[0][k])
        running_plain += torch.tensor(without[0][k])
        gap = (running_ef - (k + 1) * true).abs()
        assert bool((gap <= bound).all()), f"round {k + 1}: off by {float((gap - bound).max())}"
    # Without feedback the same rounding is lost every round: the drift grows with k.
    gap_ef = (running_ef - ROUNDS * true).abs().sum()
    gap_plain = (running_plain - ROUNDS * true).abs().sum()
    assert gap_plain > 3 * gap_ef
    # One round alone: the sum of the senders' reference round trips, within the owner's
    # rounding of that sum (none in the all-gather form).
    first = torch.tensor(without[0][0])
    sent = torch.stack([ref.quantise_round_trip(x, method) for x in inputs]).sum(0)
    assert bool(((first - sent).abs() <= ref.rounding_bound(sent, method) + 1e-5).all())
