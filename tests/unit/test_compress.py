"""Compressed communication (cloudburst/comm/compress.py): the formats' round trips, the
compressed strategies against the references' quantiser, error feedback over all-reduce rounds,
compressed runs on the virtual cluster, killed and resumed too (threads: test_compress_scatter)."""

from __future__ import annotations

import copy
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from cloudburst.comm.compress import (
    BLOCK,
    Compression,
    ErrorFeedback,
    compressed_all_reduce_sum,
    decode,
    packed_bytes,
    round_trip,
)
from cloudburst.comm.link import Topology
from cloudburst.comm.stats import CommStats
from cloudburst.config import ConfigError, RunConfig
from cloudburst.records.checkpoint import load_checkpoint
from cloudburst.sim.run import SimulationFailed, run_ranks
from cloudburst.strategies.daso import DasoStrategy
from cloudburst.strategies.diloco import DilocoStrategy
from cloudburst.strategies.local_sgd import LocalSgdStrategy
from tests import reference as ref
from tests.reference import trained
from tests.support import (
    LocalSgdCtx,
    ThreadComm,
    ThreadGroup,
    assert_follows_reference,
    compress_vector,
    drive_strategy,
    ps_job,
    references_cfg,
    run_sim,
    sim_cfg,
    survivor_cfg,
)


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


# ---------------------------------------------------------------------------- the config
def test_compress_is_refused_where_it_is_not_built():
    built = {"sync": "powersgd:2", "daso": "int8", "asgd": "fp8", "easgd": "fp8", "gossip": "fp8"}
    for strategy, method in built.items():
        assert RunConfig(strategy=strategy, workers=2, compress=method).cluster.compress == method
    for strategy in ("daso", "diloco", "asgd", "easgd", "gossip"):
        refused = f"compress: 'powersgd' is not available for strategy '{strategy}'"
        with pytest.raises(ConfigError, match=refused):
            RunConfig(strategy=strategy, workers=2, compress="powersgd")
    with pytest.raises(ConfigError, match="--daso-downcast fp16 / --daso-cycling-downcast none"):
        RunConfig(strategy="daso", workers=2, compress="int8", daso_downcast="fp16")
    with pytest.raises(ConfigError, match="apply only with --compress none"):
        RunConfig(strategy="daso", workers=2, compress="bf16", daso_cycling_downcast="bf16")
    with pytest.raises(ConfigError, match="compress: 'zip' is not allowed"):
        RunConfig(strategy="sync", workers=2, compress="zip")


# ---------------------------------------------------------------------------- strategies
def _train(pairs, steps: range) -> None:
    for step in steps:
        for replicas, strategy in pairs:
            replicas.step(0, step)
            strategy.after_step(8)


def _diloco(seed: int) -> tuple[ref.Replicas, DilocoStrategy]:
    cfg = survivor_cfg("diloco", 1, period=2, fragments=2, diloco_outer_lr=0.7, compress="int8")
    ctx = LocalSgdCtx(cfg, 0, comm=ThreadComm(ThreadGroup(1), 0))
    return ref.Replicas(1, ref.sgd(), seed=seed), DilocoStrategy(ctx)


def _daso(seed: int) -> tuple[ref.Replicas, DasoStrategy]:
    # DASO's int8 global sync over a group of one (the merge (2S·θ + C(θ + e)) / (2S + 1))
    cfg = survivor_cfg("daso", 1, compress="int8", daso_global_skip=2, daso_batches_to_wait=1,
                       daso_adaptive=False, daso_epoch_end_sync=False)  # fmt: skip
    ctx = SimpleNamespace(
        cfg=cfg, topology=Topology((0,)), node=0, rank=0, groups={"node": None, "across": None},
        comm=ThreadComm(ThreadGroup(1), 0), link=None, device=torch.device("cpu"),
    )  # fmt: skip
    return ref.Replicas(1, ref.sgd(), seed=seed), DasoStrategy(ctx)


@pytest.mark.parametrize(("build", "keys", "steps"), [
    (_diloco, {"fragment0", "fragment1"}, 6), (_daso, {"theta"}, 7),
])  # fmt: skip
def test_a_worker_checkpoints_its_residuals_and_a_restored_one_continues_alike(build, keys, steps):
    """One worker over a group of one (int8 still rounds): its state dict holds the residuals,
    and a twin of another seed restored from it ends with the same bits."""

    def make(seed: int):
        replicas, strategy = build(seed)
        strategy.wrap(replicas.models[0], replicas.optimizers[0])
        return replicas, strategy

    replicas, strategy = make(0)
    _train([(replicas, strategy)], range(1, steps))
    if build is _daso:  # syncs start at steps 2, 4, 6 and merge a step later: step 6's now
        strategy._merge()
        assert strategy.global_bytes == 3 * packed_bytes(strategy.numel, "int8")
    saved = copy.deepcopy(strategy.state_dict())
    assert set(saved["compress_feedback"]) == keys
    assert any(r.abs().sum() > 0 for r in saved["compress_feedback"].values())
    twin_replicas, twin = make(3)
    ref.set_flat(twin_replicas.models[0], ref.flat(replicas.models[0]))
    twin_replicas.optimizers[0].load_state_dict(copy.deepcopy(replicas.optimizers[0].state_dict()))
    twin.load_state_dict(saved)
    _train([(replicas, strategy), (twin_replicas, twin)], range(steps, 2 * steps))
    assert torch.equal(ref.flat(replicas.models[0]), ref.flat(twin_replicas.models[0]))


# ------------------------------------------------- against the references' quantiser
# Compressed local SGD, DiLoCo and asgd pushes against the plain-PyTorch references with the
# reference quantiser (tests/reference.py: block-wise int8 / fp8 with error feedback).
STEPS, PERIOD, WORKERS = 13, 4, 2  # three averages and a final one after a partial period
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _drive(ctx, strategy_name: str) -> list[list[float]]:
    cls = DilocoStrategy if strategy_name == "diloco" else LocalSgdStrategy
    model = ref.tiny_model()
    return drive_strategy(ctx, cls(ctx), model, ref.sgd()(model), STEPS)


def _reference(strategy: str, reduce) -> list[list[torch.Tensor]]:
    replicas = ref.Replicas(WORKERS, ref.sgd())
    if strategy == "local_sgd":
        return ref.local_sgd(replicas.models, replicas.step, STEPS, PERIOD, reduce=reduce)
    return ref.diloco(replicas.models, replicas.step, STEPS, PERIOD, OUTER_LR, OUTER_MOMENTUM,
                      nesterov=True, reduce=reduce)  # fmt: skip


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("strategy", ["local_sgd", "diloco"])
def test_compressed_averages_follow_the_reference_quantiser(tmp_path, strategy, method):
    cfg = RunConfig(strategy=strategy, workers=WORKERS, dataset="synthetic", period=PERIOD,
                    compress=method, out=str(tmp_path),
                    **({"diloco_outer_lr": OUTER_LR, "diloco_outer_momentum": OUTER_MOMENTUM}
                       if strategy == "diloco" else {}))  # fmt: skip
    runs = run_ranks(cfg, _drive, strategy)
    expected = _reference(strategy, ref.QuantisedSum(method))
    assert_follows_reference(runs, expected, STEPS)
    # The compression shows: without feedback, or uncompressed, the run is another one.
    for other in (ref.QuantisedSum(method, feedback=False), None):
        gap = (torch.tensor(runs[0][-1]) - _reference(strategy, other)[0][-1]).abs().max()
        assert gap > 1e-4, other


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_asgd_pushes_are_the_reference_quantiser_with_a_checkpointed_residual_per_shard(method):
    # Six pushes of one Δ to two shards (contiguous slices, sizes differing by at most one): each
    # slice goes as C(Δ_k + e_k), the servers apply C⁻¹ of it and e_k keeps the rest.
    cfg = references_cfg(strategy="asgd", workers=1, servers=2, compress=method)
    [worker] = ps_job(cfg, [ref.tiny_model()]).workers
    n, shards = ref.NUMEL, 2
    sizes = [n // shards + (1 if k < n % shards else 0) for k in range(shards)]
    bounds = [(sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(shards)]
    assert [tuple(b) for b in worker.bounds] == bounds
    g = torch.Generator().manual_seed(5)
    delta = torch.randn(n, generator=g) * 0.01 + 0.002
    residuals = [torch.zeros(b - a) for a, b in bounds]
    applied_sum = torch.zeros(n)
    for _ in range(6):
        kept = [worker.feedback.residuals.get(f"shard{k}", 0) for k in range(shards)]
        sent = delta.clone()
        packets = worker._compress_push(sent)
        for k, (a, b) in enumerate(bounds):
            # the worker keeps exactly e ← Δ_k + e − C⁻¹(C(Δ_k + e)) of its own quantiser
            own = delta[a:b] + kept[k]
            assert torch.equal(
                worker.feedback.residuals[f"shard{k}"], own - round_trip(own, method)
            )
            x = delta[a:b] + residuals[k]
            expected = ref.quantise_round_trip(x, method)
            residuals[k] = x - expected
            torch.testing.assert_close(sent[a:b], expected, rtol=0, atol=1e-7)
            torch.testing.assert_close(decode(packets[k], b - a, method), expected, rtol=0,
                                       atol=1e-7)  # fmt: skip
        applied_sum += sent
    # Over the rounds the servers applied 6Δ less the last residuals (one rounding).
    torch.testing.assert_close(applied_sum + torch.cat(residuals), 6 * delta, rtol=0, atol=1e-6)
    # The residuals are checkpointed, one a shard, and a restored worker holds them.
    state = worker.state_dict()
    assert set(state["compress_feedback"]) == {"shard0", "shard1"}
    [twin] = ps_job(cfg, [ref.tiny_model()]).workers
    twin.load_state_dict(state)
    for key, residual in worker.feedback.residuals.items():
        assert torch.equal(state["compress_feedback"][key], residual)
        assert torch.equal(twin.feedback.residuals[key], residual)


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
    # warm-up, cycling, an epoch end, cool-down; they learn to ~0.99 (fp32, int8 and bf16).
    schedule = dict(daso_warmup_epochs=0.25, daso_cooldown_epochs=0.25, daso_global_skip=4)
    train_size = steps * 1344 // 40
    return sim_cfg(out, "daso", 4, steps, nodes=2, train_size=train_size, **schedule, **kw)


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


BF16, PACKED = (1 - 1e-3, 1 + 1e-3), (0.999, 1.06)  # (each fragment pads its last block)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "method", "extra", "bounds"), [
    ("sync", "bf16", {}, BF16),
    ("sync", "int8", {}, PACKED),
    ("local_sgd", "int8", {"period": 4}, PACKED),
    ("diloco", "int8", {"period": 4, "fragments": 2, "fragment_delay": 1}, PACKED),
    ("diloco", "fp8", {"period": 4}, PACKED),
    ("daso", "int8", {}, (0.99, 1.01)),  # DASO's inter-node bytes: its global syncs
    ("daso", "bf16", {}, (0.99, 1.01)),
])  # fmt: skip
def test_compressed_runs_learn_and_count_compressed_bytes(
    tmp_path, plain_run, strategy, method, extra, bounds
):
    """A compressed run learns as the uncompressed one (shared per settings) does, far above
    chance (0.1), with its inter-node bytes the format's share of the fp32 run's."""
    # sync and local SGD learn to ~0.97 in 40 steps, DiLoCo (period 4) to ~0.9 in 60
    steps, plain_kw = (60 if strategy == "diloco" else 40), {}
    cfg = partial(sim_cfg, strategy=strategy, workers=2, steps=steps, nodes=2, **extra)
    if strategy == "daso":  # the uncompressed arm: every global sync in fp32
        cfg, plain_kw = _daso_cfg, {"daso_downcast": "none"}
    plain, plain_out = plain_run(f"{strategy}-{extra}", lambda out: cfg(out, **plain_kw))
    packed = run_sim(cfg(tmp_path / "packed", compress=method))
    assert packed["final_test_accuracy"] >= plain["final_test_accuracy"] - 0.05
    assert packed["final_test_accuracy"] > 0.5
    ratio = packed["inter_node_bytes"] / plain["inter_node_bytes"]
    numel = sum(p.numel() for p in trained(plain_out).parameters())
    per_value = 0.5 if method == "bf16" else packed_bytes(numel, method) / (4 * numel)
    assert per_value * bounds[0] < ratio < per_value * bounds[1]
    if strategy != "daso":  # (DASO's node-local all-reduces are intra-node)
        assert packed["inter_node_bytes"] == packed["sent_bytes"]


# ---------------------------------------------------------------------------- killed and resumed
RESUMED = [
    # (sync int8 on the virtual cluster made its residuals at the first step, after a resumed
    # worker had loaded its checkpoint: they were dropped.)
    pytest.param(dict(strategy="sync", compress="int8"), id="sync-int8"),
    pytest.param(dict(strategy="sync", compress="bf16"), id="sync-bf16"),
    pytest.param(dict(strategy="local_sgd", compress="int8", period=3), id="local_sgd-int8"),
    pytest.param(dict(strategy="diloco", compress="fp8", period=3), id="diloco-fp8"),
    pytest.param(
        dict(strategy="diloco", workers=4, nodes=2, replica="node", period=3),
        id="diloco-node-replicas",
    ),
]
KILL_AT, CHECKPOINT_EVERY = 13, 8


def _resumable(out, workers: int = 2, **kw) -> RunConfig:
    return RunConfig(dataset="synthetic", model="mlp", workers=workers, steps=20, batch_size=16,
                     test_size=64, eval_every_s=60, seed=3, out=str(out), **kw)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUMED)
def test_a_compressed_run_killed_and_resumed_ends_where_the_undisturbed_one_does(tmp_path, case):
    """Exactly, on the virtual cluster: the compressed lockstep strategies (their error feedback)
    and DiLoCo with node replicas (over real processes: tests/e2e/test_compress_resume.py)."""
    whole = run_sim(_resumable(tmp_path / "whole", **case))
    kill = {"checkpoint_every": CHECKPOINT_EVERY, "inject_fault": [f"kill:1@{KILL_AT}"]}
    cut = _resumable(tmp_path / "cut", **kill, **case)
    with pytest.raises(SimulationFailed):
        run_sim(cut)
    # The checkpoint resumed from carries the compression state (bf16 and none have none).
    [path] = (tmp_path / "cut" / "checkpoints").glob(f"worker1-step{CHECKPOINT_EVERY:08d}.pt")
    strategy_state = load_checkpoint(path)["strategy"]
    kept = [k for k in strategy_state if k.startswith("compress_")]
    assert bool(kept) == (case.get("compress") in ("int8", "fp8")), sorted(strategy_state)
    resumed = run_sim(cut.replace(resume=True, inject_fault=[]))
    assert resumed["final_test_loss"] == whole["final_test_loss"]
    assert (resumed["inter_node_bytes"] > 0) == ("nodes" in case)
    whole_model, cut_model = (trained(tmp_path / run, "mlp") for run in ("whole", "cut"))
    pairs = zip(whole_model.parameters(), cut_model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


# --------------------------------------------------- error feedback over rounds of the all-reduce
ROUNDS = 8


def _inputs(rank: int, numel: int) -> torch.Tensor:
    # The same vector every round, with a bias: a rounding error repeats instead of averaging out.
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g) * (1.0 + rank) + 0.3


def _rounds(ctx, method: str, feedback: bool, numel: int) -> list[list[float]]:
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
    """On the virtual cluster, with error feedback the running sum stays within one rounding per
    quantisation (each sender's, and from W = 3 the chunk owner's); without, it drifts."""
    cfg = RunConfig(strategy="sync", workers=workers, dataset="synthetic", out=str(tmp_path))
    with_ef = run_ranks(cfg, _rounds, method, True, numel)
    without = run_ranks(cfg, _rounds, method, False, numel)
    for runs in (with_ef, without):
        assert all(r == runs[0] for r in runs), "every rank gets the same bits every round"
    inputs = [_inputs(r, numel) for r in range(workers)]
    true = torch.stack(inputs).sum(0)
    # Σ_k out_k = k·Σx − (the last residuals): the senders' and the owners' (one rounding each)
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
