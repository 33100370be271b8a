"""The ``train`` and ``compare`` flags are generated from the config's fields
(``cloudburst.config``'s concerns, ``cloudburst.cli.add_config_flags``): the same flags as the
hand-written parser had, each parsing to the same config, and TOML sections that mirror the
concerns. The lists and dicts below were recorded from the hand-written parser."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from cloudburst import cli
from cloudburst.config import COMPONENTS, ConfigError, RunConfig, load_toml, option

# Every option in ``cloudburst train --help``'s usage (``compare`` has these and --runs), with
# its metavar or choices: a dropped or renamed flag, or one that changes how it takes its
# value, fails here.
USAGE = [
    "--allow-large-job",
    "--autocast {none,bf16}",
    "--backend {auto,gloo,nccl}",
    "--batch-size BATCH_SIZE",
    "--checkpoint-every CHECKPOINT_EVERY",
    "--clip-grad-norm CLIP_GRAD_NORM",
    "--comm-timeout-s COMM_TIMEOUT_S",
    "--compensation-window COMPENSATION_WINDOW",
    "--compress none|bf16|fp8|int8|powersgd[:RANK]",
    "--config CONFIG",
    "--consensus-every-steps CONSENSUS_EVERY_STEPS",
    "--context CONTEXT",
    "--daso-batches-to-wait DASO_BATCHES_TO_WAIT",
    "--daso-chunk-elements DASO_CHUNK_ELEMENTS",
    "--daso-cooldown-epochs DASO_COOLDOWN_EPOCHS",
    "--daso-cycling-downcast {bf16,fp16,none}",
    "--daso-downcast {bf16,fp16,none}",
    "--daso-fixed",
    "--daso-global-skip DASO_GLOBAL_SKIP",
    "--daso-local-skip DASO_LOCAL_SKIP",
    "--daso-max-global-skips DASO_MAX_GLOBAL_SKIPS",
    "--daso-no-epoch-end-sync",
    "--daso-patience DASO_PATIENCE",
    "--daso-skip-reduction-factor DASO_SKIP_REDUCTION_FACTOR",
    "--daso-stability-level DASO_STABILITY_LEVEL",
    "--daso-warmup-epochs DASO_WARMUP_EPOCHS",
    "--data-workers DATA_WORKERS",
    "--dataset SPEC",
    "--dc-lambda DC_LAMBDA",
    "--delay-threshold DELAY_THRESHOLD",
    "--desloc-first-every DESLOC_FIRST_EVERY",
    "--desloc-second-every DESLOC_SECOND_EVERY",
    "--device {auto,cpu,cuda}",
    "--diloco-no-nesterov",
    "--diloco-outer-lr DILOCO_OUTER_LR",
    "--diloco-outer-momentum DILOCO_OUTER_MOMENTUM",
    "--dn-c DN_C",
    "--dn-period DN_PERIOD",
    "--dylu",
    "--easgd-alpha EASGD_ALPHA",
    "--easgd-beta EASGD_BETA",
    "--easgd-tau EASGD_TAU",
    "--epochs EPOCHS",
    "--eval-every-s EVAL_EVERY_S",
    "--fragment-alpha FRAGMENT_ALPHA",
    "--fragment-delay FRAGMENT_DELAY",
    "--fragments FRAGMENTS",
    "--gossip-every GOSSIP_EVERY",
    "--gossip-no-full-step",
    "--gossip-push-sum",
    "--gossip-schedule {random,ring,exponential}",
    "--gossip-variant {pull,push}",
    "--heartbeat-timeout-s HEARTBEAT_TIMEOUT_S",
    "--image-size IMAGE_SIZE",
    "--init-from INIT_FROM",
    "--inject-fault SPEC",
    "--inter-node-link GBIT_PER_S[,LATENCY_MS]",
    "--local-sgd-warmup-steps LOCAL_SGD_WARMUP_STEPS",
    "--log-every-steps LOG_EVERY_STEPS",
    "--lr LR",
    "--lr-schedule {constant,cosine}",
    "--max-dataset-gib MAX_DATASET_GIB",
    "--max-push-ratio MAX_PUSH_RATIO",
    "--max-restarts MAX_RESTARTS",
    "--max-staleness MAX_STALENESS",
    "--max-train-time-s MAX_TRAIN_TIME_S",
    "--min-step-time-s MIN_STEP_TIME_S",
    "--model NAME",
    "--momentum MOMENTUM",
    "--n-fetch N_FETCH",
    "--n-push N_PUSH",
    "--n-sync N_SYNC",
    "--no-augment",
    "--no-progress",
    "--nodes NODES",
    "--optimizer {sgd,adam,adamw}",
    "--out OUT",
    "--overwrite",
    "--period PERIOD",
    "--push-log-every PUSH_LOG_EVERY",
    "--replica {rank,node}",
    "--resume DIR",
    "--seed SEED",
    "--server-lr SERVER_LR",
    "--server-momentum SERVER_MOMENTUM",
    "--server-rule {add,sgd,adagrad}",
    "--servers SERVERS",
    "--shard-placement spread|first|own|NODE,...",
    "--shard-standby",
    "--staleness-compensation {none,scale,dc,dc-adaptive,gap,delay-adaptive}",
    "--staleness-scaling",
    "--steps STEPS",
    "--straggler WORKER:FACTOR",
    "--strategy {sync,asgd,daso,local_sgd,diloco,easgd,gossip,async_diloco}",
    "--target-accuracy TARGET_ACCURACY",
    "--target-loss TARGET_LOSS",
    "--tensorboard",
    "--test-size TEST_SIZE",
    "--train-size TRAIN_SIZE",
    "--trust-config",
    "--warm-start-steps WARM_START_STEPS",
    "--warmup-steps WARMUP_STEPS",
    "--weight-decay WEIGHT_DECAY",
    "--workers WORKERS",
    "-h",
]

# Every field set away from its default by a flag (the store_false switches included).
FULL = """
--strategy easgd --workers 4 --servers 2 --n-sync 3 --n-fetch 2 --server-rule sgd
--server-lr 0.3 --server-momentum 0.5 --max-staleness 7 --staleness-scaling --warm-start-steps 5
--nodes 2 --shard-placement 1,0 --inter-node-link 1,2 --period 6 --local-sgd-warmup-steps 3
--diloco-outer-lr 0.4
--diloco-outer-momentum 0.8 --diloco-no-nesterov --easgd-tau 4 --easgd-alpha 0.2 --easgd-beta 0.7
--gossip-variant push --gossip-schedule ring --gossip-every 2 --gossip-push-sum
--gossip-no-full-step --consensus-every-steps 20 --daso-global-skip 6 --daso-batches-to-wait 2
--daso-local-skip 2
--daso-max-global-skips 9 --daso-warmup-epochs 1.5 --daso-cooldown-epochs 2.5
--daso-stability-level 0.1 --daso-patience 3 --daso-skip-reduction-factor 3 --daso-fixed
--daso-downcast fp16 --daso-cycling-downcast bf16 --daso-no-epoch-end-sync
--daso-chunk-elements 1000 --dataset synthetic --train-size 2000 --test-size 500 --image-size 16
--no-augment --data-workers 1 --model mlp --device cpu --backend gloo --autocast bf16
--tensorboard --steps 30 --epochs 2 --batch-size 16 --optimizer adam --lr 0.01
--lr-schedule cosine --momentum 0.8 --weight-decay 0.001 --seed 7 --target-accuracy 0.8
--straggler 1:2 --straggler 3:1.5 --min-step-time-s 0.01 --eval-every-s 2 --log-every-steps 5
--push-log-every 3 --comm-timeout-s 60 --heartbeat-timeout-s 5 --checkpoint-every 50
--max-restarts 2 --inject-fault kill:3@10 --inject-fault slow:2:2.0 --out runs/flags
--overwrite --no-progress --max-train-time-s 120
""".split()

# RunConfig.to_dict() of FULL, as the hand-written parser built it.
FULL_DICT = {
    "augment": False,
    "autocast": "bf16",
    "backend": "gloo",
    "batch_size": 16,
    "checkpoint_every": 50,
    "clip_grad_norm": 0.0,
    "comm_timeout_s": 60.0,
    "compensation_window": None,
    "compress": "none",
    "consensus_every_steps": 20,
    "context": 64,
    "daso_adaptive": False,
    "daso_batches_to_wait": 2,
    "daso_chunk_elements": 1000,
    "daso_cooldown_epochs": 2.5,
    "daso_cycling_downcast": "bf16",
    "daso_downcast": "fp16",
    "daso_epoch_end_sync": False,
    "daso_global_skip": 6,
    "daso_local_skip": 2,
    "daso_max_global_skips": 9,
    "daso_patience": 3,
    "daso_skip_reduction_factor": 3,
    "daso_stability_level": 0.1,
    "daso_warmup_epochs": 1.5,
    "data_workers": 1,
    "dataset": "synthetic",
    "dc_lambda": None,
    "delay_threshold": None,
    "desloc_first_every": 0,
    "desloc_second_every": 0,
    "device": "cpu",
    "diloco_nesterov": False,
    "diloco_outer_lr": 0.4,
    "diloco_outer_momentum": 0.8,
    "dn_c": 0.0,
    "dn_period": None,
    "dylu": False,
    "easgd_alpha": 0.2,
    "easgd_beta": 0.7,
    "easgd_tau": 4,
    "epochs": 2.0,
    "eval_every_s": 2.0,
    "fragment_alpha": 0.0,
    "fragment_delay": 0,
    "fragments": 1,
    "gossip_every": 2,
    "gossip_full_step": False,
    "gossip_push_sum": True,
    "gossip_schedule": "ring",
    "gossip_variant": "push",
    "heartbeat_timeout_s": 5.0,
    "image_size": 16,
    "init_from": None,
    "inject_fault": ["kill:3@10", "slow:2:2.0"],
    "inter_node_link": "1,2",
    "replica": "rank",
    "shard_placement": "1,0",
    "local_sgd_warmup_steps": 3,
    "log_every_steps": 5,
    "lr": 0.01,
    "lr_schedule": "cosine",
    "max_dataset_gib": 2.0,
    "max_push_ratio": 10.0,
    "max_restarts": 2,
    "max_staleness": 7,
    "max_train_time_s": 120.0,
    "min_step_time_s": 0.01,
    "model": "mlp",
    "momentum": 0.8,
    "n_fetch": 2,
    "n_push": 3,
    "n_sync": 3,
    "nodes": 2,
    "optimizer": "adam",
    "out": "runs/flags",
    "overwrite": True,
    "period": 6,
    "progress": False,
    "push_log_every": 3,
    "resume": False,
    "seed": 7,
    "server_lr": 0.3,
    "server_momentum": 0.5,
    "server_rule": "sgd",
    "servers": 2,
    "shard_standby": False,
    "staleness_compensation": "scale",
    "staleness_scaling": True,
    "steps": 30,
    "stragglers": ["1:2.0", "3:1.5"],
    "strategy": "easgd",
    "target_accuracy": 0.8,
    "target_loss": None,
    "tensorboard": True,
    "test_size": 500,
    "train_size": 2000,
    "warm_start_steps": 5,
    "warmup_steps": 0,
    "weight_decay": 0.001,
    "workers": 4,
}

# RunConfig.to_dict() of ``train --out runs/d``, as the hand-written parser built it.
DEFAULTS_DICT = {
    "augment": True,
    "autocast": "none",
    "backend": "auto",
    "batch_size": 64,
    "checkpoint_every": 100,
    "clip_grad_norm": 0.0,
    "comm_timeout_s": 300.0,
    "compensation_window": None,
    "compress": "none",
    "consensus_every_steps": 50,
    "context": 64,
    "daso_adaptive": True,
    "daso_batches_to_wait": 1,
    "daso_chunk_elements": 10000000,
    "daso_cooldown_epochs": 4.0,
    "daso_cycling_downcast": "none",
    "daso_downcast": "bf16",
    "daso_epoch_end_sync": True,
    "daso_global_skip": 4,
    "daso_local_skip": 1,
    "daso_max_global_skips": 8,
    "daso_patience": 2,
    "daso_skip_reduction_factor": 2,
    "daso_stability_level": 0.05,
    "daso_warmup_epochs": 4.0,
    "data_workers": None,
    "dataset": "mnist1d",
    "dc_lambda": None,
    "delay_threshold": None,
    "desloc_first_every": 0,
    "desloc_second_every": 0,
    "device": "auto",
    "diloco_nesterov": True,
    "diloco_outer_lr": 0.1,
    "diloco_outer_momentum": 0.9,
    "dn_c": 0.0,
    "dn_period": None,
    "dylu": False,
    "easgd_alpha": None,
    "easgd_beta": 0.9,
    "easgd_tau": 10,
    "epochs": 64.0,
    "eval_every_s": 1.0,
    "fragment_alpha": 0.0,
    "fragment_delay": 0,
    "fragments": 1,
    "gossip_every": 1,
    "gossip_full_step": True,
    "gossip_push_sum": False,
    "gossip_schedule": "exponential",
    "gossip_variant": "pull",
    "heartbeat_timeout_s": 10.0,
    "image_size": 32,
    "init_from": None,
    "inject_fault": [],
    "inter_node_link": None,
    "replica": "rank",
    "shard_placement": "spread",
    "local_sgd_warmup_steps": 0,
    "log_every_steps": 10,
    "lr": 0.1,
    "lr_schedule": "constant",
    "max_dataset_gib": 2.0,
    "max_push_ratio": 10.0,
    "max_restarts": 0,
    "max_staleness": None,
    "max_train_time_s": 0.0,
    "min_step_time_s": 0.0,
    "model": "cnn",
    "momentum": 0.9,
    "n_fetch": 8,
    "n_push": 8,
    "n_sync": None,
    "nodes": None,
    "optimizer": "sgd",
    "out": "runs/d",
    "overwrite": False,
    "period": 8,
    "progress": True,
    "push_log_every": 10,
    "resume": False,
    "seed": 0,
    "server_lr": 0.5,
    "server_momentum": 0.0,
    "server_rule": "add",
    "servers": 0,
    "shard_standby": False,
    "staleness_compensation": "none",
    "staleness_scaling": False,
    "steps": None,
    "stragglers": [],
    "strategy": "sync",
    "target_accuracy": None,
    "target_loss": None,
    "tensorboard": False,
    "test_size": 1000,
    "train_size": 4000,
    "warm_start_steps": 0,
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "workers": 2,
}


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch):
    """``parse(*flags)``: the RunConfig ``cloudburst train *flags`` would launch."""
    seen: list[RunConfig] = []
    monkeypatch.setattr(cli, "cmd_train", lambda args: seen.append(cli.build_config(args)) or 0)

    def run(*flags: str) -> RunConfig:
        assert cli.main(["train", *flags]) == 0
        return seen.pop()

    return run


def _help(command: str, capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _usage_items(help_text: str) -> list[str]:
    """``[--workers WORKERS]`` → ``--workers WORKERS`` for each optional option in the usage."""
    usage = " ".join(help_text.split("\n\n")[0].split())
    return re.findall(r"\[(-[^\[\]]*(?:\[[^\]]*\][^\[\]]*)*)\]", usage)


# ---------------------------------------------------------------------------- the flags
@pytest.mark.parametrize("command", ["train", "compare"])
def test_help_lists_the_same_flags_as_the_hand_written_parser(command, capsys):
    text = _help(command, capsys)
    assert sorted(_usage_items(text)) == sorted(USAGE)
    # Every flag the help text mentions exists (a renamed flag leaves no stale mention).
    flags = {item.split()[0] for item in USAGE} | {"--help", "--runs"}
    assert set(re.findall(r"(?<![\w-])--[a-z0-9]+(?:-[a-z0-9]+)*", text)) <= flags
    if command == "compare":
        assert "--runs SPEC [SPEC ...]" in " ".join(text.split())


def test_help_shows_every_default(capsys):
    """Each flag that takes a value says its default (switches are off unless given)."""
    for part in COMPONENTS:
        for f in dataclasses.fields(part):
            if f.metadata["cli"]:
                flag, options = cli.flag_spec(f)
                switch = options.get("action") in ("store_true", "store_false")
                assert switch or "(default: " in options["help"], flag
    text = " ".join(_help("train", capsys).split())
    assert "--daso-global-skip DASO_GLOBAL_SKIP B at the start of cycling" in text
    assert "(default: 10_000_000)" in text and "(default: 1/W, which averages" in text


def test_every_flag_parses_to_the_config_the_hand_written_parser_built(parse, tmp_path):
    assert parse(*FULL).to_dict() == FULL_DICT
    assert parse("--out", "runs/d").to_dict() == DEFAULTS_DICT
    init = tmp_path / "model.pt"
    init.write_bytes(b"")
    cfg = parse("--strategy", "daso", "--workers", "4", "--nodes", "2", "--init-from", str(init))
    assert cfg.init_from == str(init) and (cfg.strategy, cfg.nodes) == ("daso", 2)


def test_compare_takes_the_same_flags(monkeypatch):
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "cmd_compare", lambda args: seen.append(args) or 0)
    assert cli.main(["compare", "--runs", "sync", "asgd", *FULL]) == 0
    flags = {k: v for k, v in vars(seen[0]).items() if k not in (*cli.CLI_ONLY, "runs")}
    assert RunConfig.from_dict(flags).to_dict() == FULL_DICT


def test_flags_not_given_leave_the_file_alone_and_given_ones_win(parse, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[daso]\nglobal_skip = 6\nbatches_to_wait = 2\n[training]\nlr = 0.05\n")
    cfg = parse("--config", str(path), "--daso-batches-to-wait", "3")
    assert (cfg.daso_global_skip, cfg.daso_batches_to_wait, cfg.lr) == (6, 3, 0.05)
    path.write_text('straggler = ["1:2"]\n')  # the alias in the file, the flag's field wins
    assert parse("--config", str(path), "--straggler", "0:3").straggler_factor(0) == 3.0


# ---------------------------------------------------------------------------- the concerns
def test_the_concerns_partition_the_run_config():
    names = [f.name for part in COMPONENTS for f in dataclasses.fields(part)]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(RunConfig))
    assert len(names) == len(set(names))
    assert len({part.section for part in COMPONENTS}) == len(COMPONENTS)
    # Every field says what it is, in --help and for a reader of config.py.
    assert all(f.metadata["help"] for f in dataclasses.fields(RunConfig))


@dataclasses.dataclass
class _NewConcern:
    """A setting added as one field becomes a flag with no other code."""

    section = "new"
    title = "new"

    new_count: int = option(3, "how many")
    new_rate: float | None = option(None, "how fast", shown="as fast as it goes")
    new_name: str = option("a", "which one", choices=("a", "b"))
    new_on: bool = option(False, "turn it on")
    new_kept: bool = option(True, "do not keep it")
    new_items: list[str] = option(help="add one", metavar="ITEM", shown="none", factory=list)


def test_a_new_field_is_a_flag(monkeypatch):
    monkeypatch.setattr(cli, "COMPONENTS", (_NewConcern,))
    p = argparse.ArgumentParser()
    groups = cli.add_config_flags(p)
    assert set(groups) == {"new"}
    args = p.parse_args(
        "--new-count 5 --new-rate 0.5 --new-name b --new-on --no-new-kept "
        "--new-items x --new-items y".split()
    )
    assert vars(args) == {
        "new_count": 5,
        "new_rate": 0.5,
        "new_name": "b",
        "new_on": True,
        "new_kept": False,
        "new_items": ["x", "y"],
    }
    assert vars(p.parse_args([])) == {}  # nothing given: nothing overrides a config file
    text = " ".join(p.format_help().split())
    assert "how many (default: 3)" in text and "how fast (default: as fast as it goes)" in text
    assert "--new-items ITEM add one (default: none)" in text
    with pytest.raises(SystemExit):
        p.parse_args(["--new-name", "c"])


# ---------------------------------------------------------------------------- TOML sections
def _load(tmp_path, text: str) -> dict:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_toml(path)


def test_sections_mirror_the_concerns_and_flat_keys_still_work(tmp_path):
    sections = _load(
        tmp_path,
        '[job]\nstrategy = "daso"\nworkers = 4\n'
        "[daso]\nglobal_skip = 6\nbatches-to-wait = 2\ndaso_patience = 3\n"
        '[cluster]\nnodes = 2\nstraggler = ["1:2"]\n'
        '[model]\nmodel = "mlp"\n[training]\nlr = 0.05\n[local_sgd]\nwarmup_steps = 1\n'
        '[diloco]\nouter_lr = 0.2\n[faults]\ninject_fault = "kill:1@5"\n',
    )
    flat = _load(
        tmp_path,
        'strategy = "daso"\nworkers = 4\ndaso_global_skip = 6\ndaso-batches-to-wait = 2\n'
        'daso_patience = 3\nnodes = 2\nstraggler = ["1:2"]\nmodel = "mlp"\nlr = 0.05\n'
        'local_sgd_warmup_steps = 1\ndiloco_outer_lr = 0.2\ninject_fault = "kill:1@5"\n',
    )
    assert sections == flat
    assert RunConfig.from_dict(sections) == RunConfig.from_dict(flat)
    assert RunConfig.from_dict(sections).stragglers[0].factor == 2.0
    # The [train] table of flat keys (and sections inside it) as before; its values win.
    train = _load(tmp_path, "lr = 0.3\n[train]\nlr = 0.05\n[train.daso]\nglobal_skip = 6\n")
    assert train == {"lr": 0.05, "daso_global_skip": 6}


@pytest.mark.parametrize(
    "text, message",
    [
        ("[daso]\nglobal_skp = 4\n", "config: unknown field 'global_skp' in [daso]; did you "
         "mean 'global_skip'?"),
        ("[daso]\nlr = 0.1\n", "config: 'lr' is not a [daso] setting; it belongs in [training] "
         "(or at the top level)"),
        ("[dasso]\nglobal_skip = 4\n", "config: unknown section [dasso]; did you mean [daso]?"),
        ("lr = 0.1\n[training]\nlr = 0.2\n", "config: lr is set twice (the top level and "
         "[training]); keep one"),
        ("stragglers = []\n[cluster]\nstraggler = []\n", "config: stragglers is set twice (the "
         "top level and [cluster]); keep one"),
    ],
)  # fmt: skip
def test_bad_sections_are_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    assert str(err.value) == message


def test_a_factory_named_in_a_section_is_refused_like_a_flat_one(tmp_path, monkeypatch, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nmodel = "somepkg.mod:net"\n')
    monkeypatch.setattr(cli, "cmd_train", lambda args: cli.build_config(args) and 0)
    assert cli.main(["train", "--config", str(path)]) == 2
    assert "names the factory 'somepkg.mod:net'" in capsys.readouterr().err
