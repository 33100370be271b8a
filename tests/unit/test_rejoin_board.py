"""The rejoin announcements in the job store: order, refusal after the servers finish, and the
signature under the job secret that a forged, replayed or foreign announcement lacks."""

import json
import logging

import pytest
import torch.distributed as dist

from cloudburst.comm.auth import sign
from cloudburst.comm.liveness import RejoinBoard, RejoinRefused

pytestmark = pytest.mark.unit

SECRET = b"s" * 32


def _board(store, secret: bytes | None = SECRET, run: str = "run1") -> RejoinBoard:
    return RejoinBoard(store, timeout_s=5, secret=secret, run=run)


def test_servers_read_announcements_in_order_and_refuse_late_ones():
    store = dist.HashStore()
    worker = _board(store)
    servers = [_board(store) for _ in range(2)]
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


def _forge(store, record: dict) -> int:
    """Write ``record`` as the next announcement, as anyone who reaches the store can."""
    number = store.add(RejoinBoard.COUNT, 1)
    store.set(f"rejoin/{number}", json.dumps(record))
    return number


def test_announcements_not_signed_with_this_jobs_secret_are_refused_and_logged(caplog):
    store = dist.HashStore()
    server = _board(store)
    plain = {"rank": 3, "incarnation": 1, "late": False}
    _forge(store, plain)  # unsigned, as before the secret (the attack)
    _forge(store, {**plain, "mac": sign(b"x" * 32, "rejoin", "run1", 2, 3, 1, False)})  # guessed
    _board(store, run="run0").announce(3, 1)  # signed for another run under the same secret
    genuine_number = store.add(RejoinBoard.COUNT, 0) + 1
    _board(store).announce(2, 1)
    genuine = json.loads(store.get(f"rejoin/{genuine_number}"))
    _forge(store, genuine)  # a genuine announcement copied to another number: replayed
    _forge(store, {**genuine, "incarnation": 2})  # its restart changed
    _forge(store, {**genuine, "rank": 3})  # its rank changed
    with caplog.at_level(logging.WARNING, logger="cloudburst.comm.liveness"):
        assert server.poll() == [(2, 1)]  # the genuine one only
    assert server.refused == 6
    refusals = [r.getMessage() for r in caplog.records if "refused rejoin" in r.getMessage()]
    assert len(refusals) == RejoinBoard.LOG_FIRST  # the first five, one line each
    assert "rank 3, restart 1: not signed with the job secret" in refusals[0]


def test_a_late_announcement_flipped_to_on_time_is_refused():
    store = dist.HashStore()
    server = _board(store)
    server.close()
    with pytest.raises(RejoinRefused, match="after the parameter servers had finished"):
        _board(store).announce(2, 1)
    record = json.loads(store.get("rejoin/1"))
    assert record["late"] is True
    store.set("rejoin/1", json.dumps({**record, "late": False}))
    assert _board(store).poll() == []


def test_without_a_secret_no_announcement_is_made_or_admitted():
    store = dist.HashStore()
    with pytest.raises(RejoinRefused, match="CLOUDBURST_JOB_SECRET_FILE"):
        _board(store, secret=None).announce(2, 1)
    assert store.add(RejoinBoard.COUNT, 0) == 0  # nothing was written
    _board(store).announce(2, 1)  # signed, but this server has no secret to check it with
    unkeyed = _board(store, secret=None)
    assert unkeyed.poll() == [] and unkeyed.refused == 1
