"""Regather: linears of an all-gathered activation keep its shard for backward, as Megatron-LM's
sequence parallelism does (:mod:`autopar.runtime.kernels.gathered_linear`).

An all-gather whose readers are all linears taking it as their input (a sequence-parallel norm's
output before q, k, v or the MLP's first linears) becomes one ``gathered_linears`` node: the
gather and those linears, which saves the shard, not the gathered value, and gathers it again in
backward. The gathered value then lives only while the linears run. The cost model prices the
same moves (:func:`autopar.passes.cost.axis_terms.traffic`: the activation saved at its shard,
one more all-gather in backward) under ``Schedule.regather``.

Pre: a per-rank program of :func:`autopar.passes.rewrite.rewrite.rewrite`, before recomputation
wraps its layers. Post: a program computing the same values; gradients equal up to the order of
fp32 sums (the gathered value's gradient is summed over its linears in one place).

>>> program, fused = regather_gathered_inputs(program)   # doctest: +SKIP
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.ir import OP_NAMESPACE
from autopar.passes.rewrite.async_tp import LINEAR, feeds_only_linears


def regather_gathered_inputs(program: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """``program`` with each all-gather that only linears read fused with them (see the module
    docstring), and the names of the gathers it fused."""
    ops = getattr(torch.ops, OP_NAMESPACE)
    graph = program.graph
    fused = []
    for gather in [n for n in graph.nodes if n.target is ops.all_gather.default and feeds_only_linears(n)]:
        if _fuse(graph, gather, ops.gathered_linears.default):
            fused.append(gather.name)
    if fused:
        graph.lint()
        program.recompile()
    return program, fused


def _bias(linear: fx.Node) -> fx.Node | None:
    return linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")


def _fuse(graph: fx.Graph, gather: fx.Node, target) -> bool:
    order = {node: index for index, node in enumerate(graph.nodes)}
    linears = sorted(gather.users, key=order.__getitem__)
    first = linears[0]
    weights = [linear.args[1] for linear in linears]
    biases = [_bias(linear) for linear in linears]
    # the weights a later linear reads may be made after the first linear (a ZeRO-3 gather): move them up
    late = _made_after(weights + [b for b in biases if b is not None], first, order)
    if late is None:
        return False
    for node in sorted(late, key=order.__getitem__):
        first.prepend(node)
    x, group_name, dim, reduce_grad = gather.args
    args = (
        x,
        weights,
        [b for b in biases if b is not None],
        [b is not None for b in biases],
        group_name,
        dim,
        reduce_grad,
    )
    with graph.inserting_before(first):
        node = graph.call_function(target, args)
        node.meta = dict(first.meta)
        if all("val" in linear.meta for linear in linears):
            node.meta["val"] = [linear.meta["val"] for linear in linears]
        for index, linear in enumerate(linears):
            item = graph.call_function(operator.getitem, (node, index))
            item.meta = dict(linear.meta)
            linear.replace_all_uses_with(item)
    for linear in linears:
        graph.erase_node(linear)
    graph.erase_node(gather)
    return True


def _made_after(nodes: list, first: fx.Node, order: dict) -> set[fx.Node] | None:
    """``nodes`` and what they are computed from that the graph runs after ``first``; None if one
    of them is a linear (what reads one cannot move above the first linear)."""
    late: set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if order[node] < order[first] or node in late:
            continue
        if node.target is LINEAR:
            return None
        late.add(node)
        stack.extend(node.all_input_nodes)
    return late
