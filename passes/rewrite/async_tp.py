"""Async tensor parallelism: a matmul and the collective next to it run in pieces, so that one
piece's communication hides behind another piece's matmul.

Tensor (and sequence) parallelism puts a collective right before or right after a matmul whose
rows are independent: the all-gather of a sequence-split activation before a column-parallel
linear, the all-reduce of a row-parallel linear's partial sums. Run whole, the matmul waits for
all of the gather, and the all-reduce for all of the matmul. Run in ``pieces``:

- **gather, then linears**: the input is sliced along the gathered dim; each slice is gathered
  on its own and every linear that reads the gathered value runs on it; the pieces of each
  linear's output are put back in order (rank k's rows of piece j go to rank k's block, slot j);
- **linear, then all-reduce**: the linear's rows are sliced along the first leading dim that
  divides; each piece is all-reduced on its own and the sums are laid end to end again.

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
it as input, a reduce-scatter after a linear, a dim that does not divide into ``pieces``.

Pre: a per-rank program of :func:`autopar.passes.rewrite.rewrite.rewrite` and the inputs it is
about to run on, on a rank whose process groups exist. Post: a copy computing the same.

>>> program, pieced = pipeline_tp_matmuls(program, inputs)   # doctest: +SKIP
"""

from __future__ import annotations

import copy

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
    """``program`` with its gather-then-linear and linear-then-all-reduce pairs run in ``pieces``
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
        if node.target is ops.all_gather.default and _feeds_only_linears(node):
            split += _gather_in_pieces(graph, node, pieces)
        elif node.target is ops.all_reduce.default and _reduces_a_linear(node):
            split += _reduce_in_pieces(graph, node, pieces)
    graph.lint()
    program.recompile()
    return program, split


def _feeds_only_linears(gather: fx.Node) -> bool:
    return bool(gather.users) and all(u.target is LINEAR and u.args[0] is gather for u in gather.users)


def _reduces_a_linear(reduce: fx.Node) -> bool:
    """Whether the all-reduced value is a linear's output, or a sum with one (a residual kept partial)."""
    node = reduce.args[0]
    while isinstance(node, fx.Node) and node.target is ROW_SUM:
        node = next((a for a in node.args if isinstance(a, fx.Node) and _has_linear(a)), None)
    return isinstance(node, fx.Node) and node.target is LINEAR


def _chain(node: fx.Node) -> set[fx.Node]:
    """The linears and sums :func:`_rows` computes in pieces to compute ``node`` in pieces."""
    if node.target is LINEAR:
        return {node} | _chain(node.args[0])
    if node.target is ROW_SUM and _has_linear(node):
        return {node}.union(*(_chain(a) for a in node.args if isinstance(a, fx.Node)))
    return set()


def _has_linear(node: fx.Node) -> bool:
    return node.target is LINEAR or (
        node.target is ROW_SUM and any(isinstance(a, fx.Node) and _has_linear(a) for a in node.args)
    )


def _gather_in_pieces(graph: fx.Graph, gather: fx.Node, pieces: int) -> int:
    """Slice the gathered input along the gathered dim; gather and multiply each slice; put
    each linear's rows back: gathered piece j holds slice j of every rank, [ranks, rows / pieces]."""
    x, group, dim, reduce_grad = gather.args
    local = x.meta["val"]
    dim %= local.dim()
    if dim == local.dim() - 1 or local.shape[dim] % pieces:
        return 0
    ranks = gather.meta["val"].shape[dim] // local.shape[dim]
    rows = local.shape[dim] // pieces
    with graph.inserting_before(gather):
        gathered = [
            _call(
                graph,
                gather.target,
                (_call(graph, aten.slice.Tensor, (x, dim, j * rows, (j + 1) * rows)), group, dim, reduce_grad),
            )
            for j in range(pieces)
        ]
    for linear in list(gather.users):
        with graph.inserting_before(linear):
            outputs = [_call(graph, LINEAR, (piece, *linear.args[1:])) for piece in gathered]
            # piece j, [..., ranks * rows, ...] → [..., ranks, 1, rows, ...]; side by side over j
            blocks = [_call(graph, aten.unflatten.int, (out, dim, [ranks, 1, rows])) for out in outputs]
            whole = _call(graph, aten.cat.default, (blocks, dim + 1))
            merged = _call(graph, aten.flatten.using_ints, (whole, dim, dim + 2))
        linear.replace_all_uses_with(merged)
        graph.erase_node(linear)
    graph.erase_node(gather)
    return 1


def _reduce_in_pieces(graph: fx.Graph, reduce: fx.Node, pieces: int) -> int:
    """Slice the all-reduced value's rows along the first leading dim that divides, computing each
    slice from its linear's rows (through the sums that lead to it); all-reduce each slice; lay
    the sums end to end. A linear or sum another node also reads is put back whole for it."""
    value = reduce.args[0]
    shape = value.meta["val"].shape
    dim = next((d for d in range(len(shape) - 1) if shape[d] % pieces == 0 and shape[d] >= pieces), None)
    if dim is None:
        return 0
    rows = shape[dim] // pieces
    order = {node: index for index, node in enumerate(graph.nodes)}
    chain = _chain(value)
    if any(user not in chain and order[user] < order[reduce] for node in chain for user in node.users):
        return 0  # a node read before the all-reduce would have to wait for the pieces put back together
    pieced: dict[fx.Node, list[fx.Node]] = {}
    with graph.inserting_before(reduce):
        sums = [
            _call(graph, reduce.target, (_rows(graph, value, dim - len(shape), j, rows, pieced), *reduce.args[1:]))
            for j in range(pieces)
        ]
        whole = _call(graph, aten.cat.default, (sums, dim))
    reduce.replace_all_uses_with(whole)
    graph.erase_node(reduce)
    for node in reversed(list(pieced)):  # consumers first
        if node.users:
            with graph.inserting_before(whole):
                node.replace_all_uses_with(_call(graph, aten.cat.default, (pieced[node], dim)))
        graph.erase_node(node)
    return 1


def _rows(graph: fx.Graph, node: fx.Node, dim: int, j: int, rows: int, pieced: dict) -> fx.Node:
    """Rows ``[j * rows, (j + 1) * rows)`` along ``dim`` (negative: counted from the last, as
    broadcasting aligns dims) of ``node``: a linear on its input's rows, a sum of its operands'
    rows, else a slice; an operand broadcast along ``dim`` as it is. The linears and sums
    computed in pieces are noted in ``pieced``."""
    value = node.meta["val"]
    if value.dim() + dim < 0 or value.shape[dim] == 1:
        return node
    if node.target is LINEAR:
        piece = _call(graph, LINEAR, (_rows(graph, node.args[0], dim, j, rows, pieced), *node.args[1:]))
    elif node.target is ROW_SUM and _has_linear(node):
        args = tuple(_rows(graph, a, dim, j, rows, pieced) if isinstance(a, fx.Node) else a for a in node.args)
        piece = _call(graph, ROW_SUM, args)
    else:
        return _call(graph, aten.slice.Tensor, (node, value.dim() + dim, j * rows, (j + 1) * rows))
    pieced.setdefault(node, []).append(piece)
    return piece


def _call(graph: fx.Graph, target, args: tuple) -> fx.Node:
    """A new node computing ``target(*args)``, its ``meta["val"]`` from the inputs' fake values."""
    node = graph.call_function(target, args)
    values = fx.node.map_arg(args, lambda n: n.meta["val"])
    with detect_fake_mode(tree_flatten(values)[0]):
        node.meta["val"] = target(*values)
    return node
