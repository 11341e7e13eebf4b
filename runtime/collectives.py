"""Autograd-aware collectives, registered as torch custom ops in the ``autopar`` namespace.

The rewrite inserts these ops by name (``torch.ops.autopar.all_reduce`` ...), so a
parallelized graph stays a plain fx graph that reads like the math. Every op

- takes the c10d name of the group it talks over (one mesh axis or several flattened, see
  ``process_groups.group_name``) and resolves it with ``_resolve_process_group``, so the
  graph carries only strings;
- has a fake implementation (the shape rule), so graphs holding it trace on fake/meta tensors;
- has its dual as backward (Megatron's f/g, all-gather ↔ reduce-scatter, all-to-all ↔
  all-to-all), written with these same ops, so backward graphs contain collectives too;
- returns a fresh contiguous tensor, never an alias of its input (a custom-op rule);
- names, when a collective of its backward fails, the program node it is the backward of
  (:func:`register_dual`: autograd runs backward with no frame of the program to find it in).

"Chunk k" of a dim always belongs to the group's rank k (c10d group ranks follow global
rank order, which is mesh order for the row-major meshes of ``build_device_mesh``).

gloo in torch 2.13 supports every c10d call used here: ``all_reduce`` with SUM and AVG,
``all_gather_single``, ``reduce_scatter_single`` (SUM and AVG) and ``all_to_all_single``.
All of them work on flat 1-D buffers, so a collective along any ``dim`` first moves that
dim's chunks to the front (one copy) and moves them back after.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime.faults import calling_site, collective, plan_node

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


def _reduce_op(name: str) -> dist.ReduceOp:
    if name not in _REDUCE_OPS:
        raise ValueError(f"reduce_op must be one of {sorted(_REDUCE_OPS)}, got {name!r}")
    return _REDUCE_OPS[name]


def _normalize_dim(x: Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _chunk_size(x: Tensor, dim: int, group_size: int) -> int:
    if x.shape[dim] % group_size:
        raise ValueError(
            f"cannot split dim {dim} of size {x.shape[dim]} into {group_size} equal chunks; "
            "pad it or choose a mesh axis whose size divides it"
        )
    return x.shape[dim] // group_size


def _resized(x: Tensor, dim: int, size: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = size
    return shape


def _chunks_to_front(x: Tensor, dim: int, group_size: int) -> Tensor:
    """(..., p*s, ...) -> contiguous (p, ..., s, ...): chunk k of ``dim`` becomes row k."""
    return x.unflatten(dim, (group_size, -1)).movedim(dim, 0).contiguous()


def _chunks_from_front(rows: Tensor, dim: int) -> Tensor:
    """(p, ..., s, ...) -> contiguous (..., p*s, ...): row k becomes chunk k of ``dim``."""
    return rows.movedim(0, dim).flatten(dim, dim + 1).contiguous()


@torch.library.custom_op("autopar::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group_name: str, reduce_op: str) -> Tensor:
    """All-reduce in forward; identity in backward for "sum", grad/p for "avg": Megatron's g.

    Partial(sum) → Replicate. The output's gradient is replicated, and so is the input's.
    Example: ``y = torch.ops.autopar.all_reduce(partial_out, tp_group, "sum")``.
    """
    out = x.clone(memory_format=torch.contiguous_format)
    with collective("all_reduce", group_name):
        dist.all_reduce(out, op=_reduce_op(reduce_op), group=_resolve_process_group(group_name))
    return out


@all_reduce.register_fake
def _(x, group_name, reduce_op):
    _reduce_op(reduce_op)
    return x.new_empty(x.shape)


@torch.library.custom_op("autopar::grad_all_reduce", mutates_args=())
def grad_all_reduce(x: Tensor, group_name: str) -> Tensor:
    """Identity in forward, all-reduce (sum) in backward: Megatron's f.

    Marks where a replicated activation enters sharded compute; each rank's gradient is
    a partial sum. Example: ``h = torch.ops.autopar.grad_all_reduce(x, tp_group)``.
    """
    return x.clone(memory_format=torch.contiguous_format)


@grad_all_reduce.register_fake
def _(x, group_name):
    return x.new_empty(x.shape)


@torch.library.custom_op("autopar::grad_all_reduce_accumulated", mutates_args=())
def grad_all_reduce_accumulated(x: Tensor, earlier: Tensor, group_name: str) -> Tensor:
    """Identity in forward; in backward, the all-reduce (sum) of the gradient plus ``earlier``:
    the gradient earlier microbatches of the step accumulated on this rank (the last microbatch
    of gradient accumulation sums the whole step's gradient once). ``earlier`` gets none."""
    return x.clone(memory_format=torch.contiguous_format)


@grad_all_reduce_accumulated.register_fake
def _(x, earlier, group_name):
    return x.new_empty(x.shape)


@torch.library.custom_op("autopar::all_gather", mutates_args=())
def all_gather(x: Tensor, group_name: str, dim: int, reduce_grad: bool) -> Tensor:
    """All-gather along ``dim`` in forward (Shard(dim) → Replicate); in backward the dual:

    this rank's chunk of the gradient if ``reduce_grad`` is False (the gradient is
    replicated), reduce-scatter (sum) if True (each rank holds a partial gradient, as after
    sequence-parallel compute). Example: ``torch.ops.autopar.all_gather(x, sp_group, 1, True)``.
    """
    group = _resolve_process_group(group_name)
    dim = _normalize_dim(x, dim)
    rows = x.new_empty((group.size(), *x.shape))
    with collective("all_gather", group_name):
        dist.all_gather_single(rows.view(-1), x.contiguous().view(-1), group=group)
    return _chunks_from_front(rows, dim)


@all_gather.register_fake
def _(x, group_name, dim, reduce_grad):
    dim = _normalize_dim(x, dim)
    group_size = _resolve_process_group(group_name).size()
    return x.new_empty(_resized(x, dim, x.shape[dim] * group_size))


@torch.library.custom_op("autopar::chunk", mutates_args=())
def chunk(x: Tensor, group_name: str, dim: int) -> Tensor:
    """This rank's chunk along ``dim`` in forward (Replicate → Shard(dim), no communication);
    all-gather along ``dim`` in backward.

    Example: ``torch.ops.autopar.chunk(x, tp_group, -1)``.
    """
    group = _resolve_process_group(group_name)
    dim = _normalize_dim(x, dim)
    size = _chunk_size(x, dim, group.size())
    return x.narrow(dim, group.rank() * size, size).clone(memory_format=torch.contiguous_format)


@chunk.register_fake
def _(x, group_name, dim):
    dim = _normalize_dim(x, dim)
    size = _chunk_size(x, dim, _resolve_process_group(group_name).size())
    return x.new_empty(_resized(x, dim, size))


@torch.library.custom_op("autopar::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, group_name: str, dim: int, reduce_op: str) -> Tensor:
    """Reduce-scatter along ``dim`` in forward (Partial → Shard(dim)); all-gather along ``dim``
    in backward, divided by p for "avg".

    Example: ``torch.ops.autopar.reduce_scatter(partial_out, sp_group, 1, "sum")``.
    """
    group = _resolve_process_group(group_name)
    dim = _normalize_dim(x, dim)
    size = _chunk_size(x, dim, group.size())
    out = x.new_empty(_resized(x, dim, size))
    rows = _chunks_to_front(x, dim, group.size())
    with collective("reduce_scatter", group_name):
        dist.reduce_scatter_single(out.view(-1), rows.view(-1), op=_reduce_op(reduce_op), group=group)
    return out


@reduce_scatter.register_fake
def _(x, group_name, dim, reduce_op):
    _reduce_op(reduce_op)
    dim = _normalize_dim(x, dim)
    size = _chunk_size(x, dim, _resolve_process_group(group_name).size())
    return x.new_empty(_resized(x, dim, size))


@torch.library.custom_op("autopar::all_to_all", mutates_args=())
def all_to_all(x: Tensor, group_name: str, split_dim: int, concat_dim: int) -> Tensor:
    """All-to-all: Shard(concat_dim) → Shard(split_dim) in forward; in backward the same op
    with the two dims swapped (an all-to-all's transpose is the reverse all-to-all).

    Chunk k of ``split_dim`` goes to rank k; the chunks received from ranks 0..p-1 are
    concatenated along ``concat_dim``. Example, Ulysses attention, heads ↔ sequence:
    ``torch.ops.autopar.all_to_all(q, cp_group, 2, 1)`` on (batch, seq/p, heads, hd).
    """
    group = _resolve_process_group(group_name)
    split_dim, concat_dim = _normalize_dim(x, split_dim), _normalize_dim(x, concat_dim)
    _chunk_size(x, split_dim, group.size())
    sent = _chunks_to_front(x, split_dim, group.size())
    received = torch.empty_like(sent)
    with collective("all_to_all", group_name):
        dist.all_to_all_single(received.view(-1), sent.view(-1), group=group)
    return _chunks_from_front(received, concat_dim)


@all_to_all.register_fake
def _(x, group_name, split_dim, concat_dim):
    group_size = _resolve_process_group(group_name).size()
    split_dim, concat_dim = _normalize_dim(x, split_dim), _normalize_dim(x, concat_dim)
    shape = _resized(x, split_dim, _chunk_size(x, split_dim, group_size))
    shape[concat_dim] *= group_size
    return x.new_empty(shape)


@torch.library.custom_op("autopar::keep_on_first", mutates_args=())
def keep_on_first(x: Tensor, group_name: str) -> Tensor:
    """``x`` on group rank 0, zeros elsewhere, in forward; identity in backward.

    Replicate → Partial(sum) exactly: the sum over ranks is ``x`` once. The gradient of a
    partial tensor is replicated, and so is the input's. Example:
    ``torch.ops.autopar.keep_on_first(bias, tp_group)`` before adding to a partial sum.
    """
    if _resolve_process_group(group_name).rank() == 0:
        return x.clone(memory_format=torch.contiguous_format)
    return torch.zeros_like(x, memory_format=torch.contiguous_format)


@keep_on_first.register_fake
def _(x, group_name):
    return x.new_empty(x.shape)


def _save_args(ctx, inputs, output):
    ctx.args = inputs[1:]


def register_dual(op, backward: Callable, setup_context: Callable = _save_args) -> None:
    """``op.register_autograd(backward, setup_context=...)``, and a collective failing in
    ``backward`` names the program node whose backward it is: "in the backward of node chunk_2
    (...) in module layers.0.attn" (the program line is recorded in forward, resolved on failure).

    Example: ``register_dual(zero_gather, _zero_gather_backward, _setup_zero_gather)``.
    """

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        ctx.site = calling_site()

    def where(ctx) -> str:
        node = ctx.site.node() if ctx.site is not None else ""
        return f"in the backward of node {node}" if node else "in the backward of an op called outside a program"

    def named_backward(ctx, *grads):
        with plan_node(lambda: where(ctx)):
            return backward(ctx, *grads)

    op.register_autograd(named_backward, setup_context=setup)


def _grad_and_nones(ctx, grad_input):
    return (grad_input, *[None] * len(ctx.args))


def _all_reduce_backward(ctx, grad):
    group_name, reduce_op = ctx.args
    if reduce_op == "avg":
        grad = grad / _resolve_process_group(group_name).size()
    return _grad_and_nones(ctx, grad)


def _grad_all_reduce_backward(ctx, grad):
    (group_name,) = ctx.args
    return _grad_and_nones(ctx, all_reduce(grad, group_name, "sum"))


def _setup_accumulated(ctx, inputs, output):
    _, earlier, ctx.group_name = inputs
    ctx.save_for_backward(earlier)


def _grad_all_reduce_accumulated_backward(ctx, grad):
    (earlier,) = ctx.saved_tensors
    return all_reduce(grad + earlier, ctx.group_name, "sum"), None, None


def _all_gather_backward(ctx, grad):
    group_name, dim, reduce_grad = ctx.args
    if reduce_grad:
        return _grad_and_nones(ctx, reduce_scatter(grad, group_name, dim, "sum"))
    return _grad_and_nones(ctx, chunk(grad, group_name, dim))


def _chunk_backward(ctx, grad):
    group_name, dim = ctx.args
    return _grad_and_nones(ctx, all_gather(grad, group_name, dim, False))


def _reduce_scatter_backward(ctx, grad):
    group_name, dim, reduce_op = ctx.args
    gathered = all_gather(grad, group_name, dim, False)
    if reduce_op == "avg":
        gathered = gathered / _resolve_process_group(group_name).size()
    return _grad_and_nones(ctx, gathered)


def _all_to_all_backward(ctx, grad):
    group_name, split_dim, concat_dim = ctx.args
    return _grad_and_nones(ctx, all_to_all(grad, group_name, concat_dim, split_dim))


def _keep_on_first_backward(ctx, grad):
    return _grad_and_nones(ctx, grad)


for _op, _backward in [
    (all_reduce, _all_reduce_backward),
    (grad_all_reduce, _grad_all_reduce_backward),
    (all_gather, _all_gather_backward),
    (chunk, _chunk_backward),
    (reduce_scatter, _reduce_scatter_backward),
    (all_to_all, _all_to_all_backward),
    (keep_on_first, _keep_on_first_backward),
]:
    register_dual(_op, _backward)
register_dual(grad_all_reduce_accumulated, _grad_all_reduce_accumulated_backward, _setup_accumulated)
