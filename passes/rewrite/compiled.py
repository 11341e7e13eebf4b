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

Under mixed precision the program also casts its parameters (:func:`cast_in_program`): it
takes the fp32 masters and casts each to the compute dtype itself, where inductor fuses the
cast into the step, and where the cast sits against the sum says which dtype the gradient is
summed in (``reduce_dtype``): a sum before the cast sums the master's fp32 gradient, one after it
sums the compute dtype's (FSDP2's ``MixedPrecisionPolicy`` either way). Outside a program the runtime casts
(:mod:`autopar.runtime.mixed_precision`).

The scheduling pass then buckets and places these collectives like every other
(:mod:`autopar.passes.rewrite.overlap`). Syncing in the program is exact in every case (the sum
is linear); under ``no_sync`` or over microbatches it communicates once per backward.

Pre: a program of :func:`rewrite` (after recomputation and the stage split; ``params`` maps its
parameter placeholders to parameter names), its parameters in the compute dtype. Post: the same
computation, no ``zero_gather`` left, taking fp32 masters under mixed precision; the returned
names are the parameters whose gradients the program sums itself.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from autopar.ir import EARLIER_GRADS, OP_NAMESPACE, Axis, Plan, PrecisionPolicy, layer_of

aten = torch.ops.aten


def sync_in_program(
    program: fx.GraphModule,
    plan: Plan,
    params: dict[str, str],
    group_of: Callable[[tuple[str, ...]], str],
    *,
    whole: bool,
    accumulated: bool = False,
) -> tuple[fx.GraphModule, frozenset[str]]:
    """``program`` summing its own gradients (see the module docstring); ``group_of(axes)`` names
    the process group of mesh axes; ``whole``: also the parameters ZeRO does not split;
    ``accumulated``: the program runs the last microbatch of a step whose earlier microbatches
    left their gradients of those parameters to accumulate: it takes them as inputs after its
    own (one per name in ``program.meta[EARLIER_GRADS]``) and sums them with its own
    (``grad_all_reduce_accumulated``), so a step communicates once, behind the last backward.

    >>> program, synced = sync_in_program(program, plan, captured.params, group_of, whole=True)  # doctest: +SKIP
    """
    ops = getattr(torch.ops, OP_NAMESPACE)
    graph = program.graph
    casts = _Casts.of(plan.precision_policy)
    synced: set[str] = set()
    layers: dict[tuple, list[fx.Node]] = {}
    for gather in graph.find_nodes(op="call_function", target=ops.zero_gather.default):
        shard = gather.args[0]
        key = (layer_of(params[shard.name]) or "", shard.meta["val"].dtype, gather.args[1])
        layers.setdefault(key, []).append(gather)
    gathered = {gather.args[0] for gathers in layers.values() for gather in gathers}
    for gathers in layers.values():
        synced |= _gather_layer(graph, gathers, plan, params, group_of, ops, casts)
    earlier: list[str] = []  # accumulated: the parameters whose earlier gradients the program takes, in order
    inputs = graph.find_nodes(op="placeholder")
    anchor = inputs[-1] if inputs else None
    for placeholder in inputs:
        name = params.get(placeholder.name)
        if name is None or placeholder in gathered or not placeholder.users:
            continue
        master = casts.master(placeholder)
        sum_step = None
        if whole and name in plan.grad_sync and name not in synced:
            group = group_of(plan.grad_sync[name])
            sum_step = (ops.grad_all_reduce.default, (group,))
            if accumulated:
                with graph.inserting_after(anchor):
                    anchor = graph.placeholder(f"{placeholder.name}_earlier_grad")
                anchor.meta["val"] = placeholder.meta["val"]
                sum_step = (ops.grad_all_reduce_accumulated.default, (anchor, group))
                earlier.append(name)
            synced.add(name)
        _feed(graph, placeholder, casts.around(master, sum_step))
    graph.lint()
    result = fx.GraphModule(program, graph)
    result.meta[EARLIER_GRADS] = earlier
    return result, frozenset(synced)


class _Casts:
    """Where a mixed-precision program casts a parameter: the masters are fp32; ``param`` is the
    compute dtype, ``reduce`` the dtype gradients are summed in (None without mixed precision)."""

    def __init__(self, param: torch.dtype | None, reduce: torch.dtype | None):
        self.param, self.reduce = param, reduce

    @classmethod
    def of(cls, policy: PrecisionPolicy) -> _Casts:
        if not policy.mixed:
            return cls(None, None)
        return cls(getattr(torch, policy.param_dtype), getattr(torch, policy.reduce_dtype))

    def master(self, placeholder: fx.Node) -> bool:
        """Whether the placeholder now takes an fp32 master (its meta says so from here on)."""
        val = placeholder.meta["val"]
        if self.param is None or not val.is_floating_point():
            return False
        if val.dtype != torch.float32:
            placeholder.meta["val"] = val.to(torch.float32)
        return True

    def around(self, master: bool, sum_step: tuple | None) -> list[tuple]:
        """The steps from a parameter to its uses: its sum (None: not summed) in the reduce
        dtype, and a cast to the compute dtype (``master``: it takes an fp32 master)."""
        steps = [sum_step] if sum_step is not None else []
        if not master:
            return steps
        if not steps:
            return _cast_to(self.param)
        return [*_cast_to(self.reduce), *steps, *([] if self.reduce == self.param else _cast_to(self.param))]


def _cast_to(dtype: torch.dtype) -> list[tuple]:
    """A cast step (none to fp32: the masters are fp32 already)."""
    return [] if dtype == torch.float32 else [(aten._to_copy.default, dtype)]


def _chain(graph: fx.Graph, value: fx.Node, steps: list[tuple]) -> fx.Node:
    """``value`` through ``steps`` at the graph's insertion point: (``aten._to_copy``, dtype) casts,
    (a collective, its other arguments) sums, where an earlier gradient summed with ``value`` is
    cast to its dtype first; returns the last node."""
    for target, extra in steps:
        val = value.meta["val"]
        if target is aten._to_copy.default:
            value = graph.call_function(target, (value,), {"dtype": extra})
            value.meta["val"] = val.to(extra)
            continue
        extra = tuple(
            _chain(graph, arg, _cast_to(val.dtype))
            if isinstance(arg, fx.Node) and arg.meta["val"].dtype != val.dtype
            else arg
            for arg in extra
        )
        value = graph.call_function(target, (value, *extra))
        value.meta["val"] = val
    return value


def _feed(graph: fx.Graph, value: fx.Node, steps: list[tuple]) -> None:
    """Route every use of ``value`` through ``steps`` (:func:`_chain`), placed before its first use."""
    if not steps:
        return
    users = list(value.users)
    order = {node: index for index, node in enumerate(graph.nodes)}
    with graph.inserting_before(min(users, key=order.__getitem__)):
        last = _chain(graph, value, steps)
    for user in users:
        user.replace_input_with(value, last)


def _gather_layer(
    graph: fx.Graph, gathers: list[fx.Node], plan: Plan, params, group_of, ops, casts: _Casts
) -> set[str]:
    """One ``zero_gather_layer`` in place of one layer's ``zero_gather`` ops; returns the
    parameters whose gradients it sums. Under mixed precision each shard is cast to the reduce
    dtype first, and the op casts to the compute dtype before gathering (FSDP2's 16-bit gathers)."""
    shards = list(dict.fromkeys(gather.args[0] for gather in gathers))  # a parameter gathered twice: once
    first = {shard: next(g for g in gathers if g.args[0] is shard) for shard in shards}
    sources, synced, masters = [], set(), False
    with graph.inserting_before(gathers[0]):
        for shard in shards:
            name = params[shard.name]
            others = tuple(axis for axis in plan.grad_sync.get(name, ()) if axis != Axis.DP)
            master = casts.master(shard)
            masters |= master
            steps = _cast_to(casts.reduce) if master else []
            if others:  # summed over them first: the sum of the chunks is the chunk of the sum
                steps.append((ops.grad_all_reduce.default, (group_of(others),)))
            sources.append(_chain(graph, shard, steps))
            if name in plan.grad_sync:
                synced.add(name)
        compute_dtype = casts.param if masters and casts.param != casts.reduce else None
        dims = [first[shard].args[2] for shard in shards]
        reduce_grads = [first[shard].args[3] for shard in shards]
        layer = graph.call_function(
            ops.zero_gather_layer.default, (sources, gathers[0].args[1], dims, reduce_grads, compute_dtype)
        )
        wholes = {shard: graph.call_function(operator.getitem, (layer, index)) for index, shard in enumerate(shards)}
    for gather in gathers:
        gather.replace_all_uses_with(wholes[gather.args[0]])
        graph.erase_node(gather)
    return synced
