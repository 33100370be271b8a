import math

import pytest
import torch

from cloudburst.config import ConfigError, RunConfig, Straggler
from cloudburst.loop.train_step import make_optimizer, make_scheduler


def test_defaults_are_valid():
    cfg = RunConfig()
    assert (cfg.job.strategy, cfg.job.workers, cfg.job.servers, cfg.world_size) == ("sync", 2, 0, 2)
    # 64 epochs of 2000 samples per worker, 31 batches of 64 each
    assert cfg.steps_per_worker() == 1984
    assert (cfg.training.lr, cfg.training.momentum) == (0.1, 0.9)
    assert cfg.asgd.server_lr == 0.5 and RunConfig(workers=4).asgd.server_lr == 0.25  # λ = 1/W
    assert RunConfig(optimizer="adam").diloco.outer_lr == 0.7  # the paper's pair
    assert RunConfig(strategy="diloco").diloco.outer_lr == 0.5  # over SGD: 0.5/0.8
    assert RunConfig(strategy="diloco").diloco.outer_momentum == 0.8
    async_dn = RunConfig(strategy="async_diloco", workers=2, servers=1)
    assert (async_dn.diloco.outer_lr, async_dn.diloco.outer_momentum) == (0.1, 0.9)
    assert RunConfig(epochs=0.5).steps_per_worker() == 16  # 15.5 batches, rounded up


def test_a_config_reads_by_concern_and_keeps_flat_names_at_its_edges(tmp_path):
    """``cfg.<concern>.<field>`` inside; the flat names (flags, TOML keys, config.json,
    ``RunConfig(...)``, :meth:`~RunConfig.replace`, :meth:`~RunConfig.get`) outside, where a
    prefixed field drops its concern's prefix inside (``daso_global_skip``:
    ``cfg.daso.global_skip``)."""
    cfg = RunConfig(strategy="daso", workers=4, daso_global_skip=6, data_workers=0, lr=0.05)
    assert (cfg.daso.global_skip, cfg.data.workers, cfg.training.lr) == (6, 0, 0.05)
    assert cfg.get("daso_global_skip") == 6 and cfg.to_dict()["daso_global_skip"] == 6
    assert "global_skip" not in cfg.to_dict() and RunConfig.from_dict(cfg.to_dict()) == cfg
    slow = cfg.replace(stragglers=[Straggler(1, 2.0)])  # stragglers round-trip too
    again = RunConfig.from_dict(slow.to_dict())
    assert again == slow and again.straggler_factor(1) == 2.0 and again.straggler_factor(0) == 1.0
    wider = cfg.replace(workers=8, daso_global_skip=2)
    assert (wider.job.workers, wider.daso.global_skip, cfg.daso.global_skip) == (8, 2, 6)
    assert wider != cfg and cfg.replace() == cfg
    (tmp_path / "run.toml").write_text("[daso]\nglobal_skip = 6\n[training]\nlr = 0.1\n")
    from_file = RunConfig.from_toml(tmp_path / "run.toml", {"lr": 0.2})  # the overrides win
    assert (from_file.daso.global_skip, from_file.training.lr) == (6, 0.2)
    with pytest.raises(TypeError, match="unknown field 'global_skip'"):
        RunConfig(global_skip=6)
    with pytest.raises(AttributeError):
        cfg.get("global_skip")


def test_summing_pushes_with_several_workers_warns():
    summing = RunConfig(strategy="asgd", workers=3, servers=1, server_lr=1.0, steps=5)
    [warning] = summing.warnings()
    assert warning.startswith("asgd: server lr λ = 1 with 3 workers adds up their pushes (3x")
    assert "λ = 1/W = 0.333333 averages them" in warning
    assert RunConfig(strategy="asgd", workers=3, servers=1, steps=5).warnings() == []
    assert RunConfig(strategy="asgd", workers=1, servers=1, server_lr=1.0, steps=5).warnings() == []


# Each bad value: how the message starts (the field), and what it must say — the value and
# what is allowed, or the fix (STYLE: one line naming the field, the value and the range).
@pytest.mark.parametrize(
    "values, field, fragments",
    [
        ({"strategy": "magic"}, "strategy", ["'magic'", "sync, asgd, daso, local_sgd"]),
        ({"strategy": "asgd", "servers": 0}, "servers", ["0", "'asgd'", "--servers 1 or more"]),
        ({"strategy": "sync", "servers": 2}, "servers", ["2", "'sync'", "--servers 0"]),
        ({"batch_size": 5000}, "batch_size", ["5000", "shard of 2000 samples"]),
        ({"server_rule": "avg", "strategy": "asgd", "servers": 1}, "server_rule",
         ["'avg'", "add, sgd, adagrad"]),
        ({"init_from": "/nonexistent/model.pt"}, "init_from", ["'/nonexistent/model.pt'"]),
        ({"bogus": 1}, "config", ["unknown field 'bogus'"]),
        ({"dataset": "cifar10"}, "dataset", ["needs a path", "cifar10:PATH"]),
        ({"dataset": "cifar10:/nonexistent/cifar"}, "dataset", ["'/nonexistent/cifar'"]),
        ({"dataset": "mnist1d:/tmp"}, "dataset", ["'mnist1d:/tmp'", "takes no path"]),
        ({"dataset": "imagenet:/tmp"}, "dataset", ["'imagenet'", "cifar10:PATH"]),
        ({"model": "resnet50"}, "model", ["'resnet50'", "mlp, cnn, resnet20, convnet"]),
        ({"model": "pkg.mod:"}, "model", ["'pkg.mod:'", "package.module:function"]),
        ({"device": "tpu"}, "device", ["'tpu'", "auto, cpu, cuda"]),
        ({"backend": "mpi"}, "backend", ["'mpi'", "auto, gloo, nccl"]),
        ({"backend": "nccl", "device": "cpu"}, "backend", ["'nccl'", "--device cuda"]),
        ({"autocast": "fp8"}, "autocast", ["'fp8'", "none, bf16"]),
        ({"lr_schedule": "step"}, "lr_schedule: 'step' is not allowed; choose one of ", []),
        ({"strategy": "async_diloco", "workers": 2, "local_sgd_warmup_steps": 10},
         "local_sgd_warmup_steps: async_diloco has no", []),
        ({"strategy": "diloco", "workers": 2, "optimizer": "sgd", "desloc_second_every": 2},
         "desloc_first_every: DES-LOC averages an Adam", []),
        ({"strategy": "local_sgd", "workers": 2, "optimizer": "adamw", "desloc_second_every": 2},
         "desloc_first_every: DES-LOC averages an Adam", []),
    ],
)  # fmt: skip
def test_invalid_values_name_the_field_the_value_and_the_fix(values, field, fragments):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(values)
    msg = str(err.value)
    assert msg.startswith(field) and "\n" not in msg, msg
    assert all(fragment in msg for fragment in fragments), msg


def test_cosine_schedule_decays_to_zero_over_the_run():
    cfg = RunConfig(lr=0.1, lr_schedule="cosine", steps=50)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = make_optimizer(cfg, [param])
    sched = make_scheduler(cfg, opt, cfg.steps_per_worker())
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(50):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    # lr after k of T = 50 steps: 0.1 · (1 + cos(πk/T)) / 2 — 0.1 at the start, 0.05 half way
    expected = [0.05 * (1 + math.cos(math.pi * k / 50)) for k in range(51)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert make_scheduler(RunConfig(), opt, 10) is None


def test_path_datasets_have_no_default_size_until_loaded(tmp_path):
    cfg = RunConfig(dataset=f"npz:{tmp_path}", epochs=2, batch_size=10)
    assert cfg.data.train_size is None and cfg.data.test_size is None
    with pytest.raises(ValueError, match="the dataset's size is not known yet"):
        cfg.steps_per_worker()
    assert cfg.steps_per_worker(train_size=105) == 10  # 2 epochs of 52 samples: 5 batches of 10
    assert RunConfig(dataset="synthetic").data.train_size == 4000
    assert RunConfig(model="pkg.module:factory").model.model == "pkg.module:factory"


def test_diloco_takes_a_warm_start_and_desloc_and_warns_about_outer_lr_with_sgd():
    """(async_diloco's warm start and DES-LOC over SGD are refused: in the table above.)"""
    RunConfig(strategy="diloco", workers=2, local_sgd_warmup_steps=10, steps=10)
    RunConfig(strategy="diloco", workers=2, optimizer="adamw", desloc_first_every=3)
    RunConfig(strategy="local_sgd", workers=2, local_sgd_warmup_steps=10, steps=10)
    paper = RunConfig(strategy="diloco", workers=2, steps=10, diloco_outer_lr=0.7)
    assert len(paper.warnings()) == 1 and "outer lr 0.7" in paper.warnings()[0]
    # the defaults, outer lr 0.1 or 0.5 over SGD, and 0.7 over Adam: no warning
    for kw in ({}, {"diloco_outer_lr": 0.1}, {"diloco_outer_lr": 0.5}, {"optimizer": "adam"}):
        assert RunConfig(strategy="diloco", workers=2, steps=10, **kw).warnings() == []
    assert RunConfig(strategy="local_sgd", workers=2, steps=10).warnings() == []
