"""local_sgd (post-local SGD) and diloco against their single-process simulations."""

import pytest

from tests.helpers import cli, final_record, read_summary, simulated
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
    # 8 synchronous steps (an average after each), then an average every 4 steps (12, 16)
    # and a last one at step 18: 11 averages. Worker 1's loss at step 12 is NaN: that step
    # is skipped on worker 1 only (its gradient is its own), and step 12's average mixes
    # worker 0's step with worker 1's unchanged replica. The two workers are two emulated
    # nodes with a slow link between them: it delays, but changes no number.
    out = tmp_path / "post"
    args = ["--strategy", "local_sgd", "--workers", "2", "--period", "4",
        "--local-sgd-warmup-steps", "8", "--steps", "18", "--nodes", "2",
        "--inter-node-link", LINK, "--inject-fault", "nan:1@12", "--out", str(out),
        *COMMON]  # fmt: skip
    expected, averages = parity_local_sgd(18, workers=2, period=4, warmup_steps=8, nan=[(1, 12)])
    assert averages == 11
    _gloo_and_simulator_end_on(expected, args, out)
    # The local phase ran: the same steps averaged every step would end elsewhere.
    synchronous, _ = parity_local_sgd(18, workers=2, period=1, nan=[(1, 12)])
    assert_params_differ(expected, synchronous)

    numel, s = parity_numel(), read_summary(out)
    assert s["steps_skipped_nonfinite"] == 1 and s["nodes"] == 2
    # Each average is a ring all-reduce of θ in fp32 over 2 workers: each sends |θ|·4 bytes,
    # all of it across the node boundary.
    assert s["sent_bytes"] == s["inter_node_bytes"] == 2 * averages * numel * 4
    assert s["intra_node_bytes"] == 0
    # The emulated link charged each worker docs/cli.md's link cost for each average: a ring
    # all-reduce of n = 2 ranks, 2(n − 1) latencies and 2(n − 1)/n of its bytes.
    gbit_per_s, latency_ms = (float(v) for v in LINK.split(","))
    cost = 2 * latency_ms / 1e3 + numel * 4 / (gbit_per_s * 1e9 / 8)
    for rank in (0, 1):
        final = final_record(out, rank)
        assert final["averages"] == averages
        assert final["emulated_link_s"] == pytest.approx(averages * cost, abs=1e-5)
    assert final_record(out, 0)["steps_skipped_nonfinite"] == 0
    assert final_record(out, 1)["steps_skipped_nonfinite"] == 1


def test_diloco_warm_start_then_outer_optimizer_without_nesterov(tmp_path):
    # A synchronous warm start of 4 steps (the replicas averaged after each, no outer step),
    # then outer SGD with lr 0.5 and plain momentum 0.5 every 5 steps from there (9, 14, …,
    # 29) and once more at the end (32 = 4 + 5·5 + 3): 6 outer steps, 10 averages.
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
    s = read_summary(out)
    # One all-reduce of θ per average: 1/5 of sync's per-step gradient traffic after the warm-up.
    assert s["sent_bytes"] == 2 * (4 + outer_steps) * parity_numel() * 4
    assert [final_record(out, r)["averages"] for r in (0, 1)] == [4 + outer_steps] * 2


def test_desloc_averages_adams_moments_on_their_own_schedules(tmp_path):
    # Inner AdamW, an outer step every 4 steps (4, 8, ..., 24: 6), and after it the replicas'
    # first moments averaged every 2 periods (8, 16, 24), their second moments every period (6
    # times). (The first moments more often than the second blew this model up: a moment
    # averaged over a replica whose second moment is near 0 makes m/√v huge.)
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
    # Every all-reduce (θ's, each moment's) is |θ| fp32 values from each of the 2 workers.
    assert read_summary(out)["sent_bytes"] == 2 * (outer_steps + 3 + 6) * parity_numel() * 4
    assert [final_record(out, r)["moment_averages"] for r in (0, 1)] == [9, 9]


def test_streaming_diloco_two_fragments_one_step_delay(tmp_path):
    # F = 2 fragments of H = 6, each all-reduce started non-blocking on gloo and applied one
    # inner step later, mixed half and half with the replica's fragment; the reference, the
    # virtual cluster and gloo end on the same θ.
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
