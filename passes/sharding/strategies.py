"""Strategies: the vocabulary of how one node runs on ONE mesh axis of size p.

A :class:`Strategy` says where each tensor input must be and where the output then is;
an :class:`OpView` is what a sharding rule (:mod:`autopar.passes.sharding.rules`) sees of a node. Mesh axes are
solved one at a time, so a strategy for an N-D mesh is one of these per axis (DTensor's
expansion of single-dim strategies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from autopar.ir import Placement, Replicate, Shard

aten = torch.ops.aten
R = Replicate()


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Placement | None, ...]  # one per tensor input slot (see tensor_inputs)
    output: Placement
    kernel: str = ""  # a parallel kernel (autopar.ir.KERNEL_DIMS) that runs the op this way, on its axis only

    def __str__(self) -> str:
        text = f"{', '.join(str(p) if p else '-' for p in self.inputs)} -> {self.output}"
        return f"{text} [{self.kernel}]" if self.kernel else text


@dataclass(frozen=True)
class OpView:
    """What a rule sees of a node: its op, arguments and the (local) shapes involved."""

    node: fx.Node
    in_shapes: tuple[tuple[int, ...], ...]  # per tensor input slot
    out_shape: tuple[int, ...]  # first output's shape

    @property
    def args(self):
        return self.node.args

    def arg(self, index: int, name: str, default=None):
        if len(self.node.args) > index:
            return self.node.args[index]
        return self.node.kwargs.get(name, default)


# The tensor a ``new_*`` factory is called on lends it a dtype and a device only: not an input to lay out.
TEMPLATE_FIRST = {aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full}


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's inputs that carry tensors (or tuples of them), in argument order."""
    args = node.args[1:] if getattr(node.target, "overloadpacket", None) in TEMPLATE_FIRST else node.args
    flat, _ = tree_flatten((args, node.kwargs))
    return [arg for arg in flat if isinstance(arg, fx.Node) and _is_tensorish(arg.meta.get("val"))]


def _is_tensorish(val) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)


def output_tensors(node: fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def normalize_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def work_fraction(strategy: Strategy, axis_size: int) -> float:
    """Share of the op's work one rank does: split when any of its tensors is sharded. A partial
    sum taken in and given out (a linear op on partial values: ``add(P, P) -> P``) is a whole-size
    tensor on every rank, computed whole: such an op's work is not split (it was priced 1/axis
    size, which made keeping values partial look cheaper than reducing them)."""
    placements = [strategy.output, *strategy.inputs]
    split = any(isinstance(p, Shard) for p in placements)
    return 1 / axis_size if split else 1.0


def local_shape(shape: tuple[int, ...], placement: Placement | None, axis_size: int) -> tuple[int, ...]:
    shape = tuple(shape)
    if isinstance(placement, Shard):
        d = placement.dim % len(shape)
        return shape[:d] + (shape[d] // axis_size,) + shape[d + 1 :]
    return shape


def numel(shape) -> int:
    return math.prod(shape)
