"""The cost terms of node strategies, and the predicted cost of a whole configuration.

The ILP of :mod:`autopar.passes.search.axes` minimizes the per-node and per-edge terms defined here, one mesh
axis at a time; :func:`evaluate` sums the same terms over all axes once every choice is
made, and :func:`evaluate_plan` does so for any plan, searched or pinned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autopar.ir import (
    KERNEL_DIMS,
    Axis,
    ConfigError,
    Cost,
    HardwareProfile,
    LinkTier,
    Mesh,
    Placement,
    Plan,
    PrecisionPolicy,
    Replicate,
    Schedule,
    Shard,
    model_state_bytes,
)
from autopar.passes.capture.graph import CapturedGraph
from autopar.passes.cost.efficiency import GEMMS
from autopar.passes.cost.facts import NodeFacts, ShardedShapes, activation_bytes, analyze, move_scope
from autopar.passes.cost.kernels import kernel_time
from autopar.passes.cost.ops import (
    collective_time,
    grad_sync_time,
    maximum,
    minimum,
    optimizer_time,
    reshard_time,
)
from autopar.passes.cost.schedule import StepParts, forward_share, kept_share, schedule_cost
from autopar.passes.sharding.strategies import Strategy, local_shape, numel, work_fraction

R = Replicate()
IMPOSSIBLE_S = 1e3  # cost of a redistribution that cannot be done; never chosen when avoidable


@dataclass
class AxisContext:
    name: str
    size: int
    link: LinkTier
    pins: dict[str, Placement]
    local: ShardedShapes  # before this axis
    overlap: float  # share of gradient sync hidden behind backward
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

    @property
    def comm_share(self) -> float:
        """The share of this axis's collectives the ILP prices as exposed: on the tensor-parallel
        axis, what the stack does not hide behind GEMMs (:mod:`overlap`, without its cap)."""
        if not self.linear_overlap or self.name != Axis.TP or self.hardware is None:
            return 1.0
        return 1.0 - self.hardware.tp_overlap


def axis_spans(degrees: dict[str, int]) -> dict[str, int]:
    """Devices each axis's groups span: itself and every axis inside it (tp innermost)."""
    spans, inner = {}, 1
    for axis in reversed(list(degrees)):
        inner *= degrees[axis]
        spans[axis] = inner
    return spans


def partial_gradients(
    fact: NodeFacts, s: Strategy, ctx: AxisContext, facts, param_shapes: dict | None = None
) -> list[tuple[str, float]]:
    """(input node, all-reduce seconds) of every replicated input whose gradient this strategy
    leaves partial on this axis: an op that splits its work sends each rank's share back.

    Parameters join the bucketed gradient sync, in the policy's reduce dtype (ZeRO-3 gathers
    the weight again for backward; how much hides behind backward is :mod:`overlap`'s), of
    their shard on one rank: ``param_shapes`` once every axis is placed (the ILP, one axis at
    a time, sees the shapes before this axis); an activation's partial sums are all-reduced
    once, however many split ops consumed it (the rewrite sums them first).
    """
    if ctx.size <= 1 or isinstance(s.output, Replicate):
        return []
    out = []
    for slot, placement, shape in zip(fact.slots, s.inputs, ctx.local.slot_shapes[fact.node.name]):
        producer = facts[slot.name]
        if not isinstance(placement, Replicate) or not producer.needs_grad:
            continue
        shape = (param_shapes or {}).get(slot.name, shape)
        nbytes = numel(shape) * producer.elem_bytes
        if producer.kind == "param":
            out.append((slot.name, _param_sync(nbytes, numel(shape) * producer.grad_bytes, ctx)))
        else:
            out.append((slot.name, collective_time("all_reduce", nbytes, ctx.size, ctx.link)))
    return out


def _param_sync(param_bytes: float, grad_bytes: float, ctx: AxisContext) -> float:
    """Seconds one parameter's data-parallel traffic costs per microbatch under ZeRO (Rajbhandari
    et al. 2020, §5-7): stages 0-1 all-reduce the gradient once per step (stage 1's reduce-scatter
    and parameter all-gather move as much); stage 2 reduce-scatters it every microbatch and
    all-gathers the updated parameter once per step; stage 3 also gathers the parameter for
    forward and again for backward, every microbatch. (``evaluate`` counts stages 2-3 once per
    microbatch.)"""
    if ctx.name != Axis.DP or ctx.zero < 2:
        return grad_sync_time(grad_bytes, ctx.size, ctx.link)
    scatter = grad_sync_time(grad_bytes, ctx.size, ctx.link, kind="reduce_scatter")
    gathers = 2 if ctx.zero == 3 else 1 / max(1, ctx.schedule.microbatches)
    return scatter + gathers * collective_time(
        "all_gather", param_bytes, ctx.size, dataclasses.replace(ctx.link, sync_s=0.0)
    )


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
        zero_share = ctx.data_parallel if ctx.zero else 1
        return optimizer_time(elements / zero_share, ctx.hardware, ctx.contention) if ctx.hardware else 0.0, 0.0, 0.0
    work = ctx.local.work[fact.node.name] * work_fraction(s, ctx.size)
    compute = fact.seconds(work, local_slot_shapes(fact, s, ctx), ctx.schedule.microbatches)
    comm, sync = kernel_time(fact, s, ctx), 0.0
    for name, seconds in partial_gradients(fact, s, ctx, facts):
        if facts[name].kind == "param":
            sync += seconds * (1 - ctx.overlap)
        else:
            comm += seconds / max(1, facts[name].consumers)
    return compute, comm * ctx.comm_share, sync


def edge_time(
    producer: NodeFacts, src: Placement, dst: Placement, local_shape: tuple[int, ...], ctx: AxisContext
) -> float:
    """Seconds to bring a producer's output from ``src`` to ``dst`` on this axis (fwd + bwd)."""
    nbytes = numel(local_shape) * producer.elem_bytes
    if ctx.name == Axis.CP and isinstance(src, Shard) and isinstance(dst, Shard) and src != dst:
        # cp chunks are head-and-tail pairs, not rank-ordered runs: no all-to-all, gather then chunk
        return minimum(reshard_time(src, R, nbytes, ctx.size, ctx.link, producer.needs_grad), IMPOSSIBLE_S)
    seconds = reshard_time(src, dst, nbytes, ctx.size, ctx.link, producer.needs_grad)
    if ctx.comm_share != 1.0 and seconds != float("inf"):
        seconds = seconds * ctx.comm_share
    return minimum(seconds, IMPOSSIBLE_S)


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


def node_memory(fact: NodeFacts, s: Strategy, ctx: AxisContext) -> float:
    """Bytes a node's strategy keeps per device: model state for a parameter (its stage's
    share), else what autograd saves under the schedule."""
    shapes = ctx.local.shapes[fact.node.name]
    frac = 1 / ctx.size if not isinstance(s.output, Replicate) else 1.0
    if fact.kind == "param":  # model state, and with data parallelism a gradient-sync bucket slot
        elements = numel(shapes[0]) * frac / ctx.schedule.stages
        bucket = elements * fact.grad_bytes if ctx.data_parallel > 1 else 0.0
        state = model_state_bytes(
            elements, data_parallel=ctx.data_parallel, zero_stage=ctx.zero, precision=fact.precision
        )
        return sum(state.values()) + bucket
    saved = activation_bytes(fact, shapes, ctx.local.work[fact.node.name] * work_fraction(s, ctx.size), frac)
    return saved * kept_share(fact, ctx.schedule)


def axis_contexts(facts, degrees, strategies, mesh, hardware, zero: int = 0, schedule: Schedule = Schedule()):
    """(context, chosen strategies) per axis, each context with the local shapes before its axis."""
    spans = axis_spans(degrees)
    local = ShardedShapes.unsharded(facts)
    for axis, chosen in strategies.items():
        yield (
            AxisContext(
                axis,
                degrees[axis],
                hardware.link(mesh.shape, spans[axis], degrees[axis]),
                {},
                local,
                hardware.overlap,
                data_parallel=degrees.get(Axis.DP, 1),
                zero=zero,
                hardware=hardware,
                schedule=schedule,
                linear_overlap=False,
            ),
            chosen,
        )
        local = local.after(chosen, degrees[axis])


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


def evaluate(
    facts, degrees, strategies, mesh, hardware: HardwareProfile, zero: int = 0, schedule: Schedule = Schedule()
) -> Cost:
    """Predicted step time and memory of a fully chosen configuration.

    The ILP's terms summed by category, compute counted once over all axes (each node at its
    local shapes and microbatch), each partial gradient once, a value moved once per destination
    and :func:`autopar.passes.cost.facts.move_scope` (as the rewrite shares the move; the ILP,
    linear, prices every edge); what overlaps hide is placed by :func:`schedule_cost`. Memory as
    the runtime holds it: model state (ZeRO-sharded), gradient-sync buckets (a flat copy of every
    synced gradient), the activations autograd saves and, at the start of backward, about two
    tensors of the largest activation (the loss's gradient chain); gradients grow as activations
    are freed (see :attr:`Cost.peak_memory`).
    """
    comm = sync = tp_comm = 0.0
    synced: set[str] = set()
    local = ShardedShapes.unsharded(facts)
    param_shapes = shard_shapes(facts, degrees, strategies)
    for ctx, chosen in axis_contexts(facts, degrees, strategies, mesh, hardware, zero, schedule):
        axis_comm = 0.0
        partial: dict[str, float] = {}
        for name, s in chosen.items():
            for slot, seconds in partial_gradients(facts[name], s, ctx, facts, param_shapes):
                partial[slot] = maximum(partial.get(slot, 0.0), seconds)
        axis_comm += sum(kernel_time(facts[name], s, ctx) for name, s in chosen.items() if s.kernel)
        for slot, seconds in partial.items():
            if facts[slot].kind == "param":
                sync += seconds
                synced.add(slot)
            else:
                axis_comm += seconds
        moves = set()  # (value, destination, scope): moved once
        for producer, consumer, slot_index, shape in edges(facts, ctx):
            dst = (
                R
                if facts[consumer].kind == "output"
                else chosen[consumer].inputs[slot_index]
                if consumer in chosen
                else None
            )
            move = (producer, dst, move_scope(facts[consumer].node))
            if producer in chosen and dst is not None and move not in moves:
                moves.add(move)
                axis_comm += edge_time(facts[producer], chosen[producer].output, dst, shape, ctx)
        comm += axis_comm
        tp_comm += axis_comm if ctx.name == Axis.TP else 0.0
        local = local.after(chosen, ctx.size)
    contention = hardware.contention(mesh.shape)
    times = {n: f.seconds(local.work[n], local.slot_shapes[n], schedule.microbatches) for n, f in facts.items()}
    flops = sum(
        (f.profile.forward_flops + (f.profile.backward_flops if f.needs_grad else 0.0)) * local.work[n]
        for n, f in facts.items()
    )
    memory = dict.fromkeys(("params", "grads", "optimizer", "grad_buckets", "activations", "temporary"), 0.0)
    optimizer_elements = largest = 0.0
    for name, fact in facts.items():
        elements = sum(numel(s) for s in local.shapes[name])
        if fact.kind == "param":
            state = model_state_bytes(
                elements, data_parallel=degrees.get(Axis.DP, 1), zero_stage=zero, precision=fact.precision
            )
            for category, nbytes in state.items():
                memory[category] += nbytes
            memory["grad_buckets"] += elements * fact.grad_bytes if name in synced else 0.0
            optimizer_elements += elements / (degrees.get(Axis.DP, 1) if zero else 1)
        else:
            memory["activations"] += activation_bytes(fact, local.shapes[name], local.work[name])
            if fact.kind == "op" and fact.needs_grad:
                largest = maximum(largest, elements * fact.elem_bytes)
    memory["temporary"] = 2 * largest
    if zero >= 2:  # gradients are reduce-scattered (ZeRO-3: weights regathered) every microbatch
        sync *= schedule.microbatches
    cost = Cost(
        compute_s=sum(times.values()),
        comm_s=comm,
        grad_sync_s=sync,
        memory=memory,
        optimizer_s=optimizer_time(optimizer_elements, hardware, contention),
        model_flops=flops,
    )
    tp = degrees.get(Axis.TP, 1)
    parts = StepParts(
        compute_s=cost.compute_s,
        backward_s=sum(seconds * (1 - forward_share(facts[n])) for n, seconds in times.items()),
        gemm_s=sum(seconds for n, seconds in times.items() if facts[n].node.target in GEMMS),
        tp_comm_s=tp_comm,
        scatter=tp,
        scatter_link=hardware.link(mesh.shape, tp, tp) if tp > 1 else None,
        replicated=frozenset(n for n, s in strategies.get(Axis.TP, {}).items() if isinstance(s.output, Replicate)),
        zero=zero,
    )
    return schedule_cost(cost, facts, local, schedule, hardware, hardware.link(mesh.shape, mesh.size), parts)


def strategies_from_plan(plan: Plan, facts: dict[str, NodeFacts]) -> dict[str, dict[str, Strategy]]:
    """The per-axis strategies a plan's placements spell."""
    strategies = {axis: {} for axis in plan.degrees}
    for index, axis in enumerate(plan.degrees):
        for name, fact in facts.items():
            if fact.kind == "param":
                strategies[axis][name] = Strategy((), plan.params[fact.name][index])
            elif fact.kind == "input":
                strategies[axis][name] = Strategy((), plan.inputs[name][index])
            elif fact.kind == "buffer":
                strategies[axis][name] = Strategy((), R)
            elif fact.kind == "op" and name in plan.nodes and plan.nodes[name].output is not None:
                decision = plan.nodes[name]
                inputs = tuple(slot[index] if slot is not None else None for slot in decision.inputs)
                kernel = decision.kernel if decision.kernel and KERNEL_DIMS[decision.kernel] == axis else ""
                strategies[axis][name] = Strategy(inputs, decision.output[index], kernel)
    return strategies


def stage_mesh(mesh: Mesh, stages: int) -> Mesh:
    """The devices of one pipeline stage: stages split the outermost mesh dimension."""
    if stages == 1:
        return mesh
    if mesh.shape[0] % stages:
        raise ConfigError(
            f"{stages} pipeline stages must divide the outermost dimension of mesh {mesh}: pick another pp or mesh"
        )
    return Mesh((mesh.shape[0] // stages, *mesh.shape[1:]), mesh.device_type)


def evaluate_plan(captured: CapturedGraph, plan: Plan, hardware: HardwareProfile) -> Cost:
    """The cost model's prediction for ``plan`` (searched, loaded or hand-made) on ``hardware``,
    trained in the plan's precision."""
    facts = analyze(captured, hardware, hardware.contention(plan.mesh.shape), PrecisionPolicy.of(plan.precision))
    strategies = strategies_from_plan(plan, facts)
    return evaluate(
        facts, plan.degrees, strategies, stage_mesh(plan.mesh, plan.schedule.stages), hardware, plan.zero, plan.schedule
    )
