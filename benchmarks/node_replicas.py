"""Node replicas and shard placement (issue 42): one replica per node against one per rank, on
the virtual cluster at 4 nodes × 4 and 8 nodes × 8 and in real runs on 2 emulated nodes × 2;
the parameter server's step time with its shards spread over 8 nodes against all on node 0.

    .venv/bin/python benchmarks/node_replicas.py            # results/node_replicas.{md,json}
    .venv/bin/python benchmarks/node_replicas.py --quick    # smoke test, runs/bench-quick/

Virtual cluster: MNIST-1D's CNN trains, and the clock models ResNet-50 on A100s (`--profile
resnet50-a100`: 25,557,032 parameters, 2,470 img/s) with 10 Gbit/s and 0.05 ms between nodes
and 600 Gbit/s inside a node; the network model is NCCL's (node-aware rings). Every arm of one
cluster trains the same steps on the same batch per rank (equal samples): DiLoCo (H = 8, its
default outer optimizer), Streaming DiLoCo (H = 8, F = 4, τ = 1, α = 0.5) and asgd (one shard
per node, spread), each with `--replica rank` and `--replica node`. Reported per arm: the
inter-node bytes as counted (each rank's share of its collectives that span nodes) and as the
simulated NICs carried them, and the final test accuracy; paired by seed (t intervals).

Placement: asgd, 64 workers and 8 shards on 8 nodes, the shards spread (one per node) or all on
node 0, 40 steps; its training time per step, the ratio paired by seed.

Real runs: `cloudburst train --strategy diloco --workers 4 --nodes 2` with a 1 Gbit/s, 1 ms
emulated link, compute emulated by sleep (`--min-step-time-s 0.03`: the machine has 2 cores),
rank against node replicas, arms in a seeded random order per seed with an A/A copy of the
per-rank arm.

Targets, named before these runs from a pilot on seed 0 (DiLoCo 4 × 4: node replicas 70.7 %
against 67.4 %; placement: spread 28.8 against first 51.1 virtual s for 40 steps): node
replicas end no more than 0.5 points below per-rank replicas (equal samples); counted inter-node
bytes ≤ 1/G of per-rank replicas' (G workers per node); spread shards ≤ 0.8× the step time of
shards on node 0; real runs: node replicas' step time ≤ 1.15× per-rank's and accuracy within
−1 point. Seeds 1 to 5 confirm.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Arm, fmt, pct  # noqa: E402

CLOCK = ["--profile", "resnet50-a100", "--inter-node-link", "10,0.05",
         "--intra-node-link", "600,0.002"]  # fmt: skip
DATA = ["--batch-size", "32", "--train-size", "40000", "--test-size", "1000",
        "--checkpoint-every", "0", "--comm-timeout-s", "86400"]  # fmt: skip
STRATEGIES = {
    "diloco": ["--strategy", "diloco", "--period", "8"],
    "streaming": [
        "--strategy",
        "diloco",
        "--period",
        "8",
        "--fragments",
        "4",
        "--fragment-delay",
        "1",
        "--fragment-alpha",
        "0.5",
    ],  # fmt: skip
    "asgd": ["--strategy", "asgd"],
}
CLUSTERS = {(4, 4): 300, (8, 8): 200}  # (nodes, workers per node): steps per worker
ACC_TARGET, PLACEMENT_TARGET, REAL_TIME_TARGET, REAL_ACC_TARGET = -0.5, 0.8, 1.15, -1.0
PILOT, CONFIRM = (0,), (1, 2, 3, 4, 5)


def sim_arm(strategy: str, nodes: int, per_node: int, replica: str, steps: int) -> Arm:
    w = nodes * per_node
    servers = ["--servers", str(nodes)] if strategy == "asgd" else []
    return Arm(
        f"{strategy} {nodes}x{per_node} {replica}",
        [
            *STRATEGIES[strategy],
            "--workers",
            str(w),
            "--nodes",
            str(nodes),
            *servers,
            "--replica",
            replica,
            "--steps",
            str(steps),
            "--eval-every-s",
            "1000",
            *DATA,
            *CLOCK,
        ],  # fmt: skip
    )


def placement_arm(placement: str, steps: int) -> Arm:
    return Arm(
        f"asgd 8x8 S=8 {placement}",
        [
            "--strategy",
            "asgd",
            "--workers",
            "64",
            "--servers",
            "8",
            "--nodes",
            "8",
            "--shard-placement",
            placement,
            "--n-sync",
            "4",
            "--steps",
            str(steps),
            "--eval-every-s",
            "1000",
            *DATA,
            *CLOCK,
        ],  # fmt: skip
    )


REAL = ["--strategy", "diloco", "--period", "8", "--workers", "4", "--nodes", "2",
        "--inter-node-link", "1,1", "--min-step-time-s", "0.03", "--model", "mlp",
        "--batch-size", "32", "--eval-every-s", "1000", "--checkpoint-every", "0"]  # fmt: skip


def per_step_s(r: harness.Run) -> float | None:
    steps = r.summary.get("steps_done") or {}
    n = max((v or 0 for v in steps.values()), default=0)
    t = r.summary.get("train_time_s")
    return t / n if n and t else None


def main() -> None:
    args, prov = harness.start(__doc__)
    quick, root = args.quick, prov.runs_dir("node_replicas")
    seeds = PILOT if quick else CONFIRM
    report = harness.Report("node_replicas", "Node replicas and shard placement", prov)
    report.settings(harness.about(__doc__))

    # 1. node against rank replicas, virtual cluster
    clusters = {(2, 2): 20} if quick else CLUSTERS
    jobs = []
    for (nodes, g), steps in clusters.items():
        for strategy in STRATEGIES:
            for replica in ("rank", "node"):
                arm = sim_arm(strategy, nodes, g, replica, steps)
                jobs += [(arm, s, root / harness.slug(arm.name) / f"seed{s}") for s in seeds]
    runs = harness.simulate_all(jobs, prov, timeout_s=3600.0)
    groups = harness.by_arm(runs)
    rows = []
    for (nodes, g), steps in clusters.items():
        for strategy in STRATEGIES:
            rank = groups[sim_arm(strategy, nodes, g, "rank", steps).name]
            node = groups[sim_arm(strategy, nodes, g, "node", steps).name]
            if any(r.failed for r in rank + node):
                rows.append([strategy, f"{nodes} × {g}", "FAILED", "", "", "", "", ""])
                continue
            counted = [n.summary["inter_node_bytes"] / r.summary["inter_node_bytes"]
                       for n, r in zip(node, rank, strict=True)]  # fmt: skip
            nic = [sum(n.summary["simulated_node_nic_bytes"])
                   / sum(r.summary["simulated_node_nic_bytes"])
                   for n, r in zip(node, rank, strict=True)]  # fmt: skip
            acc_r = [r.final_accuracy for r in rank]
            acc_n = [n.final_accuracy for n in node]
            where = f"{strategy}, {nodes} nodes × {g}"
            report.claim(f"counted inter-node bytes, node ÷ rank replicas, {where}",
                         max(counted), f"≤ {1 / g:.3g} (1/G)", max(counted) <= 1 / g,
                         seeds=len(seeds))  # fmt: skip
            if len(seeds) > 1:
                harness.diff_claim(
                    report, f"final accuracy, node − rank replicas (points), {where}", acc_n,
                    acc_r, f"≥ {ACC_TARGET:g}", lambda d, lo, hi: lo >= ACC_TARGET,
                    seeds=len(seeds))  # fmt: skip
            rows.append([strategy, f"{nodes} × {g}", steps,
                         fmt(sum(r.summary["inter_node_bytes"] for r in rank) / len(rank)),
                         fmt(sum(n.summary["inter_node_bytes"] for n in node) / len(node)),
                         fmt(sum(nic) / len(nic)), " ".join(pct(a) for a in acc_r),
                         " ".join(pct(a) for a in acc_n)])  # fmt: skip
    report.section("1. One replica per node against one per rank (virtual cluster)").text(
        "Counted bytes: each rank's share of the collectives that span nodes (a ring "
        "all-reduce of n ranks: 2(n − 1)/n of the vector from each), summed over the ranks: "
        "n = W with per-rank replicas, N with node replicas. Simulated NIC bytes: what each "
        "node's NIC carried (egress + ingress) on the modelled wire, ResNet-50's θ, the rings "
        "node-aware as NCCL builds them (a ring over W ranks of N nodes crosses each NIC "
        "once): node replicas save less there than the counts say. Equal steps per rank; "
        "the accuracy is the final global model's, per seed."
    ).table("strategy | cluster | steps | counted bytes, rank | counted bytes, node | "
            "simulated NIC bytes node ÷ rank | accuracy rank (per seed) | "
            "accuracy node (per seed)", rows)  # fmt: skip

    # 2. shard placement at 8 nodes
    steps = 10 if quick else 40
    arms = [placement_arm(p, steps) for p in ("spread", "first")]
    jobs = [(a, s, root / harness.slug(a.name) / f"seed{s}") for a in arms for s in seeds]
    place_runs = harness.simulate_all(jobs, prov, timeout_s=3600.0)
    runs += place_runs
    pg = harness.by_arm(place_runs)
    spread, first = pg[arms[0].name], pg[arms[1].name]
    rows = []
    if not any(r.failed for r in spread + first):
        a, b = [per_step_s(r) for r in spread], [per_step_s(r) for r in first]
        harness.ratio_claim(report, "asgd step time, shards spread ÷ all on node 0, 8 × 8, S = 8",
                            a, b, None, f"≤ {PLACEMENT_TARGET:g}",
                            lambda x: x <= PLACEMENT_TARGET)  # fmt: skip
        for r in spread + first:
            nic = r.summary["simulated_node_nic_bytes"]
            rows.append([r.arm, r.seed, fmt(per_step_s(r)), fmt(max(nic) / (sum(nic) / len(nic))),
                         fmt(max(r.summary["node_nic_bytes"])
                             / (sum(r.summary["node_nic_bytes"]) / len(nic)))])  # fmt: skip
    report.section("2. Shard placement: 64 workers, 8 shards, 8 nodes (virtual cluster)").text(
        f"asgd, n_sync 4, {steps} steps per worker; the training time per step (virtual "
        "seconds) and each placement's busiest node NIC against the mean node's."
    ).table("arm | seed | s per step | simulated NIC max ÷ mean | counted max ÷ mean", rows)

    # 3. real runs, 2 nodes × 2, 1 Gbit/s
    real_arms = [Arm("diloco 2x2 rank", [*REAL, "--replica", "rank",
                                         "--steps", "60" if quick else "400"]),
                 Arm("diloco 2x2 node", [*REAL, "--replica", "node",
                                         "--steps", "60" if quick else "400"])]  # fmt: skip
    real = harness.interleave(real_arms, seeds, control="diloco 2x2 rank", prov=prov,
                              out_root=root / "real", timeout_s=900.0)  # fmt: skip
    runs += real
    rg = harness.by_arm(real)
    r_rank, r_node, r_aa = (rg[n] for n in ("diloco 2x2 rank", "diloco 2x2 node",
                                            harness.aa_name("diloco 2x2 rank")))  # fmt: skip
    if not any(r.failed for r in r_rank + r_node + r_aa):
        harness.ratio_claim(report, "real 2 × 2 at 1 Gbit/s: step time, node ÷ rank replicas",
                            [per_step_s(r) for r in r_node], [per_step_s(r) for r in r_rank],
                            [per_step_s(r) for r in r_aa], f"≤ {REAL_TIME_TARGET:g}",
                            lambda x: x <= REAL_TIME_TARGET)  # fmt: skip
        if len(seeds) > 1:
            harness.diff_claim(
                report, "real 2 × 2: final accuracy, node − rank replicas (points)",
                [r.final_accuracy for r in r_node], [r.final_accuracy for r in r_rank],
                f"≥ {REAL_ACC_TARGET:g}", lambda d, lo, hi: lo >= REAL_ACC_TARGET,
                seeds=len(seeds))  # fmt: skip
        rows = [[r.arm, r.seed, r.position, fmt(per_step_s(r)), pct(r.final_accuracy),
                 r.summary.get("inter_node_bytes")] for r in real]  # fmt: skip
        report.section("3. Real runs: 2 emulated nodes × 2 workers, 1 Gbit/s").text(
            "DiLoCo, H = 8, the MLP, 400 steps per worker, compute emulated by sleep (30 ms a "
            "step): what is measured is the communication. Arms in a seeded random order per "
            "seed (position), with an A/A copy of the per-rank arm."
        ).table("arm | seed | position | s per step | final accuracy | inter-node bytes", rows)
    report.write(runs)


if __name__ == "__main__":
    main()
