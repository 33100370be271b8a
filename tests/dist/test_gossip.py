"""Gossip over real gloo groups: the real strategy and transport with zero learning rate
(exact pull average, consensus for every schedule and variant), a slow peer that does not
block a pull, and the CLI end to end."""

import json

import pytest

from tests.helpers import cli, read_summary, spawn

pytestmark = pytest.mark.dist

NUMEL = 8  # nn.Linear(3, 2)


def _setup(rank: int, out: str, workers: int, **gossip):
    import torch
    from torch import nn

    from cloudburst.config import RunConfig
    from cloudburst.runtime import init_distributed

    cfg = RunConfig(
        strategy="gossip",
        workers=workers,
        dataset="synthetic",
        out=out,
        comm_timeout_s=60,
        **gossip,
    )
    ctx = init_distributed(cfg)
    model = nn.Linear(3, 2)
    return ctx, model, torch.optim.SGD(model.parameters(), lr=0.0)


def _set(model, values) -> None:
    import torch

    from cloudburst.comm.flat import assign_flat

    assign_flat(model, torch.tensor(values, dtype=torch.float32))


def _flat(model) -> list[float]:
    from cloudburst.comm.flat import flatten_params

    return flatten_params(model).tolist()


# ---------------------------------------------------------------------------- exact pull
def _pull_once(rank: int, out: str) -> dict:
    from cloudburst.runtime import shutdown
    from cloudburst.strategies.gossip import GossipStrategy

    ctx, model, opt = _setup(rank, out, 2, gossip_variant="pull")
    a = [float(i) for i in range(NUMEL)]
    b = [3.0 * i + 1.5 for i in range(NUMEL)]
    _set(model, a if rank == 0 else b)
    strategy = GossipStrategy(ctx)
    strategy.wrap(model, opt)
    strategy.start()
    if rank == 1:  # worker 0 pulls first, from worker 1's θ = b
        ctx.store.wait(["w0_pulled"])
    strategy.after_step(8)
    if rank == 0:
        ctx.store.set("w0_pulled", "1")
    after_step = _flat(model)
    strategy.finish()
    report = strategy.report()
    shutdown(ctx)
    return {"theta": after_step, "report": report, "info": strategy.step_info()}


def test_pull_between_two_workers_is_the_exact_average(tmp_path):
    w0, w1 = spawn(_pull_once, 2, tmp_path, str(tmp_path), timeout_s=60)
    a = [float(i) for i in range(NUMEL)]
    b = [3.0 * i + 1.5 for i in range(NUMEL)]
    mid = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
    assert w0["theta"] == mid  # exactly: (a + b)/2 is representable
    # Worker 1 then pulled worker 0's snapshot, published after its pull.
    assert w1["theta"] == [(y + m) / 2 for y, m in zip(b, mid, strict=True)]
    for w, peer in [(w0, 1), (w1, 0)]:
        r = w["report"]
        assert w["info"]["peer"] == peer and r["gossip_rounds"] == 1
        assert r["fetches_served"] == 1 and r["pushes_received"] == 0
        # One FETCH header out, one reply (header + θ) in; one reply out, one FETCH in; DONE.
        theta_bytes = NUMEL * 4 + 64
        assert r["bytes_sent"] == 64 + theta_bytes + 64  # FETCH, reply, DONE
        assert r["bytes_received"] == theta_bytes + 64 + 64
        assert r["intra_node_bytes"] == r["bytes_sent"] and r["inter_node_bytes"] == 0
        assert r["consensus_bytes"] > 0  # the final measurement, counted apart
    # The final consensus distance: mean_i ‖θ_i − θ̄‖ = ‖θ_0 − θ_1‖ / 2.
    d = sum((x - y) ** 2 for x, y in zip(w0["theta"], w1["theta"], strict=True)) ** 0.5 / 2
    assert w0["report"]["final_consensus_distance"] == pytest.approx(d, rel=1e-6)


# ---------------------------------------------------------------------------- consensus
VARIANTS = [
    {"gossip_variant": "pull", "gossip_schedule": "random"},
    {"gossip_variant": "pull", "gossip_schedule": "ring"},
    {"gossip_variant": "pull", "gossip_schedule": "exponential"},
    {"gossip_variant": "push", "gossip_schedule": "ring", "gossip_every": 2},
    {"gossip_variant": "push", "gossip_schedule": "random", "gossip_push_sum": True},
    {"gossip_variant": "push", "gossip_schedule": "exponential", "gossip_push_sum": True},
]
ROUNDS = 80  # gossip rounds per variant (steps: ROUNDS × gossip_every)


def _consensus(rank: int, out: str) -> list[dict]:
    import dataclasses

    from cloudburst.runtime import shutdown
    from cloudburst.strategies.gossip import GossipStrategy

    ctx, model, opt = _setup(rank, out, 4)
    results = []
    for variant in VARIANTS:
        # One job, one set of gossip groups, one strategy after the other: each finish
        # returns only once every worker's serving thread has exited.
        steps = ROUNDS * variant.get("gossip_every", 1)
        cfg = dataclasses.replace(ctx.cfg, consensus_every_steps=steps // 2, **variant)
        start = [float((rank + 1) * (i - 3) + 10 * rank) for i in range(NUMEL)]
        _set(model, start)
        strategy = GossipStrategy(dataclasses.replace(ctx, cfg=cfg))
        strategy.wrap(model, opt)
        initial = strategy.consensus_distance()
        strategy.start()
        for _ in range(steps):
            strategy.after_step(8)
        strategy.finish()
        results.append(
            {"initial": initial, "theta": _flat(model), "start": start, "report": strategy.report()}
        )
    shutdown(ctx)
    return results


def test_consensus_distance_falls_to_zero_for_every_schedule_and_variant(tmp_path):
    ranks = spawn(_consensus, 4, tmp_path, str(tmp_path), timeout_s=120)
    for k, variant in enumerate(VARIANTS):
        runs = [r[k] for r in ranks]
        report = runs[0]["report"]
        steps = ROUNDS * variant.get("gossip_every", 1)
        assert report["gossip_rounds"] == ROUNDS, variant
        assert [s for s, _ in report["consensus_history"]] == [steps // 2, steps]
        assert runs[0]["initial"] > 10
        assert report["final_consensus_distance"] < 1e-4 * runs[0]["initial"], variant
        served = sum(r["report"]["fetches_served"] + r["report"]["pushes_received"] for r in runs)
        assert served == 4 * ROUNDS, variant  # every message was served exactly once
        if variant.get("gossip_push_sum"):
            # Push-sum keeps Σ w_i = W and Σ w_i θ_i = Σ θ_i(0): the consensus is the average.
            weights = [r["report"]["push_sum_weight"] for r in runs]
            assert sum(weights) == pytest.approx(4.0, abs=1e-12)
            mean0 = [sum(r["start"][i] for r in runs) / 4 for i in range(NUMEL)]
            for r in runs:
                assert r["theta"] == pytest.approx(mean0, abs=1e-4)


# ---------------------------------------------------------------------------- a slow peer
SLEEP_S = 3.0


def _slow_peer(rank: int, out: str) -> dict:
    import time

    from cloudburst.runtime import shutdown
    from cloudburst.strategies.gossip import GossipStrategy

    ctx, model, opt = _setup(rank, out, 2, gossip_variant="pull")
    _set(model, [float(rank)] * NUMEL)
    strategy = GossipStrategy(ctx)
    strategy.wrap(model, opt)
    strategy.start()
    result = {}
    if rank == 1:
        ctx.store.set("w1_in_step", "1")
        time.sleep(SLEEP_S)  # a long step: the main thread is busy, the serving thread is not
        ctx.store.set("w1_step_done", "1")
    else:
        ctx.store.wait(["w1_in_step"])
        t0 = time.perf_counter()
        strategy.after_step(8)  # pulls from worker 1
        result["pull_s"] = time.perf_counter() - t0
        result["peer_still_in_step"] = not ctx.store.check(["w1_step_done"])
        result["theta"] = _flat(model)
    if rank == 1:
        strategy.after_step(8)  # pulls from worker 0, which has finished its steps
        result["theta"] = _flat(model)
    strategy.finish()
    result["report"] = strategy.report()
    shutdown(ctx)
    return result


def test_a_slow_peer_does_not_block_a_pull(tmp_path):
    w0, w1 = spawn(_slow_peer, 2, tmp_path, str(tmp_path), timeout_s=60)
    # Worker 1's serving thread answered while its main thread was still inside its step.
    assert w0["peer_still_in_step"]
    assert w0["pull_s"] < 1.0 < SLEEP_S
    assert w0["theta"] == [0.5] * NUMEL
    # Worker 0, already finished, still answered worker 1's pull (with its final θ).
    assert w1["theta"] == [0.75] * NUMEL
    assert w0["report"]["fetches_served"] == 1 and w1["report"]["fetches_served"] == 1


# ---------------------------------------------------------------------------- a straggler
SHORT_TIMEOUT_S = 4.0
STRAGGLER_STEP_S = 2.5


def _straggler(rank: int, out: str) -> dict:
    import dataclasses
    import datetime
    import time

    import torch.distributed as dist

    from cloudburst.runtime import shutdown
    from cloudburst.strategies.gossip import GossipStrategy

    ctx, model, opt = _setup(rank, out, 3, gossip_schedule="ring")
    # Gossip groups with a short timeout (the job's own groups keep 60 s for start-up).
    dist.barrier()
    timeout = datetime.timedelta(seconds=SHORT_TIMEOUT_S)
    request, reply = (dist.new_group([0, 1, 2], timeout=timeout) for _ in range(2))
    cfg = dataclasses.replace(ctx.cfg, comm_timeout_s=SHORT_TIMEOUT_S)
    ctx = dataclasses.replace(ctx, cfg=cfg, gossip_request_group=request, gossip_reply_group=reply)
    _set(model, [float(rank)] * NUMEL)
    strategy = GossipStrategy(ctx)
    strategy.wrap(model, opt)
    strategy.start()
    t0 = time.perf_counter()
    for _ in range(4):
        if rank == 2:
            time.sleep(STRAGGLER_STEP_S)
        strategy.after_step(8)
    strategy.finish()
    result = {"finish_s": time.perf_counter() - t0, "report": strategy.report()}
    shutdown(ctx)
    return result


def test_early_finisher_keeps_serving_a_straggler_past_the_timeout(tmp_path):
    # Ring: 0 pulls from 1, 1 from 2, 2 from 0. Workers 0 and 1 finish at once; worker 2
    # takes 4 × 2.5 s and never sends worker 1 a request, only keep-alives: without them
    # worker 1's serving thread would time out waiting for worker 2's DONE.
    w0, w1, w2 = spawn(_straggler, 3, tmp_path, str(tmp_path), timeout_s=90)
    assert w1["finish_s"] > 2 * SHORT_TIMEOUT_S  # it waited (and served) that long
    assert w1["report"]["pings_received"] >= 3 and w1["report"]["fetches_served"] == 4
    assert w0["report"]["fetches_served"] == 4  # worker 2's pulls, all after 0 finished
    assert w2["report"]["gossip_rounds"] == 4


# ---------------------------------------------------------------------------- the CLI
@pytest.mark.e2e
@pytest.mark.parametrize(
    "extra",
    [
        ["--nodes", "2"],  # pull, random peers; two emulated nodes of two workers
        ["--gossip-variant", "push", "--gossip-push-sum", "--gossip-schedule", "exponential"],
    ],
    ids=["pull-2nodes", "push-sum"],
)
def test_cli_gossip_run_finishes_with_summary_and_accuracy(tmp_path, extra):
    out = tmp_path / "gossip"
    proc = cli(
        "train",
        "--strategy",
        "gossip",
        "--workers",
        "4",
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--steps",
        "100",
        "--consensus-every-steps",
        "25",
        "--log-every-steps",
        "25",
        "--eval-every-s",
        "1",
        "--no-progress",
        "--out",
        str(out),
        *extra,
        timeout_s=120,
    )
    assert "gossip" in proc.stdout
    s = read_summary(out)
    assert s["strategy"] == "gossip" and s["lost_workers"] == []
    assert s["final_test_accuracy"] > 0.5
    assert s["samples"] == 4 * 100 * 64 and s["bytes_sent"] > 0
    # Every byte sent is counted once as inter- or intra-node (the consensus apart).
    assert s["inter_node_bytes"] + s["intra_node_bytes"] == s["bytes_sent"]
    assert (s["inter_node_bytes"] > 0) == ("--nodes" in extra)
    served = 0
    for rank in range(4):
        records = [json.loads(x) for x in (out / "metrics" / f"rank{rank}.jsonl").open()]
        steps = [r for r in records if r["event"] == "step"]
        final = next(r for r in records if r["event"] == "final")
        assert all(0 <= r["peer"] < 4 and r["peer"] != rank for r in steps)
        assert [r["consensus_step"] for r in steps if "consensus_step" in r] == [25, 50, 75, 100]
        assert final["gossip_rounds"] == 100 and final["final_consensus_distance"] >= 0
        served += final["fetches_served"] + final["pushes_received"]
    assert served == 4 * 100
