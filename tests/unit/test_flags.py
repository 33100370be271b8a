"""Flags and config files as ``cloudburst train`` reads them, down to the code they configure
(optimizer, straggler sleep, shard arithmetic, DASO), no processes; numbers by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import cloudburst.comm.allreduce as allreduce_module
import cloudburst.comm.transport as transport_module
from cloudburst.comm.link import Topology
from cloudburst.comm.transport import REAL
from cloudburst.config import RunConfig, Straggler
from cloudburst.loop.train_step import make_optimizer
from cloudburst.strategies.asgd.shard import make_shard
from cloudburst.strategies.daso import COOLDOWN, CYCLING, WARMUP, DasoStrategy
from cloudburst.strategies.daso import worker as daso


# ---------------------------------------------------------------------------- --config
def test_config_file_with_flag_overrides(tmp_path, parse):
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[train]\n"
        'strategy = "asgd"\nservers = 2\nworkers = 3\nn-sync = 4\nlr = 0.1\nmomentum = 0.5\n'
        'server-rule = "sgd"\nstraggler = ["1:2.0"]\nstaleness-scaling = true\n'
    )
    path = str(toml)
    cfg = parse("--config", path)
    job, asgd, training = cfg.job, cfg.asgd, cfg.training
    assert (job.strategy, job.servers, job.workers) == ("asgd", 2, 3)
    assert (asgd.n_fetch, asgd.n_push, asgd.server_rule) == (4, 4, "sgd")
    assert (training.lr, training.momentum) == (0.1, 0.5)
    assert asgd.staleness_scaling is True and cfg.cluster.stragglers == [Straggler(1, 2.0)]
    assert cfg.output.out.startswith("runs/asgd-")  # the default run directory names the strategy
    # Given flags win; flags not given leave the file's values alone.
    cfg = parse("--config", path, "--lr", "0.2", "--workers", "4", "--straggler", "0:3")
    assert (cfg.training.lr, cfg.job.workers) == (0.2, 4)
    assert cfg.cluster.stragglers == [Straggler(0, 3.0)]
    assert (cfg.training.momentum, cfg.asgd.server_rule, cfg.asgd.n_push) == (0.5, "sgd", 4)
    assert cfg.job.servers == 2 and cfg.asgd.staleness_scaling is True
    # An explicit --n-fetch overrides the file's n-sync for fetches only.
    cfg = parse("--config", path, "--n-fetch", "2")
    assert (cfg.asgd.n_fetch, cfg.asgd.n_push) == (2, 4)


# ---------------------------------------------------------------------------- local optimizer
def _two_steps(cfg: RunConfig) -> tuple[torch.optim.Optimizer, list[list[float]]]:
    """θ = (1, −2), loss = 0.5·θ₀ (gradient (0.5, 0)), two optimizer steps."""
    theta = nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = make_optimizer(cfg, [theta])
    trajectory = []
    for _ in range(2):
        opt.zero_grad()
        (0.5 * theta[0]).backward()
        opt.step()
        trajectory.append(theta.tolist())
    return opt, trajectory


def test_optimizer_adam_with_weight_decay(parse):
    cfg = parse("--optimizer", "adam", "--lr", "0.1", "--weight-decay", "0.1")
    opt, (first, second) = _two_steps(cfg)
    assert type(opt) is torch.optim.Adam
    # Adam's weight decay is L2 in the gradient: g' = g + 0.1·θ = (0.6, −0.2). Step 1 is
    # lr · g'/(|g'| + 1e-8), about lr · sign(g'), even for θ₁ whose gradient is 0 (AdamW would
    # move it by lr · 0.1 · 2 = 0.02 only).
    assert first == pytest.approx([1 - 0.1 * 0.6 / (0.6 + 1e-8), -2 + 0.1 * 0.2 / (0.2 + 1e-8)])
    # Step 2 by hand: g' = (0.5 + 0.1·θ₀, 0.1·θ₁); m = 0.9·m + 0.1·g'; v = 0.999·v + 0.001·g'²;
    # θ −= lr · (m / (1 − 0.9²)) / (sqrt(v / (1 − 0.999²)) + 1e-8)
    expected = []
    for g1, theta in zip((0.6, -0.2), first, strict=True):
        g2 = (0.5 if g1 > 0 else 0.0) + 0.1 * theta
        m = 0.9 * (0.1 * g1) + 0.1 * g2
        v = 0.999 * (0.001 * g1 * g1) + 0.001 * g2 * g2
        expected.append(theta - 0.1 * (m / 0.19) / (math.sqrt(v / (1 - 0.999**2)) + 1e-8))
    assert second == pytest.approx(expected, rel=1e-12)


def test_optimizer_sgd_with_momentum_and_weight_decay_is_the_default(parse):
    cfg = parse("--lr", "0.1", "--momentum", "0.5", "--weight-decay", "0.1")
    opt, (first, second) = _two_steps(cfg)
    assert type(opt) is torch.optim.SGD
    # g' = g + 0.1·θ = (0.6, −0.2) = buf; θ = (1 − 0.06, −2 + 0.02)
    assert first == pytest.approx([0.94, -1.98], rel=1e-12)
    # g' = (0.5 + 0.094, −0.198); buf = 0.5·(0.6, −0.2) + g' = (0.894, −0.298)
    assert second == pytest.approx([0.94 - 0.0894, -1.98 + 0.0298], rel=1e-12)
    assert parse().training.optimizer == "sgd" and parse().training.weight_decay == 0.0


# ---------------------------------------------------------------------------- --straggler
def test_stragglers_are_parsed_and_slow_their_worker_by_the_factor(parse, monkeypatch):
    cfg = parse("--workers", "3", "--straggler", "2:2.5", "--straggler", "0:1.5")
    assert cfg.cluster.stragglers == [Straggler(2, 2.5), Straggler(0, 1.5)]
    assert [cfg.straggler_factor(w) for w in range(3)] == [1.5, 1.0, 2.5]
    assert parse("--straggler", "1:2", "--straggler", "1:3").straggler_factor(1) == 3.0
    slept: list[float] = []
    monkeypatch.setattr(transport_module, "time", SimpleNamespace(sleep=slept.append))
    comm = transport_module.TorchTransport()
    comm.step_done(0.2, 0.0, cfg.straggler_factor(2))  # 0.2 s of compute → 0.5 s
    comm.step_done(0.2, 0.5, cfg.straggler_factor(2))  # a 0.5 s device → 1.25 s
    comm.step_done(0.2, 0.0, cfg.straggler_factor(1))  # not a straggler: no sleep
    comm.step_done(0.2, 0.5, cfg.straggler_factor(1))  # the device alone: 0.5 s
    assert slept == pytest.approx([0.3, 1.05, 0.3])


# ---------------------------------------------------------------------------- server flags
# Pushes of Δ = (delta,) against a base version, each: θ after them worked by hand, and how
# many were dropped as too stale. W = 2 (server lr 1/W = 0.5) unless a flag says otherwise.
@pytest.mark.parametrize(
    "flags, pushes, theta, dropped",
    [
        # staleness 0, 1, 2 (dropped), 1
        (["--max-staleness", "1", "--server-lr", "1"], [(1, 0), (2, 0), (4, 0), (8, 1)], 11, 1),
        (["--max-staleness", "0"], [(1, 0), (2, 0)], 0.5, 1),
        ([], [(1, 0)] * 5, 2.5, 0),  # no bound: nothing is dropped however stale
        # staleness 0, 1, 2, 3: α = 0.5, 0.5, 0.25, 0.5/3
        (["--staleness-scaling", "--server-lr", "0.5"], [(1, 0)] * 4, 1.25 + 1 / 6, 0),
        (["--server-lr", "0.5"], [(1, 0)] * 4, 2.0, 0),
        # pseudo-gradient −1 each: buf = −1, −1.9, −2.71; θ = 0.1, 0.29, 0.561
        (["--server-rule", "sgd", "--server-lr", "0.1", "--server-momentum", "0.9"],
         [(1, 0), (1, 1), (1, 2)], 0.561, 0),
        # staleness 0, 1, 2: pseudo-gradients −1, −1, −0.5
        (["--server-rule", "sgd", "--server-lr", "0.1", "--staleness-scaling"], [(1, 0)] * 3,
         0.25, 0),
        # g = −2, Σg² = 4: θ = 0.1 · 2/2; then g = −1, Σg² = 5: θ += 0.1/√5
        (["--server-rule", "adagrad", "--server-lr", "0.1"], [(2, 0), (1, 1)],
         0.1 + 0.044721359549995794, 0),
        # the worker's θ = 1: θ̃ += β/W · (1 − 0) = 0.3
        (["--strategy", "easgd", "--workers", "3", "--easgd-beta", "0.9"], [(1, 0)], 0.3, 0),
    ],
)  # fmt: skip
def test_server_flags_reach_the_shards_arithmetic(parse, flags, pushes, theta, dropped):
    """--max-staleness, --staleness-scaling, --server-lr, --server-rule, --server-momentum and
    --easgd-beta, as make_shard builds a shard from the flags."""
    cfg = parse("--strategy", "asgd", "--servers", "1", *flags)
    shard = make_shard(cfg, torch.zeros(1, dtype=torch.float32))
    for delta, base in pushes:
        shard.apply_push(torch.tensor([float(delta)]), base)
    assert shard.theta.item() == pytest.approx(theta, rel=1e-6)
    assert shard.dropped_stale == dropped and shard.version == len(pushes) - dropped


# ---------------------------------------------------------------------------- DASO flags
DASO_FLAGS = [
    "--strategy", "daso", "--workers", "4", "--nodes", "2",
    "--daso-global-skip", "3", "--daso-batches-to-wait", "2", "--daso-max-global-skips", "6",
    "--daso-warmup-epochs", "1", "--daso-cooldown-epochs", "1", "--daso-patience", "3",
    "--daso-stability-level", "0.1", "--daso-skip-reduction-factor", "3",
    "--daso-local-skip", "3", "--daso-chunk-elements", "7",
]  # fmt: skip


def _daso(cfg: RunConfig, rank: int = 0) -> DasoStrategy:
    ctx = SimpleNamespace(
        comm=REAL,
        cfg=cfg,
        rank=rank,
        node=rank // 2,
        topology=Topology.contiguous(4, 2),
        link=None,
        groups={"node": "node-group", "across": "global-group"},
        device=torch.device("cpu"),
        worker_index=rank,
    )
    return DasoStrategy(ctx)


SCHEDULE = (
    "total_epochs warmup_epochs cooldown_epochs global_skip batches_to_wait "
    "max_global_skips stability_level patience reduction_factor adaptive"
).split()


def test_daso_flags_and_defaults_reach_the_schedule(parse):
    """Every DASO flag sets its field of DasoSchedule (DASO_FLAGS moves each from its
    default); with none given the schedule is the paper's defaults."""
    strategy = _daso(parse(*DASO_FLAGS, "--daso-fixed"))
    strategy.configure(steps_per_epoch=4, total_steps=20)
    schedule = [getattr(strategy.schedule, name) for name in SCHEDULE]
    assert schedule == [5.0, 1.0, 1.0, 3, 2, 6, 0.1, 3, 3, False]
    defaults = _daso(parse("--strategy", "daso", "--workers", "4", "--nodes", "2"))
    defaults.configure(steps_per_epoch=10, total_steps=300)
    schedule = [getattr(defaults.schedule, name) for name in SCHEDULE]
    assert schedule == [30.0, 4.0, 4.0, 4, 1, 8, 0.05, 2, 2, True]


class _FakeDDP:
    """What ``counted_ddp`` returns, made with its arguments."""

    def __init__(self, module, group, device, state, hook=None, **kw):
        self.module, self.process_group = module, group
        self.require_backward_grad_sync = None

    def register_comm_hook(self, state, hook) -> None:
        pass


def _run_daso(cfg: RunConfig, monkeypatch, steps: int = 20):
    """Rank 0 of 2 nodes × 2 ranks for ``steps`` steps (4 per epoch), comm faked: the global
    all-reduce adds the other node's θ as an equal copy of this one."""
    reduces: list[tuple] = []
    world_sums: list[list[float]] = []

    def all_reduce_sum(buffer, group, stats, link=None, spans_nodes=False, **kw):
        reduces.append((strategy.local_steps, buffer.dtype, group, spans_nodes, kw))
        buffer.mul_(2)
        return SimpleNamespace(wait=lambda: None)

    def world_sum(values, stats, link=None, spans_nodes=False, comm=None):
        world_sums.append(values)
        return [2 * v for v in values]

    monkeypatch.setattr(allreduce_module, "counted_ddp", _FakeDDP)
    monkeypatch.setattr(daso, "all_reduce_sum", all_reduce_sum)
    monkeypatch.setattr(daso, "broadcast", lambda *a, **kw: None)
    monkeypatch.setattr(daso, "world_sum", world_sum)
    strategy = _daso(cfg)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1 / 3)  # not a float16 value
        model.bias.fill_(0.1)
    strategy.configure(steps_per_epoch=4, total_steps=steps)
    ddp = strategy.wrap(model, None)
    strategy.start()
    grad_sync = [ddp.require_backward_grad_sync]
    weights = []
    for _ in range(steps):
        strategy.record_loss(1.0)
        strategy.after_step(8)
        grad_sync.append(ddp.require_backward_grad_sync)
        weights.append(model.weight[0, 0].item())
    return strategy, ddp, reduces, world_sums, grad_sync, weights


def test_daso_flags_reach_the_syncs_the_local_skip_and_the_wire(parse, monkeypatch):
    cfg = parse(*DASO_FLAGS, "--daso-fixed", "--daso-downcast", "fp16")
    strategy, ddp, reduces, world_sums, grad_sync, weights = _run_daso(cfg, monkeypatch)
    assert ddp.process_group == "node-group"
    # Epoch 0 (steps 1-4) warm-up and epoch 4 (17-20) cool-down: a blocking sync each step.
    # Cycling (5-16): B = 3 starts a non-blocking sync, S = 2 steps later merged, at steps
    # 6, 9, 15 (12 ends an epoch: blocking instead); every epoch ends blocking (8, 12, 16).
    blocking = [(s, WARMUP, 3, 0) for s in range(1, 5)]
    cycling = [(6, CYCLING, 3, 2), (8, CYCLING, 3, 0), (9, CYCLING, 3, 2), (12, CYCLING, 3, 0)]
    cycling += [(15, CYCLING, 3, 2), (16, CYCLING, 3, 0)]
    assert strategy.sync_log == blocking + cycling + [(s, COOLDOWN, 3, 0) for s in range(17, 21)]
    # Rank 0 sends every other sync (local ranks take turns): blocking ones in fp16, the
    # non-blocking ones in fp32, all in chunks of 7 values over the global group.
    sent_steps = [s for s, *_ in strategy.sync_log[::2]]
    assert [r[0] for r in reduces] == sent_steps == [1, 3, 6, 9, 15, 17, 19]
    dtypes = [torch.float16, torch.float16, torch.float32, torch.float32, torch.float32]
    assert [r[1] for r in reduces] == dtypes + [torch.float16, torch.float16]
    assert {(r[2], r[3]) for r in reduces} == {("global-group", True)}
    assert {r[4]["chunk_elements"] for r in reduces} == {7}
    assert {r[4]["async_op"] for r in reduces} == {True}
    # The fp16 cast is what travels: after step 1's average θ is 1/3 rounded to float16.
    assert weights[0] == torch.tensor(1 / 3).half().item() != torch.tensor(1 / 3).item()
    # --daso-local-skip 3: the node's gradient all-reduce runs in steps 3, 6, 9, ...
    assert grad_sync == [step % 3 == 0 for step in range(1, 22)]
    # --daso-fixed: no plateau detection, so no epoch-loss all-reduce; B and S stay.
    assert world_sums == [] and strategy.schedule.global_skip == 3


def test_daso_downcast_none_keeps_float32_and_adaptive_averages_the_epoch_loss(parse, monkeypatch):
    cfg = parse(*DASO_FLAGS, "--daso-downcast", "none")
    strategy, _, reduces, world_sums, _, weights = _run_daso(cfg, monkeypatch)
    assert {r[1] for r in reduces} == {torch.float32}
    assert weights[0] == torch.tensor(1 / 3).item()
    # adaptive (the default): each cycling epoch's loss sum and count (4 steps of loss 1)
    assert world_sums == [[4.0, 4.0]] * 3
