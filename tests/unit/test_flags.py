"""Flags and config files as ``cloudburst train`` reads them (the real CLI, the launch replaced),
down to the code they configure, driven with no processes: the local optimizer, the straggler's
sleep, a shard's arithmetic, DASO's schedule and collectives (faked). Numbers worked by hand.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import cloudburst.comm.allreduce as allreduce_module
import cloudburst.comm.transport as transport_module
from cloudburst import cli
from cloudburst.comm.link import Topology
from cloudburst.comm.messages import Status
from cloudburst.comm.transport import REAL
from cloudburst.config import RunConfig, Straggler
from cloudburst.loop.train_step import make_optimizer
from cloudburst.strategies.asgd.shard import make_shard
from cloudburst.strategies.daso import COOLDOWN, CYCLING, WARMUP, DasoSchedule, DasoStrategy
from cloudburst.strategies.daso import worker as daso


@pytest.fixture
def refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """``refused(*flags)``: the one line ``cloudburst train *flags`` prints as it exits with 2."""
    monkeypatch.setattr(cli, "cmd_train", lambda args: cli.build_config(args) and 0)

    def run(*flags: str) -> str:
        assert cli.main(["train", *flags]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("cloudburst: invalid config: "), lines
        return lines[0].removeprefix("cloudburst: invalid config: ")

    return run


# ---------------------------------------------------------------------------- --config
def _toml(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_config_file_with_flag_overrides(tmp_path, parse):
    path = _toml(
        tmp_path,
        "[train]\n"
        'strategy = "asgd"\nservers = 2\nworkers = 3\nn-sync = 4\nlr = 0.1\nmomentum = 0.5\n'
        'server-rule = "sgd"\nstraggler = ["1:2.0"]\nstaleness-scaling = true\n',
    )
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


def test_bad_config_files_are_one_line(tmp_path, refused):
    assert refused("--config", str(tmp_path / "none.toml")).endswith("none.toml' does not exist")
    path = _toml(tmp_path, "workers = \n")
    assert refused("--config", path).startswith(f"config: {path!r} is not valid TOML")
    message = refused("--config", _toml(tmp_path, "wokers = 3\n"))
    assert message.startswith("config: unknown field 'wokers'")
    message = refused("--config", _toml(tmp_path, "lr = 0.1\n"), "--lr", "-0.1")  # the flag's
    assert message == "lr: -0.1 is not allowed; use a number > 0.0 and <= 100.0"


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


def test_optimizer_sgd_with_momentum_and_weight_decay_and_no_other(parse, capsys):
    cfg = parse("--lr", "0.1", "--momentum", "0.5", "--weight-decay", "0.1")
    opt, (first, second) = _two_steps(cfg)
    assert type(opt) is torch.optim.SGD
    # g' = g + 0.1·θ = (0.6, −0.2) = buf; θ = (1 − 0.06, −2 + 0.02)
    assert first == pytest.approx([0.94, -1.98], rel=1e-12)
    # g' = (0.5 + 0.094, −0.198); buf = 0.5·(0.6, −0.2) + g' = (0.894, −0.298)
    assert second == pytest.approx([0.94 - 0.0894, -1.98 + 0.0298], rel=1e-12)
    assert parse().training.optimizer == "sgd" and parse().training.weight_decay == 0.0
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--optimizer", "lion"])
    assert exit_.value.code == 2 and "invalid choice: 'lion'" in capsys.readouterr().err


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


@pytest.mark.parametrize(
    "spec, message",
    [
        ("1", "straggler: '1' is not WORKER:FACTOR (e.g. 3:2.0 makes worker 3 2x slower)"),
        ("a:2", "straggler: 'a:2' is not WORKER:FACTOR (e.g. 3:2.0 makes worker 3 2x slower)"),
        ("1:2:3", "straggler: '1:2:3' is not WORKER:FACTOR (e.g. 3:2.0 makes worker 3 2x slower)"),
        ("5:2", "straggler: worker 5 does not exist; allowed 0..2"),
        ("1:0.5", "straggler factor: 0.5 is not allowed; use a number >= 1.0 and <= 1_000.0"),
        ("1:nan", "straggler factor: nan is not allowed; use a number >= 1.0 and <= 1_000.0"),
    ],
)
def test_bad_stragglers_are_one_line(refused, spec, message):
    assert refused("--workers", "3", "--straggler", spec) == message


# ---------------------------------------------------------------------------- server flags
def _shard(parse, *flags: str):
    cfg = parse("--strategy", "asgd", "--servers", "1", *flags)
    return make_shard(cfg, torch.zeros(1, dtype=torch.float32))


def _push(shard, delta: float, base: int):
    r = shard.apply_push(torch.tensor([delta]), base)
    return r.status, r.staleness


def test_max_staleness_drops_pushes_staler_than_the_bound(parse):
    shard = _shard(parse, "--max-staleness", "1", "--server-lr", "1")
    results = [_push(shard, d, base) for d, base in ((1.0, 0), (2.0, 0), (4.0, 0), (8.0, 1))]
    ok, dropped = Status.OK, Status.STALE_DROPPED
    assert results == [(ok, 0), (ok, 1), (dropped, 2), (ok, 1)]
    assert shard.theta.item() == 11.0 and shard.version == 3 and shard.dropped_stale == 1
    strict = _shard(parse, "--max-staleness", "0")
    assert [_push(strict, 1.0, 0), _push(strict, 2.0, 0)] == [(ok, 0), (dropped, 1)]
    unbounded = _shard(parse)  # no flag: nothing is dropped however stale
    assert [_push(unbounded, 1.0, 0) for _ in range(5)][-1] == (ok, 4)


def test_staleness_scaling_and_server_lr(parse):
    scaled = _shard(parse, "--staleness-scaling", "--server-lr", "0.5")
    for _ in range(4):
        _push(scaled, 1.0, 0)  # staleness 0, 1, 2, 3: α = 0.5, 0.5, 0.25, 0.5/3
    assert scaled.theta.item() == pytest.approx(0.5 + 0.5 + 0.25 + 1 / 6, rel=1e-7)
    plain = _shard(parse, "--server-lr", "0.5")
    for _ in range(4):
        _push(plain, 1.0, 0)
    assert plain.theta.item() == 2.0


def test_server_rules_sgd_with_momentum_and_adagrad(parse):
    shard = _shard(parse, "--server-rule", "sgd", "--server-lr", "0.1", "--server-momentum", "0.9")
    thetas = []
    for _ in range(3):
        _push(shard, 1.0, shard.version)
        thetas.append(shard.theta.item())
    # pseudo-gradient −1: buf = −1, −1.9, −2.71; θ = 0.1, 0.29, 0.561
    assert thetas == pytest.approx([0.1, 0.29, 0.561], rel=1e-6)
    scaled = _shard(parse, "--server-rule", "sgd", "--server-lr", "0.1", "--staleness-scaling")
    for _ in range(3):
        _push(scaled, 1.0, 0)  # staleness 0, 1, 2: pseudo-gradients −1, −1, −0.5
    assert scaled.theta.item() == pytest.approx(0.25, rel=1e-6)
    shard = _shard(parse, "--server-rule", "adagrad", "--server-lr", "0.1")
    _push(shard, 2.0, 0)  # g = −2, Σg² = 4: θ = 0.1 · 2/2
    assert shard.theta.item() == pytest.approx(0.1, rel=1e-6)
    _push(shard, 1.0, 1)  # g = −1, Σg² = 5: θ += 0.1/√5
    assert shard.theta.item() == pytest.approx(0.1 + 0.044721359549995794, rel=1e-6)


def test_easgd_centre_moves_by_beta_over_w(parse):
    cfg = parse("--strategy", "easgd", "--servers", "1", "--workers", "3", "--easgd-beta", "0.9")
    centre = make_shard(cfg, torch.zeros(1))
    centre.apply_push(torch.tensor([1.0]), 0)  # the worker's θ = 1: θ̃ += 0.3 · (1 − 0)
    assert centre.theta.item() == pytest.approx(0.3, rel=1e-6)


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


def test_daso_flags_reach_the_schedule(parse):
    strategy = _daso(parse(*DASO_FLAGS, "--daso-fixed"))
    strategy.configure(steps_per_epoch=4, total_steps=20)
    assert strategy.schedule == DasoSchedule(
        total_epochs=5.0,
        warmup_epochs=1.0,
        cooldown_epochs=1.0,
        global_skip=3,
        batches_to_wait=2,
        max_global_skips=6,
        stability_level=0.1,
        patience=3,
        reduction_factor=3,
        adaptive=False,
    )
    defaults = _daso(parse("--strategy", "daso", "--workers", "4", "--nodes", "2"))
    defaults.configure(steps_per_epoch=10, total_steps=300)
    assert defaults.schedule == DasoSchedule(
        total_epochs=30.0,
        warmup_epochs=4.0,
        cooldown_epochs=4.0,
        global_skip=4,
        batches_to_wait=1,
        max_global_skips=8,
        stability_level=0.05,
        patience=2,
        reduction_factor=2,
        adaptive=True,
    )


class _FakeDDP:
    def __init__(self, module, device_ids=None, process_group=None):
        self.module, self.process_group = module, process_group
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

    monkeypatch.setattr(
        allreduce_module,
        "counted_ddp",
        lambda model, group, device, state, hook=None, **kw: _FakeDDP(model, process_group=group),
    )
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
