"""Random calls of convolutional networks' ops (convolutions and pooling) for the rule validation:
part of ``rule_samples.SAMPLES``."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from rule_check import Sample
from rule_draws import shape, size, values

aten = torch.ops.aten


def convolution(op, spatial: int):
    """conv{k}d (batched or one example) or convolution (batched), one group or as many as input
    channels (depthwise), with or without a bias, strided and padded at random."""

    def draw_sample(draw, p):
        c_in, c_out = size(draw, p), size(draw, p)
        groups = draw(st.sampled_from([1, c_in] if c_out % c_in == 0 else [1]))
        space = tuple(draw(st.sampled_from([4, 5, 2 * p + 1])) for _ in range(spatial))
        kernel = [draw(st.integers(1, 3)) for _ in range(spatial)]
        batched = op is aten.convolution.default or draw(st.booleans())
        x = values(draw, (size(draw, p),) * batched + (c_in, *space))
        weight = values(draw, (c_out, c_in // groups, *kernel))
        bias = values(draw, (c_out,)) if draw(st.booleans()) else None
        stride, padding = [draw(st.integers(1, 2))] * spatial, [draw(st.integers(0, 1))] * spatial
        if op is aten.convolution.default:
            return Sample(op, (x, weight, bias, stride, padding, [1] * spatial, False, [0] * spatial, groups))
        return Sample(op, (x, weight, bias, stride, padding, [1] * spatial, groups))

    return draw_sample


def pooling(op, spatial: int, adaptive: bool = False):
    """A pooling op on [N, C, *space] or [C, *space]; a window of 2 or 3 with its stride, or an
    adaptive output size."""

    def draw_sample(draw, p):
        leading = shape(draw, p, 1, 2)
        x = values(draw, (*leading, *(draw(st.sampled_from([4, 6, 7])) for _ in range(spatial))))
        if adaptive:
            return Sample(op, (x, [draw(st.integers(1, 3))] * spatial))
        window = draw(st.integers(2, 3))
        return Sample(op, (x, [window] * spatial, [draw(st.integers(1, window))] * spatial))

    return draw_sample


SPATIAL_SAMPLES = {
    **{f"aten.conv{k}d": convolution(getattr(aten, f"conv{k}d").default, k) for k in (1, 2, 3)},
    "aten.convolution": convolution(aten.convolution.default, 2),
    **{f"aten.max_pool{k}d": pooling(getattr(aten, f"max_pool{k}d").default, k) for k in (1, 2, 3)},
    "aten.max_pool2d_with_indices": pooling(aten.max_pool2d_with_indices.default, 2),
    **{f"aten.avg_pool{k}d": pooling(getattr(aten, f"avg_pool{k}d").default, k) for k in (1, 2, 3)},
    **{
        f"aten.adaptive_{kind}_pool{k}d": pooling(getattr(aten, f"adaptive_{kind}_pool{k}d").default, k, adaptive=True)
        for kind in ("avg", "max")
        for k in (1, 2, 3)
    },
}
