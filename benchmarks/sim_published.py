"""The virtual cluster's cost model against published measurements nobody here wrote (issue 30
item 2): Goyal et al. 2017, Horovod's 16-GPU table, nccl-tests on 2 × p4de, and a held-out case.

Each prediction is ``ClockModel`` (``--network-model nccl``) for the published configuration;
nothing is timed. Every assumption and target was stated before any prediction was computed.
Beside each row, a null model (perfect scaling; for nccl-tests a flat ring at line rate with no
latency): a row the null model also gets within the tolerance does not discriminate, and the
count of rows that hold leaves it out (issue 40).
Details: benchmarks/README.md.

    .venv/bin/python benchmarks/sim_published.py [--force]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

# ---------------------------------------------------------------------------- the cases
# Goyal et al. 2017 (arXiv 1706.02677 §4.3, §5.5): ResNet-50, 8 P100 per server (NVLink),
# 50 Gbit/s Ethernet, 32 images per GPU; backward ≈ 120 ms on one P100.
GOYAL = {
    "params": 25_557_032, "backward_s": 0.120, "per_node": 8,
    "intra": "160,0.01",  # assumed: NCCL over NVLink 1.0 at 20 GB/s, 10 µs a step
    "inter": "50,0.03",  # 50 Gbit/s Ethernet; assumed 30 µs a message (TCP, Gloo)
    "rise_352": 1.12,  # time per iteration at 352 GPUs ÷ at 8
    "efficiency_256": 0.90,  # ≈ 90 % scaling efficiency from 8 to 256 GPUs
}  # fmt: skip
# Horovod README (2017): 4 servers × 4 Pascal GPUs, 25 Gbit/s RoCE, batch 64 per GPU.
HOROVOD = {
    "per_node": 4, "batch": 64,
    "intra": "96,0.01",  # assumed: PCIe 3.0 x16 at 12 GB/s, 10 µs a step
    "inter": "25,0.01",  # 25 Gbit/s RoCE; assumed 10 µs a message
    # model: (parameters, one GPU images/s, ring images/s at 16, TCP at 16, PS at 16)
    "models": {
        "Inception V3": (23_851_784, 134.4, 2022.6, 1990.7, 1345.8),
        "ResNet-101": (44_549_160, 119.4, 1746.2, 1685.1, 959.6),
        "VGG-16": (138_357_544, 130.9, 1787.4, 1308.7, 74.7),
    },
}  # fmt: skip
# nccl-tests all_reduce_perf on 2 × p4de.24xlarge (16 A100, NVSwitch, 400 Gbit/s EFA a node).
NCCL_TESTS = {
    "per_node": 8,
    "intra": "2400,0.005",  # assumed: NVLink 3 at 300 GB/s a direction, 5 µs a step
    "inter": "400,0.02",  # 400 Gbit/s EFA; assumed 20 µs a message (SRD)
    # bytes: published µs
    "points": {8: 164.0, 64 * 2**20: 2644.6, 2 * 2**30: 51406.0},
}
# Held out, named before any prediction was computed: Horovod's scaling efficiency at 512 GPUs
# (128 servers × 4 Pascal GPUs, 25 Gbit/s RoCE; Horovod README / Sergeev & Del Balso 2018,
# Fig. 6): 90 % for Inception V3 and ResNet-101, 68 % for VGG-16.
HELD_OUT = {"nodes": 128, "efficiency": {"Inception V3": 0.90, "ResNet-101": 0.90, "VGG-16": 0.68}}
PS_SHARDS = (1, 2, 4, 8, 16)
EXPLAINED = """
Written after the predictions; each term is a number the model leaves out, not a fitted one.

- **Horovod 16 GPUs (1.04 / 1.07 / 1.12, PASS, but perfect scaling is within 20 % too: 1.06 /
  1.09 / 1.17, so these rows do not tell the model from no model).** The model overlaps every
  bucket but the last with backward at line rate, so it is an upper bound on the speed-up; the
  gap grows with the
  gradient (95 → 178 → 553 MB): per-message software costs (Tensor Fusion's copies in and out,
  the MPI/NCCL negotiation each cycle) that the α-β model has no term for. Over TCP the
  published VGG-16 drops to 10.0×: the model has no TCP term (only one latency per message).
- **Parameter server.** The published ring ÷ PS factors for Inception V3 and ResNet-101 (1.50,
  1.82) are what the model gives for S ≥ 4 shards (1.56 / 1.94 at S = 4, 1.52 / 1.87 at
  S = 8): the busier NIC is a worker node's (4 ranks × M) once 16·M/S < 4·M. VGG-16's 23.9 is
  not reached by any S (13.8 at S = 1): TensorFlow placed each variable whole on one shard, and
  VGG-16's fc6 weight (102.8 M parameters, 411 MB) alone puts 16 × 411 MB through one shard's
  ingress each way whatever S is: 2 × 2.10 s + its apply 0.66 s + the 0.49 s step ≈ 5.4 s, a
  factor ≈ 10.4 against the ring (by hand, the model's NIC formula); the rest (≈ 2.3×) is beyond
  bandwidth (gRPC serialisation of a 411 MB tensor).
- **Goyal et al. (rise 3.3 % against 12 %, MISS).** The model's iteration grows only by the last
  bucket's longer inter-node all-reduce (44 servers' tree or ring at 50 Gbit/s line rate). Not in
  it: the wait for the slowest of 352 GPUs each iteration (with step-time noise of CV c the
  expected maximum of W steps grows like c·√(2 ln W): from W = 8 to 352 that is 1.38 c of a
  step, so c ≈ 6 % alone would add the missing 8.7 %), and Gloo over TCP below line rate.
- **nccl-tests (8 B 0.67, 64 MiB 0.70 MISS; 2 GiB 1.08 PASS).** Small: the assumed latencies
  (5 µs an NVLink step, 20 µs an EFA message) are one-way wire figures; 164 µs for 8 bytes is
  NCCL's proxy thread and the OFI plug-in per step (2·7·5 + 2·20 = 110 µs here; 2·7·5 +
  2·47 = 164 µs would match). 64 MiB: NCCL reaches 47.6 GB/s bus bandwidth there, 61 % of its
  2 GiB figure, the pipeline not yet full; the α-β model is at its asymptote at once. 2 GiB:
  the model adds the in-node reduce-scatter and all-gather (12.6 ms) to the inter-node part
  (43.0 ms) while NCCL pipelines them: 51.4 ms measured lies between 43.0 and 55.6.
- **Held out, Horovod at 512 GPUs (1.09 / 1.08 PASS, VGG-16 1.34 MISS).** The model lets the
  512-GPU all-reduce take the cheapest algorithm (the tree between 128 servers), which the
  NCCL 2.0/2.1 of 2017-18 did not have: it ran one flat ring over all 512 ranks, 2 × 511
  latencies a bucket. The last column (computed after the verdict, so not a prediction) is that
  ring: it moves VGG-16 towards the published 68 %; the same straggler term as Goyal's applies.
"""
TOLERANCE = {"horovod": 20, "goyal": 20, "nccl": 25, "held_out": 20}  # ± % of the ratio


def clock(intra: str, inter: str, step_s: float = 1.0):
    """The virtual cluster's clock model for these links, ``--network-model nccl``."""
    from cloudburst.config import RunConfig
    from cloudburst.config.simulation import SimulationConfig
    from cloudburst.sim.clock import ClockModel

    cfg = RunConfig.from_dict({"out": "unused", "inter_node_link": inter})
    sim = SimulationConfig(intra_node_link=intra, network_model="nccl", step_time_s=step_s)
    return ClockModel(sim, cfg, 1, step_s)


def iteration_s(c, step_s: float, params: int, nodes: int, per_node: int) -> float:
    """One synchronous iteration: DDP's bucketed all-reduce overlapped with backward."""
    return c.ddp_end_s(step_s, 4.0 * params, [per_node] * nodes)


def ps_iteration_s(c, step_s: float, params: int, workers: int, per_node: int, shards: int):
    """A parameter-server iteration, not overlapped, from the NIC model's queues: each worker
    node's egress carries its ranks' pushes (per_node × M), each shard node's ingress W·M/S
    (shards on nodes of their own); the pull is the same the other way; the shards apply
    W·M/S bytes at the server's memory bandwidth."""
    spec, m = c.inter.spec, 4.0 * params
    transfer = spec.latency_s + max(per_node * m, workers * m / shards) / spec.bytes_per_s
    return step_s + 2 * transfer + c.apply_s(workers * m / shards)


def ring_only_iteration_s(c, step_s: float, params: int, gpus: int) -> float:
    """:func:`iteration_s` with every bucket a flat ring over all ``gpus`` on the NIC."""
    from cloudburst.comm.costs import ddp_overlap_end_s, ring_allreduce_s

    spec = c.inter.spec
    cost = lambda b: ring_allreduce_s(b, gpus, spec.latency_s, spec.bytes_per_s)  # noqa: E731
    return ddp_overlap_end_s(step_s / 3, 2 * step_s / 3, 4.0 * params, cost)


def main() -> None:
    args, prov = harness.start(__doc__)
    title = "The virtual cluster against published measurements"
    rep = harness.Report("sim_published", title, prov)

    scored: list[tuple[str, bool, bool]] = []  # (row, within tolerance, discriminates)

    def claim(name: str, ratio: float, case: str, null: float, note: str = "") -> None:
        """predicted ÷ published within ``TOLERANCE[case]`` % of 1; ``null`` the null model's
        ratio (perfect scaling, or line rate with no latency): a row where the null model is
        within the tolerance too does not discriminate, and the count leaves it out."""
        tol = TOLERANCE[case]
        holds, discriminates = abs(ratio - 1) <= tol / 100, abs(null - 1) > tol / 100
        scored.append((name, holds, discriminates))
        said = "discriminates" if discriminates else "does not discriminate: the null holds too"
        note = "; ".join(x for x in (note, f"null model {null:.3f}, {said}") if x)
        rep.claim(name, ratio, f"1 ± {tol} %", holds, note=note)

    rep.data = {"goyal": GOYAL, "horovod": HOROVOD, "nccl_tests": NCCL_TESTS, "held_out": HELD_OUT}

    # Horovod, 16 GPUs: speed-up of the ring, and the parameter server as a function of S.
    c = clock(HOROVOD["intra"], HOROVOD["inter"])
    hv_rows, ps_rows, held_rows = [], [], []
    for name, (params, one, ring, tcp, ps) in HOROVOD["models"].items():
        step = HOROVOD["batch"] / one
        it = iteration_s(c, step, params, 4, HOROVOD["per_node"])
        predicted, published = 16 * step / it, ring / one
        ratio = predicted / published
        hv_rows.append([name, f"{4 * params / 1e6:.0f}", f"{step * 1e3:.0f}", f"{it * 1e3:.1f}",
                        f"{predicted:.2f}×", f"{published:.2f}×", f"{ratio:.3f}",
                        f"{tcp / one:.2f}×"])  # fmt: skip
        claim(
            f"Horovod 16 GPUs {name}: speed-up predicted ÷ published",
            ratio,
            "horovod",
            null=16 / published,
        )  # perfect scaling: 16×
        factors = [ps_iteration_s(c, step, params, 16, HOROVOD["per_node"], s) / it
                   for s in PS_SHARDS]  # fmt: skip
        ps_rows.append([name, f"{ring / ps:.2f}", *[f"{f:.2f}" for f in factors]])
        # Held out: 512 GPUs on 128 servers.
        it512 = iteration_s(c, step, params, HELD_OUT["nodes"], HOROVOD["per_node"])
        eff, pub = step / it512, HELD_OUT["efficiency"][name]
        # After the verdict (post hoc, not the held-out prediction): the flat ring over all
        # 512 GPUs that NCCL 2.0/2.1 ran in 2017-18 (trees came with NCCL 2.4).
        ring_it = ring_only_iteration_s(c, step, params, HELD_OUT["nodes"] * 4)
        held_rows.append([name, f"{it512 * 1e3:.1f}", f"{eff:.3f}", f"{pub:.2f}",
                          f"{eff / pub:.3f}", f"{step / ring_it / pub:.3f}"])  # fmt: skip
        claim(f"held out: Horovod 512 GPUs {name}: efficiency predicted ÷ published", eff / pub,
              "held_out", null=1 / pub)  # fmt: skip

    # Goyal et al.: time per iteration from 8 to 352 GPUs, efficiency from 8 to 256.
    g = clock(GOYAL["intra"], GOYAL["inter"])
    step = GOYAL["backward_s"] * 1.5  # forward : backward = 1 : 2 (device_emulation)
    times = {n: iteration_s(g, step, GOYAL["params"], n // 8, 8) for n in (8, 256, 352)}
    rise, eff256 = times[352] / times[8], times[8] / times[256]
    # The claim is the rise itself (12 %) within 20 %: the ratio of the two iteration times
    # (1.12) within 20 % would pass any rise from −10 % to +34 %.
    pub_rise = GOYAL["rise_352"] - 1
    claim("Goyal et al.: rise in time per iteration 8 → 352 GPUs, predicted ÷ published (12 %)",
          (rise - 1) / pub_rise, "goyal", null=0.0,
          note=f"time per iteration 352 ÷ 8: {rise:.3f} against 1.12")  # fmt: skip
    rep.claim("Goyal et al.: scaling efficiency 8 → 256 GPUs, predicted ÷ published (≈ 90 %)",
              eff256 / GOYAL["efficiency_256"], "(reference)", None)  # fmt: skip
    goyal_rows = [[f"{n} ({n // 8} servers)", f"{t * 1e3:.1f}"] for n, t in times.items()]

    # nccl-tests all_reduce on 2 × p4de.
    n = clock(NCCL_TESTS["intra"], NCCL_TESTS["inter"])
    nccl_rows = []
    for nbytes, published in NCCL_TESTS["points"].items():
        predicted = n.group_allreduce_s(nbytes, [8, 8]) * 1e6
        ratio = predicted / published
        busbw = 2 * 15 / 16 * nbytes / (predicted / 1e6) / 1e9
        nccl_rows.append([f"{nbytes:,}", f"{predicted:.1f}", f"{published:.1f}", f"{ratio:.3f}",
                          f"{busbw:.2f}"])  # fmt: skip
        line_rate_us = 2 * 15 / 16 * nbytes / (400e9 / 8) * 1e6  # a flat ring, no latency
        claim(f"nccl-tests 2 × p4de all_reduce {nbytes:,} B: time predicted ÷ published", ratio,
              "nccl", null=line_rate_us / published)  # fmt: skip
    flat_2g = 2 * 15 / 16 * 2 * 2**30 / (400e9 / 8) * 1e6
    telling = [(name, holds) for name, holds, discriminates in scored if discriminates]
    rep.claim("predictions within tolerance, counting only the rows the null model misses",
              f"{sum(h for _, h in telling)} / {len(telling)}", "(count)", None,
              note="; ".join(f"{name.rsplit(':', 1)[0]} {'holds' if h else 'misses'}"
                             for name, h in telling))  # fmt: skip

    rep.settings(harness.about(__doc__))
    rep.section("Horovod, 16 GPUs (4 servers × 4)").text(
        f"Links: in a server `{HOROVOD['intra']}` (Gbit/s, ms; assumed PCIe), between "
        f"servers `{HOROVOD['inter']}`; step = 64 ÷ the published one-GPU images/s; "
        "gradients 4 bytes a parameter; Horovod's Tensor Fusion stood in for by DDP's "
        "25 MiB buckets overlapped with backward (backward = 2/3 of the step, spread by "
        "parameters). Speed-up = 16 × step ÷ iteration."
    ).table("model | gradient MB | step ms | iteration ms | predicted | published (RDMA) | "
            "ratio | published over TCP", hv_rows)  # fmt: skip
    rep.section("Horovod: the parameter server against the ring, by number of shards S").text(
        "Predicted (PS iteration ÷ ring iteration) for S shards on nodes of their own, "
        "no overlap: push and pull each max(4·M, 16·M/S) / β + L (the busier of a worker "
        "node's egress and a shard node's ingress), plus the shards' apply 16·M/S at "
        "10 GB/s; published: ring images/s ÷ parameter-server images/s (S not stated)."
    ).table(["model", "published", *[f"S = {s}" for s in PS_SHARDS]], ps_rows)
    rep.section("Goyal et al. 2017, time per iteration").text(
        f"Links: in a server `{GOYAL['intra']}` (assumed NVLink), between servers "
        f"`{GOYAL['inter']}`; step = 1.5 × the published 120 ms backward; 8 GPUs a "
        "server. Predicted rise 8 → 352: "
        f"**{100 * (rise - 1):.1f} %** (published 12 %); efficiency 8 → 256: "
        f"**{100 * eff256:.1f} %** (published ≈ 90 %)."
    ).table("GPUs | predicted iteration ms", goyal_rows)
    rep.section("nccl-tests all_reduce, 2 × p4de (16 A100)").text(
        f"Links: NVSwitch `{NCCL_TESTS['intra']}`, EFA `{NCCL_TESTS['inter']}` a node; "
        "hierarchical (reduce-scatter in the node, the stripes between the 2 nodes "
        "through the one NIC, all-gather) against the flat choice over 16, the cheaper. "
        f"A flat ring at 2 GiB would take {flat_2g:,.0f} µs through the NIC alone."
    ).table("bytes | predicted µs | published µs | ratio | predicted bus GB/s", nccl_rows)
    rep.section("Held out: Horovod, 512 GPUs (128 servers × 4)").table(
        "model | iteration ms | predicted efficiency | published | ratio | post hoc: "
        "flat ring over 512, ratio", held_rows)  # fmt: skip
    rep.section("What explains the differences").text(EXPLAINED)
    rep.write()


if __name__ == "__main__":
    main()
