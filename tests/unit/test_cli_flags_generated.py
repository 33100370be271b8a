"""``train``/``compare`` flags are generated from the config's fields: one per field, parsing to
it, and TOML sections mirroring the concerns (spellings the names do not give: SPELLED)."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from cloudburst import cli
from cloudburst.config import COMPONENTS, FIELDS, RunConfig, Section, load_toml, option


def _config_flags() -> dict[str, dict]:
    """Each generated flag of ``train``: its add_argument options."""
    return dict(
        cli.flag_spec(f, part.flat(f.name))
        for part in COMPONENTS
        for f in dataclasses.fields(part)
        if f.metadata["cli"]
    )


def _usage_item(flag: str, options: dict) -> str:
    """How argparse's usage shows a flag: a switch alone, else its choices or its metavar."""
    if options.get("action") in ("store_true", "store_false"):
        return flag
    if "choices" in options:
        return f"{flag} {{{','.join(options['choices'])}}}"
    return f"{flag} {options.get('metavar', options['dest'].upper())}"


# Options of ``train --help``'s usage that are not ``--field-name FIELD_NAME``: their spelling
# or metavar comes from the field's metadata (or the flag is the CLI's own), so a change to
# it fails here.
SPELLED = [
    "--allow-large-job", "--config CONFIG", "--resume DIR", "--trust-config", "-h",
    "--daso-fixed", "--daso-no-epoch-end-sync", "--diloco-no-nesterov", "--gossip-no-full-step",
    "--no-augment", "--no-progress", "--dataset SPEC", "--model NAME", "--inject-fault SPEC",
    "--straggler WORKER:FACTOR", "--inter-node-link GBIT_PER_S[,LATENCY_MS]",
    "--compress none|bf16|fp8|int8|powersgd[:RANK[:START]]",
    "--shard-placement spread|first|own|NODE,...",
    "--strategy {sync,asgd,daso,local_sgd,diloco,easgd,gossip,async_diloco}",
    "--staleness-compensation {none,scale,dc,dc-adaptive,gap,delay-adaptive}",
    "--server-rule {add,sgd,adagrad}", "--optimizer {sgd,adam,adamw}", "--replica {rank,node}",
]  # fmt: skip

# Every field set away from its default by a flag (the store_false switches included).
FULL = """
--strategy easgd --workers 4 --servers 2 --n-sync 3 --n-fetch 2 --server-rule sgd --server-lr 0.3
--server-momentum 0.5 --max-staleness 7 --staleness-scaling --warm-start-steps 5 --nodes 2
--shard-placement 1,0 --inter-node-link 1,2 --period 6 --local-sgd-warmup-steps 3
--diloco-outer-lr 0.4 --diloco-outer-momentum 0.8 --diloco-no-nesterov --easgd-tau 4
--easgd-alpha 0.2 --easgd-beta 0.7 --gossip-variant push --gossip-schedule ring --gossip-every 2
--gossip-push-sum --gossip-no-full-step --consensus-every-steps 20 --daso-global-skip 6
--daso-batches-to-wait 2 --daso-local-skip 2 --daso-max-global-skips 9 --daso-warmup-epochs 1.5
--daso-cooldown-epochs 2.5 --daso-stability-level 0.1 --daso-patience 3
--daso-skip-reduction-factor 3 --daso-fixed --daso-downcast fp16 --daso-cycling-downcast bf16
--daso-no-epoch-end-sync --daso-chunk-elements 1000 --dataset synthetic --train-size 2000
--test-size 500 --image-size 16 --no-augment --data-workers 1 --model mlp --device cpu
--backend gloo --autocast bf16 --tensorboard --steps 30 --epochs 2 --batch-size 16 --optimizer adam
--lr 0.01 --lr-schedule cosine --momentum 0.8 --weight-decay 0.001 --seed 7 --target-accuracy 0.8
--straggler 1:2 --straggler 3:1.5 --min-step-time-s 0.01 --eval-every-s 2 --log-every-steps 5
--push-log-every 3 --comm-timeout-s 60 --heartbeat-timeout-s 5 --checkpoint-every 50
--max-restarts 2 --inject-fault kill:3@10 --inject-fault slow:2:2.0 --out runs/flags --overwrite
--no-progress --max-train-time-s 120
""".split()


def _full_dict() -> dict:
    """RunConfig.to_dict() of FULL: the defaults with each flag's value, converted to its
    field's type, in its field (a switch sets or clears it, a repeated flag appends); then what
    the config derives: the straggler specs normalised, --n-sync's push count (the --n-fetch
    given wins for fetches) and --staleness-scaling as the "scale" compensation."""
    specs, defaults, tokens = _config_flags(), RunConfig(out="x").to_dict(), iter(FULL)
    expected = dict(defaults)
    for flag in tokens:
        options = specs[flag]
        dest, action = options["dest"], options.get("action")
        if action in ("store_true", "store_false"):
            expected[dest] = action == "store_true"
        elif action == "append":
            expected[dest] = [*expected[dest], next(tokens)]
        else:
            expected[dest] = options.get("type", str)(next(tokens))
    moved = {specs[t]["dest"] for t in FULL if t in specs}
    assert all(expected[dest] != defaults[dest] for dest in moved)  # FULL moves every field
    changes = {"stragglers": ["1:2.0", "3:1.5"], "n_push": 3, "staleness_compensation": "scale"}
    return {**expected, **changes}


def _help(command: str, capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _usage_items(help_text: str) -> list[str]:
    """``[--workers WORKERS]`` → ``--workers WORKERS`` for each optional option in the usage."""
    usage = " ".join(help_text.split("\n\n")[0].split())
    items, depth, start = [], 0, 0
    for i, char in enumerate(usage):  # brackets nest in a metavar: powersgd[:RANK[:START]]
        if char == "[":
            depth, start = depth + 1, (i + 1 if depth == 0 else start)
        elif char == "]":
            depth -= 1
            if depth == 0 and usage[start] == "-":
                items.append(usage[start:i])
    return items


# ---------------------------------------------------------------------------- the flags
@pytest.mark.parametrize("command", ["train", "compare"])
def test_help_lists_one_flag_per_config_field_and_the_cli_s_own(command, capsys):
    """The usage holds exactly each config field's generated flag (with its choices or
    metavar) and the CLI's own options, spelled as SPELLED says where the field name does not;
    every flag the help text mentions exists (a renamed flag leaves no stale mention); the
    help says each default."""
    text = _help(command, capsys)
    generated = [_usage_item(flag, options) for flag, options in _config_flags().items()]
    cli_own = ["--allow-large-job", "--config CONFIG", "--resume DIR", "--trust-config", "-h"]
    usage = sorted(_usage_items(text))
    assert usage == sorted(generated + cli_own) and set(SPELLED) <= set(usage)
    flags = {item.split()[0] for item in usage} | {"--help", "--runs"}
    assert set(re.findall(r"(?<![\w-])--[a-z0-9]+(?:-[a-z0-9]+)*", text)) <= flags
    text = " ".join(text.split())
    assert ("--runs SPEC [SPEC ...]" in text) == (command == "compare")
    assert "--daso-global-skip DASO_GLOBAL_SKIP B at the start of cycling" in text
    assert "(default: 10_000_000)" in text and "(default: 1/W, which averages" in text


def test_every_flag_parses_to_its_field_and_no_flag_leaves_the_defaults(parse, tmp_path):
    """Each flag sets its own field to its value (and nothing else); with none given the
    config is RunConfig's defaults."""
    assert parse(*FULL).to_dict() == _full_dict()
    assert parse("--out", "runs/d").to_dict() == RunConfig(out="runs/d").to_dict()
    init = tmp_path / "model.pt"
    init.write_bytes(b"")
    cfg = parse("--strategy", "daso", "--workers", "4", "--nodes", "2", "--init-from", str(init))
    assert cfg.training.init_from == str(init)
    assert (cfg.job.strategy, cfg.cluster.nodes) == ("daso", 2)


def test_compare_takes_the_same_flags(monkeypatch):
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "cmd_compare", lambda args: seen.append(args) or 0)
    assert cli.main(["compare", "--runs", "sync", "asgd", *FULL]) == 0
    flags = {k: v for k, v in vars(seen[0]).items() if k not in (*cli.CLI_ONLY, "runs")}
    assert RunConfig.from_dict(flags).to_dict() == _full_dict()


# ---------------------------------------------------------------------------- the concerns
def test_the_concerns_partition_the_run_config():
    """Every field is in one concern, under one flat name; a config holds one section per
    concern, as ``cfg.<section>``."""
    names = [part.flat(f.name) for part in COMPONENTS for f in dataclasses.fields(part)]
    assert sorted(names) == sorted(FIELDS) and len(names) == len(set(names))
    assert len({part.section for part in COMPONENTS}) == len(COMPONENTS)
    cfg = RunConfig()
    assert [type(getattr(cfg, part.section)) for part in COMPONENTS] == list(COMPONENTS)
    # Every field says what it is, in --help and for a reader of config.py; each flag that
    # takes a value says its default (switches are off unless given).
    assert all(f.metadata["help"] for _, f in FIELDS.values())
    for flag, options in _config_flags().items():
        switch = options.get("action") in ("store_true", "store_false")
        assert switch or "(default: " in options["help"], flag


@dataclasses.dataclass
class _NewConcern(Section):
    """A setting added as one field becomes a flag with no other code; its flat name (the
    flag's) carries the section's prefix."""

    section = "new"
    title = "new"
    prefix = "new_"

    count: int = option(3, "how many")
    rate: float | None = option(None, "how fast", shown="as fast as it goes")
    name: str = option("a", "which one", choices=("a", "b"))
    on: bool = option(False, "turn it on")
    kept: bool = option(True, "do not keep it")
    items: list[str] = option(help="add one", metavar="ITEM", shown="none", factory=list)


def test_a_new_field_is_a_flag(monkeypatch):
    monkeypatch.setattr(cli, "COMPONENTS", (_NewConcern,))
    p = argparse.ArgumentParser()
    groups = cli.add_config_flags(p)
    assert set(groups) == {"new"}
    args = p.parse_args(
        "--new-count 5 --new-rate 0.5 --new-name b --new-on --no-new-kept "
        "--new-items x --new-items y".split()
    )
    expected = dict(new_count=5, new_rate=0.5, new_name="b", new_on=True, new_kept=False)
    assert vars(args) == {**expected, "new_items": ["x", "y"]}
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
    assert RunConfig.from_dict(sections).cluster.stragglers[0].factor == 2.0
    # The [train] table of flat keys (and sections inside it) as before; its values win.
    train = _load(tmp_path, "lr = 0.3\n[train]\nlr = 0.05\n[train.daso]\nglobal_skip = 6\n")
    assert train == {"lr": 0.05, "daso_global_skip": 6}
