"""ZeRO-3's parameter gather: the op the rewrite puts before each use of a sharded parameter,
and the saved-tensor hooks that keep autograd from holding the gathered weight.

``torch.ops.autopar.zero_gather(shard, dp_group, dim, reduce_grad)`` all-gathers a parameter's
dp shards just before an op uses it; the program drops the full weight after its last use
(fx frees values after their last use). Ops that save their weight for backward (matmul,
layer norm) would keep it alive until then, so while the forward runs, :class:`Regather`'s
pack hook swaps every saved tensor that is (a view of) a gathered weight for a note, and the
unpack hook gathers the weight again when backward needs it. The gradient of the full weight
is reduce-scattered to the shard by the op's backward (sum over dp; just this rank's chunk
when the plan says the gradient is already complete on every dp rank).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from .collectives import _all_gather_backward, _save_args, all_gather

# Autograd nodes of view ops: a saved tensor reached from a gather through these shares its memory.
_VIEW_NODES = frozenset({
    "AliasBackward0", "AsStridedBackward0", "ExpandBackward0", "PermuteBackward0", "SelectBackward0",
    "SliceBackward0", "SqueezeBackward0", "SqueezeBackward1", "TBackward0", "TransposeBackward0",
    "UnsqueezeBackward0", "ViewBackward0",
})


@torch.library.custom_op("autopar::zero_gather", mutates_args=())
def zero_gather(shard: Tensor, group_name: str, dim: int, reduce_grad: bool) -> Tensor:
    """All-gather a parameter's ZeRO-3 shards along ``dim``; backward: reduce-scatter (sum) if
    ``reduce_grad``, else this rank's chunk. The all-gather of :mod:`collectives`, as its own op
    so that :class:`Regather` can tell gathered weights from other saved tensors."""
    return all_gather(shard, group_name, dim, reduce_grad)


@zero_gather.register_fake
def _(shard, group_name, dim, reduce_grad):
    return torch.ops.autopar.all_gather.default(shard, group_name, dim, reduce_grad)


zero_gather.register_autograd(_all_gather_backward, setup_context=_save_args)


@dataclass(frozen=True)
class _Gathered:
    """How to rebuild a saved tensor: gather ``shard`` again, then take the same view of it."""

    shard: Tensor
    group_name: str
    dim: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


class Regather:
    """Saved-tensor hooks that store gathered weights as their shards; one per forward. Example::

        with Regather().recording():
            loss = program(*shards, *inputs)   # zero_gather outputs are not kept for backward
        loss.backward()                        # ... but gathered again when needed
    """

    def __init__(self):
        self._regathered: dict[int, weakref.ref] = {}  # shard id → whole weight, shared by its views

    @contextmanager
    def recording(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: Tensor):
        # A gathered weight, or a view of one, is found by its autograd history: view nodes
        # back to a zero_gather node, whose input is the shard leaf (frozen shards have no
        # history: their weights stay saved whole).
        node = tensor.grad_fn
        while node is not None and node.name() in _VIEW_NODES:
            node = node.next_functions[0][0]
        if node is None or "autopar_zero_gather" not in node.name():
            return tensor
        shard = node.next_functions[0][0].variable
        group_name, dim, _ = node.args
        return _Gathered(shard, group_name, dim, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())
    def _unpack(self, packed):
        if not isinstance(packed, _Gathered):
            return packed
        cached = self._regathered.get(id(packed.shard))
        full = cached() if cached is not None else None
        if full is None:
            with torch.no_grad():
                full = all_gather(packed.shard.detach(), packed.group_name, packed.dim, False)
            self._regathered[id(packed.shard)] = weakref.ref(full)
        return full.as_strided(packed.size, packed.stride, packed.storage_offset)
