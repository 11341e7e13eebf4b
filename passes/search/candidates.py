"""Each node's candidate strategies on one mesh axis: the sharding rules' options that the axis
allows (kernels on their own axis, context parallelism's chunks, Ulysses' heads), narrowed by
what the axis fixes (batch and sequence dims on the axes that do not split them, kernel and
user pins), and kept per local shapes for the search's many layouts (:func:`all_candidates`).
"""

from __future__ import annotations

from autopar.ir import KERNEL_DIMS, Axis, Kernel, Shard, ShardingRuleError
from autopar.passes.cost.axis_terms import AxisContext
from autopar.passes.cost.facts import NodeFacts
from autopar.passes.search.pins import SPLIT_DIM, R, _named, chunks_per_rank, module_name
from autopar.passes.sharding.rules import MATMULS, attention, node_strategies, rule_for
from autopar.passes.sharding.strategies import OpView, Strategy


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
        if ctx.tracking and rule_for(fact.node.target) is attention:
            # attention splits its heads as cheaply, but the heads are not the dim being followed: a
            # sequence map through them would keep the tensor-parallel axis from splitting heads
            options = [s for s in options if s.output == R or _follows(s, ctx.name)]
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


def _follows(strategy: Strategy, axis: str) -> bool:
    """Whether an attention strategy splits the dim ``axis`` follows: the batch (dim 0), or the
    sequence, which only the context-parallel kernels split."""
    return bool(strategy.kernel) if axis == Axis.CP else strategy.output == Shard(SPLIT_DIM[axis])


def _no_kernel(fact: NodeFacts, ctx: AxisContext):
    raise ShardingRuleError(
        f"node {fact.node.format_node()} (module {module_name(fact.node)!r}) cannot run as the "
        f"{ctx.kernels[fact.node.name]!r} kernel on axis {ctx.name!r} of size {ctx.size}: its shapes do not split "
        "that way (Ulysses needs the heads to split over the axis too; vocab, the vocabulary, without class weights). "
        "Pin the other kernel or change the degrees."
    )


def _shards_batch(strategy: Strategy, batch: Strategy) -> bool:
    """Whether a strategy splits a tensor along the dim the batch runs along."""
    pairs = list(zip(strategy.inputs, batch.inputs)) + [(strategy.output, batch.output)]
    return any(isinstance(mine, Shard) and mine == theirs for mine, theirs in pairs)


def all_candidates(facts, ctx: AxisContext, reps: list[str], memo: dict | None, twin: dict[str, str]):
    """Each variable's candidates, kept in ``memo`` per local shapes (which the memo holds: their id stays theirs)."""
    key = ("candidates", id(ctx.local), ctx.name, ctx.size, ctx.later)
    if memo is not None and key in memo:
        return memo[key]
    found = {rep: _candidates(facts[rep], ctx, memo, twin.get(rep, rep)) for rep in reps}
    if memo is not None:
        memo[key] = found
    return found


def _candidates(fact: NodeFacts, ctx: AxisContext, memo: dict | None, twin: str | None = None) -> list[Strategy]:
    if memo is None:
        return candidates(fact, ctx)
    name = fact.node.name
    shapes = (tuple(ctx.local.slot_shapes[name]), tuple(ctx.local.shapes[name]))
    key = (twin or name, ctx.name, ctx.size, ctx.later, *shapes)
    if key not in memo:
        memo[key] = candidates(fact, ctx)
    return memo[key]
