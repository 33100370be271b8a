"""The virtual cluster's all-to-all, exactly: what each member receives and what virtual time it
costs, on groups of 1 to 4 ranks within one node and across nodes, against values and times
computed here by hand.

Member s's input is cut into pieces of ``S[s][i]`` elements, piece i going to member i; member
i's output is the pieces (0, i), (1, i), ... in member order. The all-to-all starts when its
last member calls it and its links are free, and costs (n − 1) latencies + the busiest
member's bytes to the others (its own piece stays home) / bandwidth, on the inter-node link
when the group spans nodes, else the intra-node link (cloudburst.comm.collectives.
all_to_all_s). A payload's bytes (floating point, uint8, int8) are scaled by modelled_params /
actual_params; control data (int64) is not. While it runs it holds both NICs of every node it
spans.
"""

from __future__ import annotations

import re

import pytest
import torch

from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.sim.run import run_ranks

LAT, BW = 0.002, 1e9  # --inter-node-link 8,2: 8 Gbit/s = 1e9 bytes/s, 2 ms
LAT_IN, BW_IN = 0.0005, 2e9  # --intra-node-link 16,0.5
SCALE = 3  # modelled_params = 3 per actual parameter: a payload byte costs 3 on the wire
WORLD = 8  # ranks 0-3 on node 0, 4-7 on node 1
STAGGER = 0.001  # member k calls the all-to-all at (k + 1) ms


def close(x: float) -> pytest.approx:
    return pytest.approx(x, abs=1e-12)


def _splits(n: int) -> list[list[int]]:
    """S[s][i]: uneven pieces, some empty from n = 3 (S[2][0] = 0)."""
    return [[(7 * s + 3 * i + 1) % 5 for i in range(n)] for s in range(n)]


def _input(pos: int, total: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([20 * pos + k for k in range(total)]).to(dtype)


def _exchange(ctx, members, dtype, out_dtype, splits, as_tensor=False):
    """The members call one all-to-all, staggered; each returns (its time, its output)."""
    comm = ctx.comm
    group = comm.new_group("a2a", members, 60.0)
    if ctx.rank not in members:
        return None
    pos = members.index(ctx.rank)
    sends = splits[pos]
    receives = [row[pos] for row in splits]
    x = _input(pos, sum(sends), dtype)
    out = torch.full((sum(receives),), -1).to(out_dtype)
    comm.sleep(STAGGER * (pos + 1))
    if as_tensor:  # split sizes counted in a narrow integer tensor, not Python ints
        sends = torch.tensor(sends, dtype=torch.int16)
        receives = torch.tensor(receives, dtype=torch.int16)
    comm.all_to_all(out, x, receives, sends, group)
    return comm.now(), out.tolist()


def _run(tmp_path, members, dtype=torch.float32, out_dtype=None, splits=None, as_tensor=False):
    cfg = RunConfig(strategy="sync", workers=WORLD, nodes=2, dataset="synthetic",
                    inter_node_link="8,2", out=str(tmp_path))  # fmt: skip
    sim = SimulationConfig(step_time_s=0.01, intra_node_link="16,0.5", modelled_params=SCALE)
    splits = _splits(len(members)) if splits is None else splits
    args = (members, dtype, out_dtype or dtype, splits, as_tensor)
    return run_ranks(cfg, _exchange, *args, sim=sim, actual_params=1)


def _expected_outputs(n: int, splits: list[list[int]]) -> list[list[int]]:
    """Member i's output by hand: piece (s, i) of every member s, in member order."""
    outs = []
    for i in range(n):
        out = []
        for s in range(n):
            first = sum(splits[s][:i])
            out += [20 * s + k for k in range(first, first + splits[s][i])]
        outs.append(out)
    return outs


def _expected_end(n: int, splits, element: int, payload: bool, spans: bool) -> float:
    if n < 2:  # a group of one: nothing on the wire, no rounds
        return STAGGER
    lat, bw = (LAT, BW) if spans else (LAT_IN, BW_IN)
    sent = max(sum(row) - row[s] for s, row in enumerate(splits))
    wire = sent * element * (SCALE if payload else 1)
    return STAGGER * n + (n - 1) * lat + wire / bw


GROUPS = {
    "one": [3],  # a group of one: its input copied to its output at no cost
    "2-node0": [1, 2],
    "2-across": [0, 7],
    "3-node1": [4, 6, 5],  # members in a non-rank order: positions are what count
    "3-across": [2, 3, 4],
    "4-node0": [0, 1, 2, 3],
    "4-across": [1, 3, 4, 6],
}
DTYPES = {  # element size, payload (scaled) or control data
    torch.float32: (4, True),
    torch.uint8: (1, True),
    torch.int64: (8, False),
}


CASES = [(name, torch.float32) for name in GROUPS] + [
    (name, dtype) for name in ("2-node0", "3-across") for dtype in (torch.uint8, torch.int64)
]


@pytest.mark.parametrize("name, dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_all_to_all_delivers_every_piece_and_costs_the_busiest_members_bytes(tmp_path, name, dtype):
    """Each member receives exactly its pieces, in member order; every member leaves at the
    last arrival + (n − 1) latencies + the busiest sender's (scaled) bytes / bandwidth, on the
    link the group spans."""
    members = GROUPS[name]
    n = len(members)
    splits = _splits(n)
    element, payload = DTYPES[dtype]
    spans = len({m * 2 // WORLD for m in members}) > 1
    end = _expected_end(n, splits, element, payload, spans)
    runs = _run(tmp_path, members, dtype)
    outs = _expected_outputs(n, splits)
    for pos, rank in enumerate(members):
        assert runs[rank] == (close(end), outs[pos]), (name, rank)
    assert all(runs[r] is None for r in range(WORLD) if r not in members)


def test_the_busiest_member_is_the_one_that_sends_most_to_others(tmp_path):
    """Member 0 holds the most data but keeps most of it; member 1 sends the most away:
    the cost counts member 1's 5 floats sent away, not member 0's input of 9."""
    splits = [[8, 1, 0], [2, 1, 3], [1, 0, 1]]
    runs = _run(tmp_path, [0, 1, 2], splits=splits)
    end = 3 * STAGGER + 2 * LAT_IN + 5 * 4 * SCALE / BW_IN
    outs = _expected_outputs(3, splits)
    assert [runs[r] for r in (0, 1, 2)] == [(close(end), outs[p]) for p in range(3)]


def test_split_sizes_in_a_narrow_integer_tensor_work_as_python_ints(tmp_path):
    """Split sizes may come as the elements of an int16 tensor (counts a caller computed with
    torch): the same pieces and the same time as Python ints."""
    runs = _run(tmp_path, [1, 3, 4, 6], as_tensor=True)
    splits = _splits(4)
    end = _expected_end(4, splits, 4, True, True)
    outs = _expected_outputs(4, splits)
    assert [runs[r] for r in (1, 3, 4, 6)] == [(close(end), o) for o in outs]


def test_the_all_to_all_holds_the_nics_of_the_nodes_it_spans(tmp_path):
    """A message from node 0 to node 1 posted while an all-to-all across them runs leaves
    when it ends (node 0's egress and node 1's ingress are busy); a message within node 0
    (the intra-node link, not held) goes at once."""
    splits = _splits(2)
    a2a_end = _expected_end(2, splits, 4, True, True)
    posted = 3 * STAGGER  # after the all-to-all began (2 ms), before it ends

    def script(ctx):
        comm, rank = ctx.comm, ctx.rank
        result = _exchange(ctx, [0, 7], torch.float32, torch.float32, splits)
        big = torch.zeros(250_000)  # 1e6 bytes, 3e6 on the wire
        if rank == 3:
            comm.sleep(posted)
            works = [comm.isend(big, 5, tag=1), comm.isend(big, 2, tag=1)]
            for w in works:
                w.wait()
        if rank in (5, 2):
            comm.recv(torch.empty(250_000), 3, tag=1)
            return comm.now()
        return result

    cfg = RunConfig(strategy="sync", workers=WORLD, nodes=2, dataset="synthetic",
                    inter_node_link="8,2", out=str(tmp_path))  # fmt: skip
    sim = SimulationConfig(step_time_s=0.01, intra_node_link="16,0.5", modelled_params=SCALE)
    runs = run_ranks(cfg, script, sim=sim, actual_params=1)
    assert runs[0][0] == close(a2a_end) and runs[7][0] == close(a2a_end)
    assert runs[5] == close(a2a_end + LAT + 3e6 / BW)  # queued behind the all-to-all
    assert runs[2] == close(posted + LAT_IN + 3e6 / BW_IN)  # not held: leaves at once


SPLITS_MSG = "all-to-all: a member's input splits do not fit its tensor"
PEER_MSG = "all-to-all: what a member sends is not what its peer expects"


def _bad(ctx, inputs, sends, receives):
    """Members 0 and 1 call an all-to-all with the given inputs and splits."""
    comm = ctx.comm
    group = comm.new_group("pair", [0, 1], 60.0)
    if ctx.rank > 1:
        return
    x = torch.arange(float(inputs[ctx.rank]))
    out = torch.zeros(sum(receives[ctx.rank]))
    comm.sleep(STAGGER * (ctx.rank + 1))
    comm.all_to_all(out, x, receives[ctx.rank], sends[ctx.rank], group)


@pytest.mark.parametrize(
    "inputs, sends, receives, message",
    [
        # Member 1's splits add up to 3 but its tensor holds 4; what it sends is what its
        # peer expects.
        ([3, 4], [[1, 2], [2, 1]], [[1, 2], [2, 1]], SPLITS_MSG),
        # Three splits each in a group of two (adding up to each tensor's size).
        ([3, 4], [[1, 1, 1], [2, 1, 1]], [[1, 2], [1, 1]], SPLITS_MSG),
        # Member 0 sends 2 to member 1, which expects 1 (each member's splits fit).
        ([3, 3], [[1, 2], [1, 2]], [[1, 1], [1, 2]], PEER_MSG),
    ],
    ids=["splits-short-of-tensor", "one-split-too-many", "peer-expects-other"],
)
def test_inconsistent_splits_fail_the_all_to_all_with_what_is_wrong(
    tmp_path, inputs, sends, receives, message
):
    """A member whose splits do not cut its tensor exactly, or whose pieces are not the sizes
    its peers expect, fails the all-to-all with a message that says which."""
    cfg = RunConfig(strategy="sync", workers=4, nodes=2, dataset="synthetic",
                    inter_node_link="8,2", out=str(tmp_path))  # fmt: skip
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        run_ranks(cfg, _bad, inputs, sends, receives)


# ---------------------------------------------------------------------------- messages
def _p2p_cfg(tmp_path) -> RunConfig:
    # Ranks 0, 1 on node 0; 2, 3 on node 1; the intra-node link is free (no delay).
    return RunConfig(strategy="sync", workers=4, nodes=2, dataset="synthetic",
                     inter_node_link="8,2", out=str(tmp_path))  # fmt: skip


def _measurement(ctx) -> dict[str, float]:
    """Rank 0 asks rank 2 inside ``measuring()``; rank 2 replies, then sends rank 1 a message
    of its own (1e6 bytes)."""
    comm, rank, t = ctx.comm, ctx.rank, {}
    if rank == 0:
        with comm.measuring():
            comm.send(torch.ones(10), 2, tag=3)
            reply = torch.zeros(10)
            comm.recv(reply, 2, tag=4)
            t["inside"], t["reply"] = comm.now(), reply[0].item()
        t["after"] = comm.now()
    elif rank == 2:
        request = torch.zeros(10)
        comm.recv(request, 0, tag=3)
        t["got_request"] = comm.now()
        comm.send(request * 5, 0, tag=4)  # the reply to a measurement: free
        t["replied"] = comm.now()
        comm.send(torch.zeros(250_000), 1, tag=4)  # to another rank: charged
        t["sent_other"] = comm.now()
    elif rank == 1:
        comm.recv(torch.zeros(250_000), 2, tag=4)
        t["got_other"] = comm.now()
    comm.barrier()
    t["messages"] = comm.net.messages
    return t


def test_a_measurement_and_its_reply_are_free_and_other_traffic_is_not(tmp_path):
    """A measurement's request and the reply to it arrive at once, on no link's time (the
    asker's clock is back where it was afterwards); the replier's next message to another
    rank costs latency + bytes / bandwidth as usual. Every message is counted once."""
    runs = run_ranks(_p2p_cfg(tmp_path), _measurement)
    one = LAT + 1e6 / BW
    assert runs[0] == {"inside": 0.0, "reply": 5.0, "after": 0.0, "messages": 3}
    assert runs[2] == {
        "got_request": 0.0, "replied": 0.0, "sent_other": close(one), "messages": 3
    }  # fmt: skip
    assert runs[1] == {"got_other": close(one), "messages": 3}


def _tags(ctx) -> list[float]:
    """Rank 0 sends rank 1 (same node, a free link: all arrive at t = 0) tag 6, then tag 5
    twice; rank 1 receives tag 5, tag 5, tag 6."""
    comm = ctx.comm
    if ctx.rank == 0:
        for value, tag in ((6.0, 6), (1.0, 5), (2.0, 5)):
            comm.send(torch.full((3,), value), 1, tag=tag)
    if ctx.rank != 1:
        return []
    got = []
    for tag in (5, 5, 6):
        buf = torch.zeros(3)
        comm.recv(buf, 0, tag=tag)
        got.append(buf[0].item())
    return got + [comm.now()]


def test_a_receive_takes_its_tags_messages_in_the_order_they_were_sent(tmp_path):
    """A receive matches the tag (a message of another tag in the same group waits), and of
    messages arriving at the same time takes the one sent first."""
    runs = run_ranks(_p2p_cfg(tmp_path), _tags)
    assert runs[1] == [1.0, 2.0, 6.0, 0.0]


def _other_tag_first(ctx, send_other: bool) -> int:
    """Rank 1 waits for rank 0's tag-5 message, sent at 2 ms; with ``send_other`` rank 0 sends
    it a tag-6 message (never received) at 1 ms. Returns the scheduler's task switches."""
    comm = ctx.comm
    if ctx.rank == 0:
        comm.sleep(0.001)
        if send_other:
            comm.send(torch.zeros(3), 1, tag=6)
        comm.sleep(0.001)
        comm.send(torch.ones(3), 1, tag=5)
    elif ctx.rank == 1:
        comm.recv(torch.zeros(3), 0, tag=5)
    comm.barrier()
    return comm.sched.switches


def test_a_message_for_another_tag_wakes_no_waiting_receiver(tmp_path):
    """A waiting receiver is woken only by a message it matches (group, tag and sender): the
    job takes as many task switches with an unmatched message sent to it as without."""
    plain = run_ranks(_p2p_cfg(tmp_path), _other_tag_first, False)
    other = run_ranks(_p2p_cfg(tmp_path), _other_tag_first, True)
    assert other == plain


# ---------------------------------------------------------------------------- group all-reduce
def _clock(network_model: str, intra: str | None = "16,0.5"):
    from cloudburst.sim.clock import ClockModel

    cfg = RunConfig(strategy="sync", workers=4, nodes=2, dataset="synthetic",
                    inter_node_link="8,2", out="unused")  # fmt: skip
    sim = SimulationConfig(step_time_s=0.01, intra_node_link=intra, network_model=network_model)
    return ClockModel(sim, cfg, 1, 0.01)


B = 1e8  # bytes all-reduced: 0.1 s on the inter-node link, 0.05 s on the intra-node one


@pytest.mark.parametrize("model", ["flat", "nccl"])
def test_a_group_on_one_node_all_reduces_on_the_intra_node_link(model):
    """Three ranks on one node: flat, a ring on the intra-node link, 4 latencies + 4/3 x bytes /
    bandwidth; nccl, the cheapest of ring and tree (2 x 2 latencies + 2 x bytes / bandwidth)
    there: the ring at this size. Not the inter-node link."""
    ring = 4 * LAT_IN + 4 / 3 * B / BW_IN
    assert 4 * LAT_IN + 2 * B / BW_IN > ring
    assert _clock(model).group_allreduce_s(B, [3]) == close(ring)


def test_a_group_on_one_node_with_a_free_intra_node_link_all_reduces_for_nothing():
    assert _clock("nccl", intra=None).group_allreduce_s(B, [3]) == 0.0


def test_nccl_takes_the_hierarchical_all_reduce_when_it_is_cheaper():
    """Two ranks on each of two nodes, nccl: flat on the NIC, the cheapest of ring (6 latencies
    + 1.5 x bytes / bw), tree (4 latencies + 2 x) and halving-doubling (4 latencies + 1.5 x):
    0.158 s; hierarchical, a ring of 2 in each node twice (2 x (0.5 ms + 0.025 s)) and an
    all-reduce of 2 nodes on the NIC (2 latencies + bytes / bw): 0.155 s, the cheaper."""
    flat = 4 * LAT + 1.5 * B / BW
    hier = 2 * (LAT_IN + 0.5 * B / BW_IN) + 2 * LAT + B / BW
    assert hier < flat
    assert _clock("nccl").group_allreduce_s(B, [2, 2]) == close(hier)
