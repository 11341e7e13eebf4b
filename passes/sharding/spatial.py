"""Sharding rules of convolutional networks' ops: convolutions split the batch or their channels
(output channels as Megatron's column split, input channels as a partial sum), pooling its batch or
channels; never the image, whose windows straddle any cut (a halo exchange autopar does not make)."""

from __future__ import annotations

import torch

from autopar.ir import Partial, Replicate, Shard
from autopar.passes.sharding.strategies import OpView, Strategy

aten = torch.ops.aten
R = Replicate()


def convolution(view: OpView) -> list[Strategy]:
    """conv1d/2d/3d and convolution: x [N, C_in, *space], w [C_out, C_in / groups, *kernel], bias
    [C_out]. The batch (weights whole); with one group, the output channels (x whole, w and bias
    by rows: Megatron's column split) or the input channels (a partial sum, as linear's rows)."""
    generic = view.node.target.overloadpacket is aten.convolution
    if generic and view.arg(6, "transposed", False):
        return []
    groups = view.arg(8 if generic else 6, "groups", 1)
    has_bias = len(view.in_shapes) == 3
    bias = lambda p: (p,) if has_bias else ()  # noqa: E731
    batched = len(view.in_shapes[0]) == len(view.in_shapes[1])  # [C_in, *space] is one example
    strategies = [Strategy((Shard(0), R) + bias(R), Shard(0))] if batched else []
    channels = 1 if batched else 0
    if groups == 1:
        strategies.append(Strategy((R, Shard(0)) + bias(Shard(0)), Shard(channels)))
        strategies.append(Strategy((Shard(channels), Shard(1)) + bias(Partial()), Partial()))
    for op in ("sum", "avg"):
        strategies.append(Strategy((Partial(op), R) + bias(Partial(op)), Partial(op)))
    return strategies


def pooling(spatial: int, linear: bool = False):
    """Pooling over the last ``spatial`` dims, each (example, channel) on its own: shard a dim before
    them; averages are linear, so partial sums pass through."""

    def rule(view: OpView) -> list[Strategy]:
        ndim, others = len(view.in_shapes[0]), (R,) * (len(view.in_shapes) - 1)
        strategies = [Strategy((Shard(d), *others), Shard(d)) for d in range(ndim - spatial)]
        return strategies + ([Strategy((Partial(op), *others), Partial(op)) for op in ("sum", "avg")] if linear else [])

    return rule
