"""The real server loop, driven by scripted workers over gloo: staleness, rejection, finish."""

import os

import pytest
import torch

from cloudburst.comm.liveness import Heartbeat, LivenessMonitor
from cloudburst.comm.messages import Header, Kind, Status
from cloudburst.comm.p2p import PeerTransport
from cloudburst.config import RunConfig
from cloudburst.records.checkpoint import load_checkpoint
from cloudburst.records.metrics import MetricsWriter, read_jsonl
from cloudburst.runtime import init_distributed, shutdown
from cloudburst.strategies import STRATEGY_CLASSES
from cloudburst.strategies.asgd.server import ServerLoop
from tests.support import spawn

pytestmark = pytest.mark.dist

NUMEL = 10


def _start(rank: int, out: str):
    """The job's context; on the server, its loop run to the end and what it reports."""
    # push records: every 2nd applied push and every one not applied; λ = 1: θ is a sum of pushes
    cfg = RunConfig(strategy="asgd", workers=2, servers=1, dataset="synthetic", out=out,
                    heartbeat_timeout_s=5.0, comm_timeout_s=60.0, checkpoint_every=2,
                    push_log_every=2, server_lr=1.0)  # fmt: skip
    ctx = init_distributed(cfg, STRATEGY_CLASSES[cfg.job.strategy])
    if not ctx.is_server:
        return ctx, None
    metrics = MetricsWriter(out, rank, "server0")
    liveness = LivenessMonitor(ctx.store, ctx.worker_ranks, 5.0)
    loop = ServerLoop(ctx, torch.zeros(NUMEL), metrics, liveness)
    loop.run()
    metrics.close()
    records = [r for r in read_jsonl(metrics.path) if r["event"] == "push"]
    pushes = [[p["staleness_versions"], p["status"], p["version"]] for p in records]
    shutdown(ctx)
    return ctx, {"stats": loop.stats(), "theta": loop.shard.theta.tolist(), "pushes": pushes}


def _finish(t: PeerTransport) -> None:
    """DONE, then PINGs until the server says it has finished."""
    kind = Kind.DONE
    while True:
        t.send(0, Header(kind, shard=0))
        if t.recv_reply(0).status == Status.FINISHED:
            return
        kind = Kind.PING


def _scripted(rank: int, out: str) -> dict:
    ctx, served = _start(rank, out)
    if served is not None:
        return served
    store = ctx.store
    t = PeerTransport()
    hb = Heartbeat(store, rank, 0.2).start()
    replies, theta_before, theta = [], [], torch.empty(NUMEL)

    def request(kind, version=0, payload=None, shard=0):
        n = NUMEL if payload is not None else 0
        header = Header(kind, shard=shard, version=version, numel=n, samples=8)
        if kind == Kind.PUSH_FETCH:
            # add rule: θ before the push comes back while the push goes out
            t.send(0, header)
            t.wait_all(
                [t.isend_payload(0, payload, reply=False), t.irecv_payload(0, theta, reply=True)]
            )
            r = t.recv_reply(0)
            theta_before.append(theta.tolist())
        else:
            t.send(0, header, payload)
            r = t.recv_reply(0, theta if kind == Kind.FETCH else None)
        replies.append([r.kind.name, r.status, r.version, r.aux])
        return r

    ones = torch.ones(NUMEL)
    if rank == 1:  # worker A
        request(Kind.FETCH)  # v0
        store.set("a_fetched", "1")
        store.wait(["b_fetched"])
        request(Kind.PUSH_FETCH, version=0, payload=ones)  # staleness 0 -> v1, fetches v1
        store.set("a_pushed", "1")
        store.wait(["b_pushed_twice"])
        request(Kind.PUSH_FETCH, version=1, payload=ones)  # v3 now -> staleness 2 -> v4
        bad = torch.where(torch.arange(NUMEL) == 3, float("nan"), 1.0)
        request(Kind.PUSH, version=4, payload=bad)  # rejected: non-finite
        request(Kind.FETCH, shard=5)  # malformed: wrong shard -> rejected
    else:  # worker B
        store.wait(["a_fetched"])
        request(Kind.FETCH)  # v0
        store.set("b_fetched", "1")
        store.wait(["a_pushed"])
        request(Kind.PUSH, version=0, payload=ones)  # v1 -> staleness 1 -> v2
        request(Kind.PUSH, version=0, payload=ones)  # v2 -> staleness 2 -> v3
        store.set("b_pushed_twice", "1")
    _finish(t)
    hb.stop()
    shutdown(ctx)
    return {"replies": replies, "theta_before": theta_before}


def test_staleness_rejection_and_finish_over_gloo(tmp_path):
    server, a, b = spawn(_scripted, 3, tmp_path, str(tmp_path))
    # applied pushes have staleness 0, 1, 2, 2 (versions 1..4): records at versions 2 and 4,
    # and the rejected one (staleness, status, version); the statistics still count every push
    assert server["pushes"] == [[1, "OK", 2], [2, "OK", 4], [0, "REJECTED", 4]]
    stats = server["stats"]
    assert stats["version"] == 4 and stats["staleness_sum_versions"] == 5
    assert stats["staleness_max_versions"] == 2 and stats["rejected_nonfinite"] == 1
    assert stats["messages_rejected"] == 1  # the wrong-shard request, once
    assert stats["dropped_peers"] == stats["lost_workers"] == []  # one fault drops no worker
    assert server["theta"] == [4.0] * NUMEL  # four applied pushes of ones
    # worker A's replies: fetch v0; push-fetch staleness 0 at v1; push-fetch staleness 2 at v4;
    # NaN push rejected; malformed request rejected
    ok, rejected = Status.OK, Status.REJECTED
    kinds = [(s, v, aux) for _, s, v, aux in a["replies"][:5]]
    assert kinds == [(ok, 0, 0), (ok, 1, 0), (ok, 4, 2), (rejected, 4, 0), (rejected, 4, 0)]
    assert [(s, aux) for _, s, _, aux in b["replies"][:3]] == [(0, 0), (0, 1), (0, 2)]
    # push-fetch replies carry θ as it was before the push: 0 at v0, then 3 pushes of ones at v3
    assert a["theta_before"] == [[0.0] * NUMEL, [3.0] * NUMEL]
    # the checkpoint (every 2 applied pushes) holds the shard as of version 4
    state = load_checkpoint(tmp_path / "checkpoints" / "server0.pt", "server-shard")
    assert state["version"] == 4 and state["theta"].tolist() == [4.0] * NUMEL


def _dies_mid_request(rank: int, out: str) -> dict:
    ctx, served = _start(rank, out)
    if served is not None:
        return served
    t = PeerTransport()
    if rank == 2:
        # announce a push, then die before sending its payload
        t.send(0, Header(Kind.PUSH, shard=0, version=0, numel=NUMEL))
        os._exit(0)
    hb = Heartbeat(ctx.store, rank, 0.2).start()
    theta = torch.empty(NUMEL)
    for _ in range(3):
        t.send(0, Header(Kind.PUSH, shard=0, version=0, numel=NUMEL), torch.ones(NUMEL))
        t.recv_reply(0)
    t.send(0, Header(Kind.FETCH, shard=0))
    t.recv_reply(0, theta)
    _finish(t)
    hb.stop()
    shutdown(ctx)
    return {"theta": theta.tolist()}


def test_worker_dying_mid_request_is_lost_and_the_rest_is_served(tmp_path):
    server, a, b = spawn(_dies_mid_request, 3, tmp_path, str(tmp_path))
    assert b is None
    assert server["stats"]["lost_workers"] == [2] and server["stats"]["version"] == 3
    assert a["theta"] == [3.0] * NUMEL == server["theta"]
