"""The rejoin announcements in the job store: order, and refusal after the servers finish."""

import pytest
import torch.distributed as dist

from cloudburst.runtime import RejoinBoard, RejoinRefused


def test_servers_read_announcements_in_order_and_refuse_late_ones():
    store = dist.HashStore()
    worker = RejoinBoard(store, timeout_s=5)
    servers = [RejoinBoard(store, timeout_s=5) for _ in range(2)]
    assert servers[0].poll() == []
    worker.announce(3, 1)
    worker.announce(2, 1)
    assert servers[0].poll() == [(3, 1), (2, 1)]
    assert servers[0].poll() == []  # each announcement is read once
    assert servers[1].poll() == [(3, 1), (2, 1)]  # by every server, in the same order
    worker.announce(3, 2)
    # closing hands over what came before the close
    assert servers[0].close() == [(3, 2)]
    assert servers[1].close() == [(3, 2)]  # the other server admits it too
    with pytest.raises(RejoinRefused, match="rank 2 was restarted after"):
        worker.announce(2, 2)
    # a late announcement is refused on both sides
    assert servers[0].poll() == [] and servers[1].close() == []
