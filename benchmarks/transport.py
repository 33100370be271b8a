"""Parameter-server transport throughput: raw gloo vs cloudburst asgd vs a torch RPC server.

What is measured: one worker (rank 1) and one server (rank 0) on 127.0.0.1, ``--numel`` fp32
parameters (default 10M, 40 MB). One *round trip* moves the parameter vector both ways: the
worker pushes ``numel`` floats and gets ``numel`` floats back. Throughput is payload bytes moved
(``2 * numel * 4`` per round trip, headers not counted) divided by the worker's wall time for
``--iters`` timed round trips, after ``--warmup`` untimed ones. Variants:

- ``raw``: ``dist.send`` / ``dist.recv`` of preallocated tensors on the gloo group (the floor
  any gloo-based transport pays);
- ``asgd``: cloudburst's real code path: rank 0 runs :class:`cloudburst.server.ServerLoop`
  for a 10M-float shard, rank 1 drives :class:`cloudburst.strategies.asgd.AsgdStrategy`
  (``start``, then ``_round(push=True, fetch=True)``, i.e. one PUSH_FETCH, then ``finish``) on a
  module holding one 10M-element parameter. Set-up and tear-down are not timed;
- ``rpc``: a ``torch.distributed.rpc`` parameter server of the PyTorch tutorial's design (a
  ``ParameterServer`` object on rank 0 held through an RRef; the worker calls
  ``rpc_sync(ps_rref.owner(), ParameterServer.push_and_fetch, args=(ps_rref, delta))``, which
  adds the update and returns the parameters), TensorPipe backend with its default transports;
- ``lean`` (a reference, *not* package code, no target): the same messages as ``asgd``
  (cloudburst's ``PeerTransport`` and ``Header``: header + payload each way) with the buffers
  allocated once and the update applied in place, i.e. what the asgd path costs once it stops
  allocating 40 MB tensors every round. It shows which part of the asgd/raw gap is fixable.

Both processes live for the whole run (``torch.multiprocessing.spawn``, OMP_NUM_THREADS=1) and
run the variants round-robin: in repetition ``r`` the order is rotated by ``r``, a barrier
separates variants. The median over repetitions is reported, with every repetition listed.

After the timed repetitions, one more asgd session runs *instrumented*: functions that the
worker's ``_round`` and the server's request handler call are wrapped (in this process only, by
rebinding names; the package is not edited) with ``time.perf_counter`` probes, and a few
single-process micro-measurements (allocation + first touch of a 40 MB buffer, the flatten
copies, ``isfinite``) explain where an asgd round trip spends its time beyond raw gloo.

    .venv/bin/python benchmarks/transport.py [--out benchmarks/results/transport.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

import cloudburst.comm.p2p as p2p_mod  # noqa: E402
import cloudburst.strategies.asgd as asgd_mod  # noqa: E402
from cloudburst.comm.flat import flatten_params  # noqa: E402
from cloudburst.config import RunConfig  # noqa: E402
from cloudburst.launch import free_port  # noqa: E402
from cloudburst.metrics import MetricsWriter  # noqa: E402
from cloudburst.runtime import Context, LivenessMonitor  # noqa: E402
from cloudburst.server import ServerLoop  # noqa: E402
from cloudburst.strategies.asgd import AsgdStrategy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402

VARIANTS = ("raw", "asgd", "rpc", "lean")
SERVER, WORKER = 0, 1
TARGET_VS_RAW = 0.8  # asgd / raw, at least
TARGET_VS_RPC = 2.0  # asgd / rpc, at least


@dataclass
class Settings:
    numel: int
    reps: int
    iters: int
    warmup: int
    profile_rounds: int
    rpc_threads: int
    store_port: int
    rpc_port: int
    workdir: str


# ---------------------------------------------------------------------------- variants
class FlatParams(nn.Module):
    """A model whose parameters are one vector of ``numel`` floats."""

    def __init__(self, numel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))


def run_raw(rank: int, s: Settings, bufs: dict[str, torch.Tensor]) -> float | None:
    """Rank 1 sends ``numel`` floats, rank 0 receives them and sends ``numel`` floats back."""
    send_buf, recv_buf = bufs["send"], bufs["recv"]
    if rank == SERVER:
        for _ in range(s.warmup + s.iters):
            dist.recv(recv_buf, src=WORKER)
            dist.send(send_buf, dst=WORKER)
        return None
    t0 = 0.0
    for i in range(s.warmup + s.iters):
        if i == s.warmup:
            t0 = time.perf_counter()
        dist.send(send_buf, dst=SERVER)
        dist.recv(recv_buf, src=SERVER)
    return time.perf_counter() - t0


def run_asgd(rank: int, s: Settings, ctx: Context, iters: int) -> float | None:
    """One complete asgd session: ServerLoop on rank 0, AsgdStrategy on rank 1.

    Only the ``iters`` PUSH_FETCH round trips after ``s.warmup`` warm-up ones are timed.
    """
    model = FlatParams(s.numel)
    if rank == SERVER:
        metrics = MetricsWriter(ctx.cfg.out, rank, "server")
        try:
            liveness = LivenessMonitor(ctx.store, ctx.worker_ranks, ctx.cfg.heartbeat_timeout_s)
            loop = ServerLoop(ctx, flatten_params(model), metrics, liveness)
            if _PROBE is not None:
                _PROBE.instrument_server(loop)
            loop.run()
        finally:
            metrics.close()
        return None
    strategy = AsgdStrategy(ctx)
    strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    strategy.start()
    for _ in range(s.warmup):
        strategy._round(push=True, fetch=True)
    if _PROBE is not None:
        _PROBE.instrument_worker(strategy)
    t0 = time.perf_counter()
    for _ in range(iters):
        strategy._round(push=True, fetch=True)
    elapsed = time.perf_counter() - t0
    if _PROBE is not None:
        _PROBE.restore()
    strategy.finish()
    return elapsed


class ParameterServer:
    """The tutorial's parameter server: state on one rank, updated under a lock."""

    def __init__(self, numel: int):
        self.theta = torch.zeros(numel)
        self.lock = threading.Lock()

    @staticmethod
    def push_and_fetch(ps_rref: rpc.RRef, delta: torch.Tensor) -> torch.Tensor:
        self = ps_rref.local_value()
        with self.lock:
            self.theta.add_(delta)
            # Returned without a copy: the cheapest choice for the RPC variant.
            return self.theta


def run_rpc(rank: int, s: Settings, state: dict[str, Any]) -> float | None:
    if rank == SERVER:
        return None  # served by the RPC agent's threads while rank 0 waits at the barrier
    ps_rref, delta = state["ps_rref"], state["delta"]
    t0 = 0.0
    for i in range(s.warmup + s.iters):
        if i == s.warmup:
            t0 = time.perf_counter()
        theta = rpc.rpc_sync(ps_rref.owner(), ParameterServer.push_and_fetch, args=(ps_rref, delta))
        assert theta.numel() == s.numel
    return time.perf_counter() - t0


def run_lean(rank: int, s: Settings, bufs: dict[str, torch.Tensor]) -> float | None:
    """asgd's messages over ``PeerTransport`` with buffers allocated once (see the docstring)."""
    transport = p2p_mod.PeerTransport()
    if rank == SERVER:
        theta, payload = bufs["theta"], bufs["payload"]
        for _ in range(s.warmup + s.iters):
            src, header = transport.recv_request_any()
            assert header is not None and header.kind == p2p_mod.Kind.PUSH_FETCH
            dist.recv(payload, src=src, tag=p2p_mod.TAG_REQUEST_PAYLOAD)
            # Exact finiteness test: a NaN/inf element makes the sum non-finite; a non-finite
            # sum of finite elements (overflow) is told apart by the slow test.
            if not math.isfinite(payload.sum().item()) and not bool(payload.isfinite().all()):
                raise RuntimeError("non-finite push")
            theta.add_(payload)
            reply = p2p_mod.Header(p2p_mod.Kind.REPLY, version=header.version + 1, numel=s.numel)
            transport.send(src, reply, theta)
        return None
    param, reference = bufs["param"], bufs["reference"]
    delta, fetched = bufs["delta"], bufs["fetched"]
    version = 0
    t0 = 0.0
    for i in range(s.warmup + s.iters):
        if i == s.warmup:
            t0 = time.perf_counter()
        torch.sub(param, reference, out=delta)
        header = p2p_mod.Header(p2p_mod.Kind.PUSH_FETCH, version=version, numel=s.numel)
        transport.send(SERVER, header, delta)
        version = transport.recv_reply(SERVER, fetched).version
        param.copy_(fetched)
        reference, fetched = fetched, reference  # the fetched θ is the new reference: no copy
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- instrumentation
class Probe:
    """Accumulates wall time per label within a round; ``end_round`` closes a round."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, float]] = []
        self._current: dict[str, float] = defaultdict(float)
        self._restore: list[tuple[object, str, object]] = []

    @contextlib.contextmanager
    def time(self, label: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._current[label] += time.perf_counter() - t0

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.time(label):
                return fn(*args, **kwargs)

        return timed

    def patch(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)
        self._restore.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, self.wrap(label, original))

    def end_round(self) -> None:
        if self._current:
            self.rounds.append(dict(self._current))
        self._current = defaultdict(float)

    def restore(self) -> None:
        for owner, name, original in reversed(self._restore):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore.clear()

    # -- what is wrapped on each side
    def instrument_worker(self, strategy: AsgdStrategy) -> None:
        round_fn = strategy._round

        def timed_round(push: bool, fetch: bool) -> None:
            with self.time("worker: AsgdStrategy._round, total"):
                round_fn(push, fetch)
            self.end_round()

        self._restore.append((strategy, "_round", _MISSING))
        strategy._round = timed_round
        self.patch(asgd_mod, "flatten_params", "worker: flatten_params(model)")
        self.patch(asgd_mod, "assign_flat", "worker: assign_flat(model, fetched)")
        self.patch(strategy.transport, "send", "worker: PeerTransport.send (header+payload)")
        self.patch(strategy.transport, "recv_reply", "worker: PeerTransport.recv_reply")
        self._patch_dist("worker")

    def instrument_server(self, loop: ServerLoop) -> None:
        handle = loop._handle

        def timed_handle(src: int, header: p2p_mod.Header) -> None:
            with self.time("server: ServerLoop._handle, total"):
                handle(src, header)
            if header.kind == p2p_mod.Kind.PUSH_FETCH:
                self.end_round()

        self._restore.append((loop, "_handle", _MISSING))
        loop._handle = timed_handle
        self.patch(loop.transport, "recv_request_any", "server: recv_request_any (idle+header)")
        self.patch(loop.transport, "recv_payload", "server: PeerTransport.recv_payload")
        self.patch(loop.shard, "apply_push", "server: ShardState.apply_push")
        self.patch(loop.metrics, "log", "server: metrics.log('push')")
        self.patch(loop.transport, "send", "server: PeerTransport.send (reply+theta)")
        self._patch_dist("server")

    def _patch_dist(self, side: str) -> None:
        probe = self

        class TimedDist:
            """Stands in for ``torch.distributed`` inside cloudburst.comm.p2p."""

            def __getattr__(self, name: str) -> Any:
                return getattr(dist, name)

            @staticmethod
            def send(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
                what = "payload" if tensor.numel() > p2p_mod.HEADER_LEN else "header"
                with probe.time(f"{side}:   dist.send {what}"):
                    return dist.send(tensor, *args, **kwargs)

            @staticmethod
            def recv(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> int:
                what = "payload" if tensor.numel() > p2p_mod.HEADER_LEN else "header"
                with probe.time(f"{side}:   dist.recv {what}"):
                    return dist.recv(tensor, *args, **kwargs)

        self._restore.append((p2p_mod, "dist", p2p_mod.dist))
        p2p_mod.dist = TimedDist()

    def medians_ms(self) -> dict[str, float]:
        labels = sorted({k for r in self.rounds for k in r})
        return {k: 1e3 * benchutil.median([r.get(k, 0.0) for r in self.rounds]) for k in labels}


_MISSING = object()
_PROBE: Probe | None = None


def micro_costs(numel: int, reps: int = 5) -> dict[str, float]:
    """Single-process costs (ms, median of ``reps``) of the operations an asgd round performs."""
    model = FlatParams(numel)
    with torch.no_grad():
        model.weight.normal_()
    reused = torch.empty(numel)
    reused.fill_(1.0)
    other = torch.ones(numel)
    mb = f"{numel * 4 / 1e6:.0f} MB"
    ops: dict[str, Callable[[], Any]] = {
        f"`torch.empty(numel)` + first write (fresh {mb})": lambda: torch.empty(numel).fill_(1.0),
        "write into a reused buffer (`fill_`)": lambda: reused.fill_(1.0),
        "copy into a reused buffer (`copy_`)": lambda: reused.copy_(other),
        "`parameters_to_vector(params)` (cat into a fresh tensor)": lambda: (
            torch.nn.utils.parameters_to_vector(model.parameters())
        ),
        "`flatten_params(model)` (cat + `.clone()`, both fresh)": lambda: flatten_params(model),
        "`a - b` (fresh result)": lambda: reused - other,
        "`torch.sub(a, b, out=reused)`": lambda: torch.sub(other, other, out=reused),
        "`torch.isfinite(x).all()`": lambda: bool(torch.isfinite(other).all()),
        "`math.isfinite(x.sum().item())`": lambda: math.isfinite(other.sum().item()),
        "`x.add_(y)`": lambda: reused.add_(other, alpha=1.0),
    }
    out = {}
    for name, fn in ops.items():
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * benchutil.median(times)
    return out


# ---------------------------------------------------------------------------- one rank
def rank_main(rank: int, s: Settings) -> None:
    global _PROBE
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, force=True)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", s.store_port, 2, is_master=rank == SERVER, timeout=timeout)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=2, timeout=timeout
    )
    cfg = RunConfig(
        strategy="asgd",
        workers=1,
        servers=1,
        dataset="synthetic",
        train_size=1000,
        test_size=100,
        steps=1,
        checkpoint_every=0,
        comm_timeout_s=120.0,
        out=str(Path(s.workdir) / "asgd"),
        progress=False,
    )
    ctx = Context(
        cfg=cfg,
        rank=rank,
        world_size=2,
        num_servers=1,
        num_workers=1,
        workers_group=None,
        store=dist.PrefixStore("cloudburst/bench/", store),
        t0=time.time(),
    )
    rpc.init_rpc(
        "server" if rank == SERVER else "worker",
        rank=rank,
        world_size=2,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{s.rpc_port}", num_worker_threads=s.rpc_threads
        ),
    )
    bufs = {"send": torch.ones(s.numel), "recv": torch.zeros(s.numel)}
    lean_bufs = (
        {"theta": torch.zeros(s.numel), "payload": torch.zeros(s.numel)}
        if rank == SERVER
        else {k: torch.zeros(s.numel) for k in ("param", "reference", "delta", "fetched")}
    )
    rpc_state: dict[str, Any] = {}
    if rank == WORKER:
        rpc_state["ps_rref"] = rpc.remote("server", ParameterServer, args=(s.numel,))
        rpc_state["delta"] = torch.zeros(s.numel)

    runners: dict[str, Callable[[], float | None]] = {
        "raw": lambda: run_raw(rank, s, bufs),
        "asgd": lambda: run_asgd(rank, s, ctx, s.iters),
        "rpc": lambda: run_rpc(rank, s, rpc_state),
        "lean": lambda: run_lean(rank, s, lean_bufs),
    }
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    orders = []
    for rep in range(s.reps):
        order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
        orders.append(list(order))
        for variant in order:
            dist.barrier()
            elapsed = runners[variant]()
            if elapsed is not None:
                seconds[variant].append(elapsed)

    # Instrumented asgd session (not part of the timings above).
    dist.barrier()
    _PROBE = Probe()
    run_asgd(rank, s, ctx, s.profile_rounds)
    _PROBE.restore()
    profile = _PROBE.medians_ms()
    dist.barrier()
    micro = micro_costs(s.numel) if rank == WORKER else {}
    dist.barrier()

    rpc.shutdown()
    result = {
        "rank": rank,
        "seconds": seconds,
        "orders": orders,
        "profile_ms": profile,
        "micro_ms": micro,
    }
    (Path(s.workdir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- report
PROBE_ORDER = (
    "worker: AsgdStrategy._round, total",
    "worker: flatten_params(model)",
    "worker: PeerTransport.send (header+payload)",
    "worker:   dist.send header",
    "worker:   dist.send payload",
    "worker: PeerTransport.recv_reply",
    "worker:   dist.recv header",
    "worker:   dist.recv payload",
    "worker: assign_flat(model, fetched)",
    "server: recv_request_any (idle+header)",
    "server:   dist.recv header",
    "server: ServerLoop._handle, total",
    "server: PeerTransport.recv_payload",
    "server:   dist.recv payload",
    "server: ShardState.apply_push",
    "server: metrics.log('push')",
    "server: PeerTransport.send (reply+theta)",
    "server:   dist.send header",
    "server:   dist.send payload",
)


def report(s: Settings, results: dict[int, dict[str, Any]]) -> list[str]:
    bytes_per_trip = 2 * s.numel * 4
    worker = results[WORKER]
    gbps = {v: [s.iters * bytes_per_trip / t / 1e9 for t in worker["seconds"][v]] for v in VARIANTS}
    ms = {v: [1e3 * t / s.iters for t in worker["seconds"][v]] for v in VARIANTS}
    med = {v: benchutil.median(gbps[v]) for v in VARIANTS}

    def ratio_row(a: str, b: str, target: float | None) -> list[str]:
        value = med[a] / med[b]
        per_rep = ", ".join(f"{x / y:.3f}" for x, y in zip(gbps[a], gbps[b], strict=True))
        if target is None:
            return [f"{a} / {b}", f"{value:.3f}", "(reference)", "-", per_rep]
        verdict = benchutil.verdict(value, target, higher_is_better=True)
        return [f"{a} / {b}", f"{value:.3f}", f">= {target}", verdict, per_rep]

    lines = [
        "# Transport throughput: raw gloo vs cloudburst asgd vs torch RPC parameter server",
        "",
        *benchutil.provenance_lines(),
        f"- settings: {s.numel:,} fp32 parameters ({s.numel * 4 / 1e6:.0f} MB) each way, "
        f"1 worker + 1 server on 127.0.0.1, {s.reps} repetitions x {s.iters} timed round trips "
        f"(after {s.warmup} warm-up) per variant, variants round-robin (order rotated per "
        f"repetition), RPC: TensorPipe default transports, {s.rpc_threads} worker threads",
        f"- bytes per round trip: {bytes_per_trip:,} (payload both ways; headers not counted); "
        "GB/s = 1e9 bytes/s",
        "- variants: `raw` = dist.send/recv of preallocated tensors; `asgd` = ServerLoop + "
        "AsgdStrategy._round(push=True, fetch=True); `rpc` = tutorial-style RPC parameter server; "
        "`lean` = asgd's messages (PeerTransport, Header) with buffers allocated once and the "
        "update in place -- benchmark code, not the package, shown for reference only",
        "",
        "## Results (median over repetitions)",
        "",
        *benchutil.table(
            ["variant", "median GB/s", "median ms / round trip", "all repetitions (GB/s)"],
            [
                [
                    v,
                    f"{med[v]:.3f}",
                    f"{benchutil.median(ms[v]):.1f}",
                    ", ".join(f"{x:.3f}" for x in gbps[v]),
                ]
                for v in VARIANTS
            ],
        ),
        "",
        "## Ratios (of the medians; per repetition alongside)",
        "",
        *benchutil.table(
            ["ratio", "value", "target", "verdict", "per repetition"],
            [
                ratio_row("asgd", "raw", TARGET_VS_RAW),
                ratio_row("asgd", "rpc", TARGET_VS_RPC),
                ratio_row("lean", "raw", None),
                ratio_row("lean", "rpc", None),
            ],
        ),
        "",
        "Order per repetition: " + "; ".join(" ".join(o) for o in worker["orders"]),
        "",
        f"## Where an asgd round trip goes ({s.profile_rounds} instrumented PUSH_FETCH rounds, "
        "median ms per round)",
        "",
        "A separate, untimed asgd session whose calls are wrapped with `time.perf_counter` probes "
        "(names rebound in the benchmark processes; the package is not edited). Wall time inside "
        "each wrapped call, per round; indented `dist.*` rows are inside the `PeerTransport` call "
        "above them. The worker's `recv_reply` includes waiting for the server (receiving the "
        "payload, apply_push, metrics, reply); the server's `recv_request_any` includes waiting "
        "for the worker's next request.",
        "",
    ]
    profile = {**results[WORKER]["profile_ms"], **results[SERVER]["profile_ms"]}
    labels = [k for k in PROBE_ORDER if k in profile] + sorted(set(profile) - set(PROBE_ORDER))
    lines += benchutil.table(
        ["probe", "ms / round"], [[f"`{k}`", f"{profile[k]:.2f}"] for k in labels]
    )
    raw_ms = benchutil.median(ms["raw"])
    w = results[WORKER]["profile_ms"]
    total = w.get("worker: AsgdStrategy._round, total", math.nan)
    accounted = sum(
        w.get(k, 0.0)
        for k in (
            "worker: flatten_params(model)",
            "worker: PeerTransport.send (header+payload)",
            "worker: PeerTransport.recv_reply",
            "worker: assign_flat(model, fetched)",
        )
    )
    lines += [
        "",
        f"Worker round total {total:.1f} ms vs raw gloo round trip {raw_ms:.1f} ms (median of the "
        f"timed repetitions). Inside `_round` but outside the probes (`delta = flat - reference`, "
        f"`torch.empty(self.numel)`, Header objects, Python): {total - accounted:.1f} ms.",
        "",
        "## Single-process costs of the operations in a round (worker process, "
        f"{s.numel:,} floats, median of 5, ms)",
        "",
        *benchutil.table(
            ["operation", "ms"], [[k, f"{v:.2f}"] for k, v in results[WORKER]["micro_ms"].items()]
        ),
    ]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(benchutil.RESULTS / "transport.md"))
    p.add_argument("--numel", type=int, default=10_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile-rounds", type=int, default=5)
    p.add_argument("--rpc-threads", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="cloudburst-bench-") as workdir:
        store_port = free_port()
        rpc_port = free_port()
        while rpc_port == store_port:
            rpc_port = free_port()
        s = Settings(
            numel=args.numel,
            reps=args.reps,
            iters=args.iters,
            warmup=args.warmup,
            profile_rounds=args.profile_rounds,
            rpc_threads=args.rpc_threads,
            store_port=store_port,
            rpc_port=rpc_port,
            workdir=workdir,
        )
        t0 = time.perf_counter()
        mp.spawn(rank_main, args=(s,), nprocs=2, join=True)
        elapsed = time.perf_counter() - t0
        results = {
            r: json.loads((Path(workdir) / f"rank{r}.json").read_text()) for r in (SERVER, WORKER)
        }
    lines = report(s, results)
    lines += [
        "",
        f"Run time (both processes, incl. start-up): {elapsed:.0f} s.",
        "",
        "Settings: `"
        + json.dumps({k: v for k, v in asdict(s).items() if k not in ("workdir",)})
        + "`",
    ]
    path = benchutil.write_markdown(args.out, lines)
    print("\n".join(lines))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
