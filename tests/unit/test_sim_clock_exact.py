"""The virtual cluster's clock model (cloudburst.sim.clock.ClockModel), exactly: the whole of
``describe()`` (what ``summary.json`` records as ``"clock_model"``) for a run with a stand-in
profile and links and for one with neither, written out here by hand; the group all-reduce of
``--network-model flat`` and ``nccl`` on cases the other clock tests leave open, against costs
computed here from cloudburst/comm/costs.py's formulas; the step-time noise's uniform; a
server apply's cost; and which run configuration a calibration is given."""

from __future__ import annotations

import hashlib
import json

import pytest

from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.sim.clock import ClockModel, resolve_step_time

LAT, BW = 0.002, 1e9  # --inter-node-link 8,2: 8 Gbit/s = 1e9 bytes/s, 2 ms
LAT_IN, BW_IN = 0.0005, 2e9  # --intra-node-link 16,0.5


def run_config(**kw) -> RunConfig:
    base = {"out": "unused", "dataset": "synthetic", "train_size": 256, "test_size": 32}
    return RunConfig.from_dict({**base, **kw})


def close(x: float):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------------- describe
NOT_MODELLED = [
    "contention between the ranks of one node for memory bandwidth and PCIe; intra-node "
    "messages queue at their sender only",
    "the switch fabric: oversubscription, congestion control, packet loss",
    "operating-system noise beyond the step-time jitter",
    "evaluation and checkpoint time",
    "a stand-in model's convergence (the maths is the run's own small model)",
]
LINK_MODEL = (
    "ring all-reduce, log2 broadcast, latency + bytes/bandwidth "
    "(cloudburst.comm.link.LinkEmulator); no link given: free"
)


def test_describe_with_a_stand_in_profile_and_both_links():
    """A resnet20-h100 stand-in (269,722 parameters, 15,552 samples/s at batch 128 on an H100)
    for a run of 1,000 parameters, both links, nccl, a NIC ingress and a slower apply: every
    entry of the summary's clock model, the profile's published figures included."""
    sim = SimulationConfig(
        profile="resnet20-h100",
        intra_node_link="16,0.5",
        step_time_jitter="pareto:3",
        network_model="nccl",
        nic_ingress_gbit_per_s=4.0,
        server_apply_gbyte_per_s=2.5,
    )
    cfg = run_config(inter_node_link="8,2", batch_size=128)
    d = ClockModel(sim, cfg, 1000, 128 / 15552, "profile").describe()
    assert d == {
        "time_unit": "virtual seconds",
        "step_time_s": 128 / 15552,
        "step_time_source": "profile",
        "step_time_jitter": "pareto:3",
        "inter_node_link": {"gbit_per_s": 8.0, "latency_ms": 2.0},
        "intra_node_link": {"gbit_per_s": 16.0, "latency_ms": 0.5},
        "link_model": LINK_MODEL,
        "network_model": "nccl",
        "nic_ingress_gbit_per_s": 4.0,
        "server_apply_gbyte_per_s": 2.5,
        "actual_params": 1000,
        "modelled_params": 269_722,
        "wire_scale": 269.722,  # 269,722 modelled / 1,000 actual parameters
        "profile": {
            "name": "resnet20-h100",
            "params": 269_722,
            "samples_per_s": 15552.0,
            "published_batch_size": 128,
            "device": "H100 80GB, fp32",
            "source": "cloudburst benchmarks/results/throughput_cuda.md, resnet20 sync W=1: "
            "15552 samples/s",
        },
        "not_modelled": NOT_MODELLED,
        "settings": {
            "step_time_s": None,
            "step_time_per_sample_s": None,
            "calibrate": False,
            "step_time_jitter": "pareto:3",
            "intra_node_link": "16,0.5",
            "nic_ingress_gbit_per_s": 4.0,
            "network_model": "nccl",
            "server_apply_gbyte_per_s": 2.5,
            "modelled_params": None,
            "modelled_step_time_s": None,
            "profile": "resnet20-h100",
        },
    }
    assert json.loads(json.dumps(d)) == d  # summary.json holds it as it is


def test_describe_without_stand_in_or_links_and_the_default_source():
    """No profile, no links, the defaults: free links are null, the wire scale 1, the profile
    null; a clock made without a step-time source says the step time came from a flag."""
    sim = SimulationConfig(step_time_s=0.05)
    d = ClockModel(sim, run_config(), 4000, 0.05).describe()
    assert d == {
        "time_unit": "virtual seconds",
        "step_time_s": 0.05,
        "step_time_source": "flag",
        "step_time_jitter": None,
        "inter_node_link": None,
        "intra_node_link": None,
        "link_model": LINK_MODEL,
        "network_model": "flat",
        "nic_ingress_gbit_per_s": None,
        "server_apply_gbyte_per_s": 10.0,
        "actual_params": 4000,
        "modelled_params": None,
        "wire_scale": 1.0,
        "profile": None,
        "not_modelled": NOT_MODELLED,
        "settings": {
            "step_time_s": 0.05,
            "step_time_per_sample_s": None,
            "calibrate": False,
            "step_time_jitter": None,
            "intra_node_link": None,
            "nic_ingress_gbit_per_s": None,
            "network_model": "flat",
            "server_apply_gbyte_per_s": 10.0,
            "modelled_params": None,
            "modelled_step_time_s": None,
            "profile": None,
        },
    }


# ---------------------------------------------------------------------------- group all-reduce
def _clock(network_model: str, inter: str | None = "8,2", intra: str | None = "16,0.5"):
    cfg = run_config(inter_node_link=inter)
    sim = SimulationConfig(intra_node_link=intra, network_model=network_model)
    return ClockModel(sim, cfg, 1, 0.01)


def test_flat_all_reduce_is_a_ring_on_the_slowest_link_spanned():
    """flat: one ring of all the group's ranks, 2(n−1) latencies + 2(n−1)/n x bytes /
    bandwidth, on the inter-node link when the group spans nodes, else the intra-node one."""
    c, b = _clock("flat"), 1e6
    assert c.group_allreduce_s(b, [2, 2]) == close(6 * LAT + 1.5 * b / BW)  # 9.5 ms
    assert c.group_allreduce_s(b, [2]) == close(2 * LAT_IN + b / BW_IN)  # 1.5 ms
    assert c.group_allreduce_s(b, [1]) == 0.0


def test_nccl_on_one_node_takes_the_cheapest_algorithm_on_the_intra_node_link():
    """Four ranks on one node, nccl: ring 6 L + 1.5 B/β, tree 4 L + 2 B/β, halving-doubling
    4 L + 1.5 B/β on the intra-node link: halving-doubling, 2.75 ms (the inter-node link
    would give 9.5 ms)."""
    b = 1e6
    assert _clock("nccl").group_allreduce_s(b, [4]) == close(4 * LAT_IN + 1.5 * b / BW_IN)


def test_nccl_with_one_rank_per_node_is_the_flat_choice_on_the_nic():
    """One rank on each of three nodes: no intra-node stage; the cheaper of ring (4 L + 4/3 B/β)
    and tree (2·2 L + 2 B/β) of three on the inter-node link: at 1 MB the ring."""
    b = 1e6
    ring, tree = 4 * LAT + 4 / 3 * b / BW, 4 * LAT + 2 * b / BW
    assert ring < tree
    assert _clock("nccl").group_allreduce_s(b, [1, 1, 1]) == close(ring)


def test_nccl_takes_hierarchical_for_two_and_one_ranks_per_node_when_cheaper():
    """Two ranks on node 0 and one on node 1 (k = 2), 1 MB: flat of three on the NIC is
    min(ring 8 + 1.33 ms, tree 8 + 2 ms) = 9.33 ms; hierarchical, a ring of 2 in the node
    twice (2 x (0.5 + 0.5 x 0.5) ms) and two nodes on the NIC (4 + 1 ms) = 6.5 ms."""
    b = 1e6
    flat = 4 * LAT + 4 / 3 * b / BW
    hier = 2 * (LAT_IN + 0.5 * b / BW_IN) + 2 * LAT + b / BW
    assert hier < flat
    assert _clock("nccl").group_allreduce_s(b, [2, 1]) == close(hier)


def test_nccl_keeps_the_flat_choice_when_the_intra_node_link_is_the_slower():
    """A slow intra-node link (1 Gbit/s, 5 ms): two ranks on each of two nodes, 1 MB; flat on
    the NIC, halving-doubling of four, 4 L + 1.5 B/β = 9.5 ms, beats hierarchical's
    2 x (5 ms + 0.5 x 8 ms) + (4 + 1) ms = 23 ms."""
    b, lat_slow, bw_slow = 1e6, 0.005, 1.25e8
    flat = 4 * LAT + 1.5 * b / BW
    hier = 2 * (lat_slow + 0.5 * b / bw_slow) + 2 * LAT + b / BW
    assert flat < hier
    assert _clock("nccl", intra="1,5").group_allreduce_s(b, [2, 2]) == close(flat)


def test_nccl_across_nodes_on_a_free_inter_node_link_costs_nothing():
    """No inter-node link (free), two ranks on each of two nodes: the flat all-reduce on the
    free NIC costs nothing, cheaper than hierarchical's intra-node stages."""
    c = _clock("nccl", inter=None)
    assert c.group_allreduce_s(1e6, [2, 2]) == 0.0
    assert c.group_allreduce_s(0.0, [2, 2]) == 0.0
    assert c.group_allreduce_s(1e6, [1, 1]) == 0.0


# ---------------------------------------------------------------------------- the rest
def test_server_apply_divides_by_gigabytes_of_ten_to_the_nine_bytes():
    """A parameter-server apply costs bytes / (GB/s x 1e9), exactly."""
    assert _clock("flat").apply_s(1e10) == 1.0  # the default 10 GB/s
    sim = SimulationConfig(server_apply_gbyte_per_s=2.5)
    assert ClockModel(sim, run_config(), 1, 0.1).apply_s(5e9) == 2.0


class _RecordingJitter:
    """A stand-in noise that returns 1 and remembers the uniforms it was asked for."""

    def __init__(self) -> None:
        self.uniforms: list[float] = []

    def sample(self, u: float) -> float:
        self.uniforms.append(u)
        return 1.0


def _hand_uniform(seed: int, worker: int, step: int) -> tuple[int, float]:
    key = f"cloudburst-step-jitter:{seed}:{worker}:{step}".encode()
    draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), byteorder="big")
    return draw, (draw + 0.5) / 2**64


def test_jitter_uniform_is_the_middle_of_the_hashs_cell():
    """The noise of (worker, step) draws u = (d + ½) / 2⁶⁴, d the 8-byte big-endian
    BLAKE2b of "cloudburst-step-jitter:seed:worker:step": the middle of d's cell, never 0.
    Worker 2's step 196,341 at seed 0 has a small d (≈ 2.7e13), where the half shows."""
    c = ClockModel(SimulationConfig(step_time_jitter="lognormal:0.5"), run_config(), 1, 0.1)
    c.jitter = recorder = _RecordingJitter()
    keys = [(0, 1), (3, 17), (2, 196_341)]
    for worker, step in keys:
        assert c.jitter_factor(worker, step) == 1.0
    expected = [_hand_uniform(0, w, s) for w, s in keys]
    assert recorder.uniforms == [u for _, u in expected]
    draw, u = expected[-1]
    assert draw < 2**45 and u != draw / 2**64 and u != (draw - 0.5) / 2**64


def test_calibration_is_given_the_run_s_configuration():
    """Both ways to a calibration (``--calibrate``, and nothing else given) time the run's own
    configuration: the calibrate function is called once with the run's RunConfig."""
    cfg = run_config(batch_size=16)
    for sim in (SimulationConfig(calibrate=True), SimulationConfig()):
        seen: list[RunConfig] = []

        def calibrate(c: RunConfig, seen=seen) -> float:
            seen.append(c)
            return c.batch_size * 0.001

        assert resolve_step_time(sim, cfg, calibrate) == (pytest.approx(0.016), "calibrated")
        assert len(seen) == 1 and seen[0] is cfg
