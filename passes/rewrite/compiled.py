"""Sync in program: a program about to be compiled takes over its own gradient sync.

A compiled program runs as one autograd node: its backward hands every gradient back at once,
at its very end, so the runtime's bucketed sync (hooks on each gradient, :mod:`autopar.runtime.grad_sync`)
could only start once backward is over, and ZeRO-3's hook-driven gathers
(:mod:`autopar.runtime.zero.gather`) would not see the weights at all. So before compiling, the
gradient sync becomes part of the program, as in SimpleFSDP and Meta's autoparallel:

- ZeRO-3 (``plan.zero == 3``): the ``zero_gather`` of each dp-split parameter (one per
  parameter, from :func:`autopar.passes.rewrite.rewrite.rewrite`) are grouped by layer (the
  first numbered module of the name, :func:`autopar.ir.layer_of`; the rest is one root group)
  and dtype, and each group becomes one ``zero_gather_layer`` op before the group's first use:
  one collective per layer, whose backward reduce-scatters the layer's gradients in one
  collective (:mod:`autopar.runtime.zero.compiled`). A parameter whose gradient is also summed
  over other axes (:attr:`Plan.grad_sync`) takes a ``grad_all_reduce`` over those first;
- whole parameters (:func:`autopar.ir.zero.syncs_whole_in_program`): each synced parameter passes through
  ``grad_all_reduce`` over its gradient axes (identity in forward, the all-reduce in backward,
  right where backward completes the gradient).

The scheduling pass then buckets and places these collectives like every other
(:mod:`autopar.passes.rewrite.overlap`). Syncing in the program is exact in every case (the sum
is linear); under ``no_sync`` or over microbatches it communicates once per backward.

Pre: a program of :func:`rewrite` (after recomputation and the stage split; ``params`` maps its
parameter placeholders to parameter names). Post: the same computation, no ``zero_gather`` left;
the returned names are the parameters whose gradients the program sums itself.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from autopar.ir import OP_NAMESPACE, Axis, Plan, layer_of


def sync_in_program(
    program: fx.GraphModule,
    plan: Plan,
    params: dict[str, str],
    group_of: Callable[[tuple[str, ...]], str],
    *,
    whole: bool,
) -> tuple[fx.GraphModule, frozenset[str]]:
    """``program`` summing its own gradients (see the module docstring); ``group_of(axes)`` names
    the process group of mesh axes; ``whole``: also the parameters ZeRO does not split.

    >>> program, synced = sync_in_program(program, plan, captured.params, group_of, whole=True)  # doctest: +SKIP
    """
    ops = getattr(torch.ops, OP_NAMESPACE)
    graph = program.graph
    synced: set[str] = set()
    layers: dict[tuple, list[fx.Node]] = {}
    for gather in graph.find_nodes(op="call_function", target=ops.zero_gather.default):
        shard = gather.args[0]
        key = (layer_of(params[shard.name]) or "", shard.meta["val"].dtype, gather.args[1])
        layers.setdefault(key, []).append(gather)
    for gathers in layers.values():
        synced |= _gather_layer(graph, gathers, plan, params, group_of, ops)
    if whole:
        for placeholder in graph.find_nodes(op="placeholder"):
            name = params.get(placeholder.name)
            if name in plan.grad_sync and name not in synced and placeholder.users:
                _sum_gradient(graph, placeholder, group_of(plan.grad_sync[name]), ops)
                synced.add(name)
    graph.lint()
    return fx.GraphModule(program, graph), frozenset(synced)


def _gather_layer(graph: fx.Graph, gathers: list[fx.Node], plan: Plan, params, group_of, ops) -> set[str]:
    """One ``zero_gather_layer`` in place of one layer's ``zero_gather`` ops; returns the
    parameters whose gradients it sums."""
    shards = list(dict.fromkeys(gather.args[0] for gather in gathers))  # a parameter gathered twice: once
    first = {shard: next(g for g in gathers if g.args[0] is shard) for shard in shards}
    sources, synced = [], set()
    with graph.inserting_before(gathers[0]):
        for shard in shards:
            name = params[shard.name]
            others = tuple(axis for axis in plan.grad_sync.get(name, ()) if axis != Axis.DP)
            source = shard
            if others:  # summed over them first: the sum of the chunks is the chunk of the sum
                source = graph.call_function(ops.grad_all_reduce.default, (shard, group_of(others)))
            sources.append(source)
            if name in plan.grad_sync:
                synced.add(name)
        dims = [first[shard].args[2] for shard in shards]
        reduce_grads = [first[shard].args[3] for shard in shards]
        layer = graph.call_function(ops.zero_gather_layer.default, (sources, gathers[0].args[1], dims, reduce_grads))
        wholes = {shard: graph.call_function(operator.getitem, (layer, index)) for index, shard in enumerate(shards)}
    for gather in gathers:
        gather.replace_all_uses_with(wholes[gather.args[0]])
        graph.erase_node(gather)
    return synced


def _sum_gradient(graph: fx.Graph, placeholder: fx.Node, group_name: str, ops) -> None:
    """Route every use of a parameter through ``grad_all_reduce``: its gradient is summed over
    ``group_name`` as soon as backward has it."""
    users = list(placeholder.users)
    order = {node: index for index, node in enumerate(graph.nodes)}
    with graph.inserting_before(min(users, key=order.__getitem__)):
        summed = graph.call_function(ops.grad_all_reduce.default, (placeholder, group_name))
    for user in users:
        user.replace_input_with(placeholder, summed)
