"""The quantise module's edges that a mutation run found unchecked: payload sizes, an empty
payload, and a block holding a NaN or an infinity arriving NaN, as it would uncompressed."""

import pytest
import torch

from cloudburst.comm.quantise import BLOCK, decode, encode, payload_bytes, quantise


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


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_block_holding_a_non_finite_value_arrives_nan(method, bad):
    x = torch.linspace(-1.0, 1.0, 2 * BLOCK + 7)
    x[BLOCK + 3] = bad  # in the second of three blocks
    out = decode(encode(x, method), x.numel(), method)
    assert bool(out[BLOCK : 2 * BLOCK].isnan().all())
    assert bool(torch.isfinite(out[:BLOCK]).all()) and bool(torch.isfinite(out[2 * BLOCK :]).all())


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_block_of_denormal_values_arrives_finite(method):
    # Its absmax / 127 (or / 448) underflows to 0 in fp32; a 0 scale decodes to NaN.
    x = torch.cat([torch.full((BLOCK,), 1e-44), torch.linspace(-1.0, 1.0, BLOCK)])
    out = decode(encode(x, method), x.numel(), method)
    assert bool(torch.isfinite(out).all())
    assert bool((out[:BLOCK].abs() <= 1e-38).all())  # within one rounding of the tiny scale


@pytest.mark.parametrize("method", ["bf16", "none", "int4"])
def test_quantising_to_a_method_without_codes_is_refused_by_name(method):
    with pytest.raises(ValueError, match=rf"^not a quantised method: '{method}'$"):
        quantise(torch.ones(3), method)
