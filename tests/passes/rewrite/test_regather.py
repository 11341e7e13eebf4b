"""Regather (passes/rewrite/regather.py, runtime/kernels/gathered_linear.py): an all-gather that
only linears read runs with them as one op, which computes the same loss and gradients and keeps
the shard, not the gathered value, for backward; on one gloo rank here (two and four ranks, eager
and compiled: the equivalence suites' regather cases)."""

import torch
import torch.fx as fx
from op_checks import loss_and_grads, opcheck_failures

import autopar.runtime  # noqa: F401  (registers torch.ops.autopar)
from autopar.passes.rewrite.regather import regather_gathered_inputs
from autopar.verify import ATOL, RTOL

ops = torch.ops.autopar
aten = torch.ops.aten


def _keeps_first_input(program, inputs) -> bool:
    """Whether autograd keeps the program's first input itself (its storage) for backward."""
    kept = set()
    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def pack(tensor):
        kept.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        program(*leaves)
    return leaves[0].untyped_storage().data_ptr() in kept


def _fused_and_checked(function, shapes: list[tuple]) -> tuple[fx.GraphModule, int]:
    """``function``'s program fused and how many gathers it fused, once checked to compute the
    same loss and gradients on random inputs of ``shapes`` and, where it fused, to keep the first
    input (the shard) where the unfused program kept its gathered copy."""
    program = fx.symbolic_trace(function)
    torch.manual_seed(0)
    inputs = tuple(torch.randn(shape) for shape in shapes)
    expected = loss_and_grads(program, inputs)
    assert not _keeps_first_input(program, inputs)
    fused_program, fused = regather_gathered_inputs(program)  # in place
    torch.testing.assert_close(loss_and_grads(fused_program, inputs), expected, rtol=RTOL, atol=ATOL)
    assert _keeps_first_input(fused_program, inputs) == bool(fused)
    return fused_program, len(fused)


def _count(program, target) -> int:
    return len(program.graph.find_nodes(op="call_function", target=target))


def test_linears_of_a_gathered_input_run_as_one_op_that_saves_the_shard(group):
    def layer(x, wq, bq, wk, w_up):  # a norm's output gathered for q, k (one with a bias, one without)
        full = ops.all_gather.default(x, group, 1, True)
        q = aten.linear.default(full, wq, bq)
        k = aten.linear.default(full, wk)
        h = ops.all_gather.default(q * k, group, 1, True)  # read by a product too: left as it is
        return (aten.linear.default(h, w_up) * h.sum()).sum()

    shapes = [(2, 8, 4), (6, 4), (6,), (6, 4), (3, 6)]
    program, fused = _fused_and_checked(layer, shapes)
    assert fused == 1
    assert _count(program, ops.gathered_linears.default) == 1 and _count(program, ops.all_gather.default) == 1


def test_a_weight_made_after_the_first_linear_moves_up(group):
    def layer(x, wq, wk):  # k's weight computed between the linears (as a ZeRO-3 gather or a cast is)
        full = ops.all_gather.default(x, group, 1, True)
        q = aten.linear.default(full, wq)
        q2 = q * 2.0
        wk2 = wk * 3.0
        k = aten.linear.default(full, wk2)
        return (q2 * k).sum()

    program, fused = _fused_and_checked(layer, [(2, 8, 4), (6, 4), (6, 4)])
    assert fused == 1 and _count(program, aten.linear.default) == 0


def test_the_ops_schema_autograd_and_shape_rules_agree_with_them(group):
    x, g, w = torch.randn(2, 8, 4), torch.randn(2, 8, 6), torch.randn(6, 4)
    grad_x = dict(requires_grad=True)
    calls = {
        "gathered_linears": (
            x.clone().requires_grad_(),
            [w.clone().requires_grad_(), torch.randn(3, 4, **grad_x)],
            [torch.randn(3, **grad_x)],
            [False, True],
            group,
            1,
            True,
        ),
        "gathered_linears_backward": (
            x,
            [g, torch.randn(2, 8, 3)],
            [w, torch.randn(3, 4)],
            [False, True],
            group,
            1,
            False,
        ),
    }
    assert opcheck_failures(calls) == {}
