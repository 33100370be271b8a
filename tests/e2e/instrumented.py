"""What several end-to-end tests share: a model factory that instruments the rank it is built
in, the processes a test starts (and how it ends them), and the checks of a restarted shard.

``--model tests.e2e.instrumented:mlp`` builds cloudburst's MLP; inside a rank of a job (where
``RANK`` is set), the environment asks for more:

- ``CLOUDBURST_TEST_RECORD=DIR``: the device emulation (straggler factor, ``slow`` fault,
  ``--min-step-time-s``) records each step in ``DIR/rank{R}.jsonl`` (compute time, factor,
  minimum, what it slept in hooks and at the end, its debt), so that what a straggler does is
  checked exactly, without timing anything.
- ``CLOUDBURST_TEST_POISON=RANK:CALL``: rank RANK's CALL-th training forward pass first sets
  one weight to NaN (a replica gone bad).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from cloudburst.models import MLP
from tests.support import REPO, cli_env, free_port, rank_records, read_summary

RECORD_ENV = "CLOUDBURST_TEST_RECORD"
POISON_ENV = "CLOUDBURST_TEST_POISON"
QUIET = ("--dataset", "synthetic", "--model", "mlp", "--batch-size", "16", "--no-progress")


class _PoisonedMLP(MLP):
    def __init__(self, input_length: int, num_classes: int, at_call: int):
        super().__init__(input_length, num_classes)
        self.at_call, self.calls = at_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at_call:
                with torch.no_grad():
                    self.net[0].weight[0, 0] = math.nan
        return super().forward(x)


def mlp(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    rank = os.environ.get("RANK")
    if rank is not None and os.environ.get(RECORD_ENV):
        _record_device_emulation(Path(os.environ[RECORD_ENV]) / f"rank{rank}.jsonl")
    poison = os.environ.get(POISON_ENV)
    if rank is not None and poison:
        target, call = (int(v) for v in poison.split(":"))
        if int(rank) == target:
            return _PoisonedMLP(math.prod(input_shape), num_classes, call)
    return MLP(math.prod(input_shape), num_classes)


def _record_device_emulation(path: Path) -> None:
    from cloudburst.comm.device_emulation import DeviceEmulator

    # The loop's hook (fails loudly if it is renamed): DeviceEmulator.end_step, once a step.
    end_step = DeviceEmulator.end_step
    if getattr(end_step, "recording", False):  # the model is built more than once
        return

    def recording(self, busy_s: float) -> float:
        slept = end_step(self, busy_s)
        plan = self.last
        record = {"min_step_time_s": self.min_step_time_s, "factor": self.factor}
        record |= {"hooks_s": plan.slept_s, "compute_s": plan.compute_s}
        record |= {k: getattr(plan, k) for k in ("remainder_s", "debt_before_s", "debt_after_s")}
        with path.open("a") as f:  # a whole line per write: readable while the rank runs
            f.write(json.dumps(record) + "\n")
        return slept

    recording.recording = True
    path.parent.mkdir(parents=True, exist_ok=True)
    DeviceEmulator.end_step = recording


# ---------------------------------------------------------------------------- processes
LAUNCH_ENV = "CLOUDBURST_TEST_LAUNCH"  # a token in every process a test starts: to kill them


def start_marked(cmd: list[str], log: Path, token: str, env: dict[str, str] | None = None):
    """``cmd`` in the background, its output in ``log``, ``token`` in its environment."""
    env = cli_env({**(env or {}), LAUNCH_ENV: token})
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
        )


def kill_marked(token: str) -> None:
    """SIGKILL every process that carries ``token``: the launchers and their ranks (torchrun
    starts each rank in a session of its own, so a process group would not reach them)."""
    needle = f"{LAUNCH_ENV}={token}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # gone, or not ours to read


GRACE_S = 20  # how long the other launch may take to fail after one did


def launch_pair(
    args: list[str], logs_dir: Path, master_addr="127.0.0.1", prefixes=([], []), node_env=({}, {})
) -> None:
    """Two torchrun launches of ``cloudburst train ARGS``, 2 ranks each, node 0 and node 1 of a
    static rendezvous at ``master_addr`` (each command behind its prefix, e.g. ``ip netns exec
    NS``); both must succeed. When one fails, the other gets GRACE_S to fail too (a static
    rendezvous does not tell the other node), then is killed; everything is killed after
    180 s and, in any case, on the way out."""
    port, token = free_port(), os.urandom(16).hex()
    logs_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], [logs_dir / f"node{node}.log" for node in range(2)]
    deadline, failed_at = time.monotonic() + 180, None
    try:
        for node in range(2):
            torchrun = f"""-m torch.distributed.run --nnodes 2 --node-rank {node}
                --nproc-per-node 2 --rdzv-backend static --master-addr {master_addr}
                --master-port {port}""".split()
            cmd = [*prefixes[node], sys.executable, *torchrun, "-m", "cloudburst", "train", *args]
            procs.append(start_marked(cmd, logs[node], token, node_env[node]))
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > GRACE_S):
                kill_marked(token)
                assert now <= deadline, "the launches did not finish in 180 s:\n" + "\n".join(
                    log.read_text() for log in logs
                )
            time.sleep(0.1)
    finally:
        kill_marked(token)
        for p in procs:
            p.wait(timeout=30)
    assert all(p.returncode == 0 for p in procs), "\n".join(
        f"--- node {i} exit {p.returncode}:\n{log.read_text()}"
        for i, (p, log) in enumerate(zip(procs, logs, strict=True))
    )


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (every process a CLI started in its own session)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


# ---------------------------------------------------------------------------- two namespaces
@dataclass(frozen=True)
class NetnsPair:
    """Two network namespaces joined by a veth pair: one per emulated node."""

    names: tuple[str, str]
    ifnames: tuple[str, str]
    addrs: tuple[str, str]

    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[node]]

    def veth_bytes(self, node: int) -> int:
        """Bytes sent plus received on this node's end of the veth pair."""
        proc = ip("-j", "-s", "-n", self.names[node], "link", "show", "dev", self.ifnames[node])
        stats = json.loads(proc.stdout)[0]["stats64"]
        return stats["tx"]["bytes"] + stats["rx"]["bytes"]


# Run in node 1's namespace: python and torchrun start there, and node 0's address answers
# through the veth (a refused connection to a closed port is an answer).
UNREACHABLE = 3
_REACH_PROBE = f"""
import socket, sys, time
import torch.distributed.run
deadline = time.monotonic() + 15  # a veth may take a moment to get its carrier
while True:
    try:
        socket.create_connection((sys.argv[1], 9), timeout=5).close()
        break
    except ConnectionRefusedError:
        break
    except OSError as e:
        if time.monotonic() > deadline:
            print(e, file=sys.stderr)
            sys.exit({UNREACHABLE})
        time.sleep(0.2)
"""


@contextlib.contextmanager
def two_namespaces():
    """Two network namespaces joined by a veth pair (a :class:`NetnsPair`), deleted on the way
    out; None where they cannot be made here (no root, no ``ip netns``, or python cannot start
    in one)."""
    base = f"cbtest-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    subnet = f"10.213.{random.randrange(256)}"  # private, and only inside the namespaces
    pair = NetnsPair(
        (f"{base}-a", f"{base}-b"), ("cbveth0", "cbveth1"), (f"{subnet}.1", f"{subnet}.2")
    )
    a, b = pair.names
    root = os.geteuid() == 0 and shutil.which("ip") is not None
    if not root or ip("netns", "add", a, check=False).returncode:
        yield None
        return
    try:
        ip("netns", "add", b)
        # Both ends are made inside their namespaces: nothing appears in the host's.
        a_if, b_if = pair.ifnames
        ip("link", "add", a_if, "netns", a, "type", "veth", "peer", "name", b_if, "netns", b)
        for ns, ifname, addr in zip(pair.names, pair.ifnames, pair.addrs, strict=True):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", ifname, "up")
        cmd = [*pair.exec_prefix(1), sys.executable, "-c", _REACH_PROBE, pair.addrs[0]]
        probe = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if probe.returncode == UNREACHABLE:
            raise AssertionError(f"the veth pair does not connect: {probe.stderr[-500:]}")
        yield pair if probe.returncode == 0 else None
    finally:
        for ns in pair.names:  # the veth pair goes with them
            ip("netns", "del", ns, check=False)


# ---------------------------------------------------------------------------- a restarted shard
def check_shard_restarted(out: Path) -> tuple[dict, list[dict], int, list[dict]]:
    """Shard 1 (rank 1), SIGKILLed once, was restarted in place from a checkpoint, and the
    workers (ranks 2 and 3) reconnected to it unrestarted, each telling it the last version
    it saw acknowledged: ``pushes_lost`` is the highest of those minus the version restored.
    Returns the summary, shard 1's records, the version restored and its pushes since."""
    summary = read_summary(out)
    assert "failed" not in summary and summary["lost_workers"] == []
    assert (summary["shard_restarts"], summary["shard_failovers"]) == (1, 0)
    shard = rank_records(out, 1)
    starts = [r for r in shard if r["event"] == "start"]
    assert len(starts) == 2  # the killed shard and its restart
    [resume] = [r for r in shard if r["event"] == "resume"]
    restored = resume["version"]
    assert restored > 0 and restored % 10 == 0  # a checkpoint's version
    acked = []
    for rank in (2, 3):  # one start each, no resume, one reconnection each
        records = rank_records(out, rank)
        assert [r["event"] for r in records].count("start") == 1
        assert not any(r["event"] == "resume" for r in records)
        reconnected = [x for r in records for x in r.get("shard_reconnected", [])]
        assert [(x["shard"], x["restart"], x["version"]) for x in reconnected] == [(1, 1, restored)]
        acked.append(reconnected[0]["acked"])
    assert summary["pushes_lost"] == max(acked) - restored >= 0  # > 0 unless killed at a checkpoint
    after = [r for r in shard[shard.index(starts[1]) :] if r["event"] == "push"]
    assert after[-1]["version"] == restored + len(after)  # each push since, one version
    return summary, shard, restored, after
