"""Compressed asgd pushes and fetches on real gloo processes (issue 17): one worker and two
shards with ``--compress int8``, through the CLI, end with the parameters and the byte counts of
the same job on the virtual cluster, and with about a quarter of an uncompressed run's bytes."""

import pytest

from tests.helpers import cli, read_summary, simulated
from tests.reference import COMMON, assert_same_params, trained

pytestmark = pytest.mark.dist


def _args(out, compress: str) -> list[str]:
    # Push every step, fetch every 2nd: a plain PUSH, then an overlapped PUSH_FETCH whose reply
    # (θ before the push, compressed) gets the worker's own decompressed Δ added.
    return ["--strategy", "asgd", "--workers", "1", "--servers", "2", "--n-fetch", "2",
        "--n-push", "1", "--server-lr", "0.5", "--steps", "30", "--compress", compress,
        "--out", str(out), *COMMON]  # fmt: skip


def test_asgd_int8_pushes_and_fetches_over_gloo_match_the_simulator(tmp_path):
    args = _args(tmp_path / "int8", "int8")
    cli("train", *args)
    sim = simulated(args)
    assert_same_params(trained(tmp_path / "int8"), trained(sim))
    real, virtual = read_summary(tmp_path / "int8"), read_summary(sim)
    assert real["pushes_rejected"] == 0 and real["messages_rejected"] == 0
    assert real["sent_bytes"] == virtual["sent_bytes"]
    plain = tmp_path / "none"
    cli("train", *_args(plain, "none"))
    assert 0.25 < real["sent_bytes"] / read_summary(plain)["sent_bytes"] < 0.3
