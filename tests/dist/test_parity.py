"""Parity: a CLI run ends with the parameters of tests/reference.py's simulation of it: sync,
asgd's server rules, staleness bound and scaling, sharding, n_fetch ≠ n_push, and EASGD's elastic
update. Beside each, the references show that without a flag the parameters would differ."""

import pytest

from tests.support import cli, final_record, rank_events, read_summary, simulated
from tests.reference import (
    COMMON,
    asgd_one_worker,
    assert_params_differ,
    assert_same_params,
    easgd_one_worker,
    parity_diloco,
    parity_local_sgd,
    sync_sgd,
    trained,
)

pytestmark = pytest.mark.dist


def _gloo_and_simulator_end_on(expected, args: list[str], out) -> None:
    """The CLI run over gloo and the same job on the virtual cluster end on ``expected``."""
    cli("train", *args)
    assert_same_params(trained(out), expected)
    assert_same_params(trained(simulated(args)), trained(out))


def test_the_simulations_agree_where_the_algorithms_coincide():
    sgd = sync_sgd(30, workers=2)
    # Averaging after every step is synchronous SGD (momentum and all: it is linear).
    assert_same_params(parity_local_sgd(30, workers=2, period=1)[0], sgd)
    # DiLoCo with an outer SGD of lr 1 and no momentum sets θ to the replicas' mean.
    assert_same_params(
        parity_diloco(32, 2, period=5, outer_lr=1.0, outer_momentum=0.0, nesterov=True)[0],
        parity_local_sgd(32, 2, period=5)[0],
    )
    # One asgd worker with the add rule, λ = 1, pushing and fetching every step: plain SGD.
    one = asgd_one_worker(30, n_fetch=1, n_push=1, rule="add", lr=1.0)[0]
    assert_same_params(one, sync_sgd(30, workers=1))
    # ... and so is the sgd rule with lr 1 and no momentum.
    assert_same_params(asgd_one_worker(30, n_fetch=1, n_push=1, rule="sgd", lr=1.0)[0], one)


def test_sync_adam_weight_decay_cosine_equals_one_model_on_the_double_batch(tmp_path):
    out = tmp_path / "sync"
    flags = dict(optimizer="adam", lr=0.01, weight_decay=0.01, cosine=True)
    args = ["--strategy", "sync", "--workers", "2", "--steps", "40", "--out", str(out),
        *COMMON, "--optimizer", "adam", "--lr", "0.01", "--weight-decay",
        "0.01", "--lr-schedule", "cosine"]  # fmt: skip
    expected = sync_sgd(40, workers=2, **flags)
    _gloo_and_simulator_end_on(expected, args, out)
    assert_params_differ(expected, sync_sgd(40, workers=2, **{**flags, "weight_decay": 0.0}))
    assert_params_differ(expected, sync_sgd(40, workers=2, **{**flags, "cosine": False}))
    assert_params_differ(expected, sync_sgd(40, workers=2, lr=0.01, weight_decay=0.01))


def _push_records(out, server):
    return [(e["status"], e["staleness_versions"]) for e in rank_events(out, server, "push")]


def test_asgd_add_rule_staleness_bound_and_scaling_over_two_shards(tmp_path):
    # Pushing every step, fetching every 4th: pushes 0..3 stale, the 3-stale one dropped, the
    # others applied with λ/max(1, staleness).
    out = tmp_path / "asgd"
    args = ["--strategy", "asgd", "--workers", "1", "--servers", "2", "--n-fetch", "4",
        "--n-push", "1", "--max-staleness", "2", "--staleness-scaling", "--server-lr", "0.5",
        "--steps", "40", "--push-log-every", "1", "--out", str(out), *COMMON]  # fmt: skip
    settings = dict(n_fetch=4, n_push=1, rule="add", lr=0.5, max_staleness=2, scaling=True)
    expected, server = asgd_one_worker(40, **settings)
    _gloo_and_simulator_end_on(expected, args, out)
    assert_params_differ(expected, asgd_one_worker(40, **{**settings, "scaling": False})[0])
    assert_params_differ(expected, asgd_one_worker(40, **{**settings, "max_staleness": None})[0])
    cycle = [("OK", 0), ("OK", 1), ("OK", 2), ("STALE_DROPPED", 3)]
    for shard in (0, 1):  # both shards see the same sequence
        assert _push_records(out, shard) == cycle * 10
    s = read_summary(out)
    assert server.dropped == 10 and server.version == 30
    assert s["pushes_dropped_stale"] == 2 * server.dropped  # counted by each shard
    assert s["max_staleness_versions"] == max(server.staleness) == 2
    assert s["mean_staleness_versions"] == pytest.approx(sum(server.staleness) / server.version)
    assert s["samples_applied"] == server.version * 16 and s["pushes_rejected"] == 0


def test_asgd_sgd_rule_with_server_momentum_keeps_unpushed_progress(tmp_path):
    # A fetch between pushes keeps the unpushed steps; the sgd rule steps with momentum on −Δ.
    out = tmp_path / "asgd-sgd"
    cli("train", "--strategy", "asgd", "--workers", "1", "--servers", "1", "--n-fetch", "2",
        "--n-push", "3", "--server-rule", "sgd", "--server-lr", "1.0", "--server-momentum",
        "0.5", "--steps", "31", "--push-log-every", "5", "--out", str(out),
        *COMMON)  # fmt: skip
    settings = dict(n_fetch=2, n_push=3, rule="sgd", lr=1.0, momentum=0.5)
    expected, server = asgd_one_worker(31, **settings)
    assert_same_params(trained(out), expected)
    assert_params_differ(expected, asgd_one_worker(31, **{**settings, "momentum": 0.0})[0])
    # 10 pushes and one for step 31; a push record every 5
    assert server.version == 11
    assert [e["version"] for e in rank_events(out, 0, "push")] == [5, 10]
    assert read_summary(out)["samples_applied"] == 31 * 16


def test_asgd_adagrad_rule_over_two_shards(tmp_path):
    out = tmp_path / "asgd-adagrad"
    cli("train", "--strategy", "asgd", "--workers", "1", "--servers", "2", "--n-sync", "5",
        "--server-rule", "adagrad", "--server-lr", "0.01", "--steps", "30", "--out", str(out),
        *COMMON)  # fmt: skip
    settings = dict(n_fetch=5, n_push=5, rule="adagrad", lr=0.01)
    expected, _ = asgd_one_worker(30, **settings)
    assert_same_params(trained(out), expected)
    assert_params_differ(expected, asgd_one_worker(30, **{**settings, "rule": "sgd"})[0])


def test_cli_easgd_tau_and_beta_against_the_simulation(tmp_path):
    # α = β / W = 0.5; 6 exchanges (every 3 steps) and one more at the finish
    out = tmp_path / "easgd"
    args = ["--strategy", "easgd", "--workers", "1", "--servers", "1", "--easgd-tau", "3",
        "--easgd-beta", "0.5", "--steps", "20", "--out", str(out), *COMMON]  # fmt: skip
    expected = easgd_one_worker(20, tau=3, alpha=0.5)
    _gloo_and_simulator_end_on(expected, args, out)  # the centre θ̃ the server holds
    assert_params_differ(expected, easgd_one_worker(20, tau=3, alpha=0.9))  # default β
    assert_params_differ(expected, easgd_one_worker(20, tau=10, alpha=0.5))  # default τ
    assert final_record(out, 1)["pushes"] == 7
    assert read_summary(out)["samples_applied"] == 20 * 16
