"""A request announced by a worker that then died, over real gloo: every later receive from any
source on the group fails (gloo keeps the dead sender's announcement and finds it first), and a
receive from a named live worker still gets that worker's requests. This is why a shard that
lost a world worker serves the one still training on receives from it alone
(``RequestServing._receive_failed``)."""

import datetime
import os
import time

import pytest

from cloudburst.comm.messages import TAG_REQUEST, Header, Kind
from cloudburst.comm.p2p import PeerTransport
from tests.support import spawn

pytestmark = pytest.mark.dist

SERVER, LIVE, DEAD = 0, 1, 2


def _dead_announcer(rank: int) -> dict | None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    t = PeerTransport()
    if rank == DEAD:  # announces a request the server has not posted a receive for, and dies
        dist.isend(Header(Kind.PING, shard=0).to_tensor(), SERVER, tag=TAG_REQUEST)
        time.sleep(0.5)
        os._exit(0)
    if rank == LIVE:
        time.sleep(2.5)  # the dead worker's announcement arrived long before
        for version in range(3):
            t.send(SERVER, Header(Kind.PUSH, shard=0, version=version))
        time.sleep(3)  # the server reads them (gloo leaves unread sends pending at exit)
        return None
    time.sleep(1.5)  # DEAD has announced and died; LIVE has not sent yet
    failures = 0
    for _ in range(3):
        try:
            t.recv_request_any()
        except RuntimeError:
            failures += 1
    got = [[src, header.version] for src, header in (t.recv_request_any(LIVE) for _ in range(3))]
    return {"failures": failures, "got": got, "bytes": t.stats.received_bytes}


def test_a_dead_announcer_breaks_the_receive_from_any_source_not_from_a_named_peer(tmp_path):
    server, live, dead = spawn(_dead_announcer, 3, tmp_path, timeout_s=90)
    assert live is None and dead is None  # (by design: no results from those two)
    assert server["failures"] == 3  # each receive from any source, for good
    assert server["got"] == [[LIVE, 0], [LIVE, 1], [LIVE, 2]]
    assert server["bytes"] == 3 * 64  # the three headers; the failed receives count none
