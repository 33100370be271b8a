"""local_sgd and diloco against their exact references."""

import json

import pytest

from tests.dist.test_parity import COMMON, assert_same_params, reference, trained
from tests.helpers import cli

pytestmark = pytest.mark.dist


def test_local_sgd_with_period_1_equals_sync_sgd(tmp_path):
    out = tmp_path / "local1"
    cli(
        "train",
        "--strategy",
        "local_sgd",
        "--workers",
        "2",
        "--period",
        "1",
        "--steps",
        "30",
        "--out",
        str(out),
        *COMMON,
    )
    assert_same_params(trained(out), reference(30, workers=2))


def test_post_local_sgd_warmup_is_sync_then_local(tmp_path):
    # 12 synchronous steps, then averages every 4: after step 12 it is still exactly sync.
    out = tmp_path / "post"
    cli(
        "train",
        "--strategy",
        "local_sgd",
        "--workers",
        "2",
        "--period",
        "4",
        "--local-sgd-warmup-steps",
        "12",
        "--steps",
        "12",
        "--out",
        str(out),
        *COMMON,
    )
    assert_same_params(trained(out), reference(12, workers=2))


def test_diloco_with_outer_sgd_lr_1_no_momentum_equals_local_sgd(tmp_path):
    runs = {}
    for name, extra in [
        ("local_sgd", []),
        ("diloco", ["--diloco-outer-lr", "1.0", "--diloco-outer-momentum", "0"]),
    ]:
        out = tmp_path / name
        cli(
            "train",
            "--strategy",
            name,
            "--workers",
            "2",
            "--period",
            "5",
            "--steps",
            "32",
            "--out",
            str(out),
            *extra,
            *COMMON,
        )
        runs[name] = out
    assert_same_params(trained(runs["diloco"]), trained(runs["local_sgd"]))
    # Averages every 5 steps plus one for the 2 steps left at the end: 7 of them, each a
    # ring all-reduce of the parameters, 1/5 of sync's gradient traffic (+ the last one).
    summaries = {k: json.loads((v / "summary.json").read_text()) for k, v in runs.items()}
    assert summaries["diloco"]["bytes_sent"] == summaries["local_sgd"]["bytes_sent"]
