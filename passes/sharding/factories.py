"""Rules of the ops that build a tensor rather than compute one from their inputs.

A factory given its size (``zeros(size)``, ``new_empty(x, size)``: ``x`` lends only its dtype and
device, see :data:`~autopar.passes.sharding.strategies.TEMPLATE_FIRST`) can build any chunk of its
output on each rank: the rewrite localizes the size argument (:data:`SIZE_ARGUMENT`) as it does a
view's shape. A query assembled by writing its parts into ``new_empty`` then stays split with
its parts instead of being gathered whole to meet a buffer every rank builds whole.
"""

from __future__ import annotations

import torch

from autopar.ir import Partial, Shard
from autopar.passes.sharding.strategies import OpView, Strategy

aten = torch.ops.aten

# Factories whose argument i is the output's size.
SIZE_ARGUMENT = {
    **dict.fromkeys([aten.zeros, aten.ones, aten.full, aten.empty], 0),
    **dict.fromkeys([aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty], 1),
}
# Fills that are their own sum over ranks (zeros, or values nothing may read); every constant is its own mean.
_SUM_TO_THEMSELVES = {aten.zeros, aten.new_zeros, aten.empty, aten.new_empty}


def sized_factory(view: OpView) -> list[Strategy]:
    """Any dim of the output split (each rank builds its chunk); or partial, where the fill allows."""
    packet = view.node.target.overloadpacket
    partials = ("sum", "avg") if packet in _SUM_TO_THEMSELVES else ("avg",)
    return [Strategy((), Shard(d)) for d in range(len(view.out_shape))] + [Strategy((), Partial(op)) for op in partials]


def like_input(view: OpView) -> list[Strategy]:
    """``zeros_like`` and friends: the output is laid out like the first input."""
    return [Strategy((Shard(d),), Shard(d)) for d in range(len(view.out_shape))]


def replicated_only(view: OpView) -> list[Strategy]:
    """Factories whose values depend on the position (``arange``), and 0-d ones: the fallback alone, not a gap."""
    return []
