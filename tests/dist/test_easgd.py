"""EASGD's elastic update, exact: a CLI run against its simulation. The elastic rule on
scripted exchanges (two shards) is tests/unit/test_references.py's, one shard over gloo
tests/dist/test_references.py's, and a non-finite push tests/unit/test_server_shard.py's."""

import pytest

from tests.helpers import cli, final_record, read_summary, simulated
from tests.reference import (
    COMMON,
    assert_params_differ,
    assert_same_params,
    easgd_one_worker,
    trained,
)

pytestmark = pytest.mark.dist


def test_cli_easgd_tau_and_beta_against_the_simulation(tmp_path):
    # One worker: α = β / W = 0.5; an elastic exchange every 3 steps (6 of them in 20 steps)
    # and one more for the last 2 steps, when the worker finishes.
    out = tmp_path / "easgd"
    args = ["--strategy", "easgd", "--workers", "1", "--servers", "1", "--easgd-tau", "3",
        "--easgd-beta", "0.5", "--steps", "20", "--out", str(out), *COMMON]  # fmt: skip
    cli("train", *args)
    sim = simulated(args)  # the same job on the virtual cluster
    expected = easgd_one_worker(20, tau=3, alpha=0.5)
    assert_same_params(trained(out), expected)  # the centre θ̃ the server holds
    assert_same_params(trained(sim), trained(out))  # the simulator == gloo
    assert_params_differ(expected, easgd_one_worker(20, tau=3, alpha=0.9))  # default β
    assert_params_differ(expected, easgd_one_worker(20, tau=10, alpha=0.5))  # default τ
    assert final_record(out, 1)["pushes"] == 7
    assert read_summary(out)["samples_applied"] == 20 * 16
