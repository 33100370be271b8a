"""Chunked payloads over real gloo: a PUSH_FETCH-shaped exchange (header, Δ one way while θ
travels the other, each in chunks, worked on chunk by chunk), a blocking reply in chunks, and a
hostile short chunk that leaves NaN where it ends."""

import pytest
import torch

from cloudburst.comm.messages import TAG_REQUEST_PAYLOAD, Header, Kind, Status
from cloudburst.comm.p2p import PeerTransport
from cloudburst.runtime import shutdown
from tests.support import spawn

pytestmark = pytest.mark.dist

NUMEL = 2500
CHUNK = 1000  # 3 chunks: 1000, 1000, 500


def _exchange(rank: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = PeerTransport(chunk_numel=CHUNK)
    theta = torch.arange(NUMEL, dtype=torch.float32)
    try:
        if rank == 0:  # the server
            src, header = t.recv_request_any()
            sending = t.isend_payload(src, theta, reply=True)
            delta, sums = torch.empty(NUMEL), []

            def summed(a: int, b: int) -> None:
                sums.append([a, b, float(delta[a:b].sum())])

            t.recv_payload(src, header.numel, out=delta, on_chunk=summed)
            sending.wait()
            theta.add_(delta)
            t.send(src, Header(Kind.REPLY, version=1, numel=NUMEL, status=Status.OK), theta)
            # A hostile sender's second chunk is short: it ends in NaN.
            short = t.recv_payload(1, NUMEL, out=torch.zeros(NUMEL))
            nan_at = torch.nonzero(~torch.isfinite(short)).flatten().tolist()
            return {"sums": sums, "nan_at": nan_at, "received": t.stats.received_bytes}
        # the worker: Δ = 2 computed chunk by chunk as it is sent; θ received meanwhile
        delta, order = torch.empty(NUMEL), []

        def prepare(a: int, b: int) -> None:
            order.append([a, b])
            delta[a:b].fill_(2.0)

        t.send(0, Header(Kind.PUSH_FETCH, numel=NUMEL))
        fetched = torch.empty(NUMEL)
        sending = t.isend_payload(0, delta, reply=False, prepare=prepare)
        receiving = t.irecv_payload(0, fetched, reply=True)
        arrived = list(receiving.arrived())
        sending.wait()
        pre_push = fetched.clone()
        reply = t.recv_reply(0, fetched)
        for part in (torch.ones(CHUNK), torch.ones(CHUNK - 7), torch.ones(NUMEL - 2 * CHUNK)):
            dist.send(part, 0, tag=TAG_REQUEST_PAYLOAD)
        return {
            "order": order,
            "arrived": [list(x) for x in arrived],
            "pre_push_ok": torch.equal(pre_push, theta),
            "after_ok": torch.equal(fetched, theta + 2.0),
            "version": reply.version,
            "sent": t.stats.sent_bytes,
        }
    finally:
        shutdown(None)  # the group kept until exit: see test_compress._compressed


def test_chunked_push_fetch_over_gloo(tmp_path):
    server, worker = spawn(_exchange, 2, tmp_path)
    chunks = [[0, 1000], [1000, 2000], [2000, 2500]]
    assert worker["order"] == chunks and worker["arrived"] == chunks
    assert worker["pre_push_ok"] and worker["after_ok"] and worker["version"] == 1
    assert server["sums"] == [[a, b, 2.0 * (b - a)] for a, b in chunks]
    assert server["nan_at"] == [CHUNK + CHUNK - 1]  # the short chunk's last element
    assert worker["sent"] == 64 + NUMEL * 4  # the header, Δ once
    assert server["received"] == 64 + 2 * NUMEL * 4  # one header, Δ, the hostile payload
