"""Async tensor parallelism: a matmul and the collective next to it run in pieces, so that one
piece's communication hides behind another piece's matmul.

Tensor (and sequence) parallelism puts a collective right before or right after a matmul whose
rows are independent: the all-gather of a sequence-split activation before a column-parallel
linear, the all-reduce of a row-parallel linear's partial sums. Run whole, the matmul waits for
all of the gather, and the all-reduce for all of the matmul. Run in ``pieces``:

- **gather, then linears**: the input is sliced along the gathered dim; each slice is gathered
  on its own and every linear that reads the gathered value runs on it; the pieces of each
  linear's output are put back in order (rank k's rows of piece j go to rank k's block, slot j);
- **linear, then all-reduce or reduce-scatter**: the linear's rows are taken in pieces (an
  all-reduce's along the first leading dim that divides; a reduce-scatter's along its dim, piece
  j being rows j of every rank's block, so that each rank receives its block's rows j); each
  piece is reduced on its own and the results are laid end to end again. The value reduced may
  be a sum with the linear (a residual kept partial): the sum is computed in pieces too.

Once compiled, the scheduling pass (:mod:`autopar.passes.rewrite.overlap`) issues every piece's
collective as soon as its input is ready and waits right before its first use, so piece j+1
moves while piece j multiplies; autograd derives the backward from the pieces, where each
piece's dual (the reduce-scatter of a gathered piece's gradient) likewise overlaps the next
piece's matmul. This is the decomposition Transformer Engine's split pipelined overlap and
DeepSpeed Domino make with standard collectives; PyTorch's async TP instead steps a ring of
point-to-point copies over symmetric memory (CUDA only), which hides every step but the
first. The first piece's communication stays exposed, and every piece costs one more
collective launch and a copy to put the output back together; so it runs only in compiled
programs, where the collectives are asynchronous (in eager mode autopar's collectives block).

Every piece computes exactly the rows the whole op computed, so the program computes the same
values; gradients of the weights are sums over the pieces (summed in another order, within fp32
rounding). Not pieced (left as they are): a gather any of whose readers is not a linear taking
it as input, a reduction whose linear or sum another node reads before it, a dim that does not
divide into ``pieces``.

Pre: a per-rank program of :func:`autopar.passes.rewrite.rewrite.rewrite` and the inputs it is
about to run on, on a rank whose process groups exist. Post: a copy computing the same.

>>> program, pieced = pipeline_tp_matmuls(program, inputs)   # doctest: +SKIP
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils._pytree import tree_flatten

from autopar.ir import OP_NAMESPACE

PIECES = 2
aten = torch.ops.aten
LINEAR = aten.linear.default
ROW_SUM = aten.add.Tensor  # a sum of row-aligned values (a partial residual plus a linear)


def pipeline_tp_matmuls(program: fx.GraphModule, inputs: tuple, pieces: int = PIECES) -> tuple[fx.GraphModule, int]:
    """``program`` with its gather-then-linear and linear-then-reduction pairs run in ``pieces``
    (see the module docstring), for ``inputs`` (this rank's: their shapes are what it reads); and
    how many collectives it split."""
    ops = getattr(torch.ops, OP_NAMESPACE)
    program = fx.GraphModule(program, copy.deepcopy(program.graph))
    FakeTensorProp(program).propagate(*inputs)  # this rank's shapes in every node's meta["val"]
    graph = program.graph
    split = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is ops.all_gather.default and feeds_only_linears(node):
            split += _gather_in_pieces(graph, node, pieces)
        elif node.target in (ops.all_reduce.default, ops.reduce_scatter.default) and _has_linear(node.args[0]):
            split += _reduce_in_pieces(graph, node, pieces, scatter=node.target is ops.reduce_scatter.default)
    graph.lint()
    program.recompile()
    return program, split


def feeds_only_linears(gather: fx.Node) -> bool:
    """Whether every reader of ``gather`` is a linear taking it as its input."""
    return bool(gather.users) and all(u.target is LINEAR and u.args[0] is gather for u in gather.users)


def _chain(node: fx.Node) -> set[fx.Node]:
    """The linears and sums :func:`_rows` computes in pieces to compute ``node`` in pieces."""
    if node.target is LINEAR:
        return {node} | _chain(node.args[0])
    if node.target is ROW_SUM and _has_linear(node):
        return {node}.union(*(_chain(a) for a in node.args if isinstance(a, fx.Node)))
    return set()


def _has_linear(node: fx.Node) -> bool:
    """Whether ``node`` is a linear's output, or a sum with one (a residual kept partial)."""
    return node.target is LINEAR or (
        node.target is ROW_SUM and any(isinstance(a, fx.Node) and _has_linear(a) for a in node.args)
    )


@dataclass(frozen=True)
class _Layout:
    """A dim of ``ranks * pieces * rows`` elements as the pieces see it: rank k's block of
    ``pieces * rows``, piece j of each block ``rows`` long; ``dim`` counted from the last (negative),
    as broadcasting aligns dims."""

    dim: int
    ranks: int
    pieces: int
    rows: int


def _take(graph: fx.Graph, node: fx.Node, layout: _Layout, j: int) -> fx.Node:
    """Piece j of ``node``: rows j of every rank's block, side by side ([ranks * rows])."""
    dim = node.meta["val"].dim() + layout.dim
    if layout.ranks == 1:
        return _call(graph, aten.slice.Tensor, (node, dim, j * layout.rows, (j + 1) * layout.rows))
    blocks = _call(graph, aten.unflatten.int, (node, dim, [layout.ranks, layout.pieces, layout.rows]))
    return _call(graph, aten.flatten.using_ints, (_call(graph, aten.select.int, (blocks, dim + 1, j)), dim, dim + 1))


def _put_back(graph: fx.Graph, parts: list[fx.Node], layout: _Layout) -> fx.Node:
    """The whole from its pieces (:func:`_take`'s inverse): each rank's rows of piece j into slot j of its block."""
    dim = parts[0].meta["val"].dim() + layout.dim
    if layout.ranks == 1:
        return _call(graph, aten.cat.default, (parts, dim))
    blocks = [_call(graph, aten.unflatten.int, (part, dim, [layout.ranks, 1, layout.rows])) for part in parts]
    return _call(graph, aten.flatten.using_ints, (_call(graph, aten.cat.default, (blocks, dim + 1)), dim, dim + 2))


def _gather_in_pieces(graph: fx.Graph, gather: fx.Node, pieces: int) -> int:
    """Slice the gathered input along the gathered dim; gather and multiply each slice; put
    each linear's rows back: gathered piece j holds slice j of every rank."""
    x, group, dim, reduce_grad = gather.args
    local = x.meta["val"]
    dim %= local.dim()
    if dim == local.dim() - 1 or local.shape[dim] % pieces:
        return 0
    rows = local.shape[dim] // pieces
    ranks = gather.meta["val"].shape[dim] // local.shape[dim]
    layout = _Layout(dim - local.dim(), ranks, pieces, rows)
    with graph.inserting_before(gather):
        own = _Layout(layout.dim, 1, pieces, rows)
        gathered = [
            _call(graph, gather.target, (_take(graph, x, own, j), group, dim, reduce_grad)) for j in range(pieces)
        ]
    for linear in list(gather.users):
        with graph.inserting_before(linear):
            outputs = [_call(graph, LINEAR, (piece, *linear.args[1:])) for piece in gathered]
            linear.replace_all_uses_with(_put_back(graph, outputs, layout))
        graph.erase_node(linear)
    graph.erase_node(gather)
    return 1


def _reduce_in_pieces(graph: fx.Graph, reduce: fx.Node, pieces: int, scatter: bool) -> int:
    """Compute the reduced value in pieces from its linear's rows (through the sums that lead
    to it) and reduce each piece: an all-reduce's along the first leading dim that divides, a
    reduce-scatter's along its dim (piece j: rows j of every rank's block, so each rank receives
    its block's rows j); the reduced pieces laid end to end. A linear or sum another node also
    reads is put back whole for it."""
    value = reduce.args[0]
    shape = value.meta["val"].shape
    if scatter:
        dim = reduce.args[2] % len(shape)
        ranks = shape[dim] // reduce.meta["val"].shape[dim]
        divides = dim < len(shape) - 1 and (shape[dim] // ranks) % pieces == 0
    else:
        dim = next((d for d in range(len(shape) - 1) if shape[d] % pieces == 0 and shape[d] >= pieces), None)
        ranks, divides = 1, dim is not None
    if not divides:
        return 0
    layout = _Layout(dim - len(shape), ranks, pieces, shape[dim] // ranks // pieces)
    order = {node: index for index, node in enumerate(graph.nodes)}
    chain = _chain(value)
    if any(user not in chain and order[user] < order[reduce] for node in chain for user in node.users):
        return 0  # a node read before the reduction would have to wait for the pieces put back together
    pieced: dict[fx.Node, list[fx.Node]] = {}
    with graph.inserting_before(reduce):
        reduced = [
            _call(graph, reduce.target, (_rows(graph, value, layout, j, pieced), *reduce.args[1:]))
            for j in range(pieces)
        ]
        whole = _call(graph, aten.cat.default, (reduced, dim))
    reduce.replace_all_uses_with(whole)
    graph.erase_node(reduce)
    for node in reversed(list(pieced)):  # consumers first
        if node.users:
            with graph.inserting_before(whole):
                node.replace_all_uses_with(_put_back(graph, pieced[node], layout))
        graph.erase_node(node)
    return 1


def _rows(graph: fx.Graph, node: fx.Node, layout: _Layout, j: int, pieced: dict) -> fx.Node:
    """Piece j of ``node`` (:func:`_take`): a linear on its input's piece, a sum of its operands'
    pieces, else taken; an operand broadcast along the dim as it is. The linears and sums
    computed in pieces are noted in ``pieced``."""
    value = node.meta["val"]
    if value.dim() + layout.dim < 0 or value.shape[layout.dim] == 1:
        return node
    if len(pieced.get(node, ())) > j:  # read twice in one piece (a sum of a node with itself): computed once
        return pieced[node][j]
    if node.target is LINEAR:
        piece = _call(graph, LINEAR, (_rows(graph, node.args[0], layout, j, pieced), *node.args[1:]))
    elif node.target is ROW_SUM and _has_linear(node):
        args = tuple(_rows(graph, a, layout, j, pieced) if isinstance(a, fx.Node) else a for a in node.args)
        piece = _call(graph, ROW_SUM, args)
    else:
        return _take(graph, node, layout, j)
    pieced.setdefault(node, []).append(piece)
    return piece


def _call(graph: fx.Graph, target, args: tuple) -> fx.Node:
    """A new node computing ``target(*args)``, its ``meta["val"]`` from the inputs' fake values."""
    node = graph.call_function(target, args)
    values = fx.node.map_arg(args, lambda n: n.meta["val"])
    with detect_fake_mode(tree_flatten(values)[0]):
        node.meta["val"] = target(*values)
    return node
