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
- ZeRO-2 (``scattered``, :func:`autopar.ir.zero.scatters_in_program`): each layer's split
  parameters pass whole through one ``zero_scatter_layer`` op, whose backward reduce-scatters
  their gradients in one collective into the chunk leaves the program takes as extra inputs
  (then summed over the other gradient axes), so no whole gradient outlives backward;
- whole parameters (:func:`autopar.ir.zero.syncs_whole_in_program`): each synced parameter passes through
  ``grad_all_reduce`` over its gradient axes (identity in forward, the all-reduce in backward,
  right where backward completes the gradient). Over microbatches (gradient accumulation below
  ZeRO-2) the earlier microbatches run the program with no sum, and the last one's takes what
  they accumulated as extra inputs and sums it with its own (``grad_all_reduce_accumulated``).

Under mixed precision a program that sums gradients itself also casts its parameters
(:class:`_Casts`): it takes the fp32 masters and casts each to the compute dtype itself, and
where the cast sits against the sum says which dtype the gradient is summed in
(``reduce_dtype``): a sum before the cast sums the master's fp32 gradient, one after it sums the
compute dtype's (FSDP2's ``MixedPrecisionPolicy`` either way). A program that sums nothing (a
pipeline stage below ZeRO-3, a microbatch before the last) takes the 16-bit copies the runtime
casts once per call (:mod:`autopar.runtime.mixed_precision`), not one cast per microbatch.

The scheduling pass then buckets and places these collectives like every other
(:mod:`autopar.passes.rewrite.overlap`). Syncing in the program is exact in every case (the sum
is linear); under ``no_sync`` it communicates once per backward.

Pre: a program of :func:`rewrite` (after recomputation and the stage split; ``params`` maps its
parameter placeholders to parameter names), its parameters in the compute dtype. Post: the same
computation, no ``zero_gather`` left, taking fp32 masters under mixed precision where it sums
gradients (``program.meta[CASTS_IN_PROGRAM]``); the returned names are the parameters whose
gradients the program sums itself.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from autopar.ir import (
    CASTS_IN_PROGRAM,
    EARLIER_GRAD,
    EXTRA_INPUTS,
    GRAD_CHUNK,
    OP_NAMESPACE,
    Axis,
    Plan,
    PrecisionPolicy,
    layer_of,
)

aten = torch.ops.aten


def sync_in_program(
    program: fx.GraphModule,
    plan: Plan,
    params: dict[str, str],
    group_of: Callable[[tuple[str, ...]], str],
    *,
    whole: bool,
    accumulated: bool = False,
    scattered: dict[str, int] | None = None,
) -> tuple[fx.GraphModule, frozenset[str]]:
    """``program`` summing its own gradients (see the module docstring); ``group_of(axes)`` names
    the process group of mesh axes; ``whole``: also the parameters ZeRO does not split;
    ``accumulated``: the program runs the last microbatch of a step whose earlier microbatches
    left their gradients of those parameters to accumulate: it takes them as inputs and sums
    them with its own (``grad_all_reduce_accumulated``), so a step communicates once, behind the
    last backward; ``scattered``: ZeRO-2's split parameters (name → dim), reduce-scattered into
    chunks the program takes as inputs (``zero_scatter_layer``). What it takes after the call's
    inputs is listed in ``program.meta[EXTRA_INPUTS]``.

    >>> program, synced = sync_in_program(program, plan, captured.params, group_of, whole=True)  # doctest: +SKIP
    """
    ops = getattr(torch.ops, OP_NAMESPACE)
    graph = program.graph
    gathers = graph.find_nodes(op="call_function", target=ops.zero_gather.default)
    sums = whole or gathers or scattered  # the program sums gradients: it casts its masters itself
    casts = _Casts.of(plan.precision_policy) if sums else _Casts(None, None)
    extras = _ExtraInputs(graph)
    synced: set[str] = set()
    layers: dict[tuple, list[fx.Node]] = {}
    for gather in gathers:
        shard = gather.args[0]
        key = (layer_of(params[shard.name]) or "", shard.meta["val"].dtype, gather.args[1])
        layers.setdefault(key, []).append(gather)
    done = {gather.args[0] for gathers in layers.values() for gather in gathers}
    for gathers in layers.values():
        synced |= _gather_layer(graph, gathers, plan, params, group_of, ops, casts)
    chunked: dict[str, list[fx.Node]] = {}
    for placeholder in graph.find_nodes(op="placeholder"):
        if params.get(placeholder.name) in (scattered or {}) and placeholder.users:
            chunked.setdefault(layer_of(params[placeholder.name]) or "", []).append(placeholder)
    for wholes in chunked.values():
        synced |= _scatter_layer(graph, wholes, plan, params, scattered, group_of, ops, casts, extras)
        done |= set(wholes)
    for placeholder in extras.original:
        name = params.get(placeholder.name)
        if name is None or placeholder in done or not placeholder.users:
            continue
        master = casts.master(placeholder)
        sum_step = None
        if whole and name in plan.grad_sync and name not in synced:
            group = group_of(plan.grad_sync[name])
            sum_step = (ops.grad_all_reduce.default, (group,))
            if accumulated:
                earlier = extras.add(EARLIER_GRAD, name, placeholder, placeholder.meta["val"])
                sum_step = (ops.grad_all_reduce_accumulated.default, (earlier, group))
            synced.add(name)
        _feed(graph, placeholder, casts.around(master, sum_step))
    graph.lint()
    result = fx.GraphModule(program, graph)
    result.meta[EXTRA_INPUTS] = extras.listed
    result.meta[CASTS_IN_PROGRAM] = casts.param is not None
    return result, frozenset(synced)


class _ExtraInputs:
    """The inputs a program takes after the call's (placeholders after its own), in order, and
    what each is (:data:`autopar.ir.EXTRA_INPUTS`)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.original = graph.find_nodes(op="placeholder")
        self.last = self.original[-1] if self.original else None
        self.listed: list[tuple[str, str]] = []

    def add(self, kind: str, name: str, of: fx.Node, val) -> fx.Node:
        with self.graph.inserting_after(self.last):
            self.last = self.graph.placeholder(f"{of.name}_{kind.replace(' ', '_')}")
        self.last.meta["val"] = val
        self.listed.append((kind, name))
        return self.last


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


def _scatter_layer(
    graph: fx.Graph, wholes: list[fx.Node], plan: Plan, params, scattered, group_of, ops, casts, extras
) -> set[str]:
    """One layer's ZeRO-2 parameters through one ``zero_scatter_layer``: they are used whole in
    forward, and backward reduce-scatters their gradients in one collective into the chunks the
    program takes (then summed over the gradient's other axes, as the chunk of the sum); returns
    the parameters it syncs."""
    users = {whole: list(whole.users) for whole in wholes}
    order = {node: index for index, node in enumerate(graph.nodes)}
    first_use = min((user for found in users.values() for user in found), key=order.__getitem__)
    sources, chunks, dims, masters = [], [], [], []
    with graph.inserting_before(first_use):
        for whole in wholes:
            name = params[whole.name]
            masters.append(casts.master(whole))
            sources.append(_chain(graph, whole, _cast_to(casts.reduce) if masters[-1] else []))
            dim = scattered[name]
            val = whole.meta["val"]
            chunk = extras.add(GRAD_CHUNK, name, whole, val.chunk(plan.degrees[Axis.DP], dim)[0].contiguous())
            others = tuple(axis for axis in plan.grad_sync[name] if axis != Axis.DP)
            chunks.append(_chain(graph, chunk, [(ops.grad_all_reduce.default, (group_of(others),))] if others else []))
            dims.append(dim)
        layer = graph.call_function(ops.zero_scatter_layer.default, (sources, chunks, group_of((Axis.DP,)), dims))
        for index, whole in enumerate(wholes):
            used = graph.call_function(operator.getitem, (layer, index))
            used.meta["val"] = sources[index].meta["val"]
            if masters[index] and casts.reduce != casts.param:
                used = _chain(graph, used, _cast_to(casts.param))
            for user in users[whole]:
                user.replace_input_with(whole, used)
    return {params[whole.name] for whole in wholes}
