"""Gossip over real gloo groups at lr 0 (an exact pull served by a busy and by a finished peer,
keep-alives for a straggler), and the CLI end to end."""

import dataclasses
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.config import RunConfig
from cloudburst.runtime import init_distributed, shutdown
from cloudburst.strategies.gossip import GossipStrategy
from tests.support import cli, final_record, rank_events, read_summary, simulated, spawn

pytestmark = pytest.mark.dist

NUMEL = 8  # nn.Linear(3, 2)


def _setup(rank: int, out: str, values: list[float], **kw):
    """The job's context (gossip, ``kw``), and nn.Linear(3, 2) of θ = ``values``, SGD at lr 0."""
    cfg = RunConfig(strategy="gossip", dataset="synthetic", out=out, comm_timeout_s=60, **kw)
    ctx = init_distributed(cfg)
    model = nn.Linear(3, 2)
    assign_flat(model, torch.tensor(values, dtype=torch.float32))
    return ctx, model, torch.optim.SGD(model.parameters(), lr=0.0)


# ---------------------------------------------------------------------------- exact pull
A, B = [float(i) for i in range(NUMEL)], [3.0 * i + 1.5 for i in range(NUMEL)]  # the 2 θs


def _pull_once(rank: int, out: str) -> dict:
    ctx, model, opt = _setup(rank, out, A if rank == 0 else B, workers=2, gossip_variant="pull")
    strategy = GossipStrategy(ctx)
    strategy.wrap(model, opt)
    strategy.start()
    if rank == 0:
        # worker 1's main thread waits in the store all through this pull: its server answers
        ctx.store.wait(["w1_busy"])
        strategy.after_step(8)
        ctx.store.set("w0_pulled", "1")

        def tell_done_sent():  # worker 0 has said DONE: it trains no more, but still serves
            while not strategy.transport._done_sent:
                threading.Event().wait(0.01)
            ctx.store.set("w0_done", "1")

        threading.Thread(target=tell_done_sent, daemon=True).start()
    else:
        ctx.store.set("w1_busy", "1")
        ctx.store.wait(["w0_pulled", "w0_done"])
        strategy.after_step(8)  # pulls from worker 0, which has finished training
    theta = flatten_params(model).tolist()
    strategy.finish()
    report = strategy.report()
    shutdown(ctx)
    return {"theta": theta, "report": report, "info": strategy.step_info()}


def test_pull_is_the_exact_average_served_by_a_busy_then_a_finished_peer(tmp_path):
    w0, w1 = spawn(_pull_once, 2, tmp_path, str(tmp_path), timeout_s=60)
    mid = [(x + y) / 2 for x, y in zip(A, B, strict=True)]
    assert w0["theta"] == mid  # exactly: (a + b)/2 is representable
    # worker 1 then pulled worker 0's snapshot published after its pull
    assert w1["theta"] == [(y + m) / 2 for y, m in zip(B, mid, strict=True)]
    for w, peer in [(w0, 1), (w1, 0)]:
        r = w["report"]
        assert w["info"]["peer"] == peer and r["gossip_rounds"] == 1
        assert r["fetches_served"] == 1 and r["pushes_received"] == 0
        theta_bytes = NUMEL * 4 + 64  # a reply: its header and θ
        assert r["sent_bytes"] == 64 + theta_bytes + 64  # FETCH, reply, DONE; received alike
        assert r["received_bytes"] == theta_bytes + 64 + 64
        assert r["intra_node_bytes"] == r["sent_bytes"] and r["inter_node_bytes"] == 0
        assert r["consensus_bytes"] > 0  # the final measurement, counted apart
    # the final consensus distance: mean_i ‖θ_i − θ̄‖ = ‖θ_0 − θ_1‖ / 2
    d = sum((x - y) ** 2 for x, y in zip(w0["theta"], w1["theta"], strict=True)) ** 0.5 / 2
    assert w0["report"]["final_consensus_distance"] == pytest.approx(d, rel=1e-6)


# ---------------------------------------------------------------------------- a straggler
SHORT_TIMEOUT_S = 4.0  # keep-alives every 1 s
STRAGGLER_STEPS, STRAGGLER_STEP_S = 20, 0.25  # 5 s in all: longer than the timeout


def _straggler(rank: int, out: str) -> dict:
    ctx, model, opt = _setup(rank, out, [float(rank)] * NUMEL, workers=3, gossip_schedule="ring")
    # gossip groups with a short timeout (the job's keep 60 s for start-up)
    dist.barrier()
    timeout = datetime.timedelta(seconds=SHORT_TIMEOUT_S)
    request, reply = (dist.new_group([0, 1, 2], timeout=timeout) for _ in range(2))
    cfg = ctx.cfg.replace(comm_timeout_s=SHORT_TIMEOUT_S)
    ctx = dataclasses.replace(ctx, cfg=cfg, groups={"requests": request, "replies": reply})
    strategy = GossipStrategy(ctx)
    strategy.wrap(model, opt)
    strategy.start()
    for _ in range(STRAGGLER_STEPS):
        if rank == 2:
            time.sleep(STRAGGLER_STEP_S)
        strategy.after_step(8)
    strategy.finish()  # raises if a serving thread timed out
    result = {"report": strategy.report()}
    shutdown(ctx)
    return result


def test_early_finisher_keeps_serving_a_straggler_past_the_timeout(tmp_path):
    # Ring: worker 2 (pulling from 0) takes 5 s, past the 4 s timeout, and sends worker 1 only
    # DONE at its end: its keep-alives alone keep worker 1's serving thread from timing out.
    w0, w1, w2 = spawn(_straggler, 3, tmp_path, str(tmp_path), timeout_s=90)
    assert w1["report"]["pings_received"] >= 1  # keep-alives were needed, and sent
    assert w1["report"]["fetches_served"] == STRAGGLER_STEPS  # worker 0's pulls
    assert w0["report"]["fetches_served"] == STRAGGLER_STEPS  # worker 2's, after 0 finished
    assert w2["report"]["fetches_served"] == STRAGGLER_STEPS  # worker 1's
    assert w2["report"]["gossip_rounds"] == STRAGGLER_STEPS


# ---------------------------------------------------------------------------- the CLI
GOSSIP_RUN = ["--strategy", "gossip", "--workers", "4", "--dataset", "synthetic", "--model",
              "mlp", "--steps", "60", "--consensus-every-steps", "20", "--log-every-steps",
              "10", "--eval-every-s", "1", "--no-progress"]  # fmt: skip


def _common_checks(out, proc, rounds: int, log_every: int = 10):
    """What every gossip run of GOSSIP_RUN ends with; its summary, steps and final records."""
    assert proc is None or "gossip" in proc.stdout
    s = read_summary(out)
    assert s["strategy"] == "gossip" and s["lost_workers"] == []
    assert s["final_test_accuracy"] > 0.5
    assert s["samples"] == 4 * 60 * 64 and s["sent_bytes"] > 0
    # every byte sent counted once as inter- or intra-node (the consensus apart)
    assert s["inter_node_bytes"] + s["intra_node_bytes"] == s["sent_bytes"]
    # each replica's accuracy is reported (the model is their mean)
    assert len(s["replica_accuracies"]) == 4
    assert s["worst_replica_accuracy"] == min(s["replica_accuracies"])
    steps = [rank_events(out, r, "step") for r in range(4)]
    finals = [final_record(out, r) for r in range(4)]
    for rank in range(4):
        assert [r["step"] for r in steps[rank]] == list(range(log_every, 61, log_every))
        assert [r["consensus_step"] for r in steps[rank] if "consensus_step" in r] == [20, 40, 60]
        assert finals[rank]["gossip_rounds"] == rounds
        assert [step for step, _ in finals[rank]["consensus_history"]] == [20, 40, 60]
    served = sum(f["fetches_served"] + f["pushes_received"] for f in finals)
    assert served == 4 * rounds  # every message served exactly once
    return s, steps, finals


def test_cli_gossip_pull_ring_every_2_steps_on_two_nodes_with_a_nan_step(tmp_path):
    out = tmp_path / "gossip"
    proc = cli("train", *GOSSIP_RUN, "--nodes", "2", "--gossip-schedule", "ring",
               "--gossip-every", "2", "--inject-fault", "nan:2@10", "--out", str(out),
               timeout_s=120)  # fmt: skip
    s, steps, finals = _common_checks(out, proc, rounds=30)
    assert s["inter_node_bytes"] > 0 and s["intra_node_bytes"] > 0
    for rank in range(4):
        assert {r["peer"] for r in steps[rank]} == {(rank + 1) % 4}  # the ring
        assert finals[rank]["fetches_served"] == 30 and finals[rank]["pushes_received"] == 0
    # nan:2@10: worker 2 alone skips its step (its gradient is its own)
    assert [f["steps_skipped_nonfinite"] for f in finals] == [0, 0, 1, 0]
    assert s["steps_skipped_nonfinite"] == 1


def test_cli_gossip_push_sum_on_the_exponential_graph(tmp_path):
    # strategy logic: on the virtual cluster (the pull test above runs it over gloo)
    out = simulated([*GOSSIP_RUN, "--gossip-variant", "push", "--gossip-push-sum",
                     "--gossip-schedule", "exponential", "--log-every-steps", "5",
                     # uneven steps: pushes arrive between steps unevenly, as on real machines
                     "--step-time-jitter", "lognormal:0.5",
                     "--out", str(tmp_path / "gossip")])  # fmt: skip
    s, steps, finals = _common_checks(out, None, rounds=60, log_every=5)
    assert s["inter_node_bytes"] == 0  # one node
    for rank in range(4):
        # step t is round t − 1, sent to worker + 2^(round mod 2)
        assert [r["peer"] for r in steps[rank]] == [
            (rank + 2 ** ((t - 1) % 2)) % 4 for t in range(5, 61, 5)
        ]
        assert finals[rank]["fetches_served"] == 0
    # push-sum weights move and add up to W; every push folded (in finish() at the latest)
    assert sum(f["push_sum_weight"] for f in finals) == pytest.approx(4.0, abs=1e-9)
    assert len({f["push_sum_weight"] for f in finals}) > 1
    assert sum(f["messages_folded"] for f in finals) == 4 * 60
