"""``cloudburst`` command line: ``train``, ``compare``, ``demo`` and ``plot``.

``cloudburst train`` validates the whole config before anything starts (a bad value: one line,
exit code 2). Outside torchrun it launches a local job and shows a progress bar; inside a
user's ``torchrun ... -m cloudburst train ...`` it runs as one rank of that job.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from cloudburst.config import (
    COMPONENTS,
    ConfigError,
    RunConfig,
    load_toml,
    refuse_code_from_file,
)
from cloudburst.preflight import preflight
from cloudburst.resilience import resume_config
from cloudburst.rundir import check_run_dir, default_out, prepare_run_dir
from cloudburst.summary import failed_message, format_summary, interrupted_message

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130  # as a shell reports a process stopped by SIGINT


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model with a data-parallel strategy",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_train_arguments(p)


def _compare_parser(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="several strategies (or settings) on the same data, model and budget: a table "
        "and learning curves",
        description="Runs one job per --runs spec, one after another, with the train flags "
        "given here shared by all; prints one table, writes OUT/curves.png and OUT/summary.md.",
    )
    p.add_argument(
        "--runs",
        nargs="+",
        required=True,
        metavar="SPEC",
        help="STRATEGY[:field=value,...], e.g. sync asgd:n_sync=10,server_lr=0.25 diloco",
    )
    _add_train_arguments(p)


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with run settings (flags override it)")
    p.add_argument(
        "--trust-config",
        action="store_true",
        help="allow a model factory (package.module:function) named in --config or in a "
        "resumed run's config.json to be imported; without it only --model may name one",
    )
    groups = add_config_flags(p)
    groups["faults"].add_argument(
        "--resume",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="continue the run in DIR (an earlier --out) from its checkpoints, with its "
        "config; flags may change settings that do not change the run's identity",
    )


def add_config_flags(p: argparse.ArgumentParser) -> dict[str, Any]:
    """One flag per :class:`RunConfig` field, generated from the field (name, type, default,
    help and spelling from its metadata), grouped by concern; returns the argument group of
    each concern's section name. Every default is ``SUPPRESS``: a flag not given leaves the
    config file's value alone."""
    groups: dict[str, Any] = {}
    by_title: dict[str, Any] = {}
    for part in COMPONENTS:
        if part.title not in by_title:
            by_title[part.title] = p.add_argument_group(part.title)
        groups[part.section] = by_title[part.title]
        for f in dataclasses.fields(part):
            if f.metadata["cli"]:
                flag, options = flag_spec(f)
                groups[part.section].add_argument(flag, **options)
    return groups


def flag_spec(f: dataclasses.Field) -> tuple[str, dict[str, Any]]:
    """``("--daso-global-skip", add_argument's options)`` for a config field: ``--name`` with
    a value of the field's type; a list is a repeatable flag; a bool is a switch that sets it
    (``--tensorboard``) or, for one that defaults to True, clears it (``--no-augment``)."""
    meta = f.metadata
    kind = str(f.type).removesuffix(" | None")
    options: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
    help_text = meta["help"]
    if kind == "bool":
        switch = "--no-" if f.default else "--"
        flag = meta["flag"] or switch + f.name.replace("_", "-")
        options["action"] = "store_false" if f.default else "store_true"
    else:
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        if kind.startswith("list["):
            options["action"] = "append"
        elif kind in ("int", "float"):
            options["type"] = int if kind == "int" else float
        for key in ("choices", "metavar"):
            if meta[key] is not None:
                options[key] = meta[key]
        shown = meta["shown"]
        if shown is None:  # 10_000_000, as the flag also accepts it
            shown = f"{f.default:_}" if kind == "int" else str(f.default)
        help_text = f"{help_text} (default: {shown})"
    options["help"] = help_text.replace("%", "%%")  # argparse %-formats help
    return flag, options


CLI_ONLY = ("command", "config", "func", "trust_config")


def build_config(args: argparse.Namespace) -> RunConfig:
    values: dict[str, Any] = load_toml(args.config) if getattr(args, "config", None) else {}
    flags = {k: v for k, v in vars(args).items() if k not in CLI_ONLY}
    trust = bool(getattr(args, "trust_config", False))
    if "resume" in flags:
        return resume_config(flags.pop("resume"), flags, has_toml=bool(values), trust=trust)
    refuse_code_from_file(values, flags, f"--config {args.config}" if values else "", trust)
    values.update(flags)
    if "out" not in values:
        values["out"] = default_out(str(values.get("strategy", "sync")))
    return RunConfig.from_dict(values)


def cmd_compare(args: argparse.Namespace) -> int:
    if _under_torchrun():
        raise ConfigError("compare: run it directly, not under torchrun (it launches its jobs)")
    from cloudburst.forkserver import start_forkserver

    start_forkserver()
    from cloudburst.compare import comparison_configs, run_comparison
    from cloudburst.launch import JobFailed, JobInterrupted

    values: dict[str, Any] = load_toml(args.config) if getattr(args, "config", None) else {}
    flags = {k: v for k, v in vars(args).items() if k not in (*CLI_ONLY, "runs")}
    if "resume" in flags:
        raise ConfigError("compare: --resume continues one run; use cloudburst train --resume")
    refuse_code_from_file(values, flags, f"--config {args.config}" if values else "", False)
    values.update(flags)
    out = values.pop("out", None) or default_out("compare")
    runs = comparison_configs(args.runs, values, out)
    for _, cfg in runs:  # every run's directory is usable before the first one starts
        check_run_dir(cfg.out, resume=False, overwrite=cfg.overwrite)
    for _, cfg in runs[:1]:
        preflight(cfg)
    try:
        run_comparison(runs, out)
    except JobInterrupted as e:
        print(interrupted_message(e.summary), file=sys.stderr)
        return EXIT_INTERRUPTED
    except JobFailed as e:
        print(f"cloudburst: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if not _under_torchrun():
        from cloudburst.forkserver import start_forkserver

        start_forkserver()  # first: its imports overlap this process's own and the checks
    from cloudburst.runtime import in_torchrun

    cfg = build_config(args)
    if int(os.environ.get("RANK", "0")) == 0:
        for warning in cfg.warnings():
            print(f"cloudburst: warning: {warning}", file=sys.stderr)
    check_run_dir(cfg.out, resume=cfg.resume, overwrite=cfg.overwrite)
    preflight(cfg)
    if in_torchrun():
        if int(os.environ["RANK"]) == 0:  # the others only check (above)
            prepare_run_dir(cfg.out, resume=cfg.resume, overwrite=cfg.overwrite)
        from cloudburst.runtime import topology_mismatch
        from cloudburst.train import run_rank

        problem = topology_mismatch(cfg, int(os.environ["WORLD_SIZE"]))
        if problem:
            raise ConfigError(problem)

        run_rank(cfg.to_dict())
        return 0
    return launch_and_report(cfg)


def _under_torchrun() -> bool:
    """This process is a rank of torchrun (checked without importing torch)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def launch_and_report(cfg: RunConfig) -> int:
    """Start a local job, draw a progress bar from its metrics, print its summary."""
    from cloudburst.launch import JobFailed, JobInterrupted, run_local_job

    try:
        summary = run_local_job(cfg)
    except JobFailed as e:
        if e.summary is None:
            print(f"cloudburst: {e}", file=sys.stderr)
            return 1
        print(format_summary([e.summary]))
        print(failed_message(e.summary), file=sys.stderr)
        print(f"cloudburst: logs in {os.path.join(cfg.out, 'logs')}", file=sys.stderr)
        return 1
    except JobInterrupted as e:
        print(format_summary([e.summary]))
        print(interrupted_message(e.summary), file=sys.stderr)
        return EXIT_INTERRUPTED
    print(format_summary([summary]))
    if summary.get("failed_agents"):
        print(
            f"cloudburst: some ranks failed (agent exit codes {summary['failed_agents']}); "
            f"lost workers: {summary['lost_workers']}",
            file=sys.stderr,
        )
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from cloudburst.plot import plot_runs

    path = plot_runs(args.runs, args.output, title=args.title)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``cloudburst`` parser with its four subcommands."""
    parser = argparse.ArgumentParser(prog="cloudburst", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _compare_parser(sub)
    p = sub.add_parser("plot", help="plot test error against wall time and samples")
    p.add_argument("runs", nargs="+", help="run directories (each with metrics/ and summary.json)")
    p.add_argument("-o", "--output", default="curves.png", help="PNG file to write")
    p.add_argument("--title", default=None)
    p = sub.add_parser("demo", help="sync vs asgd on MNIST-1D: a table and learning curves")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--epochs", type=float, default=None, help="shorter or longer than the default")
    p.add_argument("--strategies", nargs="+", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "demo":
            from cloudburst.forkserver import start_forkserver

            start_forkserver()
            from cloudburst.demo import run_demo
            from cloudburst.launch import JobInterrupted

            try:
                run_demo(args.out, args.epochs, args.strategies)
            except JobInterrupted as e:
                print(interrupted_message(e.summary), file=sys.stderr)
                return EXIT_INTERRUPTED
            return 0
        return cmd_plot(args)
    except ConfigError as e:
        print(f"cloudburst: invalid config: {e}", file=sys.stderr)
        return EXIT_CONFIG
    finally:
        if "cloudburst.forkserver" in sys.modules:  # jobs were launched from here
            sys.modules["cloudburst.forkserver"].stop_forkserver()


if __name__ == "__main__":
    sys.exit(main())
