"""Crafted messages over real gloo: a server shard and a gossip worker each get bad requests
from a scripted attacker, reject and count every one, drop the attacker when its stream cannot
be read in step, survive, and apply the next valid message exactly (θ checked to the bit)."""

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

from cloudburst.comm.gossip import GossipTransport, Mailbox, Snapshot, encode_weight
from cloudburst.comm.liveness import LivenessMonitor
from cloudburst.comm.messages import HEADER_LEN, MAGIC, TAG_REPLY, TAG_REQUEST, Header, Kind, Status
from cloudburst.comm.p2p import PeerTransport
from cloudburst.comm.stats import CommStats
from cloudburst.config import RunConfig
from cloudburst.records.metrics import MetricsWriter, read_jsonl
from cloudburst.runtime import init_distributed, shutdown
from cloudburst.strategies import STRATEGY_CLASSES
from cloudburst.strategies.asgd.server import ServerLoop
from tests.support import spawn, wait_until

pytestmark = pytest.mark.dist

NUMEL = 10
HUGE = 2**40  # elements: 4 TiB of fp32, if anyone allocated it


def _vector(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def _leave(out: str, rank: int, result: dict) -> None:
    """Write this rank's result and exit at once: sends a dropped attacker started (and no
    receiver will ever match) must not hold the process at its exit."""
    Path(out, f"result{rank}.json").write_text(json.dumps(result))
    os._exit(0)


# ---------------------------------------------------------------------------- the server
def _server_job(rank: int, out: str) -> dict:
    # server_lr 1: θ ← θ + Δ
    cfg = RunConfig(strategy="asgd", workers=3, servers=1, dataset="synthetic", out=out,
                    warm_start_steps=1, heartbeat_timeout_s=30.0, comm_timeout_s=60.0,
                    checkpoint_every=0, server_lr=1.0)  # fmt: skip
    ctx = init_distributed(cfg, STRATEGY_CLASSES[cfg.job.strategy])
    store = ctx.store
    if ctx.is_server:
        metrics = MetricsWriter(out, rank, "server0")
        liveness = LivenessMonitor(store, ctx.worker_ranks, 30.0)
        loop = ServerLoop(ctx, torch.zeros(NUMEL), metrics, liveness)
        loop.run()
        metrics.close()
        records = read_jsonl(metrics.path)
        result = {
            "stats": loop.stats(),
            "theta": loop.shard.theta.tolist(),
            "push_status": [r["status"] for r in records if r["event"] == "push"],
            "dropped": [r["worker"] for r in records if r["event"] == "peer_dropped"],
        }
        shutdown(ctx)
        return result

    t = PeerTransport()

    @contextlib.contextmanager
    def turn(k: int):  # the script's steps run one at a time, in order
        if k > 1:
            store.wait([f"step{k}"])
        yield
        store.set(f"step{k + 1}", "1")

    def request(header: Header, payload: torch.Tensor | None = None) -> int:
        t.send(0, header, payload)
        return int(t.recv_reply(0).status)

    def fetch() -> list:
        theta = torch.empty(NUMEL)
        t.send(0, Header(Kind.FETCH, shard=0))
        return [t.recv_reply(0, theta).version, theta.tolist()]

    def push(version: int, **kw) -> Header:
        fields = {"shard": 0, "version": version, "numel": NUMEL, "samples": 8}
        return Header(Kind.PUSH, **{**fields, **kw})

    if rank == 1:  # worker 0: honest, and the warm-start worker
        with turn(1):
            seen = {"init": request(Header(Kind.INIT, shard=0, numel=NUMEL), _vector(0))}
            seen["fetch0"] = fetch()
        with turn(5):  # the next valid push after attacker A's messages
            seen["push1"] = request(push(0), _vector(1))
            seen["fetch1"] = fetch()
        with turn(8):  # after attacker B's
            seen["push2"] = request(push(1), _vector(2))
            seen["fetch2"] = fetch()
        kind = Kind.DONE
        while request(Header(kind, shard=0)) != Status.FINISHED:
            kind = Kind.PING
        shutdown(ctx)
        return seen

    if rank == 2:  # attacker A: a refusal whose payload is drained, then a huge length
        # (each reason a request is refused for: tests/unit/test_message_validation.py)
        with turn(2):  # wrong shard, followed by its payload
            seen = {"wrong_shard": request(push(0, shard=3), torch.full((NUMEL,), 6.0))}
        with turn(3):  # a non-finite Δ (rejected; an honest worker's diverged push looks the same)
            nan = torch.where(torch.arange(NUMEL) == 4, float("nan"), 1.0)
            seen["nan_push"] = request(push(0), nan)
        with turn(4):  # a length no receiver may allocate or read: no payload, and no reply comes
            t.send(0, push(0, shard=2, numel=HUGE))
        _leave(out, rank, seen)

    # rank 3, attacker B: a header with bad magic followed by a payload, then a valid push
    with turn(6):
        bad = Header(Kind.PUSH, shard=0, numel=NUMEL).to_tensor()
        bad[0] = MAGIC + 1
        t._send(bad, 0, TAG_REQUEST)
        # Payloads and replies without waiting: today's server takes this payload as the next
        # push's Δ (and answers); a fixed one reads neither, nor answers.
        t.isend_payload(0, torch.full((NUMEL,), 1000.0), reply=False)
        t._irecv(torch.empty(HEADER_LEN, dtype=torch.int64), 0, TAG_REPLY)
    with turn(7):
        t.send(0, push(1))
        t.isend_payload(0, torch.full((NUMEL,), -1000.0), reply=False)
        t._irecv(torch.empty(HEADER_LEN, dtype=torch.int64), 0, TAG_REPLY)
    store.wait(["step9"])  # the server has read all it will read from this rank
    _leave(out, rank, {})


def test_server_rejects_hostile_requests_and_applies_the_next_push_exactly(tmp_path):
    server, worker, attacker_a, _ = spawn(_server_job, 4, tmp_path, str(tmp_path))
    theta0 = _vector(0)
    after1 = theta0.clone().add_(_vector(1), alpha=1.0)  # the add rule, λ = server_lr = 1
    after2 = after1.clone().add_(_vector(2), alpha=1.0)

    rejected = int(Status.REJECTED)
    assert attacker_a == {"wrong_shard": rejected, "nan_push": rejected}
    # θ to the bit: the warm-start θ, then exactly one Δ per honest push (no drained payload
    # applied, nothing of the dropped).
    assert worker["init"] == int(Status.OK) and worker["fetch0"] == [0, theta0.tolist()]
    assert worker["push1"] == int(Status.OK) and worker["fetch1"] == [1, after1.tolist()]
    assert worker["push2"] == int(Status.OK) and worker["fetch2"] == [2, after2.tolist()]
    assert server["theta"] == after2.tolist()

    stats = server["stats"]
    assert stats["version"] == 2 and stats["samples"] == 16  # nothing of the attackers
    assert stats["rejected_nonfinite"] == 1
    # A: wrong shard, huge length; B: bad magic, then its ignored push. Each counted once.
    assert stats["messages_rejected"] == 4
    assert stats["dropped_peers"] == [2, 3] == server["dropped"]
    assert stats["lost_workers"] == [2, 3]
    assert server["push_status"] == ["REJECTED"]  # applied pushes: one record every 10th


# ---------------------------------------------------------------------------- gossip
def _gossip_job(rank: int, out: str) -> dict:
    cfg = RunConfig(strategy="gossip", workers=3, dataset="synthetic", out=out,
                    comm_timeout_s=60.0, gossip_variant="push")  # fmt: skip
    ctx = init_distributed(cfg, STRATEGY_CLASSES[cfg.job.strategy])
    store = ctx.store
    transport = GossipTransport(ctx.groups["requests"], ctx.groups["replies"], rank,
                                [r for r in range(3) if r != rank], NUMEL, CommStats(),
                                worker_of=lambda r: r, timeout_s=60.0)  # fmt: skip
    snapshot, mailbox = Snapshot(NUMEL), Mailbox(NUMEL)
    theta = _vector(10 + rank)
    if rank == 2:
        theta[3] = float("nan")  # the attacker's θ: what worker 0 pulls from it
    snapshot.publish(theta, 0)
    transport.start(snapshot, mailbox)

    if rank == 2:  # the attacker: crafted pushes to worker 0 on the request group
        raw = PeerTransport(ctx.groups["requests"])

        def push(payload: torch.Tensor | None, weight: float, **kw) -> None:
            header = Header(Kind.PUSH, **{"shard": 2, "version": 1, "numel": NUMEL,
                                          "aux": encode_weight(weight), **kw})  # fmt: skip
            raw.send(0, header, payload)

        # non-finite θ (refused once read; every reason: tests/unit/test_message_validation.py)
        push(torch.where(torch.arange(NUMEL) == 4, float("nan"), 1.0), 0.5)
        push(torch.ones(NUMEL), 0.5, shard=1)  # another worker's index, its payload follows
        push(None, 0.5, shard=1, numel=HUGE)  # another worker's index and a huge length
        push(None, 0.5)  # valid, from a dropped peer: its payload is never read
        raw.isend_payload(0, torch.full((NUMEL,), 1000.0), reply=False)
        store.set("attacked", "1")
        store.wait(["w0_pulled"])
        transport.finish()  # worker 0 ignores its DONE, worker 1 takes it
        _leave(out, rank, {})

    if rank == 1:  # honest: one valid push to worker 0, after the attacker's
        store.wait(["w0_ready"])
        transport.push(0, _vector(20), 0.5, step=1)
        store.set("w1_pushed", "1")
        store.wait(["w2_done_seen"])
        transport.finish()
        shutdown(ctx)
        return {}

    # rank 0: the receiver under attack
    store.wait(["attacked"])
    faults = transport.request_faults
    # (the serving thread has handled what was sent: a mechanism, not a time)
    wait_until(lambda: faults.ignored == 1, 60, "the dropped attacker's last push, not read")
    taken = mailbox.take()
    seen = {"after_attack": [taken[0].tolist(), taken[1], taken[2]]}
    store.set("w0_ready", "1")
    store.wait(["w1_pushed"])
    wait_until(lambda: transport.counters.pushes_received == 1, 60, "the honest push")
    taken = mailbox.take()
    seen["after_push"] = [taken[0].tolist(), taken[1], taken[2]]
    pulled = torch.empty(NUMEL)
    seen["pull_honest"] = [transport.pull(1, pulled, step=1), pulled.tolist()]
    seen["pull_attacker"] = transport.pull(2, pulled, step=1)
    store.set("w0_pulled", "1")
    wait_until(lambda: faults.ignored == 2, 60, "the attacker's DONE, ignored")
    store.set("w2_done_seen", "1")
    transport.finish()
    seen.update(by_peer=faults.by_peer, counters=vars(transport.counters))
    seen.update(rejected=transport.stats.messages_rejected, dropped=transport.dropped_peers())
    shutdown(ctx)
    return seen


def test_gossip_rejects_hostile_pushes_and_pulls_and_takes_the_next_push_exactly(tmp_path):
    w0, _, _ = spawn(_gossip_job, 3, tmp_path, str(tmp_path))
    # Nothing of the attacker's reached the mailbox; the honest push did, to the bit.
    assert w0["after_attack"] == [[0.0] * NUMEL, 0, 0.0]
    assert w0["after_push"] == [_vector(20).tolist(), 1, 0.5]
    assert w0["pull_honest"] == [0, _vector(11).tolist()]
    assert w0["pull_attacker"] is None  # a non-finite θ is not averaged in
    # 2 refused (payload read and discarded) + the huge length (dropped at once), then its
    # valid push and DONE ignored; one refused reply on the pulling side.
    assert w0["by_peer"] == {"2": 3}
    counters = w0["counters"]
    assert counters["requests_rejected"] == 5 and counters["replies_rejected"] == 1
    assert counters["pushes_received"] == 1 and counters["fetches_served"] == 0
    assert w0["rejected"] == 6 and w0["dropped"] == [2]
