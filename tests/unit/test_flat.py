import pytest
import torch

from cloudburst.comm.flat import (
    assign_flat,
    flatten_params,
    join_shards,
    shard_bounds,
    split_shards,
)
from cloudburst.models import build_model


@pytest.mark.parametrize("numel, shards", [(1, 1), (7, 3), (10, 4), (101, 7), (5, 5), (12345, 8)])
def test_shards_near_equal_and_round_trip(numel, shards):
    bounds = shard_bounds(numel, shards)
    sizes = [b - a for a, b in bounds]
    assert sum(sizes) == numel and max(sizes) - min(sizes) <= 1
    assert bounds[0][0] == 0 and all(bounds[i][1] == bounds[i + 1][0] for i in range(shards - 1))
    flat = torch.randn(numel)
    assert torch.equal(join_shards(split_shards(flat, bounds)), flat)


def test_too_many_shards_is_an_error():
    with pytest.raises(ValueError, match="cannot split 3 elements into 4 non-empty shards"):
        shard_bounds(3, 4)
    with pytest.raises(ValueError, match="num_shards must be >= 1, got 0"):
        shard_bounds(3, 0)
    assert shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]  # the first take the rest


def test_flatten_assign_round_trip():
    model = build_model("cnn", 40, 10, seed=0)
    flat = flatten_params(model)
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    other = build_model("cnn", 40, 10, seed=1)
    assign_flat(other, flat)
    assert torch.equal(flatten_params(other), flat)
    with pytest.raises(ValueError, match=f"flat vector has {flat.numel() - 1} elements, model"):
        assign_flat(other, flat[:-1])


def test_assign_flat_copies_instead_of_aliasing():
    model = build_model("mlp", 40, 10, seed=0)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    assign_flat(model, flat)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert flat.abs().sum() == 0, "the model's parameters must not be views of the vector"
