"""The virtual cluster's scheduler and transport on scripted cases, exact virtual times by hand:
1 ms and 1 MB/s between nodes (1,000 bytes take 1 ms), free within a node."""

from __future__ import annotations

import pytest
import torch

from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import LinkEmulator, Topology
from cloudburst.sim.network import PeerDied, SimNetwork
from cloudburst.sim.scheduler import Deadlock, Scheduler, SimLock
from cloudburst.sim.transport import SimStore, SimTransport

LATENCY_S, BYTES_PER_S = 0.001, 1e6
TAG = 5


class ScriptClock:
    """What the network asks of the clock model, with one slow link between nodes (1 ms, 1 MB/s)
    and no shared NIC (each rank's own link)."""

    def __init__(self, step_s: float = 0.1):
        self.step = step_s
        self.emu = LinkEmulator(LinkSpec(BYTES_PER_S * 8 / 1e9, LATENCY_S * 1e3))

    def step_s(self, worker: int, step: int, factor: float) -> float:
        return self.step * factor

    def wire_bytes(self, nbytes: int, floating: bool) -> float:
        return nbytes

    def p2p_s(self, nbytes: float, crosses: bool) -> float:
        return self.emu.p2p_s(nbytes) if crosses else 0.0

    def allreduce_s(self, nbytes: float, n: int, spans: bool) -> float:
        return self.emu.allreduce_s(nbytes, n) if spans else 0.0


def _cluster(ranks: int = 2, nodes: int = 2, timeout_s: float = 60.0, step_s: float = 0.1):
    sched = Scheduler()
    net = SimNetwork(sched, ScriptClock(step_s), Topology.contiguous(ranks, nodes), timeout_s)
    comms = [SimTransport(net, r, r) for r in range(ranks)]
    return sched, net, comms


def _run(sched: Scheduler, **bodies) -> None:
    """Each body a task on the rank of its position, named by its keyword; then the run."""
    for rank, (name, body) in enumerate(bodies.items()):
        sched.spawn(body, name, rank)
    sched.run()


def _kb(k: float = 1) -> torch.Tensor:
    """k thousand bytes of float32."""
    return torch.ones(int(250 * k))


def test_two_messages_on_one_link_queue_and_arrive_in_order():
    """Each message between nodes costs latency + size / bandwidth, queued behind the sender's
    earlier ones; a wait returns at the arrival; a receive fills what the message holds."""
    sched, net, (a, b) = _cluster()
    arrivals = []

    def sender():
        w1 = a.isend(_kb(1), 1, TAG)  # 1 ms + 1 ms: arrives at 2 ms
        w2 = a.isend(_kb(3), 1, TAG)  # queued behind it: 2 ms + 1 ms + 3 ms = 6 ms
        assert a.now() == 0.0  # non-blocking sends return at once
        w1.wait()
        w2.wait()
        arrivals.append(("sender", a.now()))

    def receiver():
        for _ in range(2):
            buf = torch.zeros(750)
            b.recv(buf, 0, TAG)
            arrivals.append((int((buf != 0).sum()), b.now()))

    _run(sched, a=sender, b=receiver)
    expected = [(250, 0.002), ("sender", 0.006), (750, 0.006)]
    assert arrivals == [(who, pytest.approx(at)) for who, at in expected]


def test_same_node_messages_are_free_and_a_receiver_takes_the_earliest_arrival():
    sched, net, comms = _cluster(ranks=3, nodes=2)  # ranks 0, 1 | 2
    got = []

    def far():  # node 1 -> rank 0: 1 ms + 1 ms
        comms[2].send(_kb(1), 0, TAG)

    def near():  # same node, sent later but free: arrives first
        comms[1].sleep(0.0015)
        comms[1].send(torch.full((250,), 2.0), 0, TAG)

    def receiver():
        for _ in range(2):
            buf = torch.zeros(250)
            src = comms[0].recv(buf, None, TAG)
            got.append((src, comms[0].now()))

    _run(sched, r=receiver, near=near, far=far)
    assert got == [(1, pytest.approx(0.0015)), (2, pytest.approx(0.002))]


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_a_non_blocking_allreduce_overlapped_with_k_steps_costs_what_compute_did_not_hide(k):
    step_s = 0.004
    sched, net, (a, b) = _cluster(step_s=step_s)
    cost = ScriptClock().allreduce_s(8000, 2, True)  # 2·1 ms + 1 · 8 ms = 10 ms
    waited = {}

    def rank(comm, name):
        def body():
            t = torch.ones(2000)
            work = comm.all_reduce(t, async_op=True)
            for _ in range(k):
                comm.step_done(0.0, 0.0, 1.0)
            t0 = comm.now()
            work.wait()
            waited[name] = (comm.now() - t0, t[0].item())

        return body

    _run(sched, a=rank(a, "a"), b=rank(b, "b"))
    expected = max(0.0, cost - k * step_s)
    assert cost == pytest.approx(0.010)
    assert waited == {name: (pytest.approx(expected), 2.0) for name in ("a", "b")}


def test_a_deadlock_fails_naming_every_tasks_state_instead_of_hanging():
    """With deadlines (every receive has one) it ends at the first, named a deadlock; a wait
    without one that nothing can end is a Deadlock at once."""
    sched, net, (a, b) = _cluster(timeout_s=1e9)
    with pytest.raises(RuntimeError) as e:
        _run(sched, **{"worker-a": lambda: a.recv(torch.zeros(1), 1, TAG),
                       "worker-b": lambda: b.recv(torch.zeros(1), 0, TAG)})  # fmt: skip
    message = str(e.value)
    assert "a deadlock: nothing else could run" in message
    assert "worker-a at t=1000000000.000s waits for a message (tag 5) from 1" in message
    assert "worker-b at t=0.000s waits for a message (tag 5) from 0" in message
    sched = Scheduler()
    lock = SimLock(sched)

    def holder():
        lock.acquire()
        sched.block("forever")

    with pytest.raises(Deadlock, match="holder at t=0.000s waits for forever; waiter"):
        _run(sched, holder=holder, waiter=lock.acquire)


def test_a_receive_times_out_in_virtual_time():
    sched, net, (a, b) = _cluster(timeout_s=30.0)
    seen = {}

    def lonely():
        try:
            a.recv(torch.zeros(1), 1, TAG)
        except RuntimeError as e:
            seen["error"], seen["at"] = str(e), a.now()

    _run(sched, a=lonely, b=lambda: b.sleep(100.0))
    assert "timed out after 30 virtual s" in seen["error"] and seen["at"] == pytest.approx(30.0)


def test_a_killed_peer_fails_the_collective_at_once_and_a_task_error_stops_the_run():
    sched, net, (a, b) = _cluster()

    def victim():
        a.sleep(1.0)
        a.stop_self("kill")

    def survivor():
        b.all_reduce(torch.ones(1))

    with pytest.raises(PeerDied, match="rank 0 died at t=1.000s"):
        _run(sched, a=victim, b=survivor)


def test_ties_run_in_spawn_order_and_a_run_repeats_exactly():
    def run_once() -> list[tuple[str, float]]:
        sched = Scheduler()
        order: list[tuple[str, float]] = []
        lock = SimLock(sched)

        def task(name, dt):
            def body():
                for _ in range(3):
                    with lock:
                        sched.advance(dt)
                        order.append((name, sched.now()))

            return body

        for i, dt in enumerate([0.3, 0.1, 0.2, 0.1]):
            sched.spawn(task(f"t{i}", dt), f"t{i}", i)
        sched.run()
        return order

    first = run_once()
    assert first == run_once()
    # The lock is held while the holder's clock moves: the others queue behind it.
    assert [t for _, t in first] == sorted(t for _, t in first)
    assert first[0] == ("t0", pytest.approx(0.3))


def test_the_store_waits_in_virtual_time_and_spawned_tasks_join():
    sched, net, (a, b) = _cluster()
    store = SimStore(net)
    seen = {}

    def writer():
        a.sleep(2.0)
        store.set("k", "v")

    def reader():
        seen["value"] = store.get("k")
        seen["at"] = b.now()
        child = b.spawn(lambda: b.sleep(1.5), "child")
        child.join()
        seen["joined"] = b.now()

    _run(sched, w=writer, r=reader)
    assert seen == {"value": b"v", "at": pytest.approx(2.0), "joined": pytest.approx(3.5)}
