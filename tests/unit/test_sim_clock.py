"""The virtual cluster's clock model (cloudburst.sim.clock) and its configuration
(cloudburst.config.simulation): exact costs against hand-computed values, step times, seeded
step-time noise, what summary.json records as "clock_model", and one-line errors."""

from __future__ import annotations

import hashlib
import json
import math
import statistics

import pytest

from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.link import LinkEmulator
from cloudburst.config import ConfigError, RunConfig
from cloudburst.config.simulation import PROFILES, Jitter, SimulationConfig
from cloudburst.sim.clock import ClockModel, resolve_step_time
from tests.support import clock_run_config, close


def clock(sim: SimulationConfig | None = None, actual_params: int = 1000, step=0.1, **kw):
    return ClockModel(sim or SimulationConfig(), clock_run_config(**kw), actual_params, step)


# ---------------------------------------------------------------------------- links
# 8 Gbit/s = 1e9 bytes/s, 2 ms latency: 1 MB takes 1 ms of bandwidth.
LINK = "8,2"
LAT, BW = 0.002, 1e9
LAT_IN, BW_IN = 0.0005, 2e9  # --intra-node-link 16,0.5
MB = 1e6


@pytest.mark.parametrize("inter, intra", [("3.5,0.7", "8,1"), (None, "8,1"), (None, None)])
def test_link_costs_are_the_link_emulators_of_the_link_spanned(inter, intra):
    """Across nodes the inter-node link's costs, within a node the intra-node link's, each
    exactly its LinkEmulator's (checked by hand in test_link.py); a link not given is free."""
    c = clock(SimulationConfig(intra_node_link=intra), inter_node_link=inter)
    for crosses, text in ((True, inter), (False, intra)):
        emulator = LinkEmulator(None if text is None else LinkSpec.parse(text))
        for n in (1, 2, 3, 7, 64):
            assert c.allreduce_s(12345, n, crosses) == emulator.allreduce_s(12345, n)
            assert c.broadcast_s(12345, n, crosses) == emulator.broadcast_s(12345, n)
        assert c.p2p_s(12345, crosses) == emulator.p2p_s(12345)
        assert c.latency_s(crosses) == (0.0 if text is None else emulator.spec.latency_s)


def test_ddp_ends_after_the_step_and_waits_for_the_link_it_is_given():
    # One rank on each of 2 nodes, 1 MB: one bucket, ready when the 0.3 s step ends; a ring of
    # 2 on 8 Gbit/s, 2 ms: 2 · 2 ms + 1 ms.
    c = clock(inter_node_link=LINK, step=0.3)
    assert c.ddp_end_s(0.3, 1e6, [1, 1]) == close(0.305)
    assert c.ddp_end_s(0.3, 1e6, [1, 1], link_free_s=2.0) == close(2.005)


def test_server_apply_is_bytes_over_gigabytes_of_ten_to_the_nine_bytes_per_second():
    assert clock().apply_s(1e10) == 1.0 and clock().apply_s(1e9) == 0.1  # the default 10 GB/s
    assert clock(SimulationConfig(server_apply_gbyte_per_s=2.0)).apply_s(1e9) == 0.5
    assert clock(SimulationConfig(server_apply_gbyte_per_s=2.5)).apply_s(5e9) == 2.0


# ---------------------------------------------------------------------------- group all-reduce
IN = "16,0.5"  # the intra-node link: 16 Gbit/s = 2e9 bytes/s (BW_IN), 0.5 ms (LAT_IN)
HIER_2_1 = 2 * (LAT_IN + 0.5 * MB / BW_IN) + 2 * LAT + MB / BW  # rings of 2 in node 0, 2 on NIC
GROUP_ALL_REDUCES = {  # (model, inter, intra, bytes, ranks on each node, cost, costs it beats)
    # flat: one ring of all the group's ranks on the slowest link spanned.
    "flat-across-nodes": ("flat", LINK, IN, MB, [2, 2], 6 * LAT + 1.5 * MB / BW, ()),
    "flat-one-node": ("flat", LINK, IN, MB, [2], 2 * LAT_IN + MB / BW_IN, ()),
    "flat-one-rank": ("flat", LINK, IN, MB, [1], 0.0, ()),
    # nccl on one node: the cheapest of ring, tree, halving-doubling on the intra-node link.
    "nccl-one-node-ring": ("nccl", LINK, IN, 1e8, [3], 4 * LAT_IN + 4 / 3 * 1e8 / BW_IN,
        (4 * LAT_IN + 2 * 1e8 / BW_IN,)),  # tree
    "nccl-one-node-halving-doubling": ("nccl", LINK, IN, MB, [4], 4 * LAT_IN + 1.5 * MB / BW_IN,
        (6 * LAT_IN + 1.5 * MB / BW_IN, 4 * LAT_IN + 2 * MB / BW_IN, 4 * LAT + 1.5 * MB / BW)),
    "nccl-one-node-free-link": ("nccl", LINK, None, 1e8, [3], 0.0, ()),
    # nccl across nodes: with one rank a node, the flat choice on the NIC (ring, not tree) ...
    "nccl-one-rank-per-node": ("nccl", LINK, IN, MB, [1, 1, 1], 4 * LAT + 4 / 3 * MB / BW,
        (4 * LAT + 2 * MB / BW,)),
    # ... else the cheaper of it and hierarchical (rings in the nodes, then the nodes' on the NIC).
    "nccl-hierarchical-2-and-1": ("nccl", LINK, IN, MB, [2, 1], HIER_2_1,
        (4 * LAT + 4 / 3 * MB / BW,)),  # flat: ring of 3
    "nccl-flat-on-a-slow-intra-link": ("nccl", LINK, "1,5", MB, [2, 2], 4 * LAT + 1.5 * MB / BW,
        (2 * (0.005 + 0.5 * MB / 1.25e8) + 2 * LAT + MB / BW,)),  # hierarchical
    "nccl-free-nic": ("nccl", None, IN, MB, [2, 2], 0.0, (2 * (LAT_IN + 0.5 * MB / BW_IN),)),
    "nccl-free-nic-one-rank-per-node": ("nccl", None, IN, MB, [1, 1], 0.0, ()),
}  # fmt: skip


@pytest.mark.parametrize(
    "model, inter, intra, nbytes, ranks, cost, beaten",
    GROUP_ALL_REDUCES.values(),
    ids=list(GROUP_ALL_REDUCES),
)
def test_a_groups_all_reduce_costs_what_its_network_model_chooses_for_where_its_ranks_sit(
    model, inter, intra, nbytes, ranks, cost, beaten
):
    """flat: one ring on the slowest link spanned. nccl: within a node the cheapest of ring,
    tree and halving-doubling; across nodes the cheaper of that on the NIC and hierarchical."""
    sim = SimulationConfig(intra_node_link=intra, network_model=model)
    got = clock(sim, inter_node_link=inter).group_allreduce_s(nbytes, ranks)
    assert got == (pytest.approx(cost, rel=1e-12, abs=1e-15) if cost else 0.0)
    assert all(cost < other for other in beaten)


# ---------------------------------------------------------------------------- stand-in
def test_wire_bytes_scale_payloads_only():
    c = clock(SimulationConfig(modelled_params=25_000_000), actual_params=5000)
    assert c.wire_bytes(20_000, payload=True) == pytest.approx(20_000 * 5000)
    assert c.wire_bytes(64, payload=False) == 64  # a header stays a header
    assert clock(actual_params=5000).wire_bytes(20_000, payload=True) == 20_000


def _no_calibration(cfg: RunConfig) -> float:
    raise AssertionError("calibrated although a step time was given")


V100 = {"profile": "resnet50-v100"}  # 1,200 samples/s


@pytest.mark.parametrize(
    "sim, cfg, calibrate, step",
    [
        (V100, {"batch_size": 32}, None, (pytest.approx(32 / 1200), "profile")),
        # Explicit flags override the profile's values.
        ({**V100, "step_time_s": 0.5, "modelled_params": 1_000_000}, {}, None, (0.5, "flag")),
        ({**V100, "calibrate": True}, {}, 0.25, (0.25, "calibrated")),
        ({"step_time_per_sample_s": 0.01}, {"batch_size": 16}, None, (pytest.approx(0.16), "flag")),
        ({"modelled_step_time_s": 0.3}, {}, None, (0.3, "flag")),
        ({}, {"min_step_time_s": 0.05}, None, (0.05, "min_step_time")),
        ({}, {}, 0.02, (0.02, "calibrated")),
        ({"calibrate": True}, {}, 0.016, (0.016, "calibrated")),
    ],
)
def test_step_time_resolution_order(sim, cfg, calibrate, step):
    """A step time given, else the profile's, else --min-step-time-s, else a calibration (of
    the run's own RunConfig, once)."""
    run, seen = clock_run_config(**cfg), []
    fn = _no_calibration if calibrate is None else lambda c: seen.append(c) or calibrate
    assert resolve_step_time(SimulationConfig(**sim), run, fn) == step
    assert len(seen) == (calibrate is not None) and all(c is run for c in seen)


def test_a_profile_gives_the_stand_in_params_and_flags_win():
    assert PROFILES["resnet50-v100"].params == 25_557_032
    c = ClockModel(SimulationConfig(**V100), clock_run_config(), 5000, 0.1, "profile")
    assert c.wire_bytes(4 * 5000, True) == pytest.approx(4 * 25_557_032)
    assert c.describe()["profile"]["name"] == "resnet50-v100"
    sim = SimulationConfig(**V100, step_time_s=0.5, modelled_params=1_000_000)
    assert sim.stand_in_params == 1_000_000


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


SETTINGS = {  # what the flags were: all defaults but the step time of 0.05 s
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
}
DESCRIBED = {  # no profile, no links: free links are null, the wire scale 1, the profile null
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
    "settings": SETTINGS,
}


def test_describe_without_stand_in_or_links_and_the_default_source():
    """The defaults; a clock made without a step-time source says the step time came from a
    flag."""
    d = clock(SimulationConfig(step_time_s=0.05), actual_params=4000, step=0.05).describe()
    assert d == DESCRIBED


def test_describe_with_a_stand_in_profile_and_both_links():
    """A resnet20-h100 stand-in for a run of 1,000 parameters, both links, nccl, a NIC ingress and
    a slower apply: every entry of the summary's clock model, the profile's figures included."""
    flags = dict(intra_node_link="16,0.5", step_time_jitter="pareto:3", network_model="nccl",
                 nic_ingress_gbit_per_s=4.0, server_apply_gbyte_per_s=2.5)  # fmt: skip
    sim = SimulationConfig(profile="resnet20-h100", **flags)
    cfg = clock_run_config(inter_node_link=LINK, batch_size=128)
    d = ClockModel(sim, cfg, 1000, 128 / 15552, "profile").describe()
    assert d == {
        **DESCRIBED,
        "step_time_s": 128 / 15552,
        "step_time_source": "profile",
        "step_time_jitter": "pareto:3",
        "inter_node_link": {"gbit_per_s": 8.0, "latency_ms": 2.0},
        "intra_node_link": {"gbit_per_s": 16.0, "latency_ms": 0.5},
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
        "settings": {**SETTINGS, **flags, "step_time_s": None, "profile": "resnet20-h100"},
    }
    assert json.loads(json.dumps(d)) == d  # summary.json holds it as it is


# ---------------------------------------------------------------------------- jitter
def test_a_step_is_base_times_factor_times_a_noise_of_seed_worker_and_step_only():
    c = clock(step=0.2)  # without jitter: base x factor
    assert c.step_s(0, 1, 1.0) == pytest.approx(0.2) and c.step_s(3, 17, 2.5) == pytest.approx(0.5)
    sim = SimulationConfig(step_time_jitter="lognormal:0.3")
    a, b = clock(sim, seed=7), clock(sim, seed=7)
    keys = [(w, s) for w in range(4) for s in range(1, 50)]
    forward = {k: a.step_s(*k, 1.0) for k in keys}
    backward = {k: b.step_s(*k, 1.0) for k in reversed(keys)}
    assert forward == backward  # order of calls does not matter
    assert len(set(forward.values())) == len(keys)  # each step draws its own
    assert a.step_s(1, 5, 1.0) != clock(sim, seed=8).step_s(1, 5, 1.0)
    assert a.step_s(1, 5, 2.0) == pytest.approx(2 * a.step_s(1, 5, 1.0))


@pytest.mark.parametrize(
    "spec, tol, cv, least, most",
    [("lognormal:0.3", 0.015, 0.3, 0, 0), ("lognormal:1.0", 0.03, 1.0, 0, 0),
     ("pareto:3", 0.03, None, 2 / 3, 5)],
)  # fmt: skip
def test_jitter_has_mean_one_and_its_distributions_shape(spec, tol, cv, least, most):
    """Mean one; lognormal:CV the asked coefficient of variation and > 0; pareto:α above its
    scale (α−1)/α with a heavy tail (P(x > 5) = (2/15)^3 ≈ 0.24 % of 20,000 draws)."""
    c = clock(SimulationConfig(step_time_jitter=spec), step=1.0)
    draws = [c.step_s(w, s, 1.0) for w in range(20) for s in range(1, 1001)]
    mean = statistics.fmean(draws)
    assert mean == pytest.approx(1.0, abs=tol)
    assert cv is None or statistics.stdev(draws) / mean == pytest.approx(cv, rel=0.1)
    assert min(draws) > least and max(draws) > most


def test_a_steps_noise_is_its_jitter_at_the_middle_of_its_hash_cell():
    """Worker w's step s is scaled by the jitter at u = (d + ½) / 2⁶⁴, d the 8-byte big-endian
    BLAKE2b of "cloudburst-step-jitter:seed:w:s": the middle of d's cell, never 0. Worker 2's
    step 196,341 at seed 0 has a small d (≈ 2.7e13), where the half shows."""
    jitter = Jitter.parse("lognormal:0.5")
    c = clock(SimulationConfig(step_time_jitter="lognormal:0.5"), step=1.0, seed=0)
    for worker, step in [(0, 1), (3, 17), (2, 196_341)]:
        key = f"cloudburst-step-jitter:0:{worker}:{step}".encode()
        d = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), byteorder="big")
        assert c.step_s(worker, step, 1.0) == jitter.sample((d + 0.5) / 2**64)
    assert d < 2**45
    assert jitter.sample(d / 2**64) != c.step_s(2, 196_341, 1.0) != jitter.sample((d + 1) / 2**64)


def test_jitter_inverse_transform():
    assert Jitter.parse("lognormal:0").sample(0.9) == 1.0
    # The median of a mean-one lognormal is exp(−σ²/2).
    sigma2 = math.log1p(0.5**2)
    assert Jitter.parse("lognormal:0.5").sample(0.5) == pytest.approx(math.exp(-sigma2 / 2))
    assert Jitter.parse("pareto:2").sample(0.75) == pytest.approx(0.5 * 0.25**-0.5)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "values, message",
    [
        ({"step_time_s": 0.1, "step_time_per_sample_s": 0.01}, "give one step time"),
        ({"step_time_s": 0.1, "modelled_step_time_s": 0.1}, "give one step time"),
        ({"step_time_s": 0.1, "calibrate": True}, "calibrate: cannot be combined"),
        ({"step_time_jitter": "normal:0.1"}, "is not lognormal:CV or pareto:ALPHA"),
        ({"step_time_jitter": "lognormal"}, "is not lognormal:CV or pareto:ALPHA"),
        ({"step_time_jitter": "lognormal:-1"}, "coefficient of variation must be >= 0"),
        ({"step_time_jitter": "pareto:1"}, "ALPHA must be > 1"),
        ({"intra_node_link": "fast"}, "intra_node_link: 'fast' is not GBIT_PER_S"),
        ({"intra_node_link": "0"}, "intra_node_link: '0': the speed must be"),
        ({"network_model": "ncl"}, "network_model: 'ncl' is not allowed"),
        ({"profile": "resnet50-v1OO"}, "did you mean 'resnet50-v100'"),
        ({"modelled_params": "many"}, "modelled_params: 'many' is not a valid int"),
        ({"step_tme_s": 1.0}, "did you mean 'step_time_s'"),
    ],
)
def test_bad_values_are_one_line_errors(values, message):
    """(Each numeric field out of its range: tests/unit/test_config_ranges.py.)"""
    with pytest.raises(ConfigError) as e:
        SimulationConfig.from_dict(values)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_clock_refuses_impossible_arguments():
    with pytest.raises(ValueError, match="actual_params"):
        clock(actual_params=0)
    with pytest.raises(ValueError, match="step_time_s"):
        clock(step=0.0)
