"""Rewrite: a captured graph + a Plan → the program one rank runs, on local shards.

Pre: ``captured`` is the graph the plan was made for (same fingerprint); the runtime's
collective ops (``torch.ops.autopar.*``) are registered.
Post: a GraphModule with the same placeholders, taking each parameter's, buffer's and
input's LOCAL shard, in which
- every edge whose producer's placement differs from what its consumer needs carries the
  redistribution (per mesh axis: chunk, all-gather, all-reduce, reduce-scatter, all-to-all,
  keep-on-first), each an autograd op whose backward is the dual, one per value, destination
  and layer however many consumers take it;
- partial gradients are completed where :mod:`gradients` says (Megatron's f, fused into the
  all-gather when the input was just gathered: sequence parallelism's reduce-scatter), and
  left to the runtime's bucketed gradient sync for the parameters in ``plan.grad_sync``;
- shape arguments of views are local, and every device an op names is the runtime's;
- a mean loss over targets split on an axis (its output ``P(avg)`` there) divides its sum by
  the global count of targets not ignored (over the shards, divided by their number, counted
  first thing in forward where the targets are an input): the shards' average is then the
  mean over the whole batch however ignored targets fall;
- under ZeRO-3 (``plan.zero == 3``) a parameter split over dp (``autopar.ir.zero``) arrives
  as its dp chunk and is gathered (``torch.ops.autopar.zero_gather``) once, right before its
  first use, so the whole weight lives from its first use to its last (the runtime batches
  these gathers per layer and prefetches them); the gather's backward reduce-scatters the
  gradient.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.ir import (
    DATA_SIZED,
    KERNEL_DIMS,
    LOSS_COUNT,
    OP_NAMESPACE,
    Axis,
    InvalidPlanError,
    Kernel,
    Partial,
    Placement,
    Plan,
    Replicate,
    Shard,
    StalePlanError,
)
from autopar.ir.zero import zero_shard_dim
from autopar.passes.capture.graph import CapturedGraph
from autopar.passes.cost.facts import move_scope
from autopar.passes.rewrite.gradients import plan_gradients
from autopar.passes.runner import at_node
from autopar.passes.sharding.factories import SIZE_ARGUMENT as FACTORY_SIZES
from autopar.passes.sharding.strategies import tensor_inputs

aten = torch.ops.aten
R = Replicate()
# Ops whose argument i is the output shape (or sizes derived from it): views and sized factories.
SIZE_ARGUMENT = {**dict.fromkeys([aten.view, aten.reshape, aten._unsafe_view, aten.expand], 1), **FACTORY_SIZES}
# Ops whose arguments fix the output shape otherwise: on a shard they become a reshape to the local
# shape (unflatten's sizes are the whole dim's; squeeze(d) would drop a dim a shard has made 1).
RESHAPE_OPS = {aten.unflatten, aten.squeeze}
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.squeeze, aten.unsqueeze}
_MEAN_LOSSES = {"aten.cross_entropy_loss", "aten.nll_loss", f"{OP_NAMESPACE}.vocab_cross_entropy"}  # by op name


def rewrite(
    captured: CapturedGraph, plan: Plan, *, groups: dict[str, str], device: torch.device | str
) -> fx.GraphModule:
    """Produce the per-rank program (see the module docstring).

    ``groups`` maps each parallel dimension to the c10d group name its collectives use; for an
    export without process groups, pass the dimension names themselves.
    """
    check_plan(captured, plan)
    graph = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(captured.graph, value_map)
    graph.output(output)
    by_name = {node.name: node for node in graph.nodes}
    placements = _producer_placements(captured, plan, by_name)
    axes = tuple(plan.degrees)
    builder = _Collectives(graph, groups, axes, plan.degrees)
    gradients = plan_gradients(captured.graph, plan, captured.params, captured.user_inputs)
    if {captured.params[n]: a for n, a in gradients.synced_params.items()} != plan.grad_sync:
        raise StalePlanError("the plan's gradient sync does not match its placements: re-run autopar.plan")

    for node in list(graph.nodes):
        decision = plan.nodes.get(node.name)
        if decision is None:
            on_device(node, device)  # a decided node's arguments are localized, its devices with them
            continue
        with at_node(node):
            _rewrite_node(node, decision, plan, placements, builder, gradients, device)
    _exact_split_means(graph, plan, groups)
    if plan.zero == 3:
        _gather_zero3_params(graph, captured, plan, groups)
    _views_to_reshapes(graph)
    graph.eliminate_dead_code()
    graph.lint()
    return fx.GraphModule(captured.graph_module, graph)


def check_plan(captured: CapturedGraph, plan: Plan) -> None:
    """The plan was made for this graph and its placements fit the tensors they place: every
    parameter placed, each ``S(d)`` a dim the tensor has and whose size the degrees split evenly.
    A plan file edited by hand fails here (:class:`InvalidPlanError`) instead of inside a rank.

    >>> check_plan(capture(model, inputs), Plan.load("plan.json"))   # doctest: +SKIP
    """
    if captured.fingerprint != plan.fingerprint:
        raise StalePlanError(
            f"the plan was made for graph {plan.fingerprint}, but the model now captures as {captured.fingerprint}: "
            "the model, its inputs' shapes or autopar changed since. Re-run autopar.plan."
        )
    params = set(captured.params.values())
    if set(plan.params) != params:
        raise InvalidPlanError(
            f"the plan places parameters {sorted(set(plan.params) - params)} the model lacks and leaves out "
            f"{sorted(params - set(plan.params))}: re-run autopar.plan for this model"
        )
    for node in captured.graph.nodes:
        if node.name in captured.params:
            what, placements = f"parameter {captured.params[node.name]!r}", plan.params[captured.params[node.name]]
        elif node.name in captured.user_inputs:
            what, placements = f"input {node.name!r}", plan.inputs.get(node.name)
        elif node.name in plan.nodes:
            what, placements = f"node {node.name!r}", plan.nodes[node.name].output
        else:
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and placements is not None:
            _check_placements(what, tuple(value.shape), placements, plan.degrees)


def _check_placements(what: str, shape: tuple[int, ...], placements, degrees: dict[str, int]) -> None:
    splits = [1] * len(shape)
    for placement, (axis, size) in zip(placements, degrees.items()):
        if not isinstance(placement, Shard):
            continue
        if not 0 <= placement.dim < len(shape):
            raise InvalidPlanError(
                f"the plan places {what} (shape {list(shape)}) {placement} on {axis!r}, a dim it does not have: "
                "fix the plan file or re-run autopar.plan"
            )
        splits[placement.dim] *= size
    for dim, split in enumerate(splits):
        if shape[dim] % split:
            raise InvalidPlanError(
                f"the plan splits dim {dim} of {what} (shape {list(shape)}) into {split} pieces, which do not divide "
                f"{shape[dim]}: fix the plan file or re-run autopar.plan"
            )


def _views_to_reshapes(graph: fx.Graph) -> None:
    """Export writes ``view`` where the traced tensor's strides allowed one, e.g. after the
    transpose of fused attention's output, which is laid out [b, s, h, d]. A collective or a
    parallel kernel returns contiguous tensors, where the same view may be impossible; the graph
    is functional, so ``reshape`` (a view when it can be, a copy when not) means the same."""
    for node in graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default


def _gather_zero3_params(graph: fx.Graph, captured: CapturedGraph, plan: Plan, groups: dict[str, str]) -> None:
    """ZeRO-3: one gather of the dp chunks of each split parameter, before its first use (one
    per parameter, so the runtime can gather a layer's parameters in one collective, as FSDP2)."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.name not in captured.params or not node.users:
            continue
        name = captured.params[node.name]
        dim = zero_shard_dim(plan, name, node.meta["val"].shape)
        if dim is None:
            continue
        reduce_grad = Axis.DP in plan.grad_sync.get(name, ())  # else every dp rank has the whole gradient
        users = list(node.users)
        with graph.inserting_before(min(users, key=position.__getitem__)):
            gathered = graph.call_function(
                torch.ops.autopar.zero_gather.default, (node, groups[Axis.DP], dim, reduce_grad)
            )
        for user in users:
            user.replace_input_with(node, gathered)


def _rewrite_node(node, decision, plan, placements, builder, gradients, device) -> None:
    """Bring the node's inputs where its strategy needs them; make its arguments local."""
    axes = tuple(plan.degrees)
    graph = node.graph
    slots = tensor_inputs(node)
    if len(slots) != len(decision.inputs):
        raise StalePlanError(
            f"plan entry for {node.format_node()} has {len(decision.inputs)} inputs, the graph {len(slots)}"
        )
    new_inputs = []
    for index, (slot, wanted) in enumerate(zip(slots, decision.inputs)):
        partial_grad = {axis for axis in axes if (node.name, index, axis) in gradients.completed_edges}
        if node.target is operator.getitem:
            _move_taken(node, placements[slot.name], wanted, partial_grad, placements, builder)
            return
        with graph.inserting_before(node):
            new_inputs.append(builder.redistribute(slot, placements[slot.name], wanted, partial_grad, move_scope(node)))
    _replace_inputs(node, slots, new_inputs)
    if decision.kernel:
        _use_kernel(node, decision.kernel, builder.groups[KERNEL_DIMS[decision.kernel]])
    localize_arguments(node, decision.output, plan.degrees, device)
    if decision.output is not None:
        placements[node.name] = decision.output


def _move_taken(node: fx.Node, src, wanted, partial_grad: set[str], placements: dict, builder: _Collectives) -> None:
    """``getitem`` of a multi-output op (a split's pieces): no collective moves a tuple, so the
    piece is moved once taken, to ``wanted``, which getitem's rule also makes its output; the
    cost model prices the edge by the piece's shape, so this is the move it priced."""
    placements[node.name] = src
    if src == wanted and not partial_grad:
        return
    users = list(node.users)
    with node.graph.inserting_before(node.next):  # after it, in order: a move may be several ops
        moved = builder.redistribute(node, src, wanted, partial_grad, move_scope(node))
    moved.meta["val"] = node.meta["val"]  # its users still see a tensor input (the global value's, as every node)
    for user in users:
        user.replace_input_with(node, moved)
    placements[moved.name] = wanted


def _use_kernel(node: fx.Node, kernel: str, group: str) -> None:
    """Run the node as its parallel kernel over ``group`` (see autopar.runtime.kernels.context_parallel
    and expert_parallel): attention on a split sequence, or experts split over ranks."""
    if kernel in (Kernel.RING, Kernel.ULYSSES):
        q, k, v = node.args[:3]
        causal = _arg(node, 5, "is_causal", False)
        scale = _arg(node, 6, "scale", None)
        node.target = getattr(torch.ops.autopar, f"{kernel}_attention").default
        node.args, node.kwargs = (q, k, v, group, causal, scale), {}
    elif kernel == Kernel.EXPERTS:
        node.args = (*node.args[:-1], group)  # the experts op's last argument: its process group
    elif kernel == Kernel.VOCAB and node.target.overloadpacket is aten.embedding:
        weight, indices, padding_idx = *node.args[:2], _arg(node, 2, "padding_idx", -1)
        node.target = torch.ops.autopar.vocab_embedding.default
        node.args, node.kwargs = (weight, indices, group, padding_idx), {}
    elif kernel == Kernel.VOCAB:  # the cross-entropy over split classes, same arguments and the group
        args = _loss_args(node)
        node.target = torch.ops.autopar.vocab_cross_entropy.default
        node.args, node.kwargs = (*args, group), {}
    else:
        raise StalePlanError(f"unknown kernel {kernel!r} for node {node.name}: re-run autopar.plan")


def _arg(node: fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


# (input, target, then these) of aten.cross_entropy_loss, aten.nll_loss and autopar::vocab_cross_entropy
_LOSS_OPTIONS = (("weight", None), ("reduction", 1), ("ignore_index", -100), ("label_smoothing", 0.0))
_MEAN = 1  # at::Reduction::Mean


def _loss_args(node: fx.Node) -> list:
    """A loss node's arguments in full, defaults filled in (nll_loss takes no label smoothing)."""
    options = _LOSS_OPTIONS[:3] if node.target.overloadpacket is aten.nll_loss else _LOSS_OPTIONS
    return [*node.args[:2]] + [_arg(node, 2 + i, name, default) for i, (name, default) in enumerate(options)]


def _exact_split_means(graph: fx.Graph, plan: Plan, groups: dict[str, str]) -> None:
    """A mean loss whose targets are split over axes (its output ``P(avg)`` on them) sums its
    shard and divides by C / n: C the targets counted over the n shards (``all_reduce`` avg of
    each shard's count, axis by axis), so the shards' average Σ sum / C is the global mean even
    where shards hold different numbers of ignored targets (Megatron's per-token loss). Class
    weights count as constants here: the count uses them detached. Over microbatches the loss
    divides by its count too, split or not: the count is marked (:data:`LOSS_COUNT`) for the
    runtime to weigh each microbatch's mean by its share of the step's targets
    (:func:`autopar.passes.rewrite.loss.loss_count`), the step's loss their global mean."""
    axes = tuple(plan.degrees)
    for node in list(graph.nodes):
        decision = plan.nodes.get(node.name)
        packet = getattr(node.target, "overloadpacket", None)
        if decision is None or decision.output is None or str(packet) not in _MEAN_LOSSES:
            continue
        args = _loss_args(node)
        split = [a for a, p in zip(axes, decision.output) if p == Partial("avg") and plan.degrees[a] > 1]
        if args[3] != _MEAN or not (split or plan.schedule.microbatches > 1):
            continue
        target, weight, ignore_index = _view_root(args[1]), args[2], args[4]
        node.args, node.kwargs = (*args[:3], 2, *args[4:], *node.args[len(args) :]), {}  # sum, then divide
        early = target.op == "placeholder" and (weight is None or weight.op == "placeholder")
        with graph.inserting_before(_first_op(graph) if early else node):
            counted = graph.call_function(aten.ne.Scalar, (target, ignore_index))
            if weight is not None:
                index = graph.call_function(aten.where.ScalarOther, (counted, target, 0))
                weights = graph.call_function(
                    aten.index.Tensor, (graph.call_function(aten.detach.default, (weight,)), [index])
                )
                counted = graph.call_function(aten.mul.Tensor, (weights, counted))
            count = graph.call_function(aten.sum.default, (counted,), {"dtype": torch.float32})  # exact to 2^24
            for axis in split:
                count = graph.call_function(torch.ops.autopar.all_reduce.default, (count, groups[axis], "avg"))
        count.meta[LOSS_COUNT] = True
        with graph.inserting_before(node.next):
            mean = divided = graph.call_function(aten.div.Tensor, (node, count))
            if node.meta["val"].dtype != torch.float32:
                mean = graph.call_function(aten._to_copy.default, (divided,), {"dtype": node.meta["val"].dtype})
        mean.meta = dict(node.meta)
        node.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not divided)


def _view_root(value: fx.Node) -> fx.Node:
    """The value a chain of views reads (the same elements), e.g. the labels placeholder behind
    their flattened view: counting targets there, first thing in forward, the count's all-reduce
    meets ranks still aligned by the last step's gradient sync, as torchtitan counts tokens
    before the step, not at the end of forward."""
    while value.op == "call_function" and getattr(value.target, "overloadpacket", None) in _VIEWS:
        value = value.args[0]
    return value


def _first_op(graph: fx.Graph) -> fx.Node:
    return next(node for node in graph.nodes if node.op != "placeholder")


def _producer_placements(captured: CapturedGraph, plan: Plan, by_name) -> dict[str, tuple[Placement, ...]]:
    axes_r = tuple(R for _ in plan.degrees)
    placements = {}
    for name in by_name:
        if name in captured.params:
            placements[name] = plan.params[captured.params[name]]
        elif name in captured.user_inputs:
            placements[name] = plan.inputs[name]
        elif name in captured.buffers:
            placements[name] = axes_r
    return placements


def _replace_inputs(node: fx.Node, slots: list[fx.Node], new_inputs: list[fx.Node]) -> None:
    """Swap the k-th tensor input for its redistributed value (the same node may fill two slots)."""
    queue = list(zip(slots, new_inputs))

    def swap(arg):
        if queue and isinstance(arg, fx.Node) and arg is queue[0][0]:
            return queue.pop(0)[1]
        return arg

    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat, spec = tree_flatten((node.args, node.kwargs))
    flat = [swap(a) for a in flat]
    node.args, node.kwargs = tree_unflatten(flat, spec)


def on_device(node: fx.Node, device: torch.device | str) -> None:
    """Every device ``node`` names becomes ``device``: the graph names the one it was captured on
    (in factories, copies and torch.export's ``_assert_tensor_metadata``), and the two-argument
    form captures its planning call on the CPU whatever the ranks run on. An assertion compares
    devices exactly, so ``cuda`` becomes the current one (``cuda:0``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    swap = lambda value: device if isinstance(value, torch.device) else value  # noqa: E731
    node.args, node.kwargs = fx.node.map_aggregate(node.args, swap), fx.node.map_aggregate(node.kwargs, swap)


def localize_arguments(node: fx.Node, output: tuple[Placement, ...] | None, degrees: dict[str, int], device) -> None:
    """Shape arguments become the local shape; factory ops build on the runtime device.

    What a node's arguments are on one rank once its output is laid out as ``output`` (one
    placement per axis of ``degrees``); the rule validation (tests/helpers/rule_check.py) runs
    each op per shard through this same function. Example: ``view(x, [8, 64])`` with output
    ``(S(0),)`` on 2 ranks becomes ``view(x, [4, 64])``."""
    on_device(node, device)
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in SIZE_ARGUMENT.keys() | RESHAPE_OPS or output is None or node.meta.get(DATA_SIZED):
        return  # a size the data decides stays the node computing it
    val = node.meta.get("val")
    shape = list(val.shape)
    for placement, size in zip(output, degrees.values()):
        if isinstance(placement, Shard):
            shape[placement.dim] //= size
    if packet in RESHAPE_OPS:
        if shape != list(val.shape):
            node.target, node.args, node.kwargs = torch.ops.aten.reshape.default, (node.args[0], shape), {}
        return
    at = SIZE_ARGUMENT[packet]
    node.args = (*node.args[:at], shape, *node.args[at + 1 :])


class _Collectives:
    """Emits the collective nodes that move a value from one placement to another."""

    def __init__(self, graph: fx.Graph, groups: dict[str, str], axes: tuple[str, ...], degrees: dict[str, int]):
        self.graph, self.groups, self.axes, self.degrees = graph, groups, axes, degrees
        self.emitted: dict[tuple, fx.Node] = {}

    def redistribute(
        self, value: fx.Node, src: tuple[Placement, ...], dst: tuple[Placement, ...], partial_grad: set[str], scope: str
    ) -> fx.Node:
        """``value`` moved from ``src`` to ``dst``, completing its gradient on the axes in
        ``partial_grad``. Consumers with the same ``scope`` (:func:`autopar.passes.cost.facts.move_scope`) share
        one move: q, k and v take one gather of a sequence-parallel norm's output, and backward
        sums their gradients before its reduce-scatter, which is linear."""
        if src == dst and not partial_grad:
            return value
        key = (value, src, dst, frozenset(partial_grad), scope)
        if key not in self.emitted:
            self.emitted[key] = self._move(value, src, dst, partial_grad)
        return self.emitted[key]

    def _move(
        self, value: fx.Node, src: tuple[Placement, ...], dst: tuple[Placement, ...], partial_grad: set[str]
    ) -> fx.Node:
        current = list(src)
        # Un-shard inner axes first and shard outer axes first: chunk k of a dim sharded over
        # (dp, tp) is dp-chunk-major, as in DTensor.
        order = [i for i in reversed(range(len(self.axes))) if isinstance(src[i], Shard)]
        order += [i for i in range(len(self.axes)) if i not in order]
        for i in order:
            axis = self.axes[i]
            if self.degrees[axis] == 1:
                continue
            value = self._one_axis(value, current[i], dst[i], axis, axis in partial_grad)
            current[i] = dst[i]
        return value

    def _op(self, name: str, *args) -> fx.Node:
        return self.graph.call_function(getattr(torch.ops.autopar, name).default, args)

    def _one_axis(self, value, src: Placement, dst: Placement, axis: str, partial_grad: bool) -> fx.Node:
        group = self.groups[axis]
        if src == dst:
            return self._op("grad_all_reduce", value, group) if partial_grad else value
        if axis == Axis.CP and (isinstance(src, Shard) or isinstance(dst, Shard)):
            return self._zigzag_axis(value, src, dst, axis, partial_grad)
        if isinstance(src, Shard) and isinstance(dst, Replicate):
            return self._op("all_gather", value, group, src.dim, partial_grad)
        if isinstance(src, Partial) and isinstance(dst, Replicate):
            value = self._op("all_reduce", value, group, src.reduce_op)
        elif isinstance(src, Partial) and isinstance(dst, Shard):
            value = self._op("reduce_scatter", value, group, dst.dim, src.reduce_op)
        elif isinstance(src, Replicate) and isinstance(dst, Shard):
            value = self._op("chunk", value, group, dst.dim)
        elif isinstance(src, Replicate) and dst == Partial("sum"):
            value = self._op("keep_on_first", value, group)
        elif isinstance(src, Shard) and isinstance(dst, Shard):
            value = self._op("all_to_all", value, group, dst.dim, src.dim)
        else:
            raise AssertionError(f"no redistribution from {src} to {dst} on axis {axis}")
        if partial_grad and isinstance(dst, Replicate):
            value = self._op("grad_all_reduce", value, group)
        return value

    def _zigzag_axis(self, value, src: Placement, dst: Placement, axis: str, partial_grad: bool) -> fx.Node:
        """On cp a shard is a head and a tail chunk (:mod:`autopar.runtime.kernels.zigzag`): permute
        into rank order before chunking and back after gathering; a shard moves to another
        dim by way of the whole tensor."""
        group = self.groups[axis]
        if isinstance(src, Shard):
            value = self._op("all_gather", value, group, src.dim, partial_grad and isinstance(dst, Replicate))
            value = self._op("zigzag", value, group, src.dim, True)
            if isinstance(dst, Replicate):
                return value
            src = R
        value = self._op("zigzag", value, group, dst.dim, False)
        if isinstance(src, Partial):
            return self._op("reduce_scatter", value, group, dst.dim, src.reduce_op)
        return self._op("chunk", value, group, dst.dim)
