import pytest
import torch

from cloudburst.comm.messages import MAGIC, Header, Kind, MessageError, Status


def test_header_round_trip():
    h = Header(
        Kind.PUSH_FETCH, shard=2, version=17, numel=1000, samples=64, status=Status.OK, aux=5
    )
    assert Header.from_tensor(h.to_tensor()) == h


@pytest.mark.parametrize(
    "values, why",
    [
        ([0, 1, 0, 0, 0, 0, 0, 0], f"bad magic 0x0 (expected {MAGIC:#x})"),
        ([MAGIC, 99, 0, 0, 0, 0, 0, 0], "unknown message kind 99"),
        ([MAGIC, 2, 0, -1, 10, 0, 0, 0], "negative field in header"),  # version
        ([MAGIC, 2, 0, 0, -5, 0, 0, 0], "negative field in header"),  # length
        ([MAGIC, 2, -1, 0, 5, 0, 0, 0], "negative field in header"),  # shard
    ],
)
def test_malformed_headers_are_rejected(values, why):
    with pytest.raises(MessageError) as err:
        Header.from_tensor(torch.tensor(values, dtype=torch.int64))
    assert str(err.value).startswith(why), err.value
