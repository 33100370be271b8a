"""DASO across real node boundaries: two torchrun launches (in two network namespaces joined
by a veth pair; on 127.0.0.1 where namespaces cannot be made), ``--nodes`` in one launch, and a
``--nodes`` that disagrees.

Each rank of the torchrun runs builds its model through :func:`dumping_mlp` (a
``--model package.module:function`` factory), which saves that rank's final parameters when
the process exits, so that the test can check that every rank ends with the same θ.
"""

from __future__ import annotations

import atexit
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

import pytest
import torch

from cloudburst.models import MLP, build_model
from tests.helpers import REPO, cli, cli_env, free_port, rank_events, read_summary, saved_state

pytestmark = pytest.mark.e2e

PARAMS_DIR_ENV = "CLOUDBURST_TEST_PARAMS_DIR"
MODEL = f"{__name__}:dumping_mlp"

# 640 samples over 4 workers, 16 a batch: 10 steps an epoch, 40 steps = 4 epochs: one of
# warm-up (a blocking sync every step), then three cycling (a sync every B = 2 steps, merged
# S = 1 step later), and no cool-down, so that only finish()'s last blocking sync makes the
# nodes agree at the end. --daso-fixed keeps B and S as they are, although the plateau rule
# asked for here (a 99 % better loss every epoch) would shrink them every cycling epoch, and
# it has no epoch-loss all-reduce to run. The node-local gradient all-reduce runs every
# second step (--daso-local-skip 2), and blocking averages travel in fp16.
STEPS, STEPS_PER_EPOCH, GLOBAL_SKIP, LOCAL_SKIP = 40, 10, 2, 2
WARMUP_STEPS = STEPS_PER_EPOCH
EXPECTED_SYNCS = WARMUP_STEPS + (STEPS - WARMUP_STEPS) // GLOBAL_SKIP + 1
# The exact counts below assume every sync in 16 bits and no epoch-end averages.
DASO_ARGS = f"""--strategy daso --workers 4 --dataset synthetic --train-size 640 --test-size 200
--steps {STEPS} --batch-size 16 --no-progress --eval-every-s 1000 --daso-warmup-epochs 1
--daso-cooldown-epochs 0 --daso-fixed --daso-stability-level 0.99 --daso-patience 1
--daso-global-skip {GLOBAL_SKIP} --daso-batches-to-wait 1 --daso-local-skip {LOCAL_SKIP}
--daso-downcast fp16 --comm-timeout-s 60 --daso-cycling-downcast bf16 --daso-no-epoch-end-sync
""".split()
LAUNCH_TIMEOUT_S = 120
GRACE_S = 20  # how long the other launch may take to fail after one did


# ---------------------------------------------------------------------------- the model
_trained: list[torch.nn.Module] = []


def dumping_mlp(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """cloudburst's MLP; under torchrun with $CLOUDBURST_TEST_PARAMS_DIR set, the rank saves
    the last one it built (the trained one: preflight builds one first) when it exits."""
    model = MLP(math.prod(input_shape), num_classes)
    out = os.environ.get(PARAMS_DIR_ENV)
    if out and "RANK" in os.environ:
        if not _trained:
            atexit.register(_save_params, Path(out) / f"params_rank{os.environ['RANK']}.pt")
        _trained[:] = [model]
    return model


def _save_params(path: Path) -> None:
    state = {k: v.detach().cpu().clone() for k, v in _trained[0].state_dict().items()}
    torch.save(state, path)


# ---------------------------------------------------------------------------- launching
LAUNCH_ENV = "CLOUDBURST_TEST_LAUNCH"  # a token in every process a test starts: to kill them


def _start(
    cmd: list[str], log: Path, token: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cli_env({**(env or {}), LAUNCH_ENV: token}),
        )


def _kill_marked(token: str) -> None:
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


def _wait_all(
    procs: list[subprocess.Popen], logs: list[Path], token: str, timeout_s: float
) -> list[tuple[int, str]]:
    """Wait for every launch; (exit code, output) of each. When one fails, the others get
    GRACE_S to fail too (a static rendezvous does not tell the other node), then are killed;
    everything is killed at ``timeout_s`` and, in any case, on the way out."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > GRACE_S):
                _kill_marked(token)
                if now > deadline:
                    raise AssertionError(
                        f"the launches did not finish in {timeout_s} s:\n"
                        + "\n".join(log.read_text() for log in logs)
                    )
            time.sleep(0.1)
    finally:
        _kill_marked(token)
        for p in procs:
            p.wait(timeout=30)
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs, strict=True)]


def _launch_pair(
    args: list[str],
    logs_dir: Path,
    *,
    master_addr: str = "127.0.0.1",
    prefixes: tuple[list[str], list[str]] = ([], []),
    node_env: tuple[dict[str, str], dict[str, str]] = ({}, {}),
    timeout_s: float = LAUNCH_TIMEOUT_S,
) -> list[tuple[int, str]]:
    """Two torchrun launches of 2 ranks each, node 0 and node 1 of a static rendezvous at
    ``master_addr`` (each command behind its prefix, e.g. ``ip netns exec NS``); returns
    (exit code, output) of each."""
    port, token = free_port(), uuid.uuid4().hex
    logs_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for node in range(2):
        torchrun = f"""-m torch.distributed.run --nnodes 2 --node-rank {node} --nproc-per-node 2
            --rdzv-backend static --master-addr {master_addr} --master-port {port}""".split()
        cmd = [*prefixes[node], sys.executable, *torchrun, "-m", "cloudburst", "train", *args]
        logs.append(logs_dir / f"node{node}.log")
        procs.append(_start(cmd, logs[-1], token, node_env[node]))
    return _wait_all(procs, logs, token, timeout_s)


def _assert_ok(results: list[tuple[int, str]]) -> None:
    assert all(rc == 0 for rc, _ in results), "\n".join(
        f"--- node {i} exit {rc}:\n{out}" for i, (rc, out) in enumerate(results)
    )


# ---------------------------------------------------------------------------- checks
def _finals(out: Path, world: int) -> list[dict]:
    finals = []
    for rank in range(world):
        final = rank_events(out, rank, "final")
        assert len(final) == 1, f"rank {rank}: {len(final)} final records"
        finals.append(final[0])
    return finals


def _numel(out: Path) -> int:
    return sum(t.numel() for t in saved_state(out).values())


def _check_daso_accounting(out: Path, nodes: int = 2, per_node: int = 2) -> dict:
    """The summary's topology and bytes, and the rotation of global syncs over local ranks,
    exactly from the logged counts; returns the summary."""
    s = read_summary(out)
    world = nodes * per_node
    assert s["strategy"] == "daso" and s["lost_workers"] == []
    assert s["nodes"] == nodes and s["workers"] == world
    assert s["inter_node_bytes"] > 0 and s["intra_node_bytes"] > 0
    finals = _finals(out, world)
    # Every rank counts every global sync alike (that is the rotation): the same log.
    logs = [f["sync_log"] for f in finals]
    assert all(log == logs[0] for log in logs)
    assert all(f["global_syncs"] == EXPECTED_SYNCS == len(logs[0]) for f in finals)
    assert finals[0]["phase_steps"] == {
        "warmup": WARMUP_STEPS,
        "cycling": STEPS - WARMUP_STEPS,
        "cooldown": 0,
    }
    assert [entry[:2] for entry in logs[0][:WARMUP_STEPS]] == [
        [step, "warmup"] for step in range(1, WARMUP_STEPS + 1)
    ]
    cycling = [(step, b, wait) for step, phase, b, wait in logs[0][WARMUP_STEPS:-1]]
    assert [step for step, _, _ in cycling] == list(
        range(WARMUP_STEPS + GLOBAL_SKIP, STEPS + 1, GLOBAL_SKIP)
    )
    assert {(b, wait) for _, b, wait in cycling} == {(GLOBAL_SKIP, 1)}
    assert logs[0][-1][0] == STEPS and logs[0][-1][3] == 0  # finish(): blocking, after the end
    # Rank r (local rank r % per_node) sent the k-th sync iff k % per_node == its local rank:
    # its global_bytes are that many 16-bit copies of θ.
    numel = _numel(out)
    for rank, f in enumerate(finals):
        local = rank % per_node
        sent = sum(1 for k in range(EXPECTED_SYNCS) if k % per_node == local)
        assert f["global_bytes"] == sent * numel * 2, f"rank {rank}"
    assert sum(f["global_bytes"] for f in finals) == nodes * EXPECTED_SYNCS * numel * 2
    # What crosses nodes: each sender's ring all-reduce over the nodes, nothing else (a
    # fixed schedule has no epoch-loss all-reduce).
    ring = 2 * (nodes - 1) / nodes
    assert s["inter_node_bytes"] == int(ring * sum(f["global_bytes"] for f in finals))
    # What stays in a node: the gradient all-reduce every LOCAL_SKIP-th step (a ring of 2
    # ranks sends all of the gradient: |θ|·4 bytes), and the merged θ (fp32) that the sender
    # of each sync broadcasts to its node.
    for rank, f in enumerate(finals):
        sent = sum(1 for k in range(EXPECTED_SYNCS) if k % per_node == rank % per_node)
        local_syncs = STEPS // LOCAL_SKIP
        assert f["intra_node_bytes"] == (local_syncs + sent) * numel * 4, f"rank {rank}"
        assert f["schedule"]["adaptive"] is False
        assert (f["final_B"], f["final_S"]) == (GLOBAL_SKIP, 1)
    # The last average is (the fp16 sum of the 2 nodes' θ) / 2: 2θ is an fp16 number.
    theta2 = torch.cat([2 * v.reshape(-1) for v in saved_state(out).values()])
    assert torch.equal(theta2.half().float(), theta2)
    return s


def _check_same_params_everywhere(out: Path, params_dir: Path, world: int = 4) -> None:
    """Every rank ends with rank 0's θ, the θ of model.pt: finish()'s blocking average (the
    last steps are cycling, so the nodes disagree until then); and training moved it."""
    states = [
        torch.load(params_dir / f"params_rank{r}.pt", map_location="cpu", weights_only=True)
        for r in range(world)
    ]
    saved = saved_state(out)
    in_dim, classes = saved["net.0.weight"].shape[1], saved["net.4.weight"].shape[0]
    seed = read_summary(out)["config"]["seed"]
    initial = build_model("mlp", (in_dim,), classes, seed).state_dict()
    for name, value in saved.items():
        for r, state in enumerate(states):
            assert torch.equal(state[name], value), f"rank {r} differs from model.pt in {name}"
    moved = max((saved[k] - initial[k]).abs().max().item() for k in saved)
    assert moved > 1e-3, "the parameters did not train"


# ---------------------------------------------------------------------------- tests
# ---------------------------------------------------------------------------- two namespaces
_NETNS_PASSED = False  # set by the two-namespace test once it passed (this test process)


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
        proc = _ip("-j", "-s", "-n", self.names[node], "link", "show", "dev", self.ifnames[node])
        stats = json.loads(proc.stdout)[0]["stats64"]
        return stats["tx"]["bytes"] + stats["rx"]["bytes"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


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


@pytest.fixture
def netns_pair():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2) here")
    base = f"cbtest-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    probe = _ip("netns", "add", f"{base}-probe", check=False)
    if probe.returncode != 0:
        pytest.skip(f"`ip netns add` does not work here: {probe.stderr.strip()}")
    _ip("netns", "del", f"{base}-probe", check=False)
    subnet = f"10.213.{random.randrange(256)}"  # private, and only inside the namespaces
    pair = NetnsPair(
        (f"{base}-a", f"{base}-b"), ("cbveth0", "cbveth1"), (f"{subnet}.1", f"{subnet}.2")
    )
    a, b = pair.names
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        # Both ends are made inside their namespaces: nothing appears in the host's.
        veth = (
            f"link add {pair.ifnames[0]} netns {a} type veth peer name {pair.ifnames[1]} netns {b}"
        )
        _ip(*veth.split())
        for ns, ifname, addr in zip(pair.names, pair.ifnames, pair.addrs, strict=True):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", ifname, "up")
        probe = subprocess.run(
            [*pair.exec_prefix(1), sys.executable, "-c", _REACH_PROBE, pair.addrs[0]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if probe.returncode == UNREACHABLE:
            pytest.fail(f"the veth pair does not connect the namespaces: {probe.stderr[-500:]}")
        if probe.returncode != 0:
            pytest.skip(f"python/torch cannot start in a network namespace: {probe.stderr[-500:]}")
        yield pair
    finally:
        for ns in pair.names:  # the veth pair goes with them
            _ip("netns", "del", ns, check=False)


def test_daso_over_two_network_namespaces(tmp_path, netns_pair):
    """Each node in its own network namespace: node 1 reaches node 0 only through the veth
    pair, so the rendezvous store and the global all-reduces must use node 0's veth address."""
    out, params = tmp_path / "run", tmp_path / "params"
    params.mkdir()
    veth_before = netns_pair.veth_bytes(0)
    results = _launch_pair(
        [*DASO_ARGS, "--model", MODEL, "--out", str(out)],
        tmp_path / "logs",
        master_addr=netns_pair.addrs[0],
        prefixes=(netns_pair.exec_prefix(0), netns_pair.exec_prefix(1)),
        # This machine's hostname resolves to 127.0.0.1, where gloo would listen; across
        # namespaces each node would dial its own loopback. The runtime must pick the veth
        # (the interface of the route to the master) by itself: no GLOO_SOCKET_IFNAME here.
        node_env=tuple({PARAMS_DIR_ENV: str(params)} for _ in netns_pair.ifnames),
    )
    _assert_ok(results)
    s = _check_daso_accounting(out)
    _check_same_params_everywhere(out, params)
    # The global syncs went over the veth: it carried at least what crossed nodes.
    assert netns_pair.veth_bytes(0) - veth_before >= s["inter_node_bytes"]
    global _NETNS_PASSED
    _NETNS_PASSED = True


def test_daso_over_two_torchrun_launches_on_localhost(tmp_path):
    """The pair of launches on 127.0.0.1, where the two-namespace test above could not run
    (no root, no ``ip netns``): that one runs the same job and checks, with an address per
    node. (Two launches on 127.0.0.1 of asgd: tests/e2e/test_faults_and_torchrun.py.)"""
    if _NETNS_PASSED:
        pytest.skip("the same DASO pair ran in two network namespaces above")
    out, params = tmp_path / "run", tmp_path / "params"
    params.mkdir()
    _assert_ok(
        _launch_pair(
            [*DASO_ARGS, "--model", MODEL, "--out", str(out)],
            tmp_path / "logs",
            node_env=({PARAMS_DIR_ENV: str(params)},) * 2,
        )
    )
    _check_daso_accounting(out)
    _check_same_params_everywhere(out, params)


# ---------------------------------------------------------------------------- --nodes
def test_nodes_flag_in_one_launch_gives_the_same_topology(tmp_path):
    """``--nodes 2`` groups one launch's 4 ranks into 2 emulated nodes of 2: the same
    accounting, rotation and bytes as the two torchrun launches."""
    out, token = tmp_path / "run", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "cloudburst", "train", *DASO_ARGS, "--nodes", "2"]
    cmd += ["--model", "mlp", "--out", str(out)]
    log = tmp_path / "train.log"
    [(rc, output)] = _wait_all([_start(cmd, log, token)], [log], token, LAUNCH_TIMEOUT_S)
    assert rc == 0, output
    _check_daso_accounting(out)


def test_nodes_flag_that_disagrees_with_torchrun_fails_clearly(tmp_path):
    """Each rank refuses before it joins the job, in one line. The ranks are given the
    environment torchrun gives 4 ranks started as 2 nodes of 2 (``LOCAL_WORLD_SIZE`` 2 of
    ``WORLD_SIZE`` 4, what :func:`cloudburst.runtime.placement.launched_nodes` reads); the two real
    launches above show that torchrun sets it so."""
    out = tmp_path / "run"
    expected = (
        "cloudburst: invalid config: nodes: the config says 4 nodes, but torchrun "
        "started 2 nodes of 2 ranks each; drop --nodes or make them agree"
    )
    for rank in (0, 3):  # rank 0 also prepares the run directory first
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4"}
        env |= {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2)}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        args = [*DASO_ARGS, "--nodes", "4", "--model", "mlp", "--out", str(out)]
        proc = cli("train", *args, env=env, check=False, timeout_s=LAUNCH_TIMEOUT_S)
        assert proc.returncode != 0, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == expected, proc.stderr
        assert "Traceback" not in proc.stderr and "init_distributed" not in proc.stderr
    assert not (out / "summary.json").exists()
