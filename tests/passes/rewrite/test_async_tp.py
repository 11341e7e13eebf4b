"""Async tensor parallelism's pieces (passes/rewrite/async_tp.py): the program computes the same
loss and gradients in pieces as whole, on one gloo rank (the pieces really there: two collectives
and two matmuls where there was one each, and what cannot be pieced left alone) and on two,
where a gathered or reduce-scattered piece holds rows of every rank's block (run eagerly: the
pieces are plain ops; compiled, the equivalence suite's TP+SP case)."""

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from op_checks import loss_and_grads

import autopar.runtime  # noqa: F401  (registers torch.ops.autopar)
from autopar.passes.rewrite.async_tp import pipeline_tp_matmuls
from autopar.runtime.spawn import run_local
from autopar.verify import ATOL, RTOL

ops = torch.ops.autopar
aten = torch.ops.aten


def _pieced_and_checked(function, shapes: list[tuple], seed: int = 0) -> tuple[fx.GraphModule, int]:
    """``function``'s program in pieces and how many collectives it split, once checked to compute
    the same loss and gradients on random inputs of ``shapes``."""
    program = fx.symbolic_trace(function)
    torch.manual_seed(seed)
    inputs = tuple(torch.randn(shape) for shape in shapes)
    pieced, split = pipeline_tp_matmuls(program, inputs)
    expected, result = loss_and_grads(program, inputs), loss_and_grads(pieced, inputs)
    torch.testing.assert_close(result, expected, rtol=RTOL, atol=ATOL)  # fp32, summed in pieces
    return pieced, split


def _count(program, target) -> int:
    return len(program.graph.find_nodes(op="call_function", target=target))


def test_a_gather_before_linears_runs_in_pieces_and_computes_the_same(group):
    def layer(x, wq, wk):  # a sequence-split activation gathered for two column-parallel linears
        full = ops.all_gather.default(x, group, 1, True)
        q = aten.linear.default(full, wq)
        k = aten.linear.default(full, wk)
        return (q * k).sum()

    pieced, split = _pieced_and_checked(layer, [(2, 8, 4), (6, 4), (6, 4)])
    assert split == 1
    assert _count(pieced, ops.all_gather.default) == 2 and _count(pieced, aten.linear.default) == 4


def test_a_partial_residual_all_reduced_runs_in_pieces_and_the_sum_read_later_is_whole(group):
    def layer(residual, h, w_out, w_next):  # row-parallel linear plus a residual kept partial, as the search plans it
        partial = aten.add.Tensor(residual, aten.linear.default(h, w_out))
        summed = ops.all_reduce.default(partial, group, "sum")
        later = aten.add.Tensor(partial, aten.linear.default(summed, w_next))  # the partial sum, read again
        return ops.all_reduce.default(later, group, "sum").pow(2).sum()

    pieced, split = _pieced_and_checked(layer, [(4, 6, 8), (4, 6, 5), (8, 5), (8, 8)])
    assert split == 2
    assert _count(pieced, ops.all_reduce.default) == 4 and _count(pieced, aten.linear.default) == 4


def test_a_linear_summed_with_itself_is_computed_once_per_piece(group):
    def layer(h, w):
        product = aten.linear.default(h, w)
        return ops.all_reduce.default(aten.add.Tensor(product, product), group, "sum").pow(2).sum()

    pieced, split = _pieced_and_checked(layer, [(4, 3, 5), (6, 5)])
    assert split == 1 and _count(pieced, aten.linear.default) == 2


def test_what_cannot_run_in_pieces_is_left_as_it_is(group):
    def layer(x, w, h):
        full = ops.all_gather.default(x, group, 1, True)
        used_twice = aten.linear.default(full, w) + full.sum()  # a reader that is not a linear
        odd = ops.all_gather.default(h, group, 1, True)  # 3 rows do not divide in 2 pieces
        partial = aten.linear.default(h, w)
        early = partial * 2  # read before the all-reduce: it would wait for the pieces
        return ops.all_reduce.default(partial, group, "sum").sum() + used_twice.sum() + odd.sum() + early.sum()

    pieced, split = _pieced_and_checked(layer, [(2, 4, 5), (5, 5), (4, 3, 5)])
    assert split == 0
    assert _count(pieced, ops.all_gather.default) == 2 and _count(pieced, ops.all_reduce.default) == 1


def _layers(group: str) -> dict:
    """Each program two ranks run: (function, local input shapes). Every loss weighs each row by
    its own factor (``at``), so a row put back in the wrong place changes it."""

    def gather_for_linears(x, wq, wk, at):
        full = ops.all_gather.default(x, group, 1, True)
        return (aten.linear.default(full, wq) * aten.linear.default(full, wk) * at).sum()

    def scatter_a_partial_residual(residual, h, w_out, at, at_mine):
        partial = aten.add.Tensor(residual, aten.linear.default(h, w_out))
        mine = ops.reduce_scatter.default(partial, group, 1, "sum")
        return (mine.pow(2) * at_mine).sum() + (partial * at).sum()  # the partial sum read again: put back whole

    def all_reduce_a_linear(h, w, at):
        return (ops.all_reduce.default(aten.linear.default(h, w), group, "sum").pow(2) * at).sum()

    return {
        "gather": (gather_for_linears, [(2, 8, 4), (6, 4), (6, 4), (2, 16, 6)]),
        "reduce-scatter": (scatter_a_partial_residual, [(2, 8, 5), (2, 8, 3), (5, 3), (2, 8, 5), (2, 4, 5)]),
        "all-reduce": (all_reduce_a_linear, [(4, 3, 5), (6, 5), (4, 3, 6)]),
    }


def _two_ranks(rank: int, world: int) -> dict:
    """Each program's collectives split, once checked on this rank's own inputs (a mismatch fails the rank)."""
    layers = _layers(dist.group.WORLD.group_name).items()
    return {name: _pieced_and_checked(function, shapes, seed=rank)[1] for name, (function, shapes) in layers}


@pytest.mark.ranks
def test_on_two_ranks_every_piece_holds_the_rows_of_every_ranks_block():
    for found in run_local(_two_ranks, 2, timeout_s=120):
        assert found == {"gather": 1, "reduce-scatter": 1, "all-reduce": 1}, found
