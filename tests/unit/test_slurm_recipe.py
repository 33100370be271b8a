"""examples/slurm/cloudburst.sbatch gives every task the torchrun arguments cloudburst expects:
run by bash for a 2-node × 4-rank allocation with stand-ins for srun, scontrol and torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from cloudburst.cli import build_config, build_parser
from cloudburst.comm.auth import read_secret_file
from cloudburst.launch.agents import agent_layout
from cloudburst.strategies import STRATEGY_CLASSES

pytestmark = pytest.mark.spawns

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "cloudburst.sbatch"
HOSTS = ["gpu-a17", "gpu-b02"]

SRUN = r"""
import os, subprocess, sys
args = sys.argv[1:]
per_node, ntasks = int(os.environ["SLURM_NTASKS_PER_NODE"]), None
while args[0].startswith("--"):
    opt = args.pop(0)
    if opt.startswith("--kill-on-bad-exit"):
        continue
    value = int(args.pop(0))
    if opt == "--cpus-per-task":
        os.environ["FAKE_CPUS_PER_TASK"] = str(value)
    elif opt == "--ntasks-per-node":
        per_node = value
    elif opt == "--ntasks":
        ntasks = value
    else:
        sys.exit(f"srun stand-in: unexpected option {opt}")
nodes = int(os.environ["SLURM_NNODES"])
ntasks = ntasks or nodes * per_node
hosts = os.environ["FAKE_HOSTS"].split(",")
for t in range(ntasks):
    node = t // per_node
    env = dict(os.environ, SLURM_PROCID=str(t), SLURM_NODEID=str(node),
               SLURM_LOCALID=str(t % per_node), SLURM_NTASKS=str(ntasks),
               SLURMD_NODENAME=hosts[node])
    subprocess.run(args, env=env, check=True)
"""

TORCHRUN = r"""
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    secret = os.environ.get("CLOUDBURST_JOB_SECRET_FILE")
    f.write(json.dumps({"argv": sys.argv[1:], "host": os.environ["SLURMD_NODENAME"],
                        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "cpus": os.environ.get("FAKE_CPUS_PER_TASK"), "secret": secret,
                        "mode": secret and os.stat(secret).st_mode & 0o777,
                        "secret_bytes": secret and len(open(secret, "rb").read().strip())}) + "\n")
"""


def render(
    tmp_path: Path, cloudburst_args: list[str], agent_per_rank: bool, **extra_env: str
) -> list[dict]:
    """What each task's torchrun was given, for a 2 × 4 allocation with 4 GPUs per node."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for name, body in (("srun", SRUN), ("torchrun", TORCHRUN)):
        (bin_ / name).write_text(f"#!{sys.executable}\n{body}")
    (bin_ / "scontrol").write_text(
        f'#!/bin/sh\n[ "$1 $2 $3" = "show hostnames {",".join(HOSTS)}" ] || exit 3\n'
        f"printf '%s\\n' {' '.join(HOSTS)}\n"
    )
    for f in bin_.iterdir():
        f.chmod(0o755)
    log = tmp_path / f"torchrun-{agent_per_rank}.jsonl"
    env = {
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "4711",
        "SLURM_JOB_NODELIST": ",".join(HOSTS),
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_CPUS_PER_TASK": "2",
        "FAKE_HOSTS": ",".join(HOSTS),
        "FAKE_LOG": str(log),
        **extra_env,
    }
    if agent_per_rank:
        env["CLOUDBURST_AGENT_PER_RANK"] = "1"
    bash = shutil.which("bash")
    assert bash, "bash is needed to run the recipe"
    subprocess.run([bash, str(SCRIPT), *cloudburst_args], env=env, check=True, timeout=60)
    return [json.loads(line) for line in log.read_text().splitlines()]


def check(tasks: list[dict], strategy_args: list[str]) -> tuple[object, list, dict]:
    """Parse every task's arguments as torchrun and cloudburst do; the checks common to both
    layouts. Returns the config, the agents (nnodes, node_rank, nproc) and each host's roles."""
    parsed = [(t, get_args_parser().parse_args(t["argv"])) for t in tasks]
    for _, a in parsed:
        assert a.module and a.training_script == "cloudburst"
        assert a.training_script_args == strategy_args
    cfg = build_config(build_parser().parse_args(strategy_args))
    # One rendezvous: static, on the first node, one job id, every node rank once.
    assert {(a.rdzv_backend, a.master_addr, a.master_port, a.rdzv_id) for _, a in parsed} == {
        ("static", HOSTS[0], 29500, "4711")
    }
    (n,) = {int(a.nnodes) for _, a in parsed}  # one --nnodes for every agent
    assert sorted(a.node_rank for _, a in parsed) == list(range(n))
    agents = sorted((n, a.node_rank, int(a.nproc_per_node)) for _, a in parsed)
    # The world torchrun makes is the one the config needs (runtime refuses any other).
    assert sum(nproc for *_, nproc in agents) == cfg.world_size
    # Static rendezvous: global rank = node rank × nproc + local rank; ranks < S are servers.
    roles: dict[str, list[str]] = {h: [] for h in HOSTS}
    for t, a in parsed:
        nproc = int(a.nproc_per_node)
        for local in range(nproc):
            rank = a.node_rank * nproc + local
            roles[t["host"]].append("server" if rank < cfg.job.servers else "worker")
    return cfg, agents, roles


def test_sync_renders_one_torchrun_per_node_with_four_ranks_each(tmp_path):
    args = ["train", "--strategy", "sync", "--workers", "8", "--out", "runs/sync-8"]
    tasks = render(tmp_path, args, agent_per_rank=False)
    cfg, agents, roles = check(tasks, args)
    assert not STRATEGY_CLASSES["sync"].survives_worker_loss
    assert len(agent_layout(cfg.world_size, False)) == 1  # locally: one agent for all ranks
    assert agents == [(2, 0, 4), (2, 1, 4)]
    assert roles == {HOSTS[0]: ["worker"] * 4, HOSTS[1]: ["worker"] * 4}
    assert {t["cuda"] for t in tasks} == {None}  # torchrun's LOCAL_RANK picks the GPU
    assert {t["cpus"] for t in tasks} == {"8"}  # the node's 4 ranks' CPUs (2 per task asked)


def test_asgd_renders_one_agent_per_rank_as_the_local_launcher_does_with_one_job_secret(tmp_path):
    args = ["train", "--strategy", "asgd", "--workers", "7", "--servers", "1", "--out", "runs/a"]
    tasks = render(tmp_path, args, agent_per_rank=True)
    cfg, agents, roles = check(tasks, args)
    assert STRATEGY_CLASSES["asgd"].survives_worker_loss
    local = agent_layout(cfg.world_size, STRATEGY_CLASSES["asgd"].survives_worker_loss)
    assert agents == sorted((s.nnodes, s.node_rank, s.nproc) for s in local)
    assert agents == [(8, r, 1) for r in range(8)]
    # The server shard is rank 0, on the node that holds the store; each node has 4 ranks.
    assert roles == {HOSTS[0]: ["server"] + ["worker"] * 3, HOSTS[1]: ["worker"] * 4}
    # Every agent has LOCAL_RANK 0: each task gets its own GPU by its SLURM local id.
    by_host = {h: sorted(t["cuda"] for t in tasks if t["host"] == h) for h in HOSTS}
    assert by_host == {h: ["0", "1", "2", "3"] for h in HOSTS}
    # One job secret for every rank, only its user can read it, removed when the script ended.
    (secret,) = {t["secret"] for t in tasks}
    assert secret == str(tmp_path / ".cloudburst" / "job-4711.secret")
    assert {t["mode"] for t in tasks} == {0o600} and {t["secret_bytes"] for t in tasks} == {64}
    assert not Path(secret).exists()
    # a secret the user gives is used as it is, not replaced
    given = tmp_path / "mine.secret"
    given.write_text("k" * 32)
    given.chmod(0o600)
    tasks = render(tmp_path, args, agent_per_rank=False, CLOUDBURST_JOB_SECRET_FILE=str(given))
    assert {t["secret"] for t in tasks} == {str(given)} and given.exists()
    assert read_secret_file(given) == b"k" * 32


def test_a_world_that_does_not_match_the_config_is_caught(tmp_path):
    args = ["train", "--strategy", "sync", "--workers", "6", "--out", "runs/sync-6"]
    tasks = render(tmp_path, args, agent_per_rank=False)
    with pytest.raises(AssertionError):
        check(tasks, args)
