"""DASO over real gloo groups: the merge and its rotation; B = S = 0 against synchronous SGD;
S = 2 against tests/reference.py's daso; and an adaptive schedule's records and plot."""

import os

import pytest
import torch
from torch import nn

from cloudburst.comm.flat import assign_flat, flatten_params
from cloudburst.config import RunConfig
from cloudburst.runtime import init_distributed, shutdown
from cloudburst.strategies.daso import DasoStrategy
from tests.support import (cli, final_record, rank_events, read_summary, saved_state, simulated, spawn, DASO_REF_STEPS, assert_follows_reference, daso_reference_cfg, daso_reference_drive, daso_reference_run)
from tests.reference import COMMON, assert_same_params, sync_sgd, trained

pytestmark = pytest.mark.dist


def _merge_rank(rank: int, out: str, nodes: int, waits: list[int], compress: str) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    cfg = RunConfig(strategy="daso", workers=world, nodes=nodes, dataset="synthetic",
                    daso_downcast="none" if compress == "none" else "bf16", compress=compress,
                    out=out, comm_timeout_s=60)  # fmt: skip
    ctx = init_distributed(cfg)
    model = nn.Linear(2, 2)  # 6 parameters
    strategy = DasoStrategy(ctx)
    strategy.configure(steps_per_epoch=100, total_steps=1000)
    strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0))
    senders, results = [], []
    for k, s in enumerate(waits):  # syncs in a row: the sending local rank rotates
        # node n sends θ = n + 1 + 10k; θ_local = -1 at the merge
        assign_flat(model, torch.full((6,), float(ctx.node + 1 + 10 * k)))
        strategy._start_sync(s=s)
        senders.append(strategy.pending.sender)
        assign_flat(model, torch.full((6,), -1.0))
        strategy._merge()
        results.append(flatten_params(model).tolist())
    shutdown(ctx)
    return {"node": ctx.node, "senders": senders, "results": results,
            "global_bytes": strategy.global_bytes,
            "inter_node_bytes": strategy.stats.inter_node_bytes}  # fmt: skip


# 2 nodes of 2 ranks (each sends twice), 3 nodes of 1; int8 exact (θ constant per node).
@pytest.mark.parametrize(
    "nodes, per_node, waits, compress",
    [(2, 2, [0, 2, 0, 2], "none"), (3, 1, [1, 1], "none"), (2, 2, [0, 2, 0, 2], "int8")],
)
def test_merge_and_rotation_over_gloo(tmp_path, nodes, per_node, waits, compress):
    world = nodes * per_node
    results = spawn(_merge_rank, world, tmp_path, str(tmp_path), nodes, waits, compress)
    for r in results:
        for k, s in enumerate(waits):
            sent_sum = sum(n + 1 + 10 * k for n in range(nodes))
            expected = (2 * s * -1.0 + sent_sum) / (2 * s + nodes)
            assert r["results"][k] == pytest.approx([expected] * 6)
        # The k-th sync of a node is sent by its local rank k mod G (global rank node·G + k).
        assert r["senders"] == [r["node"] * per_node + k % per_node for k in range(len(waits))]
    # per node and sync: θ's 6 fp32 values, or one int8 block (256 values) and its scale
    per_sync = 6 * 4 if compress == "none" else 256 + 4
    assert sum(r["global_bytes"] for r in results) == nodes * len(waits) * per_sync
    if compress == "int8":  # counted as sent: an all-gather, (nodes − 1) pieces per sender
        inter = sum(r["inter_node_bytes"] for r in results)
        assert inter == nodes * len(waits) * (nodes - 1) * per_sync


def _reference_rank(rank: int, out: str, wait: int) -> list[list[float]]:
    ctx = init_distributed(daso_reference_cfg(out, wait))
    try:
        return daso_reference_drive(ctx)
    finally:
        shutdown(ctx)


def test_daso_with_a_delayed_merge_follows_the_reference_over_gloo(tmp_path):
    # tests/unit/test_daso_sync.py's, over gloo and DDP: S = 2, B = 3, L = 2, 2 nodes × 2.
    runs = spawn(_reference_rank, 4, tmp_path, str(tmp_path), 2)
    assert_follows_reference(runs, daso_reference_run(2), DASO_REF_STEPS)


def test_daso_blocking_every_batch_in_chunks_equals_sync_sgd(tmp_path):
    # fp32 averages in chunks of 1000 of 5210 values: a chunk left out would show.
    out = tmp_path / "daso"
    args = ["--strategy", "daso", "--workers", "4", "--nodes", "2", "--steps", "30",
        "--daso-global-skip", "0", "--daso-batches-to-wait", "0", "--daso-warmup-epochs", "0",
        "--daso-cooldown-epochs", "0", "--daso-downcast", "none", "--daso-chunk-elements",
        "1000", "--out", str(out), *COMMON]  # fmt: skip
    cli("train", *args)
    sim = simulated(args)  # the same job on the virtual cluster
    assert_same_params(trained(out), sync_sgd(30, workers=4))
    assert_same_params(trained(sim), trained(out))  # the simulator == gloo


# 10 steps an epoch; 8 epochs: warm-up, 6 cycling, cool-down. A 99 % lower loss (stability)
# never comes: each cycling epoch after the first halves B and S; B = 1 resets to 6 (S = 1).
STEPS_PER_EPOCH = 10
ADAPTIVE = ["--strategy", "daso", "--workers", "4", "--nodes", "2", "--dataset", "synthetic",
            "--model", "mlp", "--train-size", "640", "--test-size", "200", "--batch-size", "16",
            "--epochs", "8", "--lr", "0.01", "--daso-warmup-epochs", "1",
            "--daso-cooldown-epochs", "1", "--daso-global-skip", "4", "--daso-batches-to-wait",
            "2", "--daso-max-global-skips", "6", "--daso-stability-level", "0.99",
            "--daso-patience", "1", "--daso-skip-reduction-factor", "2", "--daso-downcast",
            "fp16", "--log-every-steps", "1", "--eval-every-s", "1000", "--no-progress",
            "--inject-fault", "nan:1@3"]  # fmt: skip
# (B, S) after k epochs have ended, k = 0 .. 8
SCHEDULE = [(4, 2), (4, 2), (4, 2), (2, 1), (1, 1), (6, 1), (3, 1), (1, 1), (1, 1)]


def _phase(step: int) -> str:
    epoch = (step - 1) // STEPS_PER_EPOCH
    return "warmup" if epoch == 0 else "cooldown" if epoch == 7 else "cycling"


def test_adaptive_schedule_phases_fp16_and_the_plot_marks(tmp_path, monkeypatch):
    import matplotlib.axes

    from cloudburst.cli.plot import plot_runs

    # The schedule is the strategy's logic: on the virtual cluster (gloo is covered above).
    out = simulated([*ADAPTIVE, "--out", str(tmp_path / "adaptive")])
    s = read_summary(out)
    assert s["steps_per_worker"] == 80
    for rank in range(4):
        steps = rank_events(out, rank, "step")
        assert [r["step"] for r in steps] == list(range(1, 81))
        # each step: the phase it started in, B and S once it ended
        got = [(r["phase"], r["B"], r["S"]) for r in steps]
        want = [(_phase(t), *SCHEDULE[t // STEPS_PER_EPOCH]) for t in range(1, 81)]
        assert got == want, f"rank {rank}"
        final = final_record(out, rank)
        assert (final["final_B"], final["final_S"]) == SCHEDULE[-1]
        assert final["phase_steps"] == {"warmup": 10, "cycling": 60, "cooldown": 10}
        # non-blocking syncs every B cycling steps; blocking ones every warm-up and cool-down
        # step, at each cycling epoch's end, and in finish()
        log = [(step, phase, b, wait) for step, phase, b, wait in final["sync_log"]]
        blocking = list(range(1, 11)) + [20, 30, 40, 50, 60, 70] + list(range(71, 81)) + [80]
        assert [step for step, _, _, wait in log if wait == 0] == blocking, f"rank {rank}"
        cycling = [
            (t, "cycling", *SCHEDULE[(t - 1) // STEPS_PER_EPOCH])
            for t in range(11, 71)
            if t % STEPS_PER_EPOCH and t % SCHEDULE[(t - 1) // STEPS_PER_EPOCH][0] == 0
        ]
        assert [entry for entry in log if entry[3]] == cycling, f"rank {rank}"
    # blocking syncs in fp16 (--daso-downcast), non-blocking in fp32 (the cycling default);
    # the k-th sync is sent by local rank k mod 2
    numel = sum(v.numel() for v in saved_state(out).values())
    log = final_record(out, 0)["sync_log"]
    for rank in range(4):
        sent = [wait for k, (_, _, _, wait) in enumerate(log) if k % 2 == rank % 2]
        expected = sum(numel * (4 if wait else 2) for wait in sent)
        assert final_record(out, rank)["global_bytes"] == expected, f"rank {rank}"
    # nan:1@3: node 0's averaged gradient is NaN, both its ranks skip the step; node 1 not
    assert [final_record(out, r)["steps_skipped_nonfinite"] for r in range(4)] == [1, 1, 0, 0]
    assert s["steps_skipped_nonfinite"] == 2

    # finish's fp16 average: 2θ is an fp16 number, seldom a bf16 one
    theta2 = torch.cat([2 * v.reshape(-1) for v in saved_state(out).values()])
    assert torch.equal(theta2.half().float(), theta2)
    assert (theta2.bfloat16().float() != theta2).float().mean() > 0.5

    # the plot marks where cycling and cool-down began (worker 0's step records)
    steps = {r["step"]: r for r in rank_events(out, 0, "step")}
    marks = []
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline", lambda self, x, **kw: marks.append(x))
    plot_runs([str(out)], str(tmp_path / "curves.png"))
    assert sorted(marks) == sorted(
        [steps[11]["time_s"], steps[71]["time_s"], steps[11]["samples"] * 4,
         steps[71]["samples"] * 4]
    )  # fmt: skip
    assert (tmp_path / "curves.png").stat().st_size > 0
