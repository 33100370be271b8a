import pytest
import torch

from cloudburst.comm.p2p import MAGIC, Header, Kind, MessageError, Status


def test_header_round_trip():
    h = Header(
        Kind.PUSH_FETCH, shard=2, version=17, numel=1000, samples=64, status=Status.OK, aux=5
    )
    assert Header.from_tensor(h.to_tensor()) == h


@pytest.mark.parametrize(
    "values",
    [
        [0, 1, 0, 0, 0, 0, 0, 0],  # wrong magic
        [MAGIC, 99, 0, 0, 0, 0, 0, 0],  # unknown kind
        [MAGIC, 2, 0, -1, 10, 0, 0, 0],  # negative version
        [MAGIC, 2, 0, 0, -5, 0, 0, 0],  # negative length
    ],
)
def test_malformed_headers_are_rejected(values):
    with pytest.raises(MessageError):
        Header.from_tensor(torch.tensor(values, dtype=torch.int64))
