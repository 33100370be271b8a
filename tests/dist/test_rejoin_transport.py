"""The point-to-point transport on a rejoin group (a gloo group outside torch.distributed's
registry): peers keep their global ranks. Two members in one process, on two threads."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from cloudburst.comm.messages import Header, Kind
from cloudburst.comm.p2p import PeerTransport

pytestmark = pytest.mark.dist

SERVER, WORKER = 0, 5  # global ranks; the worker is rank 1 of the group


def test_requests_and_replies_name_global_ranks():
    store = dist.HashStore()
    groups = {}

    def build(group_rank):
        groups[group_rank] = dist.ProcessGroupGloo(
            dist.PrefixStore("rejoin/5/1/", store), group_rank, 2, datetime.timedelta(seconds=20)
        )

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    server = PeerTransport(groups[0], members=[SERVER, WORKER])
    worker = PeerTransport(groups[1], members=[SERVER, WORKER])
    got = {}

    def serve():
        src, header = server.recv_request_any()
        got["src"], got["header"] = src, header
        got["payload"] = server.recv_payload(src, header.numel).tolist()
        server.send(src, Header(Kind.REPLY, shard=0, numel=3), torch.tensor([7.0, 8.0, 9.0]))

    t = threading.Thread(target=serve)
    t.start()
    worker.send(SERVER, Header(Kind.PUSH, shard=0, numel=2), torch.tensor([1.0, 2.0]))
    out = torch.empty(3)
    reply = worker.recv_reply(SERVER, out)
    t.join(timeout=20)
    assert got["src"] == WORKER and got["header"].kind == Kind.PUSH
    assert got["payload"] == [1.0, 2.0]
    assert reply.kind == Kind.REPLY and out.tolist() == [7.0, 8.0, 9.0]
    assert worker.stats.sent_bytes == server.stats.received_bytes
    with pytest.raises(ValueError, match="not a member"):
        worker.send(3, Header(Kind.FETCH))
