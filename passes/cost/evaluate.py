"""The predicted cost of a whole configuration.

:func:`evaluate` sums the terms of :mod:`autopar.passes.cost.axis_terms` over all axes once every
choice is made (a layout's schedule-independent terms once, in :class:`LayoutTerms`; each schedule
priced on them by :class:`PricedConfiguration`), and :func:`evaluate_plan` does so for any plan,
searched or pinned.
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
    Plan,
    PrecisionPolicy,
    Recompute,
    Replicate,
    Schedule,
    layer_of,
)
from autopar.ir.buckets import bucket_cap
from autopar.ir.zero import accumulates_in_program, scatters_in_program, syncs_whole_in_program
from autopar.passes.capture.graph import CapturedGraph
from autopar.passes.cost.axis_terms import R, axis_contexts
from autopar.passes.cost.facts import NodeFacts, ShardedShapes, activation_bytes, analyze, transient_bytes
from autopar.passes.cost.ops import accumulation_s, maximum, minimum, param_state_bytes, state_update_s
from autopar.passes.cost.replay import CompiledStep
from autopar.passes.cost.schedule import LayerTerms, StepParts, StepTimes, layer_terms, scheduled, step_times
from autopar.passes.search.partition import StageSplit, balanced_starts, layer_costs, split_rows
from autopar.passes.sharding.strategies import Strategy, numel


def evaluate(
    facts, degrees, strategies, mesh, hardware: HardwareProfile, zero: int = 0, schedule: Schedule = Schedule()
) -> Cost:
    """Predicted step time and memory of a fully chosen configuration.

    The ILP's terms summed by category, compute counted once over all axes (each node at its
    local shapes and microbatch), each partial gradient once, a value moved once per destination
    and :func:`autopar.passes.cost.facts.move_scope` (as the rewrite shares the move; the ILP,
    linear, prices every edge). Memory as the runtime holds it: model state (ZeRO-sharded),
    gradient-sync buckets (a flat copy of every synced gradient), the activations autograd saves
    and, at the start of backward, about two tensors of the largest activation (the loss's
    gradient chain); gradients grow as activations are freed (see :attr:`Cost.peak_memory`).
    Then the ``schedule``'s recomputation, microbatches, pipeline and what overlaps hide
    (:mod:`autopar.passes.cost.schedule`, :mod:`autopar.passes.cost.overlap`).
    """
    return PricedConfiguration.of(facts, degrees, strategies, mesh, hardware, zero).under(schedule)


@dataclass
class LayoutTerms:
    """What any schedule and any ZeRO stage that syncs alike (:meth:`of`) need of one solved
    layout, each computed once: its cost as one batch with the model state left out
    (:func:`_layout_cost`), the sums over layers (:func:`layer_terms`), what its overlaps need
    (:class:`StepParts`); per microbatch count, its compute (:func:`step_times`) and layer rows;
    per (stage modules, microbatches), the balanced cut points."""

    facts: dict[str, NodeFacts]
    cost: Cost  # compute (one microbatch), communication, gradient sync, activations: not the model state
    synced: set[str]  # parameters whose gradients are synchronized
    local: ShardedShapes  # every node's local shapes once all axes are solved
    link: LinkTier  # the tier a pipeline's stage boundaries cross
    parts: StepParts = StepParts()
    sync_once_s: float = 0.0  # ZeRO-1/2's parameter all-gather, once per step (after the optimizer)
    regather_s: float = 0.0  # under Schedule.regather: backward's second gathers (axis_terms.regathers)
    regathered: frozenset[tuple[str, int]] = frozenset()  # the (linear, input slot) they serve
    recompute_gather_s: float = 0.0  # ZeRO-3 under full recomputation: a stack's gathers for it (zero_traffic)
    made_of: tuple = ()  # (degrees, strategies, mesh, hardware): for :meth:`compiled_traffic`
    _terms: dict = field(default_factory=dict)
    _times: dict = field(default_factory=dict)
    _rows: dict = field(default_factory=dict)
    _starts: dict = field(default_factory=dict)  # microbatches -> BalancedStarts
    _splits: dict = field(default_factory=dict)

    @classmethod
    def of(
        cls, facts, degrees, strategies, mesh, hardware: HardwareProfile, zero: int = 0, memo: dict | None = None
    ) -> LayoutTerms:
        """The terms of ``strategies``; of ZeRO only whether it regathers weights (stage 3) or
        reduce-scatters gradients every microbatch (stage 2) matters.
        ``memo`` keeps each axis's :func:`traffic` for layouts that share their first axes."""
        layout = _layout_cost(facts, degrees, strategies, mesh, hardware, zero, memo)
        return cls(**layout, link=hardware.link(mesh.shape, mesh.size), made_of=(degrees, strategies, mesh, hardware))

    def compiled_traffic(self, zero: int, schedule: Schedule) -> tuple[float, float]:
        """(exposed communication, exposed gradient sync) of the compiled step (:mod:`replay`):
        every collective noted, then replayed against the compute it can hide behind. A folded
        graph replays its kept layers, each inner one's compute and collectives times the layers it
        stands for (:attr:`NodeFacts.weight`)."""
        degrees, strategies, mesh, hardware = self.made_of
        step = CompiledStep()
        for ctx, _, _ in axis_contexts(self.facts, degrees, strategies, mesh, hardware, zero, step=step):
            if ctx is None:
                break
        comm, sync = step.exposed(
            self.facts,
            self.local.work,
            syncs_whole_in_program(zero, schedule),
            zero == 3 or scatters_in_program(zero, schedule),
            schedule.async_tp,
            concurrency=hardware.hidden(hardware.overlap),
            sync_window=1 / schedule.microbatches if accumulates_in_program(zero, schedule) else 1.0,
        )
        return comm + step.kernel_s, sync

    def terms(self, regather: bool = False) -> LayerTerms:
        """The sums over layers; with ``regather``, the regathered inputs saved as their shards."""
        if regather not in self._terms:
            self._terms[regather] = layer_terms(self.facts, self.local, self.regathered if regather else frozenset())
        return self._terms[regather]

    def times(self, microbatches: int) -> StepTimes:
        """The layout's compute, its batch run in ``microbatches`` pieces."""
        if microbatches not in self._times:
            self._times[microbatches] = step_times(self.facts, self.local, microbatches)
        return self._times[microbatches]

    def split(self, schedule: Schedule) -> StageSplit | None:
        """Where ``schedule``'s stage modules cut the layers (its pinned cuts, else balanced)."""
        if schedule.stages == 1:
            return None
        micro = schedule.microbatches
        if micro not in self._rows:  # a layer's compute follows a microbatch's shapes
            self._rows[micro] = layer_costs(self.facts, self.local, micro)
        rows = self._rows[micro]
        # the cuts depend on the modules and microbatches; the shares also on which device runs which module
        key = (schedule.modules, micro)
        split_key = (key, schedule.stages, tuple(map(tuple, schedule.device_modules())), schedule.cuts)
        if split_key not in self._splits:
            starts = None
            if not schedule.cuts and len(rows) >= schedule.modules:
                if micro not in self._starts:  # one dynamic program per microbatch count, any count of modules
                    self._starts[micro] = balanced_starts(rows, micro, self.link)
                starts = self._starts[micro](schedule.modules)
            self._splits[split_key] = split_rows(rows, schedule, self.link, starts)
        return self._splits[split_key]


@dataclass
class PricedConfiguration:
    """One configuration's cost as one batch (everything saved, one stage), ready to price any
    schedule on: :meth:`under` reuses the sums over nodes and the stage cuts of its layout, so
    the search prices every schedule of a configuration for the cost of one pass over the graph
    (and one more per microbatch count: GEMMs run at a microbatch's shapes).

    >>> priced = PricedConfiguration.of(facts, degrees, strategies, mesh, hardware)   # doctest: +SKIP
    >>> priced.under(Schedule(stages=2, microbatches=8)).step_s                         # doctest: +SKIP
    """

    cost: Cost
    zero: int
    layout: LayoutTerms
    accumulate_s: float = 0.0  # each microbatch after the first's gradient accumulation

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
        that syncs alike (both 3, both 2, or both below 2 where ZeRO-1 all-reduces)."""
        layout = layout or LayoutTerms.of(facts, degrees, strategies, mesh, hardware, zero)
        memory, optimizer_s, accumulate_s = _model_state(facts, layout, degrees, mesh, hardware, zero)
        cost = dataclasses.replace(layout.cost, memory={**memory, **layout.cost.memory}, optimizer_s=optimizer_s)
        return cls(cost, zero, layout, accumulate_s)

    def split(self, schedule: Schedule) -> StageSplit | None:
        return self.layout.split(schedule)

    def under(self, schedule: Schedule) -> Cost:
        """The cost under ``schedule`` (as :func:`evaluate`)."""
        # ZeRO-1/2's parameter gather runs once per step, after the optimizer: nothing to hide behind
        once = self.layout.sync_once_s if self.zero in (1, 2) else 0.0  # ZeRO-0 may price on ZeRO-1's layout
        parts = dataclasses.replace(
            self.layout.parts, zero=self.zero, gather_once_s=once, accumulate_s=self.accumulate_s
        )
        cost = self.cost
        if schedule.compiled:  # what the compiled schedule leaves exposed replaces the profile's overlap
            comm, sync = self.layout.compiled_traffic(self.zero, schedule)
            cost = dataclasses.replace(cost, comm_s=comm, grad_sync_s=sync)
            parts = dataclasses.replace(parts, tp_comm_s=0.0, replayed=True, gather_once_s=0.0)
        if self.zero >= 2:  # gradients are reduce-scattered (ZeRO-3: weights regathered) every microbatch
            again = self.layout.recompute_gather_s if schedule.recompute == Recompute.FULL else 0.0
            cost = dataclasses.replace(cost, grad_sync_s=(cost.grad_sync_s + again) * schedule.microbatches)
        if schedule.regather:  # backward gathers the kept shards again, as tensor parallelism's collectives run
            cost = dataclasses.replace(cost, comm_s=cost.comm_s + self.layout.regather_s)
            parts = dataclasses.replace(parts, tp_comm_s=parts.tp_comm_s + self.layout.regather_s)
        times = self.layout.times(schedule.microbatches)
        return scheduled(
            cost,
            self.layout.terms(schedule.regather),
            times,
            schedule,
            self.split(schedule),
            self.layout.link,
            self.layout.made_of[3],
            parts,
        )


def _layout_cost(facts, degrees, strategies, mesh, hardware: HardwareProfile, zero: int, memo: dict | None = None):
    """The fields of :class:`LayoutTerms` that one pass over the graph gives: the cost of one
    batch with everything saved on one stage, model state left out (compute at one microbatch);
    the parameters whose gradients are synced; the local shapes; what overlaps need. Every sum
    over nodes weighs a node, and every sum over edges the edge's consumer, by its weight."""
    comm = sync = once = tp_comm = regather_s = recompute_s = 0.0
    synced: set[str] = set()
    regathered: frozenset[tuple[str, int]] = frozenset()
    for ctx, _, moved in axis_contexts(facts, degrees, strategies, mesh, hardware, zero, memo):
        if ctx is None:
            local = moved  # the shapes after every axis
            break
        comm, sync, once = comm + moved.comm_s, sync + moved.sync_s, once + moved.sync_once_s
        tp_comm += moved.comm_s if ctx.name == Axis.TP else 0.0
        synced |= moved.synced
        regather_s, regathered = regather_s + moved.regather_s, regathered | moved.regathered
        recompute_s += moved.recompute_gather_s
    flops = sum(
        (f.profile.forward_flops + (f.profile.backward_flops if f.needs_grad else 0.0)) * local.work[n] * f.weight
        for n, f in facts.items()
    )
    activations = largest = 0.0
    for name, fact in facts.items():
        if fact.kind != "param":
            activations += activation_bytes(fact, local.shapes[name], local.work[name]) * fact.weight
            largest = maximum(largest, transient_bytes(fact, local.shapes[name]))
    memory = {"activations": activations, "temporary": largest}
    compute = step_times(facts, local, 1).compute_s
    cost = Cost(compute_s=compute, comm_s=comm, grad_sync_s=sync, memory=memory, model_flops=flops)
    tp = degrees.get(Axis.TP, 1)
    parts = StepParts(
        tp_comm_s=tp_comm,
        scatter=tp,
        scatter_link=hardware.link(mesh.shape, tp, tp) if tp > 1 else None,
        replicated=frozenset(n for n, s in strategies.get(Axis.TP, {}).items() if isinstance(s.output, Replicate)),
        zero=zero,
    )
    return {
        "facts": facts,
        "cost": cost,
        "synced": synced,
        "local": local,
        "parts": parts,
        "sync_once_s": once,
        "regather_s": regather_s,
        "regathered": regathered,
        "recompute_gather_s": recompute_s,
    }


def _model_state(facts, layout: LayoutTerms, degrees, mesh, hardware: HardwareProfile, zero: int):
    """(memory by category of weights, gradients, optimizer state and gradient-sync buckets;
    the optimizer step's seconds; each microbatch after the first's gradient accumulation's
    seconds) under ZeRO ``zero``."""
    dp = degrees.get(Axis.DP, 1)
    memory = dict.fromkeys(("params", "grads", "optimizer", "grad_buckets"), 0.0)
    update_s = accumulate_s = 0.0
    contention = hardware.contention(mesh.shape)
    synced_by_layer: dict[str, float] = {}  # one layer's (or a leaf outside layers') synced gradient bytes
    largest_synced = 0.0
    for name, fact in facts.items():
        if fact.kind != "param":
            continue
        elements = numel(layout.local.shapes[name][0]) * fact.weight
        for category, nbytes in param_state_bytes(elements, fact, dp, zero).items():
            memory[category] += nbytes
        if name in layout.synced:
            memory["grad_buckets"] += elements * fact.grad_bytes
            group = layer_of(fact.name) or name
            one = elements * fact.grad_bytes / fact.weight
            synced_by_layer[group] = synced_by_layer.get(group, 0.0) + one
            largest_synced = maximum(largest_synced, one)
        update_s += state_update_s(elements, fact, zero, dp, hardware, contention)
        accumulate_s += accumulation_s(elements, fact, zero, dp, hardware, contention)
    if zero >= 2 and dp > 1 and synced_by_layer:
        # DDP and ZeRO-1 keep a flat copy of every synced gradient for the whole step; ZeRO-2 frees
        # each bucket once reduce-scattered (runtime/grad_sync.py), ZeRO-3 each layer group's
        # (runtime/zero/reduce_scatter.py, as FSDP2), or each parameter's for a stack that
        # reduce-scatters them alone: one filling while the one before is in flight
        group = largest_synced if hardware.zero3_per_parameter else maximum(*synced_by_layer.values())
        in_flight = 2 * (group if zero >= 3 else maximum(bucket_cap(1), largest_synced))
        memory["grad_buckets"] = minimum(memory["grad_buckets"], in_flight)
    return memory, update_s, accumulate_s


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
    trained in the plan's precision and run as its schedule says (compiled or eager)."""
    hardware = hardware.running(plan.schedule.compiled)
    facts = analyze(captured, hardware, hardware.contention(plan.mesh.shape), PrecisionPolicy.of(plan.precision))
    strategies = strategies_from_plan(plan, facts)
    return evaluate(
        facts, plan.degrees, strategies, stage_mesh(plan.mesh, plan.schedule.stages), hardware, plan.zero, plan.schedule
    )
