"""ZeRO inside a compiled program: one layer's parameters gathered by one op (ZeRO-3), and its
gradients reduce-scattered by that op's backward (ZeRO-2 and 3).

The eager runtime serves ZeRO-3 gathers from hooks (:mod:`autopar.runtime.zero.gather`): a
saved-tensor hook swaps gathered weights for notes and regathers them in backward. A compiled
program runs as one autograd node, where no such hook sees the weights, so there the gathers
are part of the graph, as in SimpleFSDP: the program calls

- ``autopar::zero_gather_layer(shards, dp_group, dims, reduce_grads, compute_dtype)``: every
  shard of one layer all-gathered in one flat collective (FSDP2's per-block gather), cast to
  ``compute_dtype`` first where one is given (mixed precision's 16-bit gathers); the compiler
  marks it for recomputation, so backward gathers the layer again instead of keeping its weights;
- its backward ``autopar::zero_reduce_scatter_layer(grads, dp_group, dims, reduce_grads)``: the
  layer's gradients, cast back to the shards' dtype (the reduce dtype), reduce-scattered (sum)
  in one collective, each rank receiving the chunks of its shards; a gradient not summed over dp
  (``reduce_grads[i]`` False) is just cut to this rank's chunk.

Where each layer's gather is issued (the next layer's prefetched while this one computes) and
where its reduce-scatter is waited for is the scheduling pass's business
(:mod:`autopar.passes.rewrite.overlap`), on the functional forms of :mod:`autopar.runtime.functional`.

ZeRO-2 keeps whole parameters and only their gradients in chunks: there
``autopar::zero_scatter_layer(wholes, chunks, dp_group, dims)`` passes a layer's parameters
through unchanged, and its backward reduce-scatters their gradients into the chunk leaves the
program takes (the same ``zero_reduce_scatter_layer``).

>>> wq, wk = torch.ops.autopar.zero_gather_layer([wq, wk], dp_group, [0, 0], [True, True], None)  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime.collectives import _chunks_to_front, _normalize_dim, _resized, chunk, register_dual
from autopar.runtime.faults import collective
from autopar.runtime.zero.gather import unflatten_gathered


def scatter_rows(grads: list[Tensor], dims: list[int], parts: int) -> Tensor:
    """The (ranks, columns) buffer of a layer's gradients: row k holds chunk k of each, end to end."""
    return torch.cat([_chunks_to_front(grad, dim, parts).view(parts, -1) for grad, dim in zip(grads, dims)], dim=1)


def split_columns(summed: Tensor, shapes: list[list[int]]) -> list[Tensor]:
    """The chunks of a reduce-scattered row, one per gradient, in their shapes."""
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(summed.reshape(-1).split(sizes), shapes)]


def chunk_shapes(grads: list[Tensor], dims: list[int], parts: int) -> list[list[int]]:
    return [
        _resized(grad, _normalize_dim(grad, dim), grad.shape[_normalize_dim(grad, dim)] // parts)
        for grad, dim in zip(grads, dims)
    ]


@torch.library.custom_op("autopar::zero_gather_layer", mutates_args=())
def zero_gather_layer(
    shards: list[Tensor],
    group_name: str,
    dims: list[int],
    reduce_grads: list[bool],
    compute_dtype: torch.dtype | None,  # no default: autograd of a custom op drops an argument left at its default
) -> list[Tensor]:
    """All-gather one layer's ZeRO-3 shards (each along its ``dims[i]``, in ``compute_dtype``
    if given) in one collective; backward: :func:`zero_reduce_scatter_layer`."""
    group = _resolve_process_group(group_name)
    sent = layer_shards(shards, compute_dtype)
    received = sent.new_empty(group.size(), sent.numel())
    with collective("parameter all-gather", group_name):
        dist.all_gather_single(received.view(-1), sent, group=group)
    return unflatten_gathered(received, [shard.shape for shard in shards], dims)


def layer_shards(shards: list[Tensor], compute_dtype: torch.dtype | None) -> Tensor:
    """A layer's shards end to end, as its gather sends them (a prims cast: the functional form
    enters a graph inductor lowers after its decompositions, where ``aten._to_copy`` is gone)."""
    flat = [shard.reshape(-1) for shard in shards]
    if compute_dtype is not None:
        flat = [torch.ops.prims.convert_element_type.default(piece, compute_dtype) for piece in flat]
    return torch.cat(flat)


@zero_gather_layer.register_fake
def _(shards, group_name, dims, reduce_grads, compute_dtype):
    size = _resolve_process_group(group_name).size()
    return [
        shard.new_empty(
            _resized(shard, _normalize_dim(shard, dim), shard.shape[_normalize_dim(shard, dim)] * size),
            dtype=compute_dtype or shard.dtype,
        )
        for shard, dim in zip(shards, dims)
    ]


@torch.library.custom_op("autopar::zero_reduce_scatter_layer", mutates_args=())
def zero_reduce_scatter_layer(
    grads: list[Tensor], group_name: str, dims: list[int], reduce_grads: list[bool]
) -> list[Tensor]:
    """This rank's chunk of each of a layer's whole gradients: summed over the group in one
    reduce-scatter where ``reduce_grads[i]``, else cut from this rank's own gradient."""
    group = _resolve_process_group(group_name)
    summed = [grad for grad, reduce in zip(grads, reduce_grads) if reduce]
    chunks = iter([])
    if summed:
        reduced_dims = [dim for dim, reduce in zip(dims, reduce_grads) if reduce]
        rows = scatter_rows(summed, reduced_dims, group.size())
        received = rows.new_empty(rows.shape[1])
        with collective("gradient reduce-scatter", group_name):
            dist.reduce_scatter_single(received, rows.view(-1), group=group)
        shapes = chunk_shapes(summed, reduced_dims, group.size())
        chunks = iter([piece.clone() for piece in split_columns(received, shapes)])  # outputs may not alias
    return [
        next(chunks) if reduce else chunk(grad, group_name, dim) for grad, dim, reduce in zip(grads, dims, reduce_grads)
    ]


@zero_reduce_scatter_layer.register_fake
def _(grads, group_name, dims, reduce_grads):
    return [
        grad.new_empty(shape)
        for grad, shape in zip(grads, chunk_shapes(grads, dims, _resolve_process_group(group_name).size()))
    ]


def _setup_gather(ctx, inputs, output):
    shards, ctx.group_name, ctx.dims, ctx.reduce_grads, _ = inputs
    ctx.wholes = [(whole.shape, shard.dtype, whole.device) for whole, shard in zip(output, shards)]


def _gather_backward(ctx, grads):
    grads = [  # in the shards' dtype: the reduce dtype
        torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad.to(dtype)
        for grad, (shape, dtype, device) in zip(grads, ctx.wholes)
    ]
    return zero_reduce_scatter_layer(grads, ctx.group_name, ctx.dims, ctx.reduce_grads), None, None, None, None


register_dual(zero_gather_layer, _gather_backward, _setup_gather)


@torch.library.custom_op("autopar::zero_scatter_layer", mutates_args=())
def zero_scatter_layer(wholes: list[Tensor], chunks: list[Tensor], group_name: str, dims: list[int]) -> list[Tensor]:
    """ZeRO-2 in a compiled program: one layer's whole parameters, as they are, in forward; in
    backward their gradients reduce-scattered (sum) in one collective, each rank's chunks going to
    ``chunks`` (this rank's chunk leaves, along ``dims``, in their dtype) and none to the wholes,
    which hold no gradient."""
    return [whole.clone(memory_format=torch.contiguous_format) for whole in wholes]


@zero_scatter_layer.register_fake
def _(wholes, chunks, group_name, dims):
    return [whole.new_empty(whole.shape) for whole in wholes]


def _setup_scatter(ctx, inputs, output):
    wholes, chunks, ctx.group_name, ctx.dims = inputs
    ctx.wholes = [(whole.shape, whole.dtype, whole.device) for whole in wholes]
    ctx.chunk_dtypes = [chunk.dtype for chunk in chunks]


def _scatter_backward(ctx, grads):
    grads = [
        torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad
        for grad, (shape, dtype, device) in zip(grads, ctx.wholes)
    ]
    summed = zero_reduce_scatter_layer(grads, ctx.group_name, ctx.dims, [True] * len(grads))
    chunks = [chunk.to(dtype) for chunk, dtype in zip(summed, ctx.chunk_dtypes)]
    return [None] * len(grads), chunks, None, None


register_dual(zero_scatter_layer, _scatter_backward, _setup_scatter)
