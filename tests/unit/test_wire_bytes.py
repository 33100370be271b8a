"""The bytes one value costs on the wire under each ``--compress`` method, from the formats'
definitions (docs/algorithms.md#compression): fp32 4, bf16 2, int8 and fp8 one byte a value
plus one fp32 scale (4 bytes) shared by each block of 256 values."""

from __future__ import annotations

import pytest
import torch

from cloudburst.comm.compress import encode, wire_bytes_per_value

VALUES_PER_SCALE = 256


@pytest.mark.parametrize(
    ("method", "expected"),
    # int8, fp8: 1 + 4/256 = 1.015625 (a byte, and a 256th of a 4-byte scale)
    [("none", 4.0), ("bf16", 2.0), ("int8", 1.015625), ("fp8", 1.015625)],
)
def test_each_method_costs_its_formats_bytes_per_value(method, expected):
    assert wire_bytes_per_value(method) == expected


@pytest.mark.parametrize("method", ["bf16", "int8", "fp8"])
def test_a_message_of_whole_blocks_costs_exactly_that_per_value(method):
    """What the docs quote per value is what an encoded message of whole blocks occupies."""

    numel = 3 * VALUES_PER_SCALE
    packet = encode(torch.linspace(-2.0, 3.0, numel), method)
    assert packet.numel() / numel == wire_bytes_per_value(method)
