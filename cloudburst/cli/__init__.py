"""``cloudburst`` command line: ``train``, ``simulate``, ``compare``, ``demo`` and ``plot``.

``cloudburst train`` validates the whole config before anything starts (a bad value, or a flag
argparse cannot read: one line, exit code 2). Outside torchrun it launches a local job, once
its ranks are known to fit this machine (``--allow-large-job`` skips that check), and shows a
progress bar; inside a user's ``torchrun ... -m cloudburst train ...`` it runs as one rank.
``cloudburst simulate`` takes the same settings plus the clock model's and runs the whole job
in this process on a virtual cluster (times in virtual seconds), or a sweep of such runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

from cloudburst.cli.checks import ALLOW_LARGE_JOB, check_local_job_fits, preflight
from cloudburst.config import (
    COMPONENTS,
    ConfigError,
    RunConfig,
    load_toml,
    refuse_code_from_file,
)
from cloudburst.loop.summary import failed_message, format_summary, interrupted_message
from cloudburst.records.resilience import resume_config
from cloudburst.records.rundir import check_run_dir, default_out, prepare_run_dir

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130  # as a shell reports a process stopped by SIGINT


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusal (an unknown flag, ``--seed x``, a value past int's digit limit)
    is one line and exit code 2, as a refused config is, without the long usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if len(message) > 300:
            message = message[:300] + "..."
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def _simulate_parser(sub) -> None:
    from cloudburst.sim.sweep import DEFAULT_TARGET_ACCURACY

    p = sub.add_parser(
        "simulate",
        help="the same job on a virtual cluster, in this process: times in virtual seconds",
        description="Runs the job a `train` with these flags would run, in one process with "
        "no torchrun and no ports, on a deterministic clock: each step, message, collective "
        "and server apply costs what the clock model says (virtual seconds). Writes what "
        'train writes (summary.json with "simulated": true and the clock model, metrics, '
        "model.pt). With --sweep, --strategies or --seeds: one run per point under OUT, and "
        "OUT/sweep.md, OUT/sweep.json and plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_config_file_arguments(p)
    add_config_flags(p)
    add_simulation_flags(p)
    for action in p._actions:  # simulate reports a time-to-target by default
        if action.dest == "target_accuracy":
            action.help = action.help.replace(
                "(default: none)", f"(default: {DEFAULT_TARGET_ACCURACY:g} here)"
            )
    g = p.add_argument_group("sweep: several simulated runs, one table and plots")
    g.add_argument(
        "--sweep",
        metavar="FIELD=V1,V2,...",
        default=argparse.SUPPRESS,
        help="run once per value of any setting of the run or of the clock model, e.g. "
        "workers=2,4,8 or step_time_jitter=lognormal:0.1,pareto:3 (a link: GBIT:LATENCY_MS)",
    )
    g.add_argument(
        "--strategies",
        metavar="A,B,...",
        default=argparse.SUPPRESS,
        help="run each of these strategies (instead of --strategy)",
    )
    g.add_argument(
        "--seeds",
        metavar="S1,S2,...",
        default=argparse.SUPPRESS,
        help="repeat each point with these seeds",
    )


def _add_config_file_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with run settings (flags override it)")
    p.add_argument(
        "--trust-config",
        action="store_true",
        help="allow a model factory (package.module:function) named in --config or in a "
        "resumed run's config.json to be imported; without it only --model may name one",
    )


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    _add_config_file_arguments(p)
    groups = add_config_flags(p)
    groups["job"].add_argument(
        ALLOW_LARGE_JOB,
        action="store_true",
        default=argparse.SUPPRESS,
        help="launch a local job even when its ranks look too many for this machine (about "
        "12 processes and threads, 128 MiB and 10 open files each); the check is skipped "
        "under torchrun, where each machine runs its own share",
    )
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
                flag, options = flag_spec(f, part.flat(f.name))
                groups[part.section].add_argument(flag, **options)
    return groups


def add_simulation_flags(p: argparse.ArgumentParser) -> Any:
    """One flag per :class:`~cloudburst.config.simulation.SimulationConfig` field (``simulate``
    only), generated as :func:`add_config_flags` does; returns their argument group."""
    from cloudburst.config.simulation import SimulationConfig

    group = p.add_argument_group(SimulationConfig.title)
    for f in dataclasses.fields(SimulationConfig):
        if f.metadata["cli"]:
            flag, options = flag_spec(f)
            group.add_argument(flag, **options)
    return group


def flag_spec(f: dataclasses.Field, name: str | None = None) -> tuple[str, dict[str, Any]]:
    """``("--daso-global-skip", add_argument's options)`` for a config field of flat name
    ``name`` (its own by default): ``--name`` with a value of the field's type; a list is a
    repeatable flag; a bool is a switch that sets it (``--tensorboard``) or, for one that
    defaults to True, clears it (``--no-augment``)."""
    meta = f.metadata
    name = name or f.name
    kind = str(f.type).removesuffix(" | None")
    options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
    help_text = meta["help"]
    if kind == "bool":
        switch = "--no-" if f.default else "--"
        flag = meta["flag"] or switch + name.replace("_", "-")
        options["action"] = "store_false" if f.default else "store_true"
    else:
        flag = meta["flag"] or "--" + name.replace("_", "-")
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


CLI_ONLY = ("command", "config", "func", "trust_config", "allow_large_job")


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

    start_forkserver(fork=True)
    from cloudburst.cli.compare import comparison_configs, run_comparison
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
        if not getattr(args, "allow_large_job", False):
            check_local_job_fits(cfg)
        check_run_dir(cfg.output.out, resume=False, overwrite=cfg.output.overwrite)
    for _, cfg in runs[:1]:
        preflight(cfg)
    try:
        run_comparison(runs, out)
    except JobInterrupted as e:
        return _interrupted(e.summary)
    except JobFailed as e:
        print(f"cloudburst: {e}", file=sys.stderr)
        return 1
    return 0


def _interrupted(summary: dict) -> int:
    """Say how to continue an interrupted job and return its exit code. The job is stopped and
    its summary written: from here a further Ctrl-C or SIGTERM (a second one sent while the
    process exits, say) is ignored, so it cannot turn exit 130 into a kill or a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(interrupted_message(summary), file=sys.stderr)
    return EXIT_INTERRUPTED


SWEEP_ONLY = ("sweep", "strategies", "seeds")


def cmd_simulate(args: argparse.Namespace) -> int:
    """One simulated run into ``--out``, or a sweep of them (``--sweep``, ``--strategies``,
    ``--seeds``) into ``OUT/<point>/`` with ``OUT/sweep.md``, ``sweep.json`` and plots."""
    from cloudburst.config.simulation import SimulationConfig
    from cloudburst.sim import sweep

    if _under_torchrun():
        raise ConfigError("simulate: run it directly, not under torchrun (it is one process)")
    sim_names = {f.name for f in dataclasses.fields(SimulationConfig)}
    given = {k: v for k, v in vars(args).items() if k not in (*CLI_ONLY, *SWEEP_ONLY)}
    flags = {k: v for k, v in given.items() if k not in sim_names}
    sim_values = {k: v for k, v in given.items() if k in sim_names}
    values: dict[str, Any] = load_toml(args.config) if getattr(args, "config", None) else {}
    trust = bool(getattr(args, "trust_config", False))
    refuse_code_from_file(values, flags, f"--config {args.config}" if values else "", trust)
    values.update(flags)
    values.setdefault("target_accuracy", sweep.DEFAULT_TARGET_ACCURACY)
    sweep_text, strategies_text, seeds_text = (getattr(args, k, None) for k in SWEEP_ONLY)
    field, sweep_values = sweep.parse_sweep(sweep_text) if sweep_text else (None, [None])
    strategies = sweep.parse_strategies(strategies_text) if strategies_text else None
    if strategies and "strategy" in flags:
        raise ConfigError("strategies: give --strategy (one run) or --strategies (several)")
    seeds = sweep.parse_seeds(seeds_text) if seeds_text else None
    if field is None and len(strategies or ()) <= 1 and len(seeds or ()) <= 1:
        if strategies:
            values["strategy"] = strategies[0]
        if seeds:
            values["seed"] = seeds[0]
        if "out" not in values:
            values["out"] = default_out(f"sim-{values.get('strategy', 'sync')}")
        cfg = RunConfig.from_dict(values)
        sim = SimulationConfig.from_dict(sim_values)
        for warning in cfg.warnings():
            print(f"cloudburst: warning: {warning}", file=sys.stderr)
        check_run_dir(cfg.output.out, resume=False, overwrite=cfg.output.overwrite)
        preflight(cfg)
        prepare_run_dir(cfg.output.out, resume=False, overwrite=cfg.output.overwrite)
        try:
            summary = _simulate_fn()(cfg, sim)
        except _simulation_failed() as e:
            print(f"cloudburst: {e}", file=sys.stderr)
            return 1
        print(format_summary([summary]))
        model, why = sim.network_model_for(cfg.model.device)
        print(
            f"cloudburst: simulated run in {cfg.output.out} (times in virtual seconds; network "
            f"model {model}: {why})",
            file=sys.stderr,
        )
        if summary.get("failed"):  # it finished, but θ diverged (cloudburst.loop.summary.diverged)
            print(failed_message(summary), file=sys.stderr)
            return 1
        return 0
    out = values.pop("out", None) or default_out("sim-sweep")
    strategies = strategies or [str(values.get("strategy", "sync"))]
    seeds = seeds or [int(values.get("seed", 0))]
    points = sweep.sweep_points(values, sim_values, field, sweep_values, strategies, seeds, out)
    for point in points:  # every run's directory is usable before the first one starts
        check_run_dir(point.cfg.output.out, resume=False, overwrite=point.cfg.output.overwrite)
    for warning in dict.fromkeys(w for point in points for w in point.cfg.warnings()):
        print(f"cloudburst: warning: {warning}", file=sys.stderr)
    preflight(points[0].cfg)
    report = sweep.run_sweep(
        points,
        out,
        field,
        lambda cfg, sim: _simulate_fn()(cfg, sim),
        prepare=lambda cfg: prepare_run_dir(
            cfg.output.out, resume=False, overwrite=cfg.output.overwrite
        ),
        failure=_simulation_failed(),
    )
    print((Path(out) / "sweep.md").read_text(), end="")
    print(f"cloudburst: sweep of {len(points)} simulated runs in {out}", file=sys.stderr)
    if report["not_reached"]:
        print(
            f"cloudburst: {report['not_reached']} of {len(points)} runs did not reach "
            f"{report['target_accuracy']}",
            file=sys.stderr,
        )
    if report["failed"]:
        print(f"cloudburst: {len(report['failed'])} of {len(points)} runs failed", file=sys.stderr)
        return 1
    return 0


def _simulate_fn():
    """``cloudburst.sim.run.simulate``, looked up at call time."""
    import importlib

    return importlib.import_module("cloudburst.sim.run").simulate


def _simulation_failed() -> tuple[type[BaseException], ...]:
    """The error a simulated job that failed raises (one line, exit code 1)."""
    import importlib

    failed = getattr(importlib.import_module("cloudburst.sim.run"), "SimulationFailed", None)
    return (failed,) if failed is not None else ()


def cmd_train(args: argparse.Namespace) -> int:
    if not _under_torchrun():
        from cloudburst.forkserver import start_forkserver

        start_forkserver(fork=True)  # first: its imports overlap the checks
    from cloudburst.runtime import in_torchrun

    cfg = build_config(args)
    if not in_torchrun() and not getattr(args, "allow_large_job", False):
        check_local_job_fits(cfg)  # before anything else: nothing forked, no data read
    if int(os.environ.get("RANK", "0")) == 0:
        for warning in cfg.warnings():
            print(f"cloudburst: warning: {warning}", file=sys.stderr)
    check_run_dir(cfg.output.out, resume=cfg.faults.resume, overwrite=cfg.output.overwrite)
    preflight(cfg)
    if in_torchrun():
        if int(os.environ["RANK"]) == 0:  # the others only check (above)
            prepare_run_dir(
                cfg.output.out, resume=cfg.faults.resume, overwrite=cfg.output.overwrite
            )
        from cloudburst.runtime.placement import topology_mismatch
        from cloudburst.train import run_rank

        problem = topology_mismatch(cfg, int(os.environ["WORLD_SIZE"]))
        if problem:
            raise ConfigError(problem)

        run_rank(cfg.to_dict())
        from cloudburst.loop.summary import finished_exit_code  # 1 when θ diverged

        return finished_exit_code(cfg.output.out) if int(os.environ["RANK"]) == 0 else 0
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
        # no results table: a failed run's numbers are not a result
        print(failed_message(e.summary), file=sys.stderr)
        print(f"cloudburst: logs in {os.path.join(cfg.output.out, 'logs')}", file=sys.stderr)
        return 1
    except JobInterrupted as e:
        print(format_summary([e.summary]))
        return _interrupted(e.summary)
    if summary.get("failed"):  # it finished, but θ diverged (cloudburst.loop.summary.diverged)
        print(failed_message(summary), file=sys.stderr)
        print(f"cloudburst: the run's files are in {cfg.output.out}", file=sys.stderr)
        return 1
    print(format_summary([summary]))
    print(
        f"cloudburst: the run is in {cfg.output.out} (summary.json, metrics/; learning curves: "
        f"cloudburst plot {cfg.output.out})",
        file=sys.stderr,
    )
    if summary.get("failed_agents"):
        from cloudburst.launch.failures import rank_errors

        lost = summary.get("lost_workers") or []
        print(
            f"cloudburst: some ranks failed (agent exit codes {summary['failed_agents']}); "
            f"lost workers: {lost}",
            file=sys.stderr,
        )
        for line in rank_errors(Path(cfg.output.out))[:3]:
            print(f"cloudburst: a rank failed with: {line}", file=sys.stderr)
        print(f"cloudburst: logs in {os.path.join(cfg.output.out, 'logs')}", file=sys.stderr)
        if len(lost) >= cfg.job.workers:  # nobody trained to the end: the model is not a result
            print("cloudburst: every worker was lost; the run failed", file=sys.stderr)
            return 1
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from cloudburst.cli.plot import plot_runs

    path = plot_runs(args.runs, args.output, title=args.title)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``cloudburst`` parser with its five subcommands."""
    parser = OneLineParser(prog="cloudburst", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    _train_parser(sub)
    _simulate_parser(sub)
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
        if args.command == "simulate":
            return cmd_simulate(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "demo":
            from cloudburst.forkserver import start_forkserver

            start_forkserver(fork=True)
            from cloudburst.cli.demo import run_demo
            from cloudburst.launch import JobInterrupted

            try:
                run_demo(args.out, args.epochs, args.strategies)
            except JobInterrupted as e:
                return _interrupted(e.summary)
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
