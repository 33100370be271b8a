"""local_sgd (post-local SGD) and diloco against their single-process simulations."""

import pytest

from tests.support import cli, final_record, read_summary, simulated
from tests.reference import (
    COMMON,
    LR,
    assert_params_differ,
    assert_same_params,
    parity_diloco,
    parity_local_sgd,
    parity_numel,
    parity_streaming_diloco,
    trained,
)

pytestmark = pytest.mark.dist

LINK = "1,0.5"  # 1 Gbit/s, 0.5 ms


def _gloo_and_simulator_end_on(expected, args: list[str], out) -> None:
    """The CLI run over gloo and the same job on the virtual cluster end on ``expected``."""
    cli("train", *args)
    assert_same_params(trained(out), expected)
    assert_same_params(trained(simulated(args)), trained(out))


def test_post_local_sgd_warmup_then_local_steps_over_an_emulated_link(tmp_path):
    # Averages after steps 1–8, 12, 16 and 18: 11. Worker 1 alone skips its NaN step 12. The
    # two workers are two nodes over an emulated link: it delays, but changes no number.
    out = tmp_path / "post"
    args = ["--strategy", "local_sgd", "--workers", "2", "--period", "4",
        "--local-sgd-warmup-steps", "8", "--steps", "18", "--nodes", "2",
        "--inter-node-link", LINK, "--inject-fault", "nan:1@12", "--out", str(out),
        *COMMON]  # fmt: skip
    expected, averages = parity_local_sgd(18, workers=2, period=4, warmup_steps=8, nan=[(1, 12)])
    assert averages == 11
    _gloo_and_simulator_end_on(expected, args, out)
    # the local phase ran: averaging every step would end elsewhere
    synchronous, _ = parity_local_sgd(18, workers=2, period=1, nan=[(1, 12)])
    assert_params_differ(expected, synchronous)

    numel, s = parity_numel(), read_summary(out)
    assert s["steps_skipped_nonfinite"] == 1 and s["nodes"] == 2
    # each average: a ring all-reduce of θ in fp32, |θ|·4 bytes from each, all across nodes
    assert s["sent_bytes"] == s["inter_node_bytes"] == 2 * averages * numel * 4
    assert s["intra_node_bytes"] == 0
    # docs/cli.md's link cost per average: 2(n − 1) latencies and 2(n − 1)/n of the bytes
    gbit_per_s, latency_ms = (float(v) for v in LINK.split(","))
    cost = 2 * latency_ms / 1e3 + numel * 4 / (gbit_per_s * 1e9 / 8)
    for rank in (0, 1):  # worker 1 alone skipped a step
        final = final_record(out, rank)
        assert (final["averages"], final["steps_skipped_nonfinite"]) == (averages, rank)
        assert final["emulated_link_s"] == pytest.approx(averages * cost, abs=1e-5)


def test_diloco_warm_start_then_outer_optimizer_without_nesterov(tmp_path):
    # 4 warm-start averages, then outer steps (lr 0.5, plain momentum 0.5) after 9, 14, …, 29
    # and at the end (32): 6 outer steps, 10 averages.
    out = tmp_path / "diloco"
    args = ["--strategy", "diloco", "--workers", "2", "--period", "5", "--steps", "32",
        "--local-sgd-warmup-steps", "4", "--diloco-outer-lr", "0.5",
        "--diloco-outer-momentum", "0.5", "--diloco-no-nesterov",
        "--out", str(out), *COMMON]  # fmt: skip
    settings = dict(period=5, outer_lr=0.5, outer_momentum=0.5)
    expected, outer_steps = parity_diloco(32, 2, nesterov=False, warmup_steps=4, **settings)
    assert outer_steps == 6
    _gloo_and_simulator_end_on(expected, args, out)
    assert_params_differ(
        expected, parity_diloco(32, 2, nesterov=True, warmup_steps=4, **settings)[0]
    )
    assert_params_differ(expected, parity_diloco(32, 2, nesterov=False, **settings)[0])
    # one all-reduce of θ per average
    assert read_summary(out)["sent_bytes"] == 2 * (4 + outer_steps) * parity_numel() * 4
    assert [final_record(out, r)["averages"] for r in (0, 1)] == [4 + outer_steps] * 2


def test_desloc_averages_adams_moments_on_their_own_schedules(tmp_path):
    # Inner AdamW, 6 outer steps (every 4), first moments averaged every 2 periods (8, 16, 24),
    # second moments every period. (The first more often than the second blew this model up.)
    out = tmp_path / "desloc"
    args = ["--strategy", "diloco", "--workers", "2", "--period", "4", "--steps", "24",
        "--optimizer", "adamw", "--desloc-first-every", "2", "--desloc-second-every", "1",
        "--diloco-outer-lr", "0.7", "--diloco-outer-momentum", "0.9",
        "--out", str(out), *COMMON]  # fmt: skip
    settings = dict(period=4, outer_lr=0.7, outer_momentum=0.9, nesterov=True, adamw_lr=LR)
    expected, outer_steps = parity_diloco(24, 2, desloc=(2, 1), **settings)
    assert outer_steps == 6
    _gloo_and_simulator_end_on(expected, args, out)
    assert_params_differ(expected, parity_diloco(24, 2, desloc=(0, 1), **settings)[0])
    assert_params_differ(expected, parity_diloco(24, 2, **settings)[0])
    # every all-reduce (θ's, each moment's): |θ| fp32 values from each worker
    assert read_summary(out)["sent_bytes"] == 2 * (outer_steps + 3 + 6) * parity_numel() * 4
    assert [final_record(out, r)["moment_averages"] for r in (0, 1)] == [9, 9]


def test_streaming_diloco_two_fragments_one_step_delay(tmp_path):
    # F = 2, H = 6, each all-reduce non-blocking on gloo, applied a step later, mixed α = 0.5
    out = tmp_path / "streaming"
    args = ["--strategy", "diloco", "--workers", "2", "--period", "6", "--steps", "20",
        "--fragments", "2", "--fragment-delay", "1", "--fragment-alpha", "0.5",
        "--diloco-outer-lr", "0.7", "--diloco-outer-momentum", "0.9", "--nodes", "2",
        "--inter-node-link", LINK,
        "--out", str(out), *COMMON]  # fmt: skip
    settings = dict(period=6, fragments=2, delay=1, alpha=0.5, outer_lr=0.7)
    expected, syncs = parity_streaming_diloco(20, 2, outer_momentum=0.9, nesterov=True, **settings)
    assert syncs == 8
    _gloo_and_simulator_end_on(expected, args, out)
    s = read_summary(out)
    assert s["sent_bytes"] == s["inter_node_bytes"] == 2 * 4 * (4 * parity_numel())
    assert [final_record(out, r)["averages"] for r in (0, 1)] == [syncs] * 2
