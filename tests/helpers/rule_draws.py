"""Drawing shapes and values for the rule samples (rule_samples.py), with hypothesis."""

import torch
from hypothesis import strategies as st

F64 = torch.float64
F32 = torch.float32  # for ops that compute in float32 whatever they are given


def size(draw, p: int) -> int:
    """A dim size: mostly a multiple of p (shardable), sometimes not (1 or p + 1)."""
    return draw(st.sampled_from([p, 2 * p, 2 * p, 3 * p, 1, p + 1]))


def shape(draw, p: int, min_dims: int = 1, max_dims: int = 4) -> tuple[int, ...]:
    return tuple(size(draw, p) for _ in range(draw(st.integers(min_dims, max_dims))))


def values(draw, shape: tuple[int, ...], dtype=F64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(-8, 8, shape, generator=generator, dtype=dtype)


def indices(draw, shape: tuple[int, ...], high: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return torch.randint(0, high, shape, generator=generator)


def dim_of(draw, ndim: int) -> int:
    """A dim, sometimes written negative (rules must normalize it)."""
    d = draw(st.integers(0, ndim - 1))
    return d - ndim if draw(st.booleans()) else d


def tensor(draw, p, min_dims=1, max_dims=4, dtype=F64) -> torch.Tensor:
    return values(draw, shape(draw, p, min_dims, max_dims), dtype)
