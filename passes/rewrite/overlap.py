"""Overlap: place each collective of a compiled graph so that communication hides behind compute.

Runs inside the compiler (:mod:`autopar.runtime.compile`) on each forward and backward graph
AOTAutograd makes of a per-rank program, where autograd has turned every ``autopar::`` op into
its forward or its dual. Three steps:

1. **lower**: every op listed in ``forms`` (:data:`autopar.runtime.functional.FUNCTIONAL_FORMS`)
   becomes its functional form, a collective that returns at once (``_c10d_functional.*``) and a
   ``wait_tensor``, with the layout copies around them (traced on the graph's fake tensors);
2. **bucket** (:func:`bucket_all_reduces`): all-reduces on one group, of one dtype, whose inputs
   are all ready before any of their results is needed (the gradients of a layer, as they come
   out of backward) merge into one collective over a flat buffer, in order of readiness, closing a
   bucket at DDP's sizes (:func:`autopar.ir.buckets.bucket_cap`);
3. **place** (:func:`place_collectives`): each wait (with the views and copies that unpack its
   result) moves down to right before its first use, and each collective (with the copies that
   pack its input) moves up to right after its input is ready. A gather of parameters (its input
   is the program's own inputs: ZeRO-3's layer gathers) starts no earlier than the previous
   parameter gather's wait, so exactly one layer is prefetched while the layer before computes,
   as FSDP2 does; the same holds in backward, where the gathers are recomputed.

What then lies between a collective and its wait is what hides it; the cost model computes the
same windows from the planned graph (:mod:`autopar.passes.cost.replay`).

Pre: a functional aten graph whose nodes carry ``meta["val"]`` (inductor's post-grad graphs), run
on a rank whose process groups exist. Post: the same computation; no ``forms`` op is left; every
``wait_tensor`` follows its collective and precedes every use of its result.

>>> schedule_communication(graph, FUNCTIONAL_FORMS)   # doctest: +SKIP
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.traceback import NodeSource, NodeSourceAction
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.ir import wait_name
from autopar.ir.buckets import bucket_cap

functional = torch.ops._c10d_functional
COLLECTIVES = (
    functional.all_reduce.default,
    functional.all_gather_into_tensor.default,
    functional.reduce_scatter_tensor.default,
    functional.all_to_all_single.default,
)
WAIT = functional.wait_tensor.default
PLAN_NODES = "autopar_plan_nodes"  # a wait's meta: the program's nodes whose communication it waits for
aten = torch.ops.aten
# Ops that only pack a collective's input or unpack its result: they move with it.
LAYOUT_OPS = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.permute.default,
        aten.clone.default,
        aten.cat.default,
        aten.split_with_sizes.default,
        aten.split.Tensor,
        aten.slice.Tensor,
        aten.squeeze.dim,
        aten.unsqueeze.default,
        aten.expand.default,
        operator.getitem,
    }
)


def schedule_communication(graph: fx.Graph, forms: Mapping[Callable, Callable]) -> None:
    """Lower, bucket and place the graph's collectives (see the module docstring)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in forms:
            _replace_by_trace(node, forms[node.target])
    bucket_all_reduces(graph)
    place_collectives(graph)
    graph.lint()


def _replace_by_trace(node: fx.Node, form: Callable) -> None:
    """Put ``form``'s graph, traced on ``node``'s fake inputs, in place of ``node``."""
    flat, spec = tree_flatten((node.args, node.kwargs))
    tensor_at = [i for i, value in enumerate(flat) if isinstance(value, fx.Node)]

    def call(*tensors):
        values = list(flat)
        for index, tensor in zip(tensor_at, tensors):
            values[index] = tensor
        args, kwargs = tree_unflatten(values, spec)
        return form(*args, **kwargs)

    plan_nodes = [_plan_node(node)]
    outputs = _splice(node.graph, call, [flat[i] for i in tensor_at], before=node, plan_nodes=plan_nodes)
    if isinstance(node.meta["val"], (list, tuple)):
        for user in list(node.users):
            assert user.target is operator.getitem, f"{user.format_node()} takes an item of a collective's outputs"
            user.replace_all_uses_with(outputs[user.args[1]])
            node.graph.erase_node(user)
    else:
        node.replace_all_uses_with(outputs[0])
    node.graph.erase_node(node)


def _plan_node(node: fx.Node) -> str:
    """The program's node an ``autopar::`` op of a compiled graph comes from (itself, or the one
    it is the backward of): the last program line in its stack trace, ``all_gather_3 = torch.ops.autopar...``."""
    found = re.findall(r"^\s*(\w+) = torch\.ops\.autopar\.", node.meta.get("stack_trace") or "", re.MULTILINE)
    return found[-1] if found else node.name


def _splice(
    graph: fx.Graph, function: Callable, inputs: list[fx.Node], before: fx.Node, plan_nodes: list[str]
) -> list[fx.Node]:
    """Trace ``function`` on the fake values of ``inputs`` and insert its nodes before ``before``;
    returns the nodes of its (flattened) outputs. Its waits are named after ``plan_nodes`` (the
    program's nodes it computes) and made their own origin, which inductor's comments then show
    (:func:`autopar.ir.wait_name`: a wait that fails names them)."""
    fake = [node.meta["val"] for node in inputs]
    backward = any(node.name.startswith("tangents") for node in graph.find_nodes(op="placeholder"))
    with torch._guards.detect_fake_mode(fake):
        traced = make_fx(function)(*fake)
    env = dict(zip(traced.graph.find_nodes(op="placeholder"), inputs))
    outputs: list[fx.Node] = []
    with graph.inserting_before(before):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = [env[out] for out in tree_flatten(node.args[0])[0]]
                continue
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.target is WAIT:
                wait = env[node]
                wait.meta[PLAN_NODES] = plan_nodes
                wait._rename(wait_name(plan_nodes, backward))
                # the "Source Nodes" of inductor's comment above a call are its nodes' origins
                wait.meta["from_node"] = [NodeSource(wait, "autopar.overlap", NodeSourceAction.CREATE)]
    return outputs


# --------------------------------------------------------------------------- bucketing


def _wait_of(collective: fx.Node) -> fx.Node:
    (wait,) = collective.users
    assert wait.target is WAIT, f"{collective.format_node()} must be waited for by one wait_tensor"
    return wait


def bucket_all_reduces(graph: fx.Graph) -> None:
    """Merge all-reduces that could run as one (see the module docstring, step 2)."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    open_buckets: dict[tuple, list[fx.Node]] = {}
    closed: list[list[fx.Node]] = []
    for node in graph.find_nodes(op="call_function", target=functional.all_reduce.default):
        value = node.args[0].meta["val"]
        key = (node.args[2], node.args[1], value.dtype)
        ready, first_use = position[node.args[0]], min(position[user] for user in _wait_of(node).users)
        members = open_buckets.get(key, [])
        if members and ready >= min(min(position[u] for u in _wait_of(m).users) for m in members):
            closed.append(open_buckets.pop(key))  # a member's result is needed before this input is ready
            members = []
        if members and max(position[m.args[0]] for m in members) >= first_use:
            closed.append(open_buckets.pop(key))
            members = []
        members.append(node)
        open_buckets[key] = members
        if sum(_nbytes(m) for m in members) >= bucket_cap(len(closed)):
            closed.append(open_buckets.pop(key))
    closed += open_buckets.values()
    for members in closed:
        if len(members) > 1:
            _merge(graph, members, position)


def _nbytes(collective: fx.Node) -> int:
    value = collective.args[0].meta["val"]
    return value.numel() * value.element_size()


def _merge(graph: fx.Graph, members: list[fx.Node], position: dict[fx.Node, int]) -> None:
    """One all-reduce over the members' inputs laid end to end, in place of the members."""
    _, reduce_op, group_name = members[0].args
    inputs = [member.args[0] for member in members]
    shapes = [node.meta["val"].shape for node in inputs]

    def merged(*tensors):
        flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
        summed = functional.wait_tensor(functional.all_reduce(flat, reduce_op, group_name))
        return [piece.view(shape) for piece, shape in zip(summed.split([s.numel() for s in shapes]), shapes)]

    last_input = max(inputs, key=position.__getitem__)
    plan_nodes = [name for member in members for name in _wait_of(member).meta.get(PLAN_NODES, [member.name])]
    outputs = _splice(graph, merged, inputs, before=last_input.next, plan_nodes=plan_nodes)
    for member, output in zip(members, outputs):
        wait = _wait_of(member)
        wait.replace_all_uses_with(output)
        graph.erase_node(wait)
        graph.erase_node(member)


# --------------------------------------------------------------------------- placement


def place_collectives(graph: fx.Graph) -> None:
    """Sink every wait to its first use, then hoist every collective to its ready input (step 3)."""
    collectives = [node for node in graph.nodes if node.op == "call_function" and node.target in COLLECTIVES]
    for collective in reversed(collectives):
        _sink(_wait_of(collective))
    previous_gather_wait: fx.Node | None = None
    for collective in collectives:
        gathers_params = collective.target is functional.all_gather_into_tensor.default and _from_inputs(collective)
        _hoist(collective, not_before=previous_gather_wait if gathers_params else None)
        if gathers_params:
            previous_gather_wait = _wait_of(collective)


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: index for index, node in enumerate(graph.nodes)}


def _sink(node: fx.Node) -> None:
    """Move ``node`` (after the layout ops that use only it) to right before its first user."""
    for user in sorted(node.users, key=_order(node.graph).__getitem__, reverse=True):
        if user.op == "call_function" and user.target in LAYOUT_OPS and _only_input(user) is node:
            _sink(user)
    if not node.users:  # a result the traced form computes but nobody reads
        return
    order = _order(node.graph)
    first_user = min(node.users, key=order.__getitem__)
    if node.next is not first_user:
        first_user.prepend(node)


def _hoist(node: fx.Node, not_before: fx.Node | None) -> None:
    """Move ``node`` (after the layout ops that feed only it) to right after its last input,
    and no earlier than ``not_before``; never later than where it is."""
    for producer in node.all_input_nodes:
        if producer.op == "call_function" and producer.target in LAYOUT_OPS and len(producer.users) == 1:
            _hoist(producer, not_before)
    order = _order(node.graph)
    anchors = [*node.all_input_nodes, *([not_before] if not_before is not None else [])]
    anchor = max(anchors, key=order.__getitem__, default=None)
    if anchor is None:
        anchor = max(node.graph.find_nodes(op="placeholder"), key=order.__getitem__, default=None)
    if anchor is not None and order[anchor] < order[node] and anchor.next is not node:
        anchor.append(node)


def _only_input(node: fx.Node) -> fx.Node | None:
    inputs = node.all_input_nodes
    return inputs[0] if len(inputs) == 1 else None


def _from_inputs(node: fx.Node) -> bool:
    """Whether every tensor ``node`` is computed from is a graph input (through layout ops)."""
    for producer in node.all_input_nodes:
        if producer.op == "placeholder" or producer.op == "get_attr":
            continue
        if producer.op == "call_function" and producer.target in LAYOUT_OPS and _from_inputs(producer):
            continue
        return False
    return True
