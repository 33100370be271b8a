"""``cloudburst`` command line: ``train``, ``compare``, ``demo`` and ``plot``.

``cloudburst train`` validates the whole config before anything starts (a bad value: one line,
exit code 2). Outside torchrun it launches a local job and shows a progress bar; inside a
user's ``torchrun ... -m cloudburst train ...`` it runs as one rank of that job.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cloudburst.config import (
    AUTOCASTS,
    BACKENDS,
    DATASETS,
    DEVICES,
    DOWNCASTS,
    GOSSIP_SCHEDULES,
    GOSSIP_VARIANTS,
    LR_SCHEDULES,
    MODELS,
    OPTIMIZERS,
    SERVER_RULES,
    STRATEGIES,
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
    S = argparse.SUPPRESS  # unset flags do not override the config file
    p.add_argument("--config", help="TOML file with run settings (flags override it)")
    p.add_argument(
        "--trust-config",
        action="store_true",
        help="allow a model factory (package.module:function) named in --config or in a "
        "resumed run's config.json to be imported; without it only --model may name one",
    )
    p.add_argument("--strategy", choices=STRATEGIES, default=S, help="(default sync)")
    p.add_argument("--workers", type=int, default=S, help="W, training ranks (default 2)")
    p.add_argument(
        "--servers",
        type=int,
        default=S,
        help="S, parameter-server shards (asgd, easgd; default 1 for them)",
    )
    p.add_argument(
        "--n-sync", type=int, default=S, help="GPU A-SGD n_sync: sets --n-fetch and --n-push"
    )
    p.add_argument("--n-fetch", type=int, default=S, help="fetch θ every this many local steps")
    p.add_argument("--n-push", type=int, default=S, help="push Δ every this many local steps")
    p.add_argument("--server-rule", choices=SERVER_RULES, default=S, help="(default add)")
    p.add_argument(
        "--server-lr", type=float, default=S, help="λ of the add rule / server optimizer lr"
    )
    p.add_argument("--server-momentum", type=float, default=S)
    p.add_argument("--max-staleness", type=int, default=S, help="drop pushes staler than this")
    p.add_argument(
        "--staleness-scaling", action="store_true", default=S, help="scale each push by 1/staleness"
    )
    p.add_argument(
        "--warm-start-steps",
        type=int,
        default=S,
        help="K: worker 0 trains alone for K steps, then all start from its θ",
    )
    p.add_argument("--init-from", default=S, help="start from this model checkpoint (model.pt)")
    p.add_argument(
        "--nodes",
        type=int,
        default=S,
        help="group this launch's ranks into N emulated nodes (default: torchrun's nodes, or 1)",
    )
    p.add_argument(
        "--inter-node-link",
        default=S,
        metavar="GBIT_PER_S[,LATENCY_MS]",
        help="emulate a link of this speed between nodes (software delay; e.g. 1,1)",
    )
    g = p.add_argument_group("local SGD and DiLoCo (--strategy local_sgd | diloco)")
    g.add_argument("--period", type=int, default=S, help="H: average every H local steps (8)")
    g.add_argument(
        "--local-sgd-warmup-steps", type=int, default=S, help="post-local SGD: sync first (0)"
    )
    g.add_argument("--diloco-outer-lr", type=float, default=S, help="outer SGD lr (0.7)")
    g.add_argument("--diloco-outer-momentum", type=float, default=S, help="outer momentum (0.9)")
    g.add_argument(
        "--diloco-no-nesterov",
        dest="diloco_nesterov",
        action="store_false",
        default=S,
        help="plain momentum in the outer optimizer",
    )
    g = p.add_argument_group("EASGD (--strategy easgd, with --servers)")
    g.add_argument("--easgd-tau", type=int, default=S, help="τ: elastic step every τ steps (10)")
    g.add_argument("--easgd-alpha", type=float, default=S, help="α (default β/W)")
    g.add_argument("--easgd-beta", type=float, default=S, help="β (0.9)")
    g = p.add_argument_group("gossip (--strategy gossip)")
    g.add_argument("--gossip-variant", choices=GOSSIP_VARIANTS, default=S, help="(pull)")
    g.add_argument("--gossip-schedule", choices=GOSSIP_SCHEDULES, default=S, help="(random)")
    g.add_argument("--gossip-every", type=int, default=S, help="gossip every k steps (1)")
    g.add_argument(
        "--gossip-push-sum", action="store_true", default=S, help="push-sum weights (push only)"
    )
    g.add_argument(
        "--consensus-every-steps", type=int, default=S, help="log consensus distance (50)"
    )
    g = p.add_argument_group("DASO (--strategy daso)")
    g.add_argument("--daso-global-skip", type=int, default=S, help="B at the start of cycling (4)")
    g.add_argument("--daso-batches-to-wait", type=int, default=S, help="S at the start (1)")
    g.add_argument("--daso-local-skip", type=int, default=S, help="L: node-local sync every L (1)")
    g.add_argument("--daso-max-global-skips", type=int, default=S, help="B after a reset (8)")
    g.add_argument("--daso-warmup-epochs", type=float, default=S, help="blocking epochs first (4)")
    g.add_argument("--daso-cooldown-epochs", type=float, default=S, help="blocking epochs last (4)")
    g.add_argument("--daso-stability-level", type=float, default=S, help="plateau threshold (0.05)")
    g.add_argument("--daso-patience", type=int, default=S, help="plateau epochs (2)")
    g.add_argument("--daso-skip-reduction-factor", type=int, default=S, help="B, S divisor (2)")
    g.add_argument(
        "--daso-fixed",
        dest="daso_adaptive",
        action="store_false",
        default=S,
        help="keep B and S at their starting values",
    )
    g.add_argument(
        "--daso-downcast", choices=DOWNCASTS, default=S, help="blocking averages' dtype (bf16)"
    )
    g.add_argument(
        "--daso-cycling-downcast",
        choices=DOWNCASTS,
        default=S,
        help="non-blocking syncs' dtype (none = fp32, as Heat)",
    )
    g.add_argument(
        "--daso-no-epoch-end-sync",
        dest="daso_epoch_end_sync",
        action="store_false",
        default=S,
        help="no blocking average on the last batch of each cycling epoch",
    )
    g.add_argument(
        "--daso-chunk-elements", type=int, default=S, help="global all-reduce chunk size (1e7)"
    )
    p.add_argument(
        "--dataset",
        default=S,
        metavar="SPEC",
        help=f"one of {', '.join(DATASETS)} (default mnist1d; paths are read, never downloaded)",
    )
    p.add_argument("--train-size", type=int, default=S, help="(default 4000 for mnist1d, else all)")
    p.add_argument("--test-size", type=int, default=S, help="(default 1000 for mnist1d, else all)")
    p.add_argument(
        "--image-size", type=int, default=S, help="imagefolder: resize and crop to this (32)"
    )
    p.add_argument(
        "--no-augment",
        dest="augment",
        action="store_false",
        default=S,
        help="images: no random crop (padding 4) and flip",
    )
    p.add_argument(
        "--data-workers",
        type=int,
        default=S,
        help="DataLoader processes per worker (default 2 for images, 0 otherwise)",
    )
    p.add_argument(
        "--model",
        default=S,
        metavar="NAME",
        help=f"one of {', '.join(MODELS)}, or package.module:function (default cnn)",
    )
    p.add_argument("--device", choices=DEVICES, default=S, help="auto: cuda when a GPU is present")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=S,
        help="workers' collectives; auto: nccl when each worker has its own GPU, else gloo",
    )
    p.add_argument(
        "--autocast", choices=AUTOCASTS, default=S, help="bf16: autocast forward and loss"
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        default=S,
        help="also write TensorBoard events under OUT/tensorboard",
    )
    p.add_argument("--epochs", type=float, default=S, help="passes of each worker over its shard")
    p.add_argument(
        "--steps", type=int, default=S, help="local steps per worker (overrides --epochs)"
    )
    p.add_argument("--batch-size", type=int, default=S, help="per worker (default 64)")
    p.add_argument(
        "--optimizer", choices=OPTIMIZERS, default=S, help="local optimizer (default sgd)"
    )
    p.add_argument("--lr", type=float, default=S)
    p.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default=S,
        help="constant, or cosine decay to 0 over each worker's steps",
    )
    p.add_argument("--momentum", type=float, default=S)
    p.add_argument("--weight-decay", type=float, default=S)
    p.add_argument("--seed", type=int, default=S)
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=S,
        help="report the time to reach this test accuracy (0..1)",
    )
    p.add_argument(
        "--straggler",
        action="append",
        default=S,
        metavar="WORKER:FACTOR",
        help="worker WORKER sleeps (FACTOR-1)x its compute time each step",
    )
    p.add_argument(
        "--min-step-time-s",
        type=float,
        default=S,
        help="emulate a device: every step takes at least this long (sleep)",
    )
    p.add_argument("--eval-every-s", type=float, default=S)
    p.add_argument("--log-every-steps", type=int, default=S)
    p.add_argument(
        "--push-log-every",
        type=int,
        default=S,
        help="servers log one push record every N applied pushes, and one for each push not "
        "applied (10)",
    )
    p.add_argument("--comm-timeout-s", type=float, default=S)
    p.add_argument("--heartbeat-timeout-s", type=float, default=S)
    g = p.add_argument_group("fault tolerance")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=S,
        help="workers checkpoint every this many steps, servers every this many pushes (100; "
        "0: off)",
    )
    g.add_argument(
        "--resume",
        metavar="DIR",
        default=S,
        help="continue the run in DIR (an earlier --out) from its checkpoints, with its "
        "config; flags may change settings that do not change the run's identity",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=S,
        help="restart failed ranks this many times (sync/daso/local_sgd/diloco/gossip: the "
        "whole job, from its last checkpoint; asgd/easgd: the rank rejoins)",
    )
    g.add_argument(
        "--inject-fault",
        action="append",
        metavar="SPEC",
        default=S,
        help="kill:RANK@STEP | stop:RANK@STEP | nan:RANK@STEP | slow:RANK:FACTOR (repeatable; "
        "first attempt only)",
    )
    p.add_argument(
        "--out", default=S, help="output directory (default runs/<strategy>-<time>-<random>)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        default=S,
        help="write into an existing directory that is not a cloudburst run (only the run's "
        "own files are ever replaced)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", default=S)


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


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
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
