"""The point-to-point payload sizes and the decoding of an empty payload (the quantise module's
edges that a mutation run on the fast tier found unchecked): an fp32 payload is 4 bytes a
value, bf16 2, a quantised one 1 per padded value plus a 4-byte scale per block; nothing
decodes to an empty vector."""

import pytest
import torch

from cloudburst.comm.quantise import BLOCK, decode, encode, payload_bytes


@pytest.mark.parametrize("numel", [0, 1, 3, BLOCK, BLOCK + 1])
def test_payload_bytes_per_method(numel):
    blocks = -(-numel // BLOCK)
    assert payload_bytes(numel, "none") == 4 * numel
    assert payload_bytes(numel, "bf16") == 2 * numel
    for method in ("int8", "fp8"):
        assert payload_bytes(numel, method) == blocks * (BLOCK + 4)
    with pytest.raises(ValueError, match="no point-to-point payload"):
        payload_bytes(numel, "powersgd")


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_an_empty_payload_decodes_to_an_empty_vector(method):
    packed = encode(torch.empty(0), method)
    assert packed.numel() == 0
    out = decode(packed, 0, method)
    assert out.shape == (0,) and out.dtype == torch.float32
