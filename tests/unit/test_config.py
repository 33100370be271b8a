import pytest

from cloudburst.config import ConfigError, RunConfig, Straggler


def test_defaults_are_valid():
    cfg = RunConfig()
    assert cfg.strategy == "sync" and cfg.world_size == cfg.workers
    assert cfg.steps_per_worker() == 10 * ((4000 // 2) // 64)


def test_n_sync_sets_fetch_and_push():
    cfg = RunConfig(strategy="asgd", servers=1, n_sync=7)
    assert (cfg.n_fetch, cfg.n_push) == (7, 7)


@pytest.mark.parametrize(
    "values, field",
    [
        ({"strategy": "magic"}, "strategy"),
        ({"workers": 0}, "workers"),
        ({"strategy": "asgd", "servers": 0}, "servers"),
        ({"strategy": "sync", "servers": 2}, "servers"),
        ({"lr": -0.1}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"batch_size": 5000}, "batch_size"),
        ({"n_fetch": 0, "strategy": "asgd", "servers": 1}, "n_fetch"),
        ({"server_rule": "avg", "strategy": "asgd", "servers": 1}, "server_rule"),
        ({"target_accuracy": 1.5}, "target_accuracy"),
        ({"stragglers": ["7:2"]}, "straggler"),
        ({"stragglers": ["x"]}, "straggler"),
        ({"init_from": "/nonexistent/model.pt"}, "init_from"),
        ({"workers": "four"}, "workers"),
        ({"bogus": 1}, "bogus"),
        ({"dataset": "cifar10"}, "dataset"),
        ({"dataset": "cifar10:/nonexistent/cifar"}, "dataset"),
        ({"dataset": "mnist1d:/tmp"}, "dataset"),
        ({"dataset": "imagenet:/tmp"}, "dataset"),
        ({"model": "resnet50"}, "model"),
        ({"model": "pkg.mod:"}, "model"),
        ({"device": "tpu"}, "device"),
        ({"backend": "mpi"}, "backend"),
        ({"backend": "nccl", "device": "cpu"}, "backend"),
        ({"autocast": "fp8"}, "autocast"),
        ({"image_size": 4}, "image_size"),
        ({"data_workers": -1}, "data_workers"),
    ],
)
def test_invalid_values_name_the_field(values, field):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(values)
    msg = str(err.value)
    assert field in msg and "\n" not in msg


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nstrategy = "asgd"\nservers = 2\nworkers = 3\nn-sync = 4\nlr = 0.1\n')
    cfg = RunConfig.from_toml(path, {"lr": 0.2})
    assert (cfg.strategy, cfg.servers, cfg.workers, cfg.n_push, cfg.lr) == ("asgd", 2, 3, 4, 0.2)


def test_bad_toml_is_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("strategy = \n")
    with pytest.raises(ConfigError) as err:
        RunConfig.from_toml(path)
    assert "not valid TOML" in str(err.value)


def test_round_trip_through_dict():
    cfg = RunConfig(strategy="asgd", servers=2, workers=3, stragglers=[Straggler(1, 2.0)])
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert again.straggler_factor(1) == 2.0 and again.straggler_factor(0) == 1.0


def test_cosine_schedule_decays_to_zero_over_the_run():
    import torch

    from cloudburst.train import make_optimizer, make_scheduler

    cfg = RunConfig(lr=0.1, lr_schedule="cosine", steps=50)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = make_optimizer(cfg, [param])
    sched = make_scheduler(cfg, opt, cfg.steps_per_worker())
    lrs = []
    for _ in range(50):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] < 0.1 and lrs[-1] == pytest.approx(0.0, abs=1e-9)
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert make_scheduler(RunConfig(), opt, 10) is None
    with pytest.raises(ConfigError, match="lr_schedule"):
        RunConfig(lr_schedule="step")


def test_path_datasets_have_no_default_size_until_loaded(tmp_path):
    cfg = RunConfig(dataset=f"npz:{tmp_path}", epochs=2, batch_size=10)
    assert cfg.train_size is None and cfg.test_size is None
    with pytest.raises(ValueError):
        cfg.steps_per_worker()
    assert cfg.steps_per_worker(train_size=105) == 2 * ((105 // 2) // 10)
    assert RunConfig(dataset="synthetic").train_size == 4000
    assert RunConfig(model="pkg.module:factory").model == "pkg.module:factory"


def test_diloco_refuses_warmup_and_warns_about_outer_lr_with_sgd():
    with pytest.raises(ConfigError, match="local_sgd_warmup_steps"):
        RunConfig(strategy="diloco", workers=2, local_sgd_warmup_steps=10, steps=10)
    RunConfig(strategy="local_sgd", workers=2, local_sgd_warmup_steps=10, steps=10)
    default = RunConfig(strategy="diloco", workers=2, steps=10)
    assert len(default.warnings()) == 1 and "outer lr 0.7" in default.warnings()[0]
    assert RunConfig(strategy="diloco", workers=2, steps=10, diloco_outer_lr=0.1).warnings() == []
    assert RunConfig(strategy="diloco", workers=2, steps=10, optimizer="adam").warnings() == []
    assert RunConfig(strategy="local_sgd", workers=2, steps=10).warnings() == []
