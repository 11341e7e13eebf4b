"""The intra-op search: one ILP per mesh axis choosing a :class:`Strategy` per node.

Axes are solved outermost first, each on the local shapes the earlier ones leave. The ILP
(:mod:`ilp`) minimizes the node and edge terms of :mod:`autopar.passes.cost.evaluate`:

- variables: one strategy per node with a tensor output (:func:`candidates`: the sharding
  rules' options, narrowed by what the axis fixes);
- objective: compute + communication + gradient sync of each node's strategy, plus the
  redistribution time on every edge whose producer's output placement differs from what the
  consumer wants;
- constraints: data-like axes (dp, ep, cp) pin user inputs to their batch or sequence dim and
  parameters to replicated (:func:`axis_pins`); the tensor-parallel axis is free but for user
  pins; the memory budget binds on the last sharded axis, where all sharding is known;
  elementwise followers take their producer's placement (:func:`followers`).
"""

from __future__ import annotations

import fnmatch
import math

import numpy as np

from autopar.ir import (
    BATCH_DIMS,
    KERNEL_DIMS,
    Axis,
    HardwareProfile,
    Kernel,
    Placement,
    Replicate,
    Schedule,
    Shard,
    ShardingRuleError,
    parse_placement,
)
from autopar.passes.capture.graph import module_path
from autopar.passes.capture.moe import EXPERTS_OP
from autopar.passes.cost.evaluate import AxisContext, axis_spans, edge_time, edges, node_memory, node_terms
from autopar.passes.cost.facts import NodeFacts, ShardedShapes
from autopar.passes.search.ilp import ChoiceProblem, solve_choices
from autopar.passes.sharding.rules import KERNEL_RULES, MATMULS, node_strategies, pointwise, rule_for
from autopar.passes.sharding.strategies import OpView, Strategy

R = Replicate()
# the tensor dim each data-like axis splits in user inputs (and keeps parameters whole over)
SPLIT_DIM = {Axis.DP: 0, Axis.EP: 0, Axis.CP: 1}


def chunks_per_rank(axis: str) -> int:
    """cp holds a head and a tail chunk of the sequence per rank (which balances causal attention)."""
    return 2 if axis == Axis.CP else 1


def solve_axes(search, degrees: dict[str, int], zero: int, schedule: Schedule) -> dict[str, dict[str, Strategy]]:
    """One ILP per axis, outermost first; the memory budget binds on the last sharded axis
    (the leanest layout when nothing fits, which ``evaluate`` then reports). ``search`` is the
    :class:`~autopar.passes.search.search.SearchContext`."""
    facts, hardware, mesh = search.facts, search.hardware, search.mesh
    axes = list(degrees)
    last_sharded = max((i for i, a in enumerate(axes) if degrees[a] > 1), default=-1)
    experts = expert_params(facts)
    spans = axis_spans(degrees)
    local = ShardedShapes.unsharded(facts)
    strategies: dict[str, dict[str, Strategy]] = {}
    for index, axis in enumerate(axes):
        ctx = AxisContext(
            name=axis,
            size=degrees[axis],
            link=hardware.link(mesh.shape, spans[axis], degrees[axis]),
            pins=axis_pins(facts, axis, degrees[axis], search.options.constraints or {}, experts),
            kernels=kernel_pins(facts, search.options.constraints or {}) if axis in KERNEL_DIMS.values() else {},
            local=local,
            overlap=hardware.overlap,
            bind_memory=index == last_sharded,
            batch=None if axis in BATCH_DIMS else search.batch_dims,
            sequence=None if axis == Axis.CP else search.sequence_dims,
            data_parallel=degrees[Axis.DP],
            zero=zero,
            hardware=hardware,
            contention=hardware.contention(mesh.shape),
            schedule=schedule,
            later=math.prod(degrees[a] for a in axes[index + 1 :]),
        )
        chosen = solve_axis(facts, ctx, search.limit) or solve_axis(facts, ctx, None)
        strategies[axis] = chosen
        local = local.after(chosen, ctx.size)
    return strategies


def axis_pins(facts, axis: str, size: int, constraints, experts: frozenset[str] = frozenset()) -> dict[str, Placement]:
    """What an axis fixes: dp and ep split the inputs' batch dim, cp their sequence dim; all
    three keep parameters whole (but ep the experts' weights, which its kernel may split)."""
    split_dim = SPLIT_DIM.get(axis)
    multiple = chunks_per_rank(axis) * size
    pins = {}
    for name, fact in facts.items():
        if fact.kind == "buffer":
            pins[name] = R
        elif split_dim is not None and fact.kind == "param" and not (axis == Axis.EP and name in experts):
            pins[name] = R
        elif fact.kind == "input":
            shape = fact.out_shape
            splits = split_dim is not None and len(shape) > split_dim and shape[split_dim] % multiple == 0
            pins[name] = Shard(split_dim) if splits and size > 1 else R
    if axis == Axis.TP:
        pins.update(_constraint_pins(facts, constraints))
    return pins


def kernel_pins(facts, constraints) -> dict[str, str]:
    """Nodes pinned to a parallel kernel: ``{"layers.*.attn": "ring"}`` (by :func:`module_name`)."""
    pins = {}
    for pattern, value in constraints.items():
        if value in KERNEL_DIMS:
            matched = [
                n for n, f in facts.items() if f.kind == "op" and fnmatch.fnmatchcase(module_name(f.node), pattern)
            ]
            pins.update({name: value for name in matched if _has_kernel(facts[name], value)})
            if not any(_has_kernel(facts[name], value) for name in matched):
                raise ShardingRuleError(
                    f"constraint {pattern!r}: {value!r} pins a kernel, but no op of a module matching it has one"
                )
    return pins


def module_name(node) -> str:
    """The module a constraint pattern matches a node by: its module path, or ``"<top>"`` for
    the model's own forward (where a loss is usually computed), as plans print it."""
    return module_path(node) or "<top>"


def _has_kernel(fact: NodeFacts, kernel: str) -> bool:
    return rule_for(fact.node.target) in KERNEL_RULES[kernel]


def _constraint_pins(facts, constraints) -> dict[str, Placement]:
    pins = {}
    for pattern, value in constraints.items():
        if value in KERNEL_DIMS:
            continue
        placement = parse_placement(value) if isinstance(value, str) else value
        matched = [
            name
            for name, f in facts.items()
            if (f.kind == "param" and fnmatch.fnmatchcase(f.name, pattern))
            or (f.kind == "op" and f.out_shapes and fnmatch.fnmatchcase(module_name(f.node), pattern))
        ]
        if not matched:
            raise ShardingRuleError(f"constraint {pattern!r} matches no parameter and no module: check the name")
        for name in matched:
            pins[name] = _pinned(facts[name], pattern, placement)
    return pins


def _pinned(fact: NodeFacts, pattern: str, placement: Placement) -> Placement:
    """The pin with a negative dim counted from the end; a dim the tensor does not have is the user's mistake."""
    if not isinstance(placement, Shard):
        return placement
    shape = fact.out_shape
    if not -len(shape) <= placement.dim < len(shape):
        raise ShardingRuleError(
            f"constraint {pattern!r}={placement}: {_named(fact)} has {len(shape)} dims (shape {list(shape)}), so "
            f"S(d) needs {-len(shape)} <= d < {len(shape)}: pin a dim it has, e.g. S(-1) for its last"
        )
    return Shard(placement.dim % len(shape))


def expert_params(facts) -> frozenset[str]:
    """Parameters that feed an experts op's expert weights (every slot after the router's)."""
    return frozenset(
        slot.name
        for f in facts.values()
        if f.kind == "op" and str(f.node.target).startswith(EXPERTS_OP)
        for slot in f.slots[2:]
        if facts[slot.name].kind == "param"
    )


def _on_axis(strategy: Strategy, view: OpView, ctx: AxisContext) -> bool:
    """Kernels run only on their own axis; on cp every split dim holds 2·p chunks, and
    Ulysses needs the heads left after later axes to split again."""
    if strategy.kernel and KERNEL_DIMS[strategy.kernel] != ctx.name:
        return False
    if strategy.kernel == Kernel.ULYSSES and view.in_shapes[0][1] % (ctx.size * ctx.later):
        return False
    if ctx.name != Axis.CP:
        return True
    shapes = list(view.in_shapes) + [view.out_shape]
    placements = list(strategy.inputs) + [strategy.output]
    multiple = chunks_per_rank(ctx.name) * ctx.size
    return all(not isinstance(p, Shard) or shape[p.dim] % multiple == 0 for p, shape in zip(placements, shapes))


def candidates(fact: NodeFacts, ctx: AxisContext) -> list[Strategy]:
    """A node's strategies on this axis: the rule's options that the axis allows, pins applied."""
    name = fact.node.name
    if fact.kind in ("param", "buffer", "input"):
        shape = ctx.local.shapes[name][0]
        multiple = chunks_per_rank(ctx.name) * ctx.size
        options = [Strategy((), R)] + [
            Strategy((), Shard(d)) for d in range(len(shape)) if ctx.size > 1 and shape[d] % multiple == 0
        ]
    else:
        shapes = ctx.local.shapes[name]
        view = OpView(fact.node, tuple(ctx.local.slot_shapes[name]), shapes[0] if shapes else ())
        options, _ = node_strategies(view, ctx.size)
        options = [s for s in options if _on_axis(s, view, ctx)]
    if ctx.batch and name in ctx.batch:
        options = [s for s in options if not _shards_batch(s, ctx.batch[name])] or options[:1]
    if ctx.sequence and name in ctx.sequence and rule_for(fact.node.target) in MATMULS:
        # only cp runs matmuls on a split sequence; other axes split weights (or, as Megatron's
        # sequence parallelism, the sequence only between matmuls)
        options = [s for s in options if not _shards_batch(s, ctx.sequence[name])] or options[:1]
    if name in ctx.kernels and ctx.name == KERNEL_DIMS[ctx.kernels[name]]:
        options = [s for s in options if s.kernel == ctx.kernels[name]] or _no_kernel(fact, ctx)
    if name in ctx.pins:
        pinned = [s for s in options if s.output == ctx.pins[name]]
        if not pinned:
            pin, shape = ctx.pins[name], ctx.local.shapes[name][0] if ctx.local.shapes[name] else ()
            multiple = chunks_per_rank(ctx.name) * ctx.size
            why = (
                f" (dim {pin.dim} has size {shape[pin.dim]} here, which {ctx.name}={ctx.size} does not split evenly)"
                if isinstance(pin, Shard) and pin.dim < len(shape) and shape[pin.dim] % multiple
                else ""
            )
            raise ShardingRuleError(
                f"{_named(fact)} cannot be placed {pin} on axis {ctx.name!r}{why}: its candidates are "
                f"{[str(s.output) for s in options]}. Change the constraint or the degrees."
            )
        options = pinned
    return options


def _named(fact: NodeFacts) -> str:
    """A node as a user knows it: a parameter by name, an op by its node and module."""
    if fact.kind == "param":
        return f"parameter {fact.name!r}"
    return f"node {fact.node.format_node()} (module {module_name(fact.node)!r})"


def _no_kernel(fact: NodeFacts, ctx: AxisContext):
    raise ShardingRuleError(
        f"node {fact.node.format_node()} (module {module_name(fact.node)!r}) cannot run as the "
        f"{ctx.kernels[fact.node.name]!r} kernel on axis {ctx.name!r} of size {ctx.size}: its shapes do not split "
        "that way (Ulysses needs the heads to split over the axis too; vocab, the vocabulary, without class weights). "
        "Pin the other kernel or change the degrees."
    )


def split_dims(
    facts, hardware: HardwareProfile, axis: str, batch: dict[str, Strategy] | None = None
) -> dict[str, Strategy]:
    """Where the batch (axis "dp") or sequence (axis "cp", never splitting the ``batch`` dim)
    dim of every tensor is: that axis's solution on a virtual axis where gradient sync is
    free (hidden), so the dim stays split wherever it can. Where that solution chunks a weight
    instead (an output projection by columns, when the sequence cannot pass the logits' flatten)
    the node's split is the weight's, neither dim: such nodes are left out."""
    dim, multiple = SPLIT_DIM[axis], chunks_per_rank(axis)
    sizes = [f.out_shape[dim] for f in facts.values() if f.kind == "input" and len(f.out_shape) > dim]
    size = next((k for k in range(2, (sizes[0] if sizes else 1) + 1) if sizes[0] % (k * multiple) == 0), 1)
    if size == 1:
        return {}
    ctx = AxisContext(
        name=axis,
        size=size,
        link=hardware.links[0],
        pins=axis_pins(facts, axis, size, {}),
        local=ShardedShapes.unsharded(facts),
        overlap=1.0,
        batch=batch,
    )
    chosen = solve_axis(facts, ctx, None)
    return {name: s for name, s in chosen.items() if not _splits_a_weight(facts[name], s, facts)}


def _splits_a_weight(fact: NodeFacts, strategy: Strategy, facts) -> bool:
    return any(
        isinstance(placement, Shard) and facts[slot.name].kind == "param"
        for slot, placement in zip(fact.slots, strategy.inputs)
    )


def _shards_batch(strategy: Strategy, batch: Strategy) -> bool:
    """Whether a strategy splits a tensor along the dim the batch runs along."""
    pairs = list(zip(strategy.inputs, batch.inputs)) + [(strategy.output, batch.output)]
    return any(isinstance(mine, Shard) and mine == theirs for mine, theirs in pairs)


def solve_axis(facts, ctx: AxisContext, limit) -> dict[str, Strategy] | None:
    """The ILP of one axis (see the module docstring); None when ``limit`` cannot be met."""
    names = [n for n, f in facts.items() if f.kind != "output" and f.out_shapes]
    index = {n: i for i, n in enumerate(names)}
    options = {n: candidates(facts[n], ctx) for n in names}
    unary = [np.array([sum(node_terms(facts[n], s, ctx, facts)) for s in options[n]]) for n in names]
    memory = [np.array([node_memory(facts[n], s, ctx) for s in options[n]]) for n in names]
    pairs = []
    for producer, consumer, slot_index, shape in edges(facts, ctx):
        if facts[consumer].kind == "output":
            wanted = [R]
        elif consumer in index:
            wanted = [s.inputs[slot_index] for s in options[consumer]]
        else:
            continue
        matrix = np.array(
            [[edge_time(facts[producer], s.output, dst, shape, ctx) for dst in wanted] for s in options[producer]]
        )
        if facts[consumer].kind == "output":
            unary[index[producer]] = unary[index[producer]] + matrix[:, 0]
        else:
            pairs.append((index[producer], index[consumer], matrix))
    problem = ChoiceProblem(
        unary,
        pairs,
        memory if ctx.bind_memory else None,
        limit if ctx.bind_memory else None,
        followers(facts, options, index),
    )
    solution = solve_choices(problem)
    if solution is None:
        return None
    return {n: options[n][solution.choice[index[n]]] for n in names}


def followers(facts, options, index) -> dict[int, tuple[int, list[int]]]:
    """Elementwise ops with one tensor input follow their producer: for each of its options,
    the candidate that takes its output as it is (Alpa's merge of followers)."""
    out = {}
    for name, i in index.items():
        fact = facts[name]
        if fact.kind != "op" or len(fact.slots) != 1 or rule_for(fact.node.target) is not pointwise:
            continue
        leader = fact.slots[0].name
        if leader not in index:
            continue
        tie = [
            next((t for t, s in enumerate(options[name]) if s.inputs[0] == lead.output), None)
            for lead in options[leader]
        ]
        if None not in tie:
            out[i] = (index[leader], tie)
    return out
