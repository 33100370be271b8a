"""RunConfig: its defaults and concerns; numeric settings have finite ranges, TOML values their
field's type, a local job larger than this machine is refused (issue 44), through ``cli.main``
with nothing launched: one line, exit 2; other bad values name the field and the fix."""

from __future__ import annotations

import dataclasses
import math

import pytest

import cloudburst.forkserver
from cloudburst import cli
from cloudburst.cli import checks
from cloudburst.cli.checks import Capacity, check_local_job_fits, local_job_needs
from cloudburst.config import FIELDS, ConfigError, RunConfig, Straggler
from cloudburst.config.fields import MAX_STEPS, Bounds, is_numeric
from cloudburst.config.simulation import SimulationConfig

ROOMY = Capacity(tasks=10**7, memory_bytes=2**50, fds=10**7)


@pytest.fixture
def train(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """``train(*flags)``: ``(exit code, stderr lines, the configs launched)`` of ``cloudburst
    train *flags``, with this machine's capacity ROOMY unless a test sets another."""
    launched: list[RunConfig] = []
    monkeypatch.setattr(cloudburst.forkserver, "stop_forkserver", lambda: None)
    monkeypatch.setattr(cli, "preflight", lambda cfg: None)
    monkeypatch.setattr(cli, "launch_and_report", lambda cfg: launched.append(cfg) or 0)
    monkeypatch.setattr(checks, "machine_capacity", lambda: ROOMY)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)

    def run(*flags: str) -> tuple[int, list[str], list[RunConfig]]:
        try:
            code = cli.main(["train", *flags])
        except SystemExit as e:  # argparse's refusals exit
            code = e.code
        err = capsys.readouterr().err.strip().splitlines()
        return code, err, launched

    return run


def _refused(result: tuple[int, list[str], list[RunConfig]]) -> str:
    code, lines, launched = result
    assert code == 2 and len(lines) == 1 and not launched, (code, lines)
    assert "Traceback" not in lines[0]
    return lines[0]


# ---------------------------------------------------------------------------- every field
def _numeric_fields(cls: type) -> list[tuple[str, dataclasses.Field]]:
    """(flat name, field) of every numeric setting."""
    if cls is RunConfig:
        return [(name, f) for name, (_, f) in FIELDS.items() if is_numeric(f)]
    return [(f.name, f) for f in dataclasses.fields(cls) if is_numeric(f)]


@pytest.mark.parametrize("cls", [RunConfig, SimulationConfig])
def test_every_numeric_field_carries_a_finite_range(cls):
    fields = _numeric_fields(cls)
    assert len(fields) > (40 if cls is RunConfig else 5)
    missing = [name for name, f in fields if not isinstance(f.metadata.get("bounds"), Bounds)]
    assert missing == [], f"numeric fields without bounds=: {missing}"
    for _, f in fields:
        bounds = f.metadata["bounds"]
        assert math.isfinite(bounds.low) and math.isfinite(bounds.high), f.name
        assert bounds.low < bounds.high, f.name
        if f.default is not None and f.default is not dataclasses.MISSING:
            assert bounds.allows(f.default, str(f.type).startswith("int")), (f.name, f.default)


def _outside(f: dataclasses.Field) -> list[int | float]:
    """A value just above the field's range and one just below it."""
    b: Bounds = f.metadata["bounds"]
    if str(f.type).startswith("int"):
        return [int(b.high) + 1, int(b.low) - 1]
    below = b.low if b.low_open else (b.low / 2 if b.low > 0 else b.low - 1)
    return [b.high if b.high_open else b.high * 2, below, math.inf, math.nan]


@pytest.mark.parametrize(
    "cls, name, value",
    [
        (cls, name, value)
        for cls in (RunConfig, SimulationConfig)
        for name, f in _numeric_fields(cls)
        for value in _outside(f)
    ],
)
def test_a_setting_outside_its_range_is_one_line_naming_field_value_and_range(cls, name, value):
    """Run settings and the virtual clock's alike."""
    f = dict(_numeric_fields(cls))[name]
    with pytest.raises(ConfigError) as err:
        cls.from_dict({name: value})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{name}: {value!r} is not allowed; use "), message
    if name != "n_sync":  # asgd's defaults check its lower end on their own
        assert message.endswith(f.metadata["bounds"].text(str(f.type).startswith("int"))), message


@pytest.mark.parametrize("spec", ["lognormal:1e300", "pareto:1e300", "lognormal:-1"])
def test_step_time_noise_is_bounded(spec):
    with pytest.raises(ConfigError, match=rf"^step_time_jitter: '{spec}': .* must be .* and <= "):
        SimulationConfig(step_time_jitter=spec)


@pytest.mark.parametrize("value", [1e20, 4.0, True, "four", "1e20"])
def test_a_float_a_bool_or_words_are_not_an_int(value):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"workers": value})
    assert str(err.value) == f"workers: {value!r} is not a valid int"


def test_text_from_flags_and_sweeps_is_parsed_with_the_fields_type():
    """compare's specs and simulate's sweeps give text."""
    assert RunConfig.from_dict({"workers": "4", "lr": "0.5", "augment": "false"}).job.workers == 4


# ---------------------------------------------------------------------------- bad flag values
NOT_A_STRAGGLER = "straggler: {!r} is not WORKER:FACTOR (e.g. 3:2.0 makes worker 3 2x slower)"
FACTOR = "straggler factor: {} is not allowed; use a number >= 1.0 and <= 1_000.0"
SEED = "seed: {} is not allowed; use an integer >= 0 and <= 4_294_967_295"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr", "1e308"], "lr: 1e+308 is not allowed; use a number > 0.0 and <= 100.0"),
        (["--lr", "1e999"], "lr: inf is not allowed; use a number > 0.0 and <= 100.0"),
        (["--seed", str(2**63)], SEED.format(2**63)),
        (["--seed", str(2**64)], SEED.format(2**64)),
        (["--nodes", "2", "--inter-node-link", "1e-300"], "inter_node_link: '1e-300': a speed of "
         "1e-300 Gbit/s is not allowed; use a number >= 1e-06 and <= 1_000_000.0 Gbit/s (1 kbit/s "
         "to 1 Pbit/s)"),
        (["--nodes", "2", "--inter-node-link", "1,1e9"], "inter_node_link: '1,1e9': a latency of "
         "1000000000.0 ms is not allowed; use a number >= 0.0 and <= 60_000.0 ms"),
        (["--workers", "3", "--straggler", "1"], NOT_A_STRAGGLER.format("1")),
        (["--workers", "3", "--straggler", "a:2"], NOT_A_STRAGGLER.format("a:2")),
        (["--workers", "3", "--straggler", "1:2:3"], NOT_A_STRAGGLER.format("1:2:3")),
        (["--workers", "3", "--straggler", "5:2"],
         "straggler: worker 5 does not exist; allowed 0..2"),
        (["--workers", "3", "--straggler", "1:0.5"], FACTOR.format("0.5")),
        (["--workers", "3", "--straggler", "1:nan"], FACTOR.format("nan")),
        (["--straggler", "0:1e9"], FACTOR.format("1000000000.0")),
        (["--straggler", "1:100", "--inject-fault", "slow:1:100"], "straggler: worker 1 would be "
         "slowed 10000x (its --straggler factor times its slow: faults); allowed up to 1000x"),
        (["--min-step-time-s", "200", "--straggler", "1:2"], "min_step_time_s: 200 s x a slowdown "
         "of 2 is not below comm_timeout_s 300 s: the other ranks would time out waiting for its "
         "step; lower it or raise --comm-timeout-s"),
        (["--steps", str(2**63)],
         f"steps: {2**63} is not allowed; use an integer >= 1 and <= {MAX_STEPS:_}"),
        (["--comm-timeout-s", "1e300"],
         "comm_timeout_s: 1e+300 is not allowed; use a number > 0.0 and <= 86_400.0"),
        (["--inject-fault", "kill:1@" + "9" * 30], f"inject_fault: 'kill:1@{'9' * 30}' is not one "
         "of kill:RANK@STEP, stop:RANK@STEP, nan:RANK@STEP, slow:RANK:FACTOR"),
        (["--inject-fault", f"kill:1@{MAX_STEPS + 1}"],
         f"inject_fault: 'kill:1@{MAX_STEPS + 1}': STEP must be <= {MAX_STEPS:_}"),
    ],
)  # fmt: skip
def test_bad_flag_values_are_one_line_exit_2_and_launch_nothing(train, flags, message):
    assert _refused(train(*flags)) == f"cloudburst: invalid config: {message}"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--seed", "2**64"], "argument --seed: invalid int value: '2**64'"),
        (["--seed", "9" * 5000], "argument --seed: invalid int value: '9999"),  # past int()'s limit
        (["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    ],
)
def test_a_flag_argparse_cannot_read_is_one_short_line_with_exit_2(train, flags, words):
    line = _refused(train(*flags))
    assert line.startswith(f"cloudburst train: error: {words}"), line
    assert line.endswith("(see cloudburst train --help)") and len(line) < 400, line


# ---------------------------------------------------------------------------- config files
# A config file's text (None: no file), the flags after --config PATH, and the message ({path}:
# PATH; one ending in ... is the message's start).
@pytest.mark.parametrize(
    "text, flags, message",
    [
        (None, [], "config: file {path!r} does not exist"),
        ("workers = \n", [], "config: {path!r} is not valid TOML (..."),  # then tomllib's words
        ("wokers = 3\n", [], "config: unknown field 'wokers'; did you mean 'workers'?"),
        ("lr = 0.1\n", ["--lr", "-0.1"],  # the flag's value, not the file's
         "lr: -0.1 is not allowed; use a number > 0.0 and <= 100.0"),
        ('workers = "4"\n', [],
         "workers: '4' in run.toml is a string; expected an integer (e.g. workers = 4)"),
        ("steps = 1e20\n", [],
         "steps: 1e+20 in run.toml is a float; expected an integer (e.g. steps = 4)"),
        ("workers = true\n", [],
         "workers: True in run.toml is a boolean; expected an integer (e.g. workers = 4)"),
        ('[training]\nlr = "0.1"\n', [],
         "lr: '0.1' in run.toml is a string; expected a number (e.g. lr = 0.5)"),
        ("[output]\noverwrite = 1\n", [], "overwrite: 1 in run.toml is an integer; expected true "
         "or false (e.g. overwrite = true)"),
        ("dataset = 3\n", [],
         'dataset: 3 in run.toml is an integer; expected a string (e.g. dataset = "text")'),
        ("straggler = [1]\n", [], "stragglers: [1] in run.toml is a list; expected a string or "
         'an array of strings (e.g. stragglers = ["text"])'),
        ("[daso]\nglobal_skp = 4\n", [],
         "config: unknown field 'global_skp' in [daso]; did you mean 'global_skip'?"),
        ("[daso]\nlr = 0.1\n", [],
         "config: 'lr' is not a [daso] setting; it belongs in [training] (or at the top level)"),
        ("[dasso]\nglobal_skip = 4\n", [], "config: unknown section [dasso]; did you mean [daso]?"),
        ("lr = 0.1\n[training]\nlr = 0.2\n", [],
         "config: lr is set twice (the top level and [training]); keep one"),
        ("stragglers = []\n[cluster]\nstraggler = []\n", [],
         "config: stragglers is set twice (the top level and [cluster]); keep one"),
        ('[model]\nmodel = "somepkg.mod:net"\n', [], "model: --config {path} names the factory "
         "'somepkg.mod:net', which would import and run that code; pass --model somepkg.mod:net "
         "(or --trust-config) if you mean to run it"),
    ],
)  # fmt: skip
def test_a_bad_config_file_is_one_line_exit_2_and_launches_nothing(
    tmp_path, train, text, flags, message
):
    """Missing or unreadable, an unknown or misplaced key, a value of the wrong type, a key
    set twice, a factory named in a section; a flag given wins over the file's value."""
    path = tmp_path / "run.toml"
    if text is not None:
        path.write_text(text)
    line = _refused(train("--config", str(path), *flags))
    message = f"cloudburst: invalid config: {message.format(path=str(path))}"
    assert line.startswith(message[:-3]) if message.endswith("...") else line == message, line


def test_toml_numbers_of_the_right_type_are_taken(tmp_path, train):
    path = tmp_path / "run.toml"
    path.write_text('workers = 3\nlr = 1\nepochs = 2\nstraggler = "1:2"\n[model]\nmodel = "mlp"\n')
    code, lines, [cfg] = train("--config", str(path), "--out", str(tmp_path / "out"))
    assert code == 0, lines
    assert (cfg.job.workers, cfg.training.lr, cfg.training.epochs) == (3, 1.0, 2.0)
    assert cfg.straggler_factor(1) == 2.0
    assert type(cfg.training.lr) is float and type(cfg.training.epochs) is float


# ---------------------------------------------------------------------------- local job size
@pytest.mark.parametrize(
    "capacity, words",
    [
        (Capacity(tasks=1000, memory_bytes=None, fds=None), "needs about 120000 processes and "
         "threads (12 a rank); this user may start 1000 more here"),
        (Capacity(tasks=None, memory_bytes=8 * 2**30, fds=None), "needs about 1250.0 GiB of "
         "memory (128 MiB a rank); 8.0 GiB is available here"),
        (Capacity(tasks=None, memory_bytes=None, fds=1024), "needs about 100064 open files in "
         "one process (10 a rank); RLIMIT_NOFILE's hard limit here is 1024"),
    ],
)  # fmt: skip
def test_workers_beyond_the_machine_are_refused_before_anything_starts(
    train, monkeypatch, capacity, words
):
    monkeypatch.setattr(checks, "machine_capacity", lambda: capacity)
    flags = ["--workers", "10000", "--train-size", "1000000", "--steps", "5"]
    line = _refused(train(*flags))
    assert line.startswith(
        f"cloudburst: invalid config: workers: a local job of 10000 ranks {words}"
    ), line
    assert line.endswith("or pass --allow-large-job to launch it anyway"), line
    # The override launches it (here: hands it to the faked launch).
    code, lines, launched = train(*flags, "--allow-large-job")
    assert code == 0 and [cfg.job.workers for cfg in launched] == [10000], lines


def test_a_job_is_sized_by_ranks_and_data_loaders_and_launched_if_it_fits(train, monkeypatch):
    need = local_job_needs(RunConfig(strategy="asgd", workers=4, servers=1, steps=1))
    assert need == Capacity(tasks=5 * 12, memory_bytes=5 * 128 * 2**20, fds=64 + 5 * 10)
    images = RunConfig(workers=2, steps=1, data_workers=3)  # 6 DataLoader processes
    assert local_job_needs(images).tasks == 2 * 12 + 6 * 4
    monkeypatch.setattr(checks, "machine_capacity", lambda: Capacity(200, 2**34, 1024))
    code, lines, launched = train("--workers", "6", "--steps", "5")
    assert code == 0 and len(launched) == 1, lines
    fds = Capacity(None, None, 1024)
    with pytest.raises(ConfigError, match="1024"):  # 96 ranks need 64 + 960 + 10 descriptors
        check_local_job_fits(RunConfig(workers=97, train_size=100_000, steps=1), fds)
    check_local_job_fits(RunConfig(workers=96, train_size=100_000, steps=1), fds)
    monkeypatch.undo()
    real = checks.machine_capacity()  # this machine: finite, non-negative where known
    assert all(v is None or v >= 0 for v in dataclasses.astuple(real))


def test_simulate_is_not_held_to_the_local_launch_check(monkeypatch, tmp_path):
    """The virtual cluster runs every worker in this process: 128 workers (and sweeps of
    them) stay allowed on a machine that could not launch 128 local ranks."""
    monkeypatch.setattr(checks, "machine_capacity", lambda: Capacity(10, 2**20, 64))
    runs: list[RunConfig] = []
    monkeypatch.setattr(cli, "_simulate_fn", lambda: lambda cfg, sim: runs.append(cfg) or {})
    monkeypatch.setattr(cli, "preflight", lambda cfg: None)
    monkeypatch.setattr(cli, "format_summary", lambda summaries: "")
    flags = ["--workers", "128", "--dataset", "synthetic", "--train-size", "4096"]
    flags += ["--batch-size", "8", "--steps", "2", "--step-time-s", "0.1"]
    assert cli.main(["simulate", *flags, "--out", str(tmp_path / "one")]) == 0
    assert [cfg.job.workers for cfg in runs] == [128]


# ---------------------------------------------------------------------------- defaults, concerns
def test_defaults_are_valid():
    cfg = RunConfig()
    assert (cfg.job.strategy, cfg.job.workers, cfg.job.servers, cfg.world_size) == ("sync", 2, 0, 2)
    # 64 epochs of 2000 samples per worker, 31 batches of 64 each
    assert cfg.steps_per_worker() == 1984
    assert (cfg.training.lr, cfg.training.momentum) == (0.1, 0.9)
    assert cfg.asgd.server_lr == 0.5 and RunConfig(workers=4).asgd.server_lr == 0.25  # λ = 1/W
    adam = RunConfig(strategy="diloco", workers=4, optimizer="adam").diloco  # the paper's pair
    assert (adam.outer_lr, adam.outer_momentum) == (0.7, 0.9)
    sgd = RunConfig(strategy="diloco").diloco  # over SGD: 0.5/0.8
    assert (sgd.outer_lr, sgd.outer_momentum) == (0.5, 0.8)
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
