"""Each ``autopar::`` collective written with torch's functional collectives: what a compiled
program runs in its place.

``torch.ops._c10d_functional`` splits a collective in two ops: the collective itself, which
returns at once with the communication in flight, and ``wait_tensor``, which waits for it.
Inductor knows both (a collective kernel and a wait kernel), so once an ``autopar::`` op in a
compiled graph is replaced by its form below, a scheduling pass
(:mod:`autopar.passes.rewrite.overlap`) can issue the collective early and wait for it late.
Every form computes exactly what its op computes, with the same chunk layout ("chunk k of a
dim belongs to group rank k", :mod:`autopar.runtime.collectives`), on gloo and NCCL alike.

Only forward computations are listed: by the time a compiled graph is scheduled, autograd has
turned every op into its forward or its dual, which is again one of these ops. ``grad_all_reduce``,
``grad_all_reduce_accumulated`` and ``zero_scatter_layer`` compute nothing in forward (their
forms are the identity); ``chunk``, ``keep_on_first`` and the parallel kernels (ring and Ulysses
attention, experts) stay opaque ops.

>>> FUNCTIONAL_FORMS[torch.ops.autopar.all_reduce.default](x, group_name, "sum")  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime.collectives import _chunks_from_front, _chunks_to_front, _normalize_dim
from autopar.runtime.zero.compiled import chunk_shapes, layer_shards, scatter_rows, split_columns
from autopar.runtime.zero.gather import unflatten_gathered

functional = torch.ops._c10d_functional
autopar = torch.ops.autopar


def _size(group_name: str) -> int:
    return _resolve_process_group(group_name).size()


def _all_reduce(x: Tensor, group_name: str, reduce_op: str) -> Tensor:
    return functional.wait_tensor(functional.all_reduce(x.contiguous(), reduce_op, group_name))


def _grad_all_reduce(x: Tensor, group_name: str) -> Tensor:
    return x


def _grad_all_reduce_accumulated(x: Tensor, earlier: Tensor, group_name: str) -> Tensor:
    return x


def _all_gather(x: Tensor, group_name: str, dim: int, reduce_grad: bool) -> Tensor:
    size = _size(group_name)
    rows = functional.wait_tensor(functional.all_gather_into_tensor(x.contiguous(), size, group_name))
    return _chunks_from_front(rows.view(size, *x.shape), _normalize_dim(x, dim))


def _reduce_scatter(x: Tensor, group_name: str, dim: int, reduce_op: str) -> Tensor:
    size = _size(group_name)
    rows = _chunks_to_front(x, _normalize_dim(x, dim), size)
    summed = functional.wait_tensor(functional.reduce_scatter_tensor(rows, reduce_op, size, group_name))
    return summed.view(rows.shape[1:])


def _all_to_all(x: Tensor, group_name: str, split_dim: int, concat_dim: int) -> Tensor:
    size = _size(group_name)
    sent = _chunks_to_front(x, _normalize_dim(x, split_dim), size)
    received = functional.wait_tensor(functional.all_to_all_single(sent, [1] * size, [1] * size, group_name))
    return _chunks_from_front(received, _normalize_dim(x, concat_dim))


def _zero_gather_layer(shards: list[Tensor], group_name: str, dims: list[int], reduce_grads: list[bool], dtype):
    size = _size(group_name)
    sent = layer_shards(shards, dtype)
    received = functional.wait_tensor(functional.all_gather_into_tensor(sent, size, group_name))
    return unflatten_gathered(received.view(size, -1), [shard.shape for shard in shards], dims)


def _zero_reduce_scatter_layer(grads: list[Tensor], group_name: str, dims: list[int], reduce_grads: list[bool]):
    size = _size(group_name)
    summed = [(grad, dim) for grad, dim, reduce in zip(grads, dims, reduce_grads) if reduce]
    chunks = iter([])
    if summed:
        rows = scatter_rows([grad for grad, _ in summed], [dim for _, dim in summed], size)
        received = functional.wait_tensor(functional.reduce_scatter_tensor(rows, "sum", size, group_name))
        shapes = chunk_shapes([grad for grad, _ in summed], [dim for _, dim in summed], size)
        chunks = iter(split_columns(received, shapes))
    return [
        next(chunks) if reduce else autopar.chunk(grad, group_name, dim)
        for grad, dim, reduce in zip(grads, dims, reduce_grads)
    ]


def _zero_scatter_layer(wholes: list[Tensor], chunks: list[Tensor], group_name: str, dims: list[int]):
    return list(wholes)


FUNCTIONAL_FORMS = {
    autopar.all_reduce.default: _all_reduce,
    autopar.grad_all_reduce.default: _grad_all_reduce,
    autopar.grad_all_reduce_accumulated.default: _grad_all_reduce_accumulated,
    autopar.all_gather.default: _all_gather,
    autopar.zero_gather.default: _all_gather,
    autopar.reduce_scatter.default: _reduce_scatter,
    autopar.all_to_all.default: _all_to_all,
    autopar.zero_gather_layer.default: _zero_gather_layer,
    autopar.zero_reduce_scatter_layer.default: _zero_reduce_scatter_layer,
    autopar.zero_scatter_layer.default: _zero_scatter_layer,
}
