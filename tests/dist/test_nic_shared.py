"""The shared NIC record across processes: two ranks of one node, each in a process of its own,
book through one NicState file (the hand-computed ends of tests/unit/test_nic_sharing.py)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import LinkEmulator, Topology
from cloudburst.comm.nic import NicState

pytestmark = pytest.mark.dist

TIMEOUT_S = 60


def _rank(path: str, rank: int, go, done, results) -> None:
    """Rank ``rank`` of 4 on 2 nodes: books its DASO global group's op once ``go`` is set,
    then waits for the op's end (its other member books it from the test's process)."""
    nic = NicState(path, 2)
    emu = LinkEmulator(LinkSpec(1.0, 1.0), topology=Topology.contiguous(4, 2), rank=rank, nic=nic)
    if not go.wait(TIMEOUT_S):
        results.put((rank, "never told to go"))
        return
    group = ("across0", (0, 2)) if rank in (0, 2) else ("across1", (1, 3))
    pending = emu.book_collective(0.5, group, start=10.0)
    done.set()
    results.put((rank, pending.wait(TIMEOUT_S)))
    nic.close()


def test_ranks_in_two_processes_share_the_node_nic(tmp_path):
    ctx = mp.get_context("fork")
    path = str(tmp_path / "nic")
    results = ctx.Queue()
    go, first_done, second_done = ctx.Event(), ctx.Event(), ctx.Event()
    first = ctx.Process(target=_rank, args=(path, 0, go, first_done, results))
    second = ctx.Process(target=_rank, args=(path, 1, first_done, second_done, results))
    first.start()
    second.start()
    nic = NicState(path, 2)
    topo = Topology.contiguous(4, 2)
    late = {r: LinkEmulator(LinkSpec(1.0, 1.0), topology=topo, rank=r, nic=nic) for r in (2, 3)}
    try:
        go.set()
        assert second_done.wait(TIMEOUT_S)
        # Both processes' first members are in; the last members (node 1) come from here.
        assert late[2].book_collective(0.5, ("across0", (0, 2)), start=10.2) == 10.7
        assert late[3].book_collective(0.5, ("across1", (1, 3)), start=10.3) == 11.2
        got = dict(results.get(timeout=TIMEOUT_S) for _ in range(2))
    finally:
        for p in (first, second):
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()
    # Each process waited for its op's end, which the other process's booking had pushed.
    assert got == {0: 10.7, 1: 11.2}
    with nic.locked():
        assert nic.free(0) == nic.free(1) == (11.2, 11.2)
    nic.unlink()
    nic.close()
    assert list(tmp_path.iterdir()) == []
