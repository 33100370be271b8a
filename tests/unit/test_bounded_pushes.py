"""Bounded pushes (``--max-push-ratio``, issue 44): a shard refuses a push whose update of θ_k
(adagrad: λ·s·Δ) is longer than ratio·max(‖θ_k‖, 1) or not finite; the worker counts it and goes
on from the shard's θ. Issue 44's attack (Δ = 3e38); a non-finite final test loss fails the run."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from torch import nn

from cloudburst import cli
from cloudburst.comm.messages import Status
from cloudburst.config import RunConfig
from cloudburst.loop import summary as summary_module
from cloudburst.loop.summary import diverged, failed_message
from cloudburst.records.metrics import write_json_atomic
from cloudburst.strategies.asgd.serve import Standby
from cloudburst.strategies.asgd.shard import ShardState
from cloudburst.strategies.asgd.worker import AsgdStrategy
from tests import reference as ref
from tests.support import StandbyForwards, ps_job, run_sim, shard_of

HUGE = 3e38  # finite in float32 (max 3.4e38): issue 44's push
RATIO = 2.0

# Every server rule and compensator: (rule, compensation, extra ShardState arguments).
RULES = [
    ("add", "none", {}),
    ("add", "scale", {}),
    ("add", "delay-adaptive", {"delay_threshold": 1}),
    ("add", "dc", {"dc_lambda": 0.5}),
    ("add", "dc-adaptive", {"dc_lambda": 0.5}),
    ("add", "gap", {}),
    ("sgd", "none", {"momentum": 0.9}),
    ("adagrad", "none", {}),
    ("dn", "none", {"momentum": 0.9, "dn_period": 2}),
    ("dn", "scale", {"momentum": 0.9, "dn_period": 3, "dn_c": 0.5}),
    ("sgd", "dc-adaptive", {"momentum": 0.5, "dc_lambda": 0.5}),
    ("adagrad", "scale", {}),
    ("elastic", "none", {}),
]


def _shard(rule: str, compensation: str, extra: dict, ratio: float) -> ShardState:
    return shard_of(torch.linspace(-1.0, 1.0, 6), rule=rule, lr=0.5, compensation=compensation,
                    max_push_ratio=ratio, **extra)  # fmt: skip


def _script(rule: str) -> list[tuple[torch.Tensor, int]]:
    """Pushes of lengths 1e-3 to 1e3 (a few beyond the bound), stalenesses 0..2 (elastic: θ_i)."""
    gen = torch.Generator().manual_seed(7)
    pushes = []
    for i in range(24):
        scale = 10.0 ** (-3 + 6 * (i * 7 % 24) / 23)
        delta = torch.randn(6, generator=gen) * scale
        if rule == "elastic":
            delta = torch.linspace(-1.0, 1.0, 6) + delta
        pushes.append((delta, i % 3))
    return pushes


@pytest.mark.parametrize("rule, compensation, extra", RULES, ids=lambda v: str(v))
def test_a_push_is_refused_exactly_when_the_update_it_makes_is_too_long(rule, compensation, extra):
    shard = _shard(rule, compensation, extra, RATIO)
    clean = _shard(rule, compensation, extra, 0.0)  # gets the accepted pushes only
    free = _shard(rule, compensation, extra, 0.0)
    outcomes = set()
    for delta, staleness in _script(rule):
        base = max(0, shard.version - staleness)
        free.load_state_dict(shard.state_dict())  # the reference: unbounded, the shard's state
        free_status, update = free.apply_push(delta, base).status, free.theta - shard.theta
        limit = RATIO * max(float(shard.theta.norm()), 1.0)
        length = float(update.norm())
        if rule == "adagrad":  # its step is at most λ per coordinate: the push's own is bound
            s = 1 / max(1, shard.version - base) if compensation == "scale" else 1.0
            length = shard.lr * s * float(delta.norm())
        if free_status == Status.OK and abs(length / limit - 1.0) < 1e-3:
            continue  # on the bound: rounding decides, either is right
        fits = free_status == Status.OK and length <= limit
        before, version = shard.theta.clone(), shard.version
        result = shard.apply_push(delta, base)
        outcomes.add(result.status)
        if fits:
            assert result.status == Status.OK
            assert clean.apply_push(delta, base).status == Status.OK
            assert torch.equal(shard.theta, clean.theta)
        else:
            assert result.status == Status.REFUSED
            assert torch.equal(shard.theta, before) and shard.version == version
    assert outcomes == {Status.OK, Status.REFUSED}, "the script must reach both sides"
    # refused pushes left no trace: the shard is the one that only saw the accepted ones
    assert torch.equal(shard.theta, clean.theta) and shard.version == clean.version
    assert shard.refused > 0 and shard.stats()["refused_pushes"] == shard.refused
    mine, theirs = shard.state_dict(), clean.state_dict()
    assert repr(mine["optimizer"]) == repr(theirs["optimizer"])
    assert repr(mine["compensator"]) == repr(theirs["compensator"])


def test_the_bound_is_ratio_times_the_norm_of_theta_floored_at_1_and_inf_is_always_refused():
    # ‖θ‖ = 5: updates up to 2·5 = 10 pass; λ = 1
    shard = ShardState(torch.tensor([3.0, 4.0]), max_push_ratio=2.0)
    assert shard.apply_push(torch.tensor([6.0, 8.0]), 0).status == Status.OK  # exactly 10
    assert shard.apply_push(torch.tensor([0.0, 31.0]), 1).status == Status.REFUSED  # 31 > 30
    # ‖θ‖ near 0: the floor, 2·1
    tiny = ShardState(torch.zeros(2), max_push_ratio=2.0, lr=0.5)
    assert tiny.apply_push(torch.tensor([0.0, 5.0]), 0).status == Status.REFUSED  # λ·5 > 2
    assert "exceeds --max-push-ratio 2" in tiny.last_refusal
    assert tiny.apply_push(torch.tensor([4.0, 0.0]), 0).status == Status.OK  # λ·4 = 2
    # with the bound off, a push that would make θ (or adagrad's state) not finite is refused
    shard = ShardState(torch.tensor([3e38, 1.0]), max_push_ratio=0.0)
    assert shard.apply_push(torch.tensor([1e37, 1e30]), 0).status == Status.OK  # finite
    assert shard.apply_push(torch.tensor([HUGE, 0.0]), 1).status == Status.REFUSED
    assert shard.last_refusal == "θ + its update would not be finite"
    assert torch.isfinite(shard.theta).all() and shard.version == 1
    # adagrad: its step is bounded by λ per coordinate, but g² would poison its state
    adagrad = ShardState(torch.zeros(2), rule="adagrad", lr=0.1, max_push_ratio=0.0)
    assert adagrad.apply_push(torch.tensor([HUGE, 0.0]), 0).status == Status.REFUSED
    assert "state would not be finite" in adagrad.last_refusal


# ------------------------------------------------------------------ the attack, re-run
CONFIGS = {
    "add, overlapped push-fetch": dict(n_sync=1),  # the worker adds Δ only if told OK
    "add, push then fetch later": dict(n_push=1, n_fetch=2),  # a refusal: fetch θ again
    "sgd rule, reply after apply": dict(n_sync=1, server_rule="sgd", server_lr=0.5),  # with θ
    "easgd": dict(strategy="easgd", easgd_tau=1),
    "async_diloco": dict(strategy="async_diloco", period=1),
}


@pytest.mark.parametrize("settings", CONFIGS.values(), ids=list(CONFIGS))
def test_a_push_of_3e38_is_refused_and_the_worker_goes_on_from_the_shards_theta(settings, caplog):
    settings = {"strategy": "asgd", **settings}
    cfg = RunConfig(workers=1, servers=2, dataset="synthetic", train_size=512, **settings)
    model = nn.Linear(2, 3)
    ref.set_flat(model, torch.linspace(-1.0, 1.0, 9))
    job = ps_job(cfg, [model])
    worker = job.workers[0]
    worker.start()
    theta0 = job.server_theta.clone()
    model.weight.data[0, 0] += HUGE  # Δ = 3e38 on shard 0's part (θ stays finite: < 3.4e38)
    with caplog.at_level(logging.WARNING):
        worker.after_step(8)
    assert torch.equal(job.server_theta, theta0)  # nothing applied, θ finite
    assert [loop.shard.refused for loop in job.loops] == [1, 0]
    assert job.loops[0].stats()["refused_pushes"] == 1
    assert worker.pushes_refused == 1 and worker.report()["pushes_refused"] == 1
    assert torch.equal(ref.flat(model), job.server_theta)  # the worker goes on from there
    records = [f for e, f in job.metrics[0].records if e == "push" and f["status"] == "REFUSED"]
    assert len(records) == 1 and records[0]["worker"] == cfg.job.servers
    logged = [r.getMessage() for r in caplog.records]
    assert sum("refused a push from rank 2" in m for m in logged) == 1
    assert sum("refused this worker's push" in m for m in logged) == 1
    # Honest steps after it are applied as usual.
    pushed_before = job.loops[0].shard.version
    for _ in range(2):
        model.weight.data.add_(0.01)
        worker.after_step(8)
    assert job.loops[0].shard.version > pushed_before
    assert job.loops[0].shard.refused == 1 and not torch.equal(job.server_theta, theta0)


def test_refusals_never_drop_the_worker_and_each_resets_its_optimizer():
    """A diverging replica's pushes are refused, never held against it; the momentum that made
    one, kept, would make the next ones as large."""
    cfg = RunConfig(strategy="asgd", workers=1, servers=1, dataset="synthetic", n_sync=1)
    model = nn.Linear(2, 3)
    job = ps_job(cfg, [model])
    worker, loop = job.workers[0], job.loops[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    worker.wrap(model, optimizer)
    worker.start()
    for grad in [1e15] * 8 + [0.01, 0.01]:  # spikes, then honest gradients
        for p in model.parameters():
            p.grad = torch.full_like(p, grad)
        optimizer.step()
        worker.after_step(8)
    assert loop.shard.refused == 8 and worker.pushes_refused == 8
    assert loop.stats()["dropped_peers"] == [] and loop.lost == set()
    assert loop.shard.version == 2  # both honest pushes applied
    assert float(loop.shard.theta.abs().max()) < 10


# ------------------------------------------------------------------ whole runs
def test_a_simulated_run_counts_the_refused_push_in_its_summary(tmp_path, monkeypatch):
    """Worker 1 pushes Δ = 3e38 once mid-run: refused, counted, the run ends finite, not failed."""
    poisoned = []
    original = AsgdStrategy.after_step

    def after_step(self, samples: int) -> None:
        if self.ctx.worker_index == 1 and self.local_steps == 5 and not poisoned:
            poisoned.append(True)
            next(self.model.parameters()).data.add_(HUGE)
        original(self, samples)

    monkeypatch.setattr(AsgdStrategy, "after_step", after_step)
    summary = run_sim(RunConfig(strategy="asgd", workers=2, steps=12, n_sync=2, dataset="synthetic",
                                train_size=256, test_size=64, batch_size=8, model="mlp",
                                eval_every_s=1000.0, out=str(tmp_path)))  # fmt: skip
    assert poisoned and summary["pushes_refused"] == 1
    assert "failed" not in summary and math.isfinite(summary["final_test_loss"])


def test_a_final_test_loss_that_is_not_finite_fails_the_run(tmp_path, monkeypatch, capsys):
    assert diverged(0.5) is None
    assert "test loss is nan" in diverged(float("nan"))
    assert "test loss is inf" in diverged(float("inf"))
    monkeypatch.setattr(summary_module, "evaluate_dataset", lambda *a, **k: (0.1, math.nan))
    out = tmp_path / "nan"
    code = cli.main(
        ["simulate", "--strategy", "asgd", "--workers", "2", "--steps", "4", "--dataset",
         "synthetic", "--train-size", "256", "--test-size", "64", "--batch-size", "8",
         "--model", "mlp", "--no-progress", "--out", str(out)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == diverged(math.nan)
    assert failed_message(summary) in err
    assert failed_message(summary).startswith("cloudburst: the run failed after 4 steps: ")


# ------------------------------------------------------------------ a shard's standby copy
def test_a_standby_copy_follows_its_shards_refusals():
    """The standby applies the shard's verdict on each forwarded push, not its own measure."""
    cfg = RunConfig(strategy="asgd", workers=1, servers=2, shard_standby=True, n_sync=1,
                    dataset="synthetic", train_size=512)  # fmt: skip
    model = nn.Linear(2, 3)
    ref.set_flat(model, torch.linspace(-1.0, 1.0, 9))
    job = ps_job(cfg, [model])
    worker, primary = job.workers[0], job.loops[0]
    primary.standby_link = forwards = StandbyForwards(0)
    worker.start()
    for poison in (1e6, 0.0, 0.0):  # too large but finite, then two honest pushes
        model.weight.data[0, 0] += poison + 0.01
        worker.after_step(8)
    assert primary.shard.refused == 1 and primary.shard.version == 2
    standby = Standby(job.loops[1], 0, forwards.replay())
    standby.replica.max_push_ratio = 0.0  # alone, it would apply the 1e6 push
    standby._run()
    assert torch.equal(standby.replica.theta, primary.shard.theta)
    assert standby.replica.stats() == primary.shard.stats()


def test_train_exits_1_with_the_line_when_the_final_loss_is_not_finite(monkeypatch, capsys):
    """``cloudburst train``'s local job finished, but θ diverged: exit 1 and the line."""
    import cloudburst.launch

    cfg = RunConfig(strategy="asgd", workers=2, dataset="synthetic", out="unused")
    finished = dict(strategy="asgd", workers=2, servers=1, failed=diverged(math.inf),
                    final_test_accuracy=0.1, final_test_loss=math.inf,
                    steps_done={"1": 7, "2": None}, failed_agents=[])  # fmt: skip
    monkeypatch.setattr(cloudburst.launch, "run_local_job", lambda cfg: finished)
    assert cli.launch_and_report(cfg) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"cloudburst: the run failed after 7 steps: {diverged(math.inf)}",
        "cloudburst: the run's files are in unused",
    ]


def test_rank_0_of_a_users_torchrun_exits_1_when_its_summary_says_failed(tmp_path, capsys):
    from cloudburst.loop.summary import finished_exit_code

    assert finished_exit_code(tmp_path) == 0  # no summary (yet)
    write_json_atomic(tmp_path / "summary.json", {"final_test_loss": 0.3, "steps_done": {}})
    assert finished_exit_code(tmp_path) == 0
    failed = {"failed": diverged(math.nan), "final_test_loss": math.nan, "steps_done": {"1": 9}}
    write_json_atomic(tmp_path / "summary.json", failed)
    assert finished_exit_code(tmp_path) == 1
    assert capsys.readouterr().err.strip() == failed_message(failed)
