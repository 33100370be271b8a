"""Every numeric setting has a range that cannot overflow downstream, TOML values have their
field's type, and a local job larger than this machine is refused before anything is forked
(issue 44, "values"). The CLI is driven through ``cli.main`` with the forkserver, the
preflight and the launch replaced, so nothing starts; a refusal is one line and exit code 2.
Every flag value and config file the CLI refuses is in one of the tables here.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

import cloudburst.forkserver
from cloudburst import cli
from cloudburst.cli import checks
from cloudburst.cli.checks import Capacity, check_local_job_fits, local_job_needs
from cloudburst.config import FIELDS, ConfigError, RunConfig
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
    named = (
        FIELDS.items()
        if cls is RunConfig
        else ((f.name, (cls, f)) for f in dataclasses.fields(cls))
    )
    return [(name, f) for name, (_, f) in named if is_numeric(f)]


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
        default = f.default
        if default is not None and default is not dataclasses.MISSING:
            assert bounds.allows(default, str(f.type).startswith("int")), (f.name, default)


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


@pytest.mark.parametrize("value", [1e20, 4.0, True, "four"])
def test_a_float_a_bool_or_words_are_not_an_int(value):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"workers": value})
    assert str(err.value) == f"workers: {value!r} is not a valid int"


def test_text_from_flags_and_sweeps_is_parsed_with_the_fields_type():
    """compare's specs and simulate's sweeps give text."""
    assert RunConfig.from_dict({"workers": "4", "lr": "0.5", "augment": "false"}).job.workers == 4
    with pytest.raises(ConfigError, match=r"^steps: '1e20' is not a valid int$"):
        RunConfig.from_dict({"steps": "1e20"})


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
