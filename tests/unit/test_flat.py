import pytest
import torch
from torch import nn

from cloudburst.comm.flat import (
    adopt_flat,
    assign_flat,
    flatten_params,
    is_flat_view,
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


def test_flatten_assign_round_trip_copying_instead_of_aliasing():
    model = build_model("cnn", 40, 10, seed=0)
    flat = flatten_params(model)
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    other = build_model("cnn", 40, 10, seed=1)
    assign_flat(other, flat)
    assert torch.equal(flatten_params(other), flat)
    with pytest.raises(ValueError, match=f"flat vector has {flat.numel() - 1} elements, model"):
        assign_flat(other, flat[:-1])
    zeros = torch.zeros_like(flat)
    assign_flat(other, zeros)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    assert zeros.abs().sum() == 0, "the model's parameters must not be views of the vector"


def test_split_shards_refuses_a_non_vector_even_when_the_bounds_fit_and_says_where_they_end():
    with pytest.raises(ValueError, match="^bounds end at 6, tensor has 6$"):
        split_shards(torch.zeros(2, 3), [(0, 3), (3, 6)])
    with pytest.raises(ValueError, match="^bounds end at 0, tensor has 6$"):
        split_shards(torch.zeros(2, 3), [])
    with pytest.raises(ValueError, match="^bounds end at 9, tensor has 10$"):
        split_shards(torch.zeros(10), [(0, 3), (3, 6), (6, 9)])


def test_flatten_params_of_a_list_with_non_contiguous_and_half_precision_parameters():
    transposed = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    half = torch.tensor([7.0, 8.0], dtype=torch.float16)
    flat = flatten_params([transposed, half])
    assert flat.dtype == torch.float32
    assert flat.tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0, 7.0, 8.0]
    only_half = flatten_params([half])
    assert only_half.dtype == torch.float32 and only_half.tolist() == [7.0, 8.0]
    out = torch.zeros(5)  # written into the buffer given
    result = flatten_params([torch.ones(2), torch.full((3,), 2.0)], out=out)
    assert result.data_ptr() == out.data_ptr()
    assert out.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]


def test_adopt_flat_makes_the_same_parameters_views_of_the_vector():
    model = nn.Linear(2, 2)
    params = list(model.parameters())
    flat = torch.arange(6.0)
    assert not is_flat_view(model, flatten_params(model))  # a copy, not the parameters
    adopt_flat(model, flat)
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))
    assert model.weight.tolist() == [[0.0, 1.0], [2.0, 3.0]] and model.bias.tolist() == [4.0, 5.0]
    assert is_flat_view(model, flat) and not is_flat_view(model, torch.zeros(6))
    flat[0] = 10.0  # no copy: the parameter sees it
    assert model.weight[0, 0].item() == 10.0
    model.bias.data = torch.zeros(2)  # a parameter's storage replaced
    assert not is_flat_view(model, flat)
    with pytest.raises(ValueError, match="^flat vector has 5 elements, model has 6$"):
        adopt_flat(nn.Linear(2, 2), torch.zeros(5))


def test_adopt_flat_copies_into_parameters_of_another_dtype():
    params = list(nn.Linear(2, 2).half().parameters())
    flat = torch.arange(6.0)
    adopt_flat(params, flat)
    assert [p.dtype for p in params] == [torch.float16, torch.float16]
    assert params[0].tolist() == [[0.0, 1.0], [2.0, 3.0]] and params[1].tolist() == [4.0, 5.0]
    flat[0] = 10.0  # a copy: the parameter keeps its value
    assert params[0][0, 0].item() == 0.0


def _transposed(flat: torch.Tensor) -> list[torch.Tensor]:
    p = flat.view(2, 2).t()  # starts where ``flat`` does, but is not laid out as it is
    assert not p.is_contiguous() and p.data_ptr() == flat.data_ptr()
    return [p]


@pytest.mark.parametrize(
    "shape, params, is_view",
    [
        ((6,), lambda f: [f[0:2].view(2, 1), f[2:6]], True),  # consecutive views, in order
        ((6,), lambda f: [f[0:2], f[2:4]], False),  # ``flat`` longer than the parameters
        ((2, 3), lambda f: [f.view(-1)[0:3], f.view(-1)[3:6]], False),  # ``flat`` not 1-D
        ((4,), lambda f: [f.view(torch.int32)], False),  # same storage, another dtype
        ((4,), _transposed, False),  # not contiguous
    ],
    ids=["views", "longer", "2-d", "dtype", "transposed"],
)
def test_parameters_are_a_flat_view_only_as_consecutive_contiguous_views_of_all_of_it(
    shape, params, is_view
):
    flat = torch.zeros(shape)
    assert is_flat_view(params(flat), flat) is is_view
