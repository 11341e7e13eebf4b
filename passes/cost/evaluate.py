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
    Replicate,
    Schedule,
    Shard,
    model_state_bytes,
)
from autopar.ir.zero import syncs_whole_in_program
from autopar.passes.capture.graph import CapturedGraph
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
from autopar.passes.cost.replay import CompiledStep
from autopar.passes.cost.schedule import LayerTerms, kept_share, layer_terms, scheduled
from autopar.passes.search.partition import StageSplit, balanced_starts, layer_costs, split_rows
from autopar.passes.sharding.strategies import Strategy, numel, work_fraction

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


def axis_spans(degrees: dict[str, int]) -> dict[str, int]:
    """Devices each axis's groups span: itself and every axis inside it (tp innermost)."""
    spans, inner = {}, 1
    for axis in reversed(list(degrees)):
        inner *= degrees[axis]
        spans[axis] = inner
    return spans


def partial_gradients(fact: NodeFacts, s: Strategy, ctx: AxisContext, facts) -> list[tuple[str, float]]:
    """(input node, all-reduce seconds) of every replicated input whose gradient this strategy
    leaves partial on this axis: an op that splits its work sends each rank's share back.

    Parameters join the bucketed gradient sync (exposed beyond the overlap; ZeRO-3 gathers
    the weight again for backward); an activation's partial sums are all-reduced once,
    however many split ops consumed it (the rewrite sums them first).
    """
    if ctx.size <= 1 or isinstance(s.output, Replicate):
        return []
    out = []
    for slot, placement, shape in zip(fact.slots, s.inputs, ctx.local.slot_shapes[fact.node.name]):
        producer = facts[slot.name]
        if not isinstance(placement, Replicate) or not producer.needs_grad:
            continue
        nbytes = numel(shape) * producer.elem_bytes
        if producer.kind == "param":
            regather = (
                collective_time("all_gather", nbytes, ctx.size, ctx.link)
                if ctx.zero == 3 and ctx.name == Axis.DP
                else 0.0
            )
            out.append((slot.name, (grad_sync_time(nbytes, ctx.size, ctx.link) + regather) * (1 - ctx.overlap)))
        else:
            out.append((slot.name, collective_time("all_reduce", nbytes, ctx.size, ctx.link)))
    return out


def node_terms(fact: NodeFacts, s: Strategy, ctx: AxisContext, facts) -> tuple[float, float, float]:
    """(compute, communication, gradient sync) seconds a node's strategy costs on this axis,
    for the ILP: compute counts the work left after earlier axes (for a parameter, its
    optimizer update); an activation's partial-gradient all-reduce is shared among its consumers."""
    if fact.kind == "param":
        elements = numel(ctx.local.shapes[fact.node.name][0]) * (
            1 / ctx.size if not isinstance(s.output, Replicate) else 1.0
        )
        zero_share = ctx.data_parallel if ctx.zero else 1
        return optimizer_time(elements / zero_share, ctx.hardware, ctx.contention) if ctx.hardware else 0.0, 0.0, 0.0
    compute = fact.full_time_s * ctx.local.work[fact.node.name] * work_fraction(s, ctx.size)
    comm, sync = kernel_time(fact, s, ctx), 0.0
    for name, seconds in partial_gradients(fact, s, ctx, facts):
        if facts[name].kind == "param":
            sync += seconds
        else:
            comm += seconds / max(1, facts[name].consumers)
    return compute, comm, sync


def edge_time(
    producer: NodeFacts,
    src: Placement,
    dst: Placement,
    local_shape: tuple[int, ...],
    ctx: AxisContext,
    backward: bool = True,
) -> float:
    """Seconds to bring a producer's output from ``src`` to ``dst`` on this axis (fwd + bwd; fwd
    alone when not ``backward``)."""
    nbytes = numel(local_shape) * producer.elem_bytes
    needs_grad = producer.needs_grad and backward
    if ctx.name == Axis.CP and isinstance(src, Shard) and isinstance(dst, Shard) and src != dst:
        # cp chunks are head-and-tail pairs, not rank-ordered runs: no all-to-all, gather then chunk
        return minimum(reshard_time(src, R, nbytes, ctx.size, ctx.link, needs_grad), IMPOSSIBLE_S)
    return minimum(reshard_time(src, dst, nbytes, ctx.size, ctx.link, needs_grad), IMPOSSIBLE_S)


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
        bucket = elements * fact.elem_bytes if ctx.data_parallel > 1 else 0.0
        state = model_state_bytes(
            elements, data_parallel=ctx.data_parallel, zero_stage=ctx.zero, precision=fact.precision
        )
        return sum(state.values()) + bucket
    saved = activation_bytes(fact, shapes, ctx.local.work[fact.node.name] * work_fraction(s, ctx.size), frac)
    return saved * kept_share(fact, ctx.schedule)


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
    local = (memo if memo is not None else {}).get(("unsharded", id(facts)), (None, None))[1]
    if local is None:
        local = ShardedShapes.unsharded(facts)
        if memo is not None:
            memo[("unsharded", id(facts))] = (facts, local)
    key: tuple = ()
    for axis, chosen in strategies.items():
        ctx = AxisContext(
            axis,
            degrees[axis],
            hardware.link(mesh.shape, spans[axis], degrees[axis]),
            {},
            local,
            hardware.overlap if step is None else 0.0,
            data_parallel=degrees.get(Axis.DP, 1),
            zero=zero,
        )
        key += (traffic_key(ctx, chosen),)
        if memo is not None and key in memo:
            _, moved, local = memo[key]
        else:
            moved, local = traffic(facts, ctx, chosen, step), local.after(chosen, degrees[axis])
            if memo is not None:
                memo[key] = (chosen, moved, local)
        yield ctx, chosen, moved
    yield None, None, local


def evaluate(
    facts, degrees, strategies, mesh, hardware: HardwareProfile, zero: int = 0, schedule: Schedule = Schedule()
) -> Cost:
    """Predicted step time and memory of a fully chosen configuration.

    The ILP's terms summed by category, compute counted once over all axes, each partial
    gradient once, a value moved once per destination and :func:`autopar.passes.cost.facts.move_scope` (as the
    rewrite shares the move; the ILP, linear, prices every edge). Memory as the runtime holds
    it: model state (ZeRO-sharded), gradient-sync buckets (a flat copy of every synced gradient),
    the activations autograd saves and, at the start of backward, about two tensors of the largest
    activation (the loss's gradient chain); gradients grow as activations are freed (see :attr:`Cost.peak_memory`).
    Then the ``schedule``'s recomputation, microbatches and pipeline (:mod:`autopar.passes.cost.schedule`).
    """
    return PricedConfiguration.of(facts, degrees, strategies, mesh, hardware, zero).under(schedule)


@dataclass
class LayoutTerms:
    """What any schedule and any ZeRO stage of the same weight regathering need of one solved
    layout, each computed once: its cost as one batch with the model state left out
    (:func:`_layout_cost`), the sums over layers (:func:`layer_terms`), the layer rows and, per
    (stage modules, microbatches), the balanced cut points."""

    facts: dict[str, NodeFacts]
    cost: Cost  # compute, communication, gradient sync, activations: not the model state
    synced: set[str]  # parameters whose gradients are synchronized
    local: ShardedShapes  # every node's local shapes once all axes are solved
    link: LinkTier  # the tier a pipeline's stage boundaries cross
    made_of: tuple = ()  # (degrees, strategies, mesh, hardware): for :meth:`compiled_traffic`
    _terms: LayerTerms | None = None
    _rows: list | None = None
    _starts: dict = field(default_factory=dict)
    _splits: dict = field(default_factory=dict)

    @classmethod
    def of(
        cls, facts, degrees, strategies, mesh, hardware: HardwareProfile, zero: int = 0, memo: dict | None = None
    ) -> LayoutTerms:
        """The terms of ``strategies``; of ZeRO only whether it regathers weights (stage 3) matters.
        ``memo`` keeps each axis's :func:`traffic` for layouts that share their first axes."""
        cost, synced, local = _layout_cost(facts, degrees, strategies, mesh, hardware, zero, memo)
        made_of = (degrees, strategies, mesh, hardware)
        return cls(facts, cost, synced, local, hardware.link(mesh.shape, mesh.size), made_of)

    def compiled_traffic(self, zero: int, schedule: Schedule) -> tuple[float, float]:
        """(exposed communication, exposed gradient sync) of the compiled step (:mod:`replay`):
        every collective noted, then replayed against the compute it can hide behind. A folded
        graph replays its kept layers only (:attr:`NodeFacts.weight` is not applied here)."""
        degrees, strategies, mesh, hardware = self.made_of
        step = CompiledStep()
        for ctx, _, _ in axis_contexts(self.facts, degrees, strategies, mesh, hardware, zero, step=step):
            if ctx is None:
                break
        comm, sync = step.exposed(self.facts, self.local.work, syncs_whole_in_program(zero, schedule), zero == 3)
        return comm + step.kernel_s, sync

    @property
    def terms(self) -> LayerTerms:
        if self._terms is None:
            self._terms = layer_terms(self.facts, self.local)
        return self._terms

    def split(self, schedule: Schedule) -> StageSplit | None:
        """Where ``schedule``'s stage modules cut the layers (its pinned cuts, else balanced)."""
        if schedule.stages == 1:
            return None
        if self._rows is None:
            self._rows = layer_costs(self.facts, self.local)
        # the cuts depend on the modules and microbatches; the shares also on which device runs which module
        key = (schedule.modules, schedule.microbatches)
        split_key = (key, schedule.stages, tuple(map(tuple, schedule.device_modules())), schedule.cuts)
        if split_key not in self._splits:
            if not schedule.cuts and key not in self._starts and len(self._rows) >= schedule.modules:
                self._starts[key] = balanced_starts(self._rows, schedule.modules, schedule.microbatches, self.link)
            self._splits[split_key] = split_rows(self._rows, schedule, self.link, self._starts.get(key))
        return self._splits[split_key]


@dataclass
class PricedConfiguration:
    """One configuration's cost as one batch (everything saved, one stage), ready to price any
    schedule on: :meth:`under` reuses the sums over nodes and the stage cuts of its layout, so
    the search prices every schedule of a configuration for the cost of one pass over the graph.

    >>> priced = PricedConfiguration.of(facts, degrees, strategies, mesh, hardware)   # doctest: +SKIP
    >>> priced.under(Schedule(stages=2, microbatches=8)).step_s                         # doctest: +SKIP
    """

    cost: Cost
    zero: int
    layout: LayoutTerms

    @classmethod
    def of(
        cls,
        facts,
        degrees,
        strategies,
        mesh,
        hardware: HardwareProfile,
        zero: int = 0,
        layout: LayoutTerms | None = None,
    ) -> PricedConfiguration:
        """Price ``strategies`` at ``zero``; ``layout``: their terms, from another ZeRO stage
        that regathers weights alike (both 3, or neither)."""
        layout = layout or LayoutTerms.of(facts, degrees, strategies, mesh, hardware, zero)
        memory, optimizer_s = _model_state(facts, layout, degrees, mesh, hardware, zero)
        cost = dataclasses.replace(layout.cost, memory={**memory, **layout.cost.memory}, optimizer_s=optimizer_s)
        return cls(cost, zero, layout)

    def split(self, schedule: Schedule) -> StageSplit | None:
        return self.layout.split(schedule)

    def under(self, schedule: Schedule) -> Cost:
        """The cost under ``schedule`` (as :func:`evaluate`)."""
        cost = self.cost
        if schedule.compiled:  # what the compiled schedule leaves exposed replaces the profile's overlap
            comm, sync = self.layout.compiled_traffic(self.zero, schedule)
            cost = dataclasses.replace(cost, comm_s=comm, grad_sync_s=sync)
        if self.zero >= 2:  # gradients are reduce-scattered (ZeRO-3: weights regathered) every microbatch
            cost = dataclasses.replace(cost, grad_sync_s=cost.grad_sync_s * schedule.microbatches)
        return scheduled(cost, self.layout.terms, schedule, self.split(schedule), self.layout.link)


def _layout_cost(facts, degrees, strategies, mesh, hardware: HardwareProfile, zero: int, memo: dict | None = None):
    """(cost of one batch with everything saved on one stage, model state left out; the
    parameters whose gradients are synced; the local shapes): every sum over nodes weighs a
    node, and every sum over edges the edge's consumer, by its weight."""
    comm = sync = 0.0
    synced: set[str] = set()
    for ctx, _, moved in axis_contexts(facts, degrees, strategies, mesh, hardware, zero, memo):
        if ctx is None:
            local = moved  # the shapes after every axis
            break
        comm, sync = comm + moved[0], sync + moved[1]
        synced |= moved[2]
    compute = sum(f.full_time_s * local.work[n] * f.weight for n, f in facts.items())
    flops = sum(
        (f.profile.forward_flops + (f.profile.backward_flops if f.needs_grad else 0.0)) * local.work[n] * f.weight
        for n, f in facts.items()
    )
    activations = largest = 0.0
    for name, fact in facts.items():
        if fact.kind != "param":
            activations += activation_bytes(fact, local.shapes[name], local.work[name]) * fact.weight
            if fact.kind == "op" and fact.needs_grad:
                largest = maximum(largest, sum(numel(s) for s in local.shapes[name]) * fact.elem_bytes)
    memory = {"activations": activations, "temporary": 2 * largest}
    cost = Cost(compute_s=compute, comm_s=comm, grad_sync_s=sync, memory=memory, model_flops=flops)
    return cost, synced, local


def traffic_key(ctx: AxisContext, chosen: dict[str, Strategy]) -> tuple:
    """What one axis's :func:`traffic` and the shapes after it depend on besides the axes before it."""
    return (ctx.name, ctx.size, repr(ctx.link), ctx.zero, ctx.data_parallel, ctx.overlap, id(chosen))


def traffic(
    facts, ctx: AxisContext, chosen: dict[str, Strategy], step: CompiledStep | None = None
) -> tuple[float, float, set[str]]:
    """(exposed communication, exposed gradient sync, the parameters synced) of one solved axis:
    parallel kernels, each partial gradient once, each value moved once per destination and scope;
    each noted in ``step`` when given (a compiled step, :mod:`replay`)."""
    comm = sync = 0.0
    synced: set[str] = set()
    partial: dict[str, float] = {}
    for name, s in chosen.items():
        for slot, seconds in partial_gradients(facts[name], s, ctx, facts):
            partial[slot] = maximum(partial.get(slot, 0.0), seconds)
    kernels = sum(kernel_time(facts[name], s, ctx) * facts[name].weight for name, s in chosen.items() if s.kernel)
    comm += kernels
    for slot, seconds in partial.items():
        if facts[slot].kind == "param":
            sync += seconds * facts[slot].weight
            synced.add(slot)
        else:
            comm += seconds * facts[slot].weight
        if step is not None:
            step.note_gradient(slot, seconds, numel(ctx.local.shapes[slot][0]) * facts[slot].elem_bytes, facts[slot])
    if step is not None:
        step.kernel_s += kernels
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
            seconds = edge_time(facts[producer], chosen[producer].output, dst, shape, ctx)
            comm += seconds * facts[consumer].weight
            if step is not None and seconds:
                forward = edge_time(facts[producer], chosen[producer].output, dst, shape, ctx, backward=False)
                step.moves.append((producer, consumer, forward, seconds - forward))
    return comm, sync, synced


def _model_state(facts, layout: LayoutTerms, degrees, mesh, hardware: HardwareProfile, zero: int):
    """(memory by category of weights, gradients, optimizer state and gradient-sync buckets;
    the optimizer step's seconds) under ZeRO ``zero``."""
    dp = degrees.get(Axis.DP, 1)
    memory = dict.fromkeys(("params", "grads", "optimizer", "grad_buckets"), 0.0)
    optimizer_elements = 0.0
    for name, fact in facts.items():
        if fact.kind != "param":
            continue
        elements = numel(layout.local.shapes[name][0]) * fact.weight
        state = model_state_bytes(elements, data_parallel=dp, zero_stage=zero, precision=fact.precision)
        for category, nbytes in state.items():
            memory[category] += nbytes
        memory["grad_buckets"] += elements * fact.elem_bytes if name in layout.synced else 0.0
        optimizer_elements += elements / (dp if zero else 1)
    return memory, optimizer_time(optimizer_elements, hardware, hardware.contention(mesh.shape))


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
    """The cost model's prediction for ``plan`` (searched, loaded or hand-made) on ``hardware``."""
    facts = analyze(captured, hardware, hardware.contention(plan.mesh.shape))
    strategies = strategies_from_plan(plan, facts)
    return evaluate(
        facts, plan.degrees, strategies, stage_mesh(plan.mesh, plan.schedule.stages), hardware, plan.zero, plan.schedule
    )
