"""Linears of an all-gathered input that keep only its shard for backward (Megatron-LM's
sequence parallelism: Korthikanti et al. 2022, §4.2.2).

Under sequence parallelism a column-parallel linear reads an activation all-gathered along the
sequence (a norm's output, split over the tensor-parallel ranks). Written as two ops, the
gather and the linear, autograd keeps the gathered input for the weight's gradient: the whole
sequence, p times the shard every rank already holds. This op runs the gather and every linear
that reads it as one node and keeps the shard instead; backward gathers it again for the weights'
gradients, behind the input's gradient (Megatron-LM's ``LinearWithGradAccumulationAndAsync
Communication`` does the same), then hands the input's gradient on as the gather's dual would
(reduce-scatter, or this rank's chunk where the gradient is replicated).

``torch.ops.autopar.gathered_linears(x, weights, biases, has_bias, group_name, dim, reduce_grad)``
returns ``[linear(gather(x), w, b) for each weight]``; ``biases`` holds only the linears' that
have one, ``has_bias`` says which. Its backward is one op too (``gathered_linears_backward``), so a
compiled program's backward keeps the regather's overlap. :mod:`autopar.passes.rewrite.regather`
puts it in a program.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime.collectives import (
    _chunks_from_front,
    _normalize_dim,
    all_gather,
    chunk,
    reduce_scatter,
    register_dual,
)
from autopar.runtime.faults import collective


def _linears(x: Tensor, weights: list[Tensor], biases: list[Tensor], has_bias: list[bool]) -> list[Tensor]:
    remaining = iter(biases)
    return [F.linear(x, w, next(remaining) if b else None) for w, b in zip(weights, has_bias)]


@torch.library.custom_op("autopar::gathered_linears", mutates_args=())
def gathered_linears(
    x: Tensor,
    weights: list[Tensor],
    biases: list[Tensor],
    has_bias: list[bool],
    group_name: str,
    dim: int,
    reduce_grad: bool,
) -> list[Tensor]:
    """``[F.linear(all_gather(x, dim), w, b) ...]``; backward keeps ``x``, not the gathered value."""
    return _linears(all_gather(x, group_name, dim, reduce_grad), weights, biases, has_bias)


@gathered_linears.register_fake
def _(x, weights, biases, has_bias, group_name, dim, reduce_grad):
    whole = torch.ops.autopar.all_gather(x, group_name, dim, reduce_grad)  # its shape rule
    return [whole.new_empty((*whole.shape[:-1], w.shape[0])) for w in weights]


@torch.library.custom_op("autopar::gathered_linears_backward", mutates_args=())
def gathered_linears_backward(
    x: Tensor,
    grads: list[Tensor],
    weights: list[Tensor],
    has_bias: list[bool],
    group_name: str,
    dim: int,
    reduce_grad: bool,
) -> list[Tensor]:
    """``[grad of x, grad of each weight..., grad of each bias...]``: ``x`` gathered again while
    the gathered value's gradient is computed (it needs the weights only), then the weights'."""
    group = _resolve_process_group(group_name)
    rows = x.new_empty((group.size(), *x.shape))
    with collective("all_gather", group_name):
        gathering = dist.all_gather_single(rows.view(-1), x.contiguous().view(-1), group=group, async_op=True)
    grad_whole = sum(g.matmul(w) for g, w in zip(grads, weights))
    with collective("all_gather", group_name):
        gathering.wait()
    whole = _chunks_from_front(rows, _normalize_dim(x, dim)).flatten(0, -2)
    grad_weights = [g.flatten(0, -2).t().matmul(whole) for g in grads]
    grad_biases = [g.flatten(0, -2).sum(0) for g, b in zip(grads, has_bias) if b]
    if reduce_grad:  # each rank holds a partial gradient of the gathered value: sum it, keep this rank's
        grad_x = reduce_scatter(grad_whole, group_name, dim, "sum")
    else:
        grad_x = chunk(grad_whole, group_name, dim)
    return [grad_x, *grad_weights, *grad_biases]


@gathered_linears_backward.register_fake
def _(x, grads, weights, has_bias, group_name, dim, reduce_grad):
    biases = [g.new_empty(g.shape[-1]) for g, b in zip(grads, has_bias) if b]
    return [x.new_empty(x.shape), *(w.new_empty(w.shape) for w in weights), *biases]


def _setup(ctx, inputs, output):
    x, weights, _, ctx.has_bias, ctx.group_name, ctx.dim, ctx.reduce_grad = inputs
    ctx.save_for_backward(x, *weights)


def _backward(ctx, grads):
    x, *weights = ctx.saved_tensors
    args = (ctx.has_bias, ctx.group_name, ctx.dim, ctx.reduce_grad)
    grad_x, *rest = torch.ops.autopar.gathered_linears_backward(x, list(grads), weights, *args)
    return grad_x, rest[: len(weights)], rest[len(weights) :], None, None, None, None


register_dual(gathered_linears, _backward, _setup)
