"""Flatten a model's parameters into one vector and split it into server shards.

Mechanism only, no policy: the strategies decide when and with whom; these functions move
between a module's parameters, one flat fp32 vector, and S contiguous shards of it.
"""

from __future__ import annotations

import torch
from torch import nn


def shard_bounds(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``num_shards`` contiguous ``[start, stop)`` ranges.

    Sizes differ by at most one element (the first ``numel % num_shards`` shards get the extra
    one), so shards of one dtype have near-equal byte size.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if numel < num_shards:
        raise ValueError(f"cannot split {numel} elements into {num_shards} non-empty shards")
    base, extra = divmod(numel, num_shards)
    bounds = []
    start = 0
    for k in range(num_shards):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_shards(flat: torch.Tensor, bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of ``flat`` for each shard range (no copy)."""
    if flat.dim() != 1 or (bounds and bounds[-1][1] != flat.numel()):
        raise ValueError(
            f"bounds end at {bounds[-1][1] if bounds else 0}, tensor has {flat.numel()}"
        )
    return [flat[a:b] for a, b in bounds]


def join_shards(shards: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`split_shards`: one contiguous vector."""
    return torch.cat([s.reshape(-1) for s in shards])


def _params(module: nn.Module | list[torch.Tensor]) -> list[torch.Tensor]:
    # A list given by the caller saves walking the module tree (~100 µs on every call of a
    # small model's average, more than the copies themselves).
    return module if isinstance(module, list) else list(module.parameters())


def flatten_params(
    module: nn.Module | list[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """All parameters as one detached fp32 vector, in ``module.parameters()`` order
    (``module`` may also be that list of parameters).

    With ``out`` (a persistent buffer of the right size) nothing is allocated: on large models
    a fresh vector per call costs more in page faults than the copy itself.
    """
    with torch.no_grad():  # plain views: no autograd bookkeeping per parameter (~2x faster)
        params = [p.view(-1) if p.is_contiguous() else p.reshape(-1) for p in _params(module)]
        params = [p if p.dtype == torch.float32 else p.float() for p in params]
        if out is None:
            return torch.cat(params)
        return torch.cat(params, out=out)


def assign_flat(module: nn.Module | list[torch.Tensor], flat: torch.Tensor) -> None:
    """Overwrite the module's parameters with ``flat`` (same order as :func:`flatten_params`)."""
    params = _params(module)
    sizes = [p.numel() for p in params]
    if flat.numel() != sum(sizes):
        raise ValueError(f"flat vector has {flat.numel()} elements, model has {sum(sizes)}")
    # Copy in place (not torch's vector_to_parameters, which makes the parameters views of
    # ``flat``): the optimizer keeps its parameter objects and ``flat`` stays independent.
    with torch.no_grad():
        for p, chunk in zip(params, flat.split(sizes), strict=True):
            p.copy_(chunk.view_as(p))


def adopt_flat(module: nn.Module | list[torch.Tensor], flat: torch.Tensor) -> None:
    """Make the module's parameters views of ``flat`` (no copy), as PyTorch's model averager
    does: ``flat`` must be a fresh fp32 vector that nothing else writes to afterwards.

    The parameter objects stay the same (an optimizer keeps them and its state); only their
    storage moves. Falls back to :func:`assign_flat` for parameters that are not fp32.
    """
    params = _params(module)
    sizes = [p.numel() for p in params]
    if flat.numel() != sum(sizes):
        raise ValueError(f"flat vector has {flat.numel()} elements, model has {sum(sizes)}")
    if any(p.dtype != flat.dtype or p.device != flat.device for p in params):
        assign_flat(params, flat)
        return
    for p, chunk in zip(params, flat.split(sizes), strict=True):
        p.data = chunk.view_as(p)


def is_flat_view(module: nn.Module | list[torch.Tensor], flat: torch.Tensor) -> bool:
    """Whether the parameters are, in order, the consecutive views of ``flat`` that
    :func:`adopt_flat` made (nothing has replaced a parameter's storage since): then ``flat``
    *is* the parameters, and :func:`flatten_params` / :func:`assign_flat` need no copy."""
    params = _params(module)
    if sum(p.numel() for p in params) != flat.numel() or flat.dim() != 1:
        return False
    offset, base = 0, flat.data_ptr()
    for p in params:
        if (
            p.dtype != flat.dtype
            or p.device != flat.device
            or not p.is_contiguous()
            or p.data_ptr() != base + offset * flat.element_size()
        ):
            return False
        offset += p.numel()
    return True
