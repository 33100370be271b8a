"""``--compress powersgd:RANK:START``: PowerSGD's rank and the step it starts compressing at
(plain all-reduce before it: its authors' warm-up), as PyTorch's PowerSGDState gets them."""

import pytest

from cloudburst.comm.allreduce import new_powersgd_state
from cloudburst.comm.compress import POWERSGD_START, Compression
from cloudburst.config import ConfigError, RunConfig


@pytest.mark.parametrize(
    "spec, rank, start",
    [
        ("powersgd", 1, POWERSGD_START),
        ("powersgd:4", 4, POWERSGD_START),
        ("powersgd:2:200", 2, 200),
    ],
)
def test_rank_and_start_reach_powersgds_state(spec, rank, start):
    assert Compression.parse(spec) == Compression("powersgd", rank, start)
    state = new_powersgd_state(None, spec)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (rank, start)
    assert state.use_error_feedback and state.warm_start


@pytest.mark.parametrize(
    "spec, message",
    [
        ("powersgd:2:1", "start must be an integer in 2.."),
        ("powersgd:2:", "start must be an integer in 2.."),
        ("powersgd:2:x", "start must be an integer in 2.."),
        ("powersgd:0:100", "rank must be an integer in 1.."),
        ("int8:2:100", "only powersgd takes arguments"),
    ],
)
def test_a_bad_start_or_rank_is_one_config_line(spec, message):
    with pytest.raises(ConfigError, match=f"^compress: '{spec}': .*{message}") as err:
        RunConfig(strategy="sync", workers=2, compress=spec)
    assert "\n" not in str(err.value)
