"""Exact pins of a parameter-server shard's documented defaults and helpers, of the flat-view
test behind the zero-copy averaging paths, and of the link emulator's shared-NIC check.

- ``staleness_factor`` / ``add_rule_alpha``: delay-adaptive's default τ_C = 1, and a fresh
  push (τ = 0 ≤ τ_C) is never scaled, even with τ_C = 0.
- ``ShardState``'s constructor defaults (DC-ASGD's λ = 0.04, local lr 1, τ_C = 1, a ring of 16
  versions, Delayed Nesterov with N = 1 and c = 0), the ``staleness_scaling`` flag, the
  unknown-compensation message and the clamped-push counter in ``stats``.
- ``merged_histogram`` / ``histogram_quantiles``: sums and exact quantiles worked by hand.
- ``is_flat_view``: each condition on its own (length, shape of ``flat``, dtype, contiguity).
- ``LinkEmulator``: a NIC record without the topology or without the rank is refused.

Every reference value is written out by hand (dyadic where possible, so floats are exact).
"""

from __future__ import annotations

import pytest
import torch

from cloudburst.comm.costs import LinkSpec
from cloudburst.comm.flat import is_flat_view
from cloudburst.comm.link import LinkEmulator, Topology
from cloudburst.comm.messages import Status
from cloudburst.comm.nic import NicState
from cloudburst.strategies.asgd.compensation import add_rule_alpha, staleness_factor
from cloudburst.strategies.asgd.shard import ShardState
from cloudburst.strategies.asgd.summary import histogram_quantiles, merged_histogram
from tests.helpers import shard_of


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _push(shard: ShardState, delta: torch.Tensor, base: int) -> None:
    assert shard.apply_push(delta, base).status == Status.OK


# ---------------------------------------------------------------------------- scalar factors
def test_delay_adaptive_defaults_to_a_threshold_of_one():
    """τ_C defaults to 1: τ = 2 is scaled by 1/2, τ = 3 by 1/3, τ = 1 not at all."""
    assert staleness_factor("delay-adaptive", 1) == 1.0
    assert staleness_factor("delay-adaptive", 2) == 0.5
    assert staleness_factor("delay-adaptive", 3) == 1 / 3
    # the add rule's α = λ·s with the same default τ_C
    assert add_rule_alpha(0.5, 2, "delay-adaptive") == 0.25
    assert add_rule_alpha(0.5, 1, "delay-adaptive") == 0.5


def test_a_fresh_push_is_never_scaled_by_delay_adaptive():
    """τ = 0 is within every threshold (τ ≤ τ_C gives 1), τ_C = 0 included."""
    assert staleness_factor("delay-adaptive", 0, 0) == 1.0
    assert staleness_factor("delay-adaptive", 0, 5) == 1.0
    assert staleness_factor("delay-adaptive", 5, 5) == 1.0  # at the threshold: still 1
    assert staleness_factor("delay-adaptive", 6, 3) == 0.5


def test_add_rule_alpha_defaults_to_no_compensation():
    """Without a compensation, α = λ whatever the staleness."""
    assert add_rule_alpha(0.25, 7) == 0.25


# ---------------------------------------------------------------------------- ShardState
def test_shard_parameter_takes_no_gradient_and_is_a_float32_copy():
    """θ_k is a detached fp32 copy of the given θ that autograd does not track."""
    theta = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    shard = ShardState(theta)
    assert shard.param.requires_grad is False
    assert shard.theta.dtype == torch.float32 and torch.equal(shard.theta, _t(1.0, 2.0))


def test_unknown_compensation_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^unknown staleness compensation 'bogus'$"):
        ShardState(_t(0.0), compensation="bogus")


def test_staleness_scaling_flag_says_whether_the_compensation_is_scale():
    """``staleness_scaling`` is True exactly for ``scale`` (asked for by name or by the flag)."""
    assert ShardState(_t(0.0)).staleness_scaling is False
    assert ShardState(_t(0.0), staleness_scaling=True).staleness_scaling is True
    assert ShardState(_t(0.0), compensation="scale").staleness_scaling is True
    assert ShardState(_t(0.0), compensation="delay-adaptive").staleness_scaling is False
    assert ShardState(_t(0.0), compensation="dc").staleness_scaling is False


def test_default_delay_threshold_of_a_shard_is_one():
    """delay-adaptive with the default τ_C = 1: pushes at τ = 0 and 1 apply whole, τ = 2 half."""
    shard = ShardState(_t(0.0), compensation="delay-adaptive")
    _push(shard, _t(1.0), 0)  # τ = 0: θ = 1
    _push(shard, _t(2.0), 0)  # τ = 1: θ = 3
    _push(shard, _t(4.0), 0)  # τ = 2: θ = 3 + 4/2 = 5
    assert torch.equal(shard.theta, _t(5.0))


def test_default_dc_lambda_and_local_lr():
    """DC-ASGD with λ = 0.04 and η = 1: Δ̃ = Δ − λ·Δ²·(θ_now − θ_then)/η."""
    shard = ShardState(_t(0.0), compensation="dc")
    _push(shard, _t(1.0), 0)  # τ = 0: θ_now − θ_then = 0, applied as is: θ = 1
    _push(shard, _t(2.0), 0)  # τ = 1: θ_then = 0, Δ̃ = 2 − 0.04·4·1 = 1.84
    assert shard.theta.item() == pytest.approx(2.84, rel=1e-6)


def test_default_ring_keeps_sixteen_versions_then_clamps():
    """The default window R = 16: θ after versions 0..15 is kept; once the 16th push is
    recorded, version 0 has left the ring and a push against it is clamped (``stats``)."""
    shard = ShardState(_t(0.0), compensation="dc")
    for v in range(15):
        _push(shard, _t(0.0), v)
    _push(shard, _t(0.0), 0)  # at version 15: the ring holds versions 0..15
    assert shard.stats()["compensation_clamped"] == 0
    _push(shard, _t(0.0), 0)  # at version 16: the ring holds versions 1..16
    assert shard.stats()["compensation_clamped"] == 1
    assert ShardState(_t(0.0)).stats()["compensation_clamped"] == 0  # no compensator


def test_delayed_nesterov_defaults_to_a_period_of_one():
    """N = 1 (and c = 0): every push is a momentum step, m ← β·m + g, θ ← θ − η·β·m − η·g."""
    eta, beta = 0.5, 0.5
    shard = shard_of(_t(0.0), rule="dn", lr=eta, momentum=beta)
    _push(shard, _t(1.0), 0)  # g = −1: m = −1, θ = 0 + 0.25 + 0.5 = 0.75
    assert torch.equal(shard.theta, _t(0.75))
    _push(shard, _t(1.0), 1)  # g = −1: m = −1.5, θ = 0.75 + 0.375 + 0.5 = 1.625
    assert torch.equal(shard.theta, _t(1.625))


def test_delayed_nesterov_defaults_to_c_zero():
    """c = 0: between the momentum steps (N = 2), a push is plain SGD of lr η/N."""
    eta, beta = 0.5, 0.5
    shard = shard_of(_t(0.0), rule="dn", lr=eta, momentum=beta, dn_period=2)
    _push(shard, _t(1.0), 0)  # t = 0: θ = 0 + η/2·1 = 0.25
    assert torch.equal(shard.theta, _t(0.25))
    _push(shard, _t(1.0), 1)  # t = 1: a = −2, m = −1, θ = 0.25 + 0.25 + 0.25 = 0.75
    assert torch.equal(shard.theta, _t(0.75))
    _push(shard, _t(1.0), 2)  # t = 2: no momentum term (c = 0): θ = 0.75 + 0.25 = 1.0
    assert torch.equal(shard.theta, _t(1.0))


# ---------------------------------------------------------------------------- histograms
def test_merged_histogram_adds_the_shards_counts_under_the_key():
    stats = [
        {"h": {"1": 2, "3": 1}, "other": {"9": 9}},
        {"h": {"1": 5, "0.5": 4}},
        {},
        {"h": None},
    ]
    merged = merged_histogram(stats, "h")
    assert merged == {0.5: 4, 1.0: 7, 3.0: 1}
    assert list(merged) == [0.5, 1.0, 3.0]


def test_histogram_quantile_is_the_smallest_value_reaching_its_share():
    """With counts {1: 1, 2: 1}, half the counts are at or below 1: p50 = 1."""
    assert histogram_quantiles({1.0: 1, 2.0: 1}, qs=(0.5,)) == {"p50": 1.0, "max": 2.0}
    assert histogram_quantiles({1.0: 1, 2.0: 3}, qs=(0.25, 0.26)) == {
        "p25": 1.0,
        "p26": 2.0,
        "max": 2.0,
    }
    assert histogram_quantiles({}) is None


# ---------------------------------------------------------------------------- is_flat_view
def test_consecutive_views_of_a_flat_vector_are_its_flat_view():
    flat = torch.zeros(6)
    params = [flat[0:2].view(2, 1), flat[2:6]]
    assert is_flat_view(params, flat) is True


def test_a_flat_vector_longer_than_the_parameters_is_not_their_view():
    """Same storage, same start, but ``flat`` has elements beyond the parameters."""
    flat = torch.zeros(6)
    assert is_flat_view([flat[0:2], flat[2:4]], flat) is False


def test_a_two_dimensional_buffer_is_not_a_flat_view():
    """The parameters cover all of ``flat``'s storage in order, but ``flat`` is not 1-D."""
    flat = torch.zeros(2, 3)
    line = flat.view(-1)
    assert is_flat_view([line[0:3], line[3:6]], flat) is False


def test_a_parameter_of_another_dtype_is_not_a_view_even_on_the_same_storage():
    flat = torch.zeros(4)
    assert is_flat_view([flat.view(torch.int32)], flat) is False


def test_a_non_contiguous_parameter_is_not_a_flat_view():
    """A transposed view starts at the right place but is not laid out as ``flat``."""
    flat = torch.zeros(4)
    p = flat.view(2, 2).t()
    assert not p.is_contiguous() and p.data_ptr() == flat.data_ptr()
    assert is_flat_view([p], flat) is False


# ---------------------------------------------------------------------------- LinkEmulator
NIC_MESSAGE = r"^a shared NIC needs the topology and this rank$"


def test_a_shared_nic_needs_both_the_topology_and_the_rank(tmp_path):
    nic = NicState(str(tmp_path / "nic"), 2)
    topology = Topology((0, 1))
    spec = LinkSpec(1.0, 1.0)
    try:
        with pytest.raises(ValueError, match=NIC_MESSAGE):
            LinkEmulator(spec, topology=topology, rank=None, nic=nic)
        with pytest.raises(ValueError, match=NIC_MESSAGE):
            LinkEmulator(spec, topology=None, rank=0, nic=nic)
        with pytest.raises(ValueError, match=NIC_MESSAGE):
            LinkEmulator(spec, nic=nic)
        assert LinkEmulator(spec, topology=topology, rank=1, nic=nic).shared
    finally:
        nic.close()
