"""The cost terms of node strategies on one mesh axis, and what one solved axis moves.

The ILP of :mod:`autopar.passes.search.axes` minimizes the per-node and per-edge terms defined
here, one mesh axis at a time; :func:`traffic` sums the same terms over one solved axis for
:mod:`autopar.passes.cost.evaluate`, which prices the whole configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.ir import (
    Axis,
    HardwareProfile,
    LinkTier,
    Partial,
    Placement,
    Replicate,
    Schedule,
    Shard,
)
from autopar.passes.cost.collectives import collective_time, reshard_time
from autopar.passes.cost.facts import NodeFacts, ShardedShapes, activation_bytes, transient_bytes
from autopar.passes.cost.kernels import kernel_time
from autopar.passes.cost.ops import accumulation_s, maximum, minimum, param_state_bytes, state_update_s
from autopar.passes.cost.replay import CompiledStep
from autopar.passes.cost.schedule import kept_share, output_held
from autopar.passes.cost.zero_traffic import param_sync, recompute_gathers_s, zero3_layer_s
from autopar.passes.rewrite.async_tp import LINEAR, ROW_SUM
from autopar.passes.sharding.strategies import Strategy, local_shape, numel, work_fraction

R = Replicate()
# cost of a redistribution that cannot be done; never chosen when avoidable. The ILP reads any cost at or
# above it as such a move (ilp._solve): moves are capped there, and no op of a step runs that long.
IMPOSSIBLE_S = 1e3


@dataclass
class AxisContext:
    name: str
    size: int
    link: LinkTier
    pins: dict[str, Placement]
    local: ShardedShapes  # before this axis
    overlap: float  # share of gradient sync that leaves the step behind backward (HardwareProfile.hidden)
    bind_memory: bool = False
    batch: dict[str, Strategy] | None = None  # node → its batch-dim sharding; never used on this axis
    sequence: dict[str, Strategy] | None = None  # node → its sequence-dim sharding; matmuls never split it here
    data_parallel: int = 1  # the dp degree, over which ZeRO shards model state
    zero: int = 0
    hardware: HardwareProfile | None = None
    contention: float = 1.0
    schedule: Schedule = Schedule()
    later: int = 1  # devices the axes after this one split each of its shards into
    kernels: dict[str, str] = field(default_factory=dict)  # node → the parallel kernel pinned for it
    linear_overlap: bool = True  # the ILP's linear prices: overlap as a flat share (evaluate caps it instead)
    tracking: bool = False  # split_dims' virtual axis, which follows one dim (the batch or the sequence)

    @property
    def comm_share(self) -> float:
        """The share of this axis's collectives the ILP prices as exposed: on the tensor-parallel
        axis, what the stack does not hide behind GEMMs (:mod:`overlap`, without its cap)."""
        if not self.linear_overlap or self.name != Axis.TP or self.hardware is None:
            return 1.0
        return 1.0 - self.hardware.hidden(self.hardware.tp_overlap)


def axis_spans(degrees: dict[str, int]) -> dict[str, int]:
    """Devices each axis's groups span: itself and every axis inside it (tp innermost)."""
    spans, inner = {}, 1
    for axis in reversed(list(degrees)):
        inner *= degrees[axis]
        spans[axis] = inner
    return spans


def partial_gradients(
    fact: NodeFacts, s: Strategy, ctx: AxisContext, facts, param_shapes: dict | None = None
) -> list[tuple[str, float, float]]:
    """(input node, seconds, seconds once per step) of every replicated input whose gradient this
    strategy leaves partial on this axis: an op that splits its work sends each rank's share back.

    Parameters join the bucketed gradient sync, in the policy's reduce dtype (:func:`param_sync`;
    how much hides behind backward is :mod:`overlap`'s), of their shard on one rank:
    ``param_shapes`` once every axis is placed (the ILP, one axis at a time, sees the shapes
    before this axis); an activation's partial sums are all-reduced once, however many split ops
    consumed it (the rewrite sums them first). Under ZeRO-3 every weight an op uses moves on the
    data-parallel axis however the op runs there (its gathers).
    """
    if ctx.size <= 1:
        return []
    split = not isinstance(s.output, Replicate)
    gathers = ctx.name == Axis.DP and ctx.zero == 3  # ZeRO-3 gathers every weight an op uses, split or not
    if not (split or gathers):
        return []
    out = []
    for slot, placement, shape in zip(fact.slots, s.inputs, ctx.local.slot_shapes[fact.node.name]):
        producer = facts[slot.name]
        weight, partial = producer.kind == "param", split and isinstance(placement, Replicate)
        if not (weight and gathers or partial and producer.needs_grad):
            continue
        shape = (param_shapes or {}).get(slot.name, shape)
        nbytes = numel(shape) * producer.elem_bytes
        if weight:  # (a weight the op slices is gathered whole first, and its gradient is whole)
            grad, master = (numel(shape) * per for per in (producer.grad_bytes, producer.master_bytes))
            sync = param_sync(
                nbytes, grad, ctx, master, trainable=producer.needs_grad, reduced=partial, elements=numel(shape)
            )
            out.append((slot.name, *sync))
        else:
            out.append((slot.name, collective_time("all_reduce", nbytes, ctx.size, ctx.link), 0.0))
    return out


def local_slot_shapes(fact: NodeFacts, s: Strategy, ctx: AxisContext) -> list[tuple[int, ...]]:
    """The node's input shapes on one rank once this axis places them as ``s`` says."""
    return [local_shape(x, p, ctx.size) for x, p in zip(ctx.local.slot_shapes[fact.node.name], s.inputs)]


def node_terms(fact: NodeFacts, s: Strategy, ctx: AxisContext, facts) -> tuple[float, float, float]:
    """(compute, communication, gradient sync) seconds a node's strategy costs on this axis,
    for the ILP: compute counts the work left after earlier axes at the local shapes after this
    one (for a parameter, its optimizer update); an activation's partial-gradient all-reduce is
    shared among its consumers; gradient sync and tensor-parallel collectives count less what
    overlaps them (flat shares: the ILP is linear)."""
    if fact.kind == "param":
        elements = numel(ctx.local.shapes[fact.node.name][0]) * (
            1 / ctx.size if not isinstance(s.output, Replicate) else 1.0
        )
        if ctx.hardware is None:
            return 0.0, 0.0, 0.0
        args = (elements, fact, ctx.zero, ctx.data_parallel, ctx.hardware, ctx.contention)
        again = max(0, ctx.schedule.microbatches - 1)  # microbatches whose gradients are added
        return state_update_s(*args) + again * accumulation_s(*args), 0.0, 0.0
    work = ctx.local.work[fact.node.name] * work_fraction(s, ctx.size)
    compute = fact.seconds(work, local_slot_shapes(fact, s, ctx), ctx.schedule.microbatches)
    comm, sync = kernel_time(fact, s, ctx), 0.0
    for name, seconds, once in partial_gradients(fact, s, ctx, facts):
        if facts[name].kind == "param":
            sync += (seconds + once / max(1, ctx.schedule.microbatches)) * (1 - ctx.overlap)
        else:
            comm += seconds / max(1, facts[name].consumers)
    return compute, comm * ctx.comm_share, sync


def edge_time(
    producer: NodeFacts,
    src: Placement,
    dst: Placement,
    local_shape: tuple[int, ...],
    ctx: AxisContext,
    backward: bool = True,
) -> float:
    """Seconds to bring a producer's output from ``src`` to ``dst`` on this axis (fwd + bwd; fwd
    alone when not ``backward``), for the ILP less the share overlaps hide (:attr:`AxisContext.comm_share`)."""
    nbytes = numel(local_shape) * producer.elem_bytes
    needs_grad = producer.needs_grad and backward
    if ctx.name == Axis.CP and isinstance(src, Shard) and isinstance(dst, Shard) and src != dst:
        # cp chunks are head-and-tail pairs, not rank-ordered runs: no all-to-all, gather then chunk
        return minimum(reshard_time(src, R, nbytes, ctx.size, ctx.link, needs_grad), IMPOSSIBLE_S)
    seconds = reshard_time(src, dst, nbytes, ctx.size, ctx.link, needs_grad)
    if ctx.comm_share != 1.0 and seconds != float("inf"):
        seconds = seconds * ctx.comm_share
    return minimum(seconds, IMPOSSIBLE_S)


def edge_times(memo: dict | None, ctx: AxisContext):
    """:func:`edge_time` on ``ctx``'s axis as ``(producer, src, dst, shape) -> seconds``, each kept
    in ``memo`` for the search's other layouts (a move's time depends on its bytes, placements and axis)."""
    if memo is None:
        return lambda fact, src, dst, shape: edge_time(fact, src, dst, shape, ctx)
    times = memo.setdefault(("edge times", ctx.name, ctx.size, repr(ctx.link), ctx.comm_share), {})

    def timed(fact: NodeFacts, src, dst, shape) -> float:
        key = (fact.elem_bytes, fact.needs_grad, src, dst, shape)
        if key not in times:
            times[key] = edge_time(fact, src, dst, shape, ctx)
        return times[key]

    return timed


def edges(facts, ctx: AxisContext):
    """Every (producer, consumer, slot index, local shape of the value on that edge)."""
    for consumer, fact in facts.items():
        for slot_index, slot in enumerate(fact.slots):
            if slot.name not in facts or not facts[slot.name].out_shapes:
                continue
            if fact.kind == "output":
                yield slot.name, consumer, slot_index, ctx.local.shapes[slot.name][0]
            else:
                yield slot.name, consumer, slot_index, ctx.local.slot_shapes[consumer][slot_index]


def pieced_linear(facts, producer: str, consumer: str, slot_index: int, src: Placement, dst: Placement) -> str:
    """The linear a compiled program runs in pieces with this move (async tensor parallelism,
    :mod:`autopar.passes.rewrite.async_tp`), "" for none: a gather along a leading dim into a
    linear's input, or the all-reduce or reduce-scatter (along a leading dim) of a linear's
    partial output (or of a sum with one)."""
    rank = len(facts[producer].out_shapes[0]) if facts[producer].out_shapes else 0

    def leading(placement: Placement) -> bool:  # split along a row dim (not the features a linear reads or makes)
        return isinstance(placement, Shard) and placement.dim % max(rank, 1) != rank - 1

    if isinstance(src, Shard) and isinstance(dst, Replicate):  # a gather
        return consumer if leading(src) and slot_index == 0 and _is_linear(facts[consumer]) else ""
    if isinstance(src, Partial) and (isinstance(dst, Replicate) or leading(dst)):  # an all-reduce, a reduce-scatter
        if _is_linear(facts[producer]):
            return producer
        if facts[producer].node.target is ROW_SUM:
            linears = (
                slot.name for slot in facts[producer].slots if slot.name in facts and _is_linear(facts[slot.name])
            )
            return next(linears, "")
    return ""


def _is_linear(fact: NodeFacts) -> bool:
    return fact.kind == "op" and fact.node.target is LINEAR


def node_memory(fact: NodeFacts, s: Strategy, ctx: AxisContext) -> float:
    """Bytes a node's strategy keeps per device: model state for a parameter (its stage's
    share), else what autograd saves under the schedule."""
    shapes = ctx.local.shapes[fact.node.name]
    frac = 1 / ctx.size if not isinstance(s.output, Replicate) else 1.0
    if fact.kind == "param":  # model state, and with data parallelism a gradient-sync bucket slot
        elements = numel(shapes[0]) * frac / ctx.schedule.stages
        bucket = elements * fact.grad_bytes if ctx.data_parallel > 1 and fact.needs_grad else 0.0
        return sum(param_state_bytes(elements, fact, ctx.data_parallel, ctx.zero).values()) + bucket
    work = ctx.local.work[fact.node.name] * work_fraction(s, ctx.size)
    # a partial sum is read only by its reduction: held as autograd saves it (schedule.selective_held)
    held = None if isinstance(s.output, Partial) else output_held(fact, ctx.schedule.recompute)
    saved = activation_bytes(fact, shapes, work, frac, saved=held)
    return saved * kept_share(fact, ctx.schedule)


def node_transient(fact: NodeFacts, s: Strategy, ctx: AxisContext) -> float:
    """:func:`transient_bytes` of a node's strategy on this axis, one microbatch's: what the priced
    peak's temporary is the largest of."""
    shapes = [local_shape(shape, s.output, ctx.size) for shape in ctx.local.shapes[fact.node.name]]
    return transient_bytes(fact, shapes) / ctx.schedule.microbatches


def shard_shapes(facts, degrees, strategies) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on one rank once every axis places it."""
    shapes = {}
    for name, fact in facts.items():
        if fact.kind == "param":
            shape = fact.out_shape
            for axis, chosen in strategies.items():
                shape = local_shape(shape, chosen[name].output, degrees[axis]) if name in chosen else shape
            shapes[name] = shape
    return shapes


@dataclass(frozen=True)
class Traffic:
    """What one solved axis moves, in seconds before any overlap but the compiled replay's."""

    comm_s: float = 0.0  # parallel kernels, activations' partial gradients, value moves
    sync_s: float = 0.0  # parameters' gradient sync (ZeRO-2/3: per microbatch)
    sync_once_s: float = 0.0  # ZeRO-1/2's parameter all-gather, once per step
    synced: frozenset[str] = frozenset()  # the parameters synced
    regather_s: float = 0.0  # under Schedule.regather, what backward's second gathers (:func:`regathers`) leave exposed
    regathered: frozenset[tuple[str, int]] = frozenset()  # (consumer, input slot) of those moves
    recompute_gather_s: float = 0.0  # ZeRO-3 under full recomputation: a stack's gathers for it, per microbatch


def axis_contexts(
    facts,
    degrees,
    strategies,
    mesh,
    hardware,
    zero: int = 0,
    memo: dict | None = None,
    step: CompiledStep | None = None,
):
    """(context, chosen strategies, what the axis moves: :func:`traffic`) per axis, each context
    with the local shapes before its axis; then (None, None, local shapes after every axis).
    ``memo`` keeps each axis's traffic and shapes after it for the layouts that share the axes
    before it (keyed by :func:`traffic_key`; an entry holds its strategies, so their id is never
    reused while it is there). ``step`` notes every collective for a compiled step's replay
    (no profile overlap then: the replay places what hides)."""
    memo = None if step is not None else memo
    spans = axis_spans(degrees)
    local = unsharded_shapes(facts, memo)
    param_shapes = shard_shapes(facts, degrees, strategies)
    key: tuple = (tuple(param_shapes.values()),)  # what parameters sync depends on every axis
    for axis, chosen in strategies.items():
        ctx = AxisContext(
            axis,
            degrees[axis],
            hardware.link(mesh.shape, spans[axis], degrees[axis]),
            {},
            local,
            hardware.hidden(hardware.overlap) if step is None else 0.0,
            data_parallel=degrees.get(Axis.DP, 1),
            zero=zero,
            hardware=hardware,
            linear_overlap=False,
        )
        key += (traffic_key(ctx, chosen),)
        if memo is not None and key in memo:
            _, moved, local = memo[key]
        else:
            moved, local = (
                traffic(facts, ctx, chosen, param_shapes, step, memo),
                shapes_after(local, chosen, degrees[axis], memo),
            )
            if memo is not None:
                memo[key] = (chosen, moved, local)
        yield ctx, chosen, moved
    yield None, None, local


def unsharded_shapes(facts, memo: dict | None) -> ShardedShapes:
    """The graph's shapes before any axis, made once per search (``memo``)."""
    if memo is None:
        return ShardedShapes.unsharded(facts)
    key = ("unsharded", id(facts))
    if key not in memo:
        memo[key] = (facts, ShardedShapes.unsharded(facts))  # facts kept: their id stays theirs
    return memo[key][1]


def shapes_after(local: ShardedShapes, chosen: dict[str, Strategy], size: int, memo: dict | None) -> ShardedShapes:
    """``local.after(chosen, size)``, computed once per search (``memo``) for the layouts that share it."""
    if memo is None:
        return local.after(chosen, size)
    key = ("after", id(local), id(chosen), size)
    if key not in memo:
        memo[key] = (local, chosen, local.after(chosen, size))  # both kept: their ids stay theirs
    return memo[key][2]


def traffic_key(ctx: AxisContext, chosen: dict[str, Strategy]) -> tuple:
    """What one axis's :func:`traffic` and the shapes after it depend on besides the axes before it."""
    return (ctx.name, ctx.size, repr(ctx.link), ctx.zero, ctx.data_parallel, ctx.overlap, id(chosen))


def traffic(
    facts,
    ctx: AxisContext,
    chosen: dict[str, Strategy],
    param_shapes: dict,
    step: CompiledStep | None = None,
    memo: dict | None = None,
) -> Traffic:
    """What one solved axis moves (:class:`Traffic`): parallel kernels, each partial gradient once,
    each value moved once per destination and scope; each noted in ``step`` when given (a
    compiled step, :mod:`replay`). ``memo`` keeps the moves' times (:func:`edge_times`)."""
    timed = edge_times(memo, ctx)
    comm = sync = once_s = 0.0
    synced: set[str] = set()
    partial: dict[str, tuple[float, float]] = {}
    for name, s in chosen.items():
        for slot, seconds, once in partial_gradients(facts[name], s, ctx, facts, param_shapes):
            before = partial.get(slot, (0.0, 0.0))
            partial[slot] = (maximum(before[0], seconds), maximum(before[1], once))
    kernels = sum(kernel_time(facts[name], s, ctx) * facts[name].weight for name, s in chosen.items() if s.kernel)
    comm += kernels
    layer_s, layers = zero3_layer_s(ctx), set()
    for slot, (seconds, once) in partial.items():
        if facts[slot].kind == "param" and layer_s and facts[slot].gather_group not in layers:
            layers.add(facts[slot].gather_group)  # the layer's collectives' latency, charged with its first parameter
            seconds += layer_s
        if facts[slot].kind == "param":
            sync += seconds * facts[slot].weight
            once_s += once * facts[slot].weight
            synced.add(slot)
        else:
            comm += seconds * facts[slot].weight
        if step is not None:
            nbytes = numel(ctx.local.shapes[slot][0]) * facts[slot].elem_bytes
            step.note_gradient(slot, seconds + once, nbytes, facts[slot])
    if step is not None:
        step.kernel_s += kernels
    moves: dict[tuple, tuple[str, tuple, list[tuple[str, int]]]] = {}  # (value, destination, scope): moved once
    for producer, consumer, slot_index, shape in edges(facts, ctx):
        dst = (
            R
            if facts[consumer].kind == "output"
            else chosen[consumer].inputs[slot_index]
            if consumer in chosen
            else None
        )
        if producer not in chosen or dst is None:
            continue
        move = (producer, dst, facts[consumer].scope)
        if move in moves:
            moves[move][2].append((consumer, slot_index))  # one more reader of the same move
            continue
        moves[move] = (consumer, shape, [(consumer, slot_index)])
        seconds = timed(facts[producer], chosen[producer].output, dst, shape)
        comm += seconds * facts[consumer].weight
        if step is not None and seconds:
            forward = edge_time(facts[producer], chosen[producer].output, dst, shape, ctx, backward=False)
            weight = facts[consumer].weight
            linear = pieced_linear(facts, producer, consumer, slot_index, chosen[producer].output, dst)
            step.moves.append((producer, consumer, forward * weight, (seconds - forward) * weight, linear))
    regather_s, regathered_inputs = 0.0, set()
    for (producer, dst, _), (consumer, shape, readers) in moves.items():
        if regathers(facts, chosen[producer].output, dst, readers):  # backward gathers the value again
            gather = edge_time(facts[producer], chosen[producer].output, dst, shape, ctx, backward=False)
            regather_s += (
                maximum(0.0, gather - _input_gradients_s(facts, chosen, readers, ctx)) * facts[consumer].weight
            )
            regathered_inputs.update(readers)
    recompute_s = recompute_gathers_s(facts, list(partial), ctx, param_shapes)
    return Traffic(comm, sync, once_s, frozenset(synced), regather_s, frozenset(regathered_inputs), recompute_s)


def _input_gradients_s(facts, chosen: dict[str, Strategy], readers: list[tuple[str, int]], ctx: AxisContext) -> float:
    """What a regather hides behind where communication runs beside compute (the profile's
    ``overlap``): its linears' input-gradient matmuls, each one forward's worth of the op's
    forward and backward (:mod:`autopar.runtime.kernels.gathered_linear` issues the gather first)."""
    seconds = 0.0
    for reader, _ in readers:
        fact, s = facts[reader], chosen[reader]
        profile = fact.profile
        share = profile.forward_flops / max(profile.forward_flops + profile.backward_flops, 1.0)
        work = ctx.local.work[reader] * work_fraction(s, ctx.size)
        seconds += fact.seconds(work, local_slot_shapes(fact, s, ctx)) * share
    return seconds * (ctx.hardware.hidden(ctx.hardware.overlap) if ctx.hardware is not None else 0.0)


def regathers(facts, src: Placement, dst: Placement, readers: list[tuple[str, int]]) -> bool:
    """Whether ``Schedule.regather`` keeps a moved value's shard for backward and gathers it again
    there: an all-gather whose readers are all linears taking it as their input, which the
    runtime runs as one op with them (:mod:`autopar.passes.rewrite.regather`: the same rule on
    the program), a gradient flowing back through it."""
    return (
        isinstance(src, Shard)
        and isinstance(dst, Replicate)
        and all(slot == 0 and _is_linear(facts[reader]) for reader, slot in readers)
        and any(facts[reader].needs_grad for reader, _ in readers)
    )
