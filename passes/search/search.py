"""Search: choose the pipeline stages, the parallel degrees, ZeRO, the schedule and every
node's placement with the cost model.

Identical layers are folded first (:mod:`fold`): the search runs on a reduced graph whose ILPs
and sums do not grow with depth, and the chosen plan is expanded to every node and priced on
the whole graph. Outer loop: every configuration of :mod:`space` — pipeline stages over the
outermost mesh dimension, degrees of one stage, ZeRO stage —, weighed on predicted step time
unless one of :mod:`space`'s rules proves it cannot be chosen; the lowest bounds first, after a
few seeds likely to be good (a fast plan found early lets the bounds prune the rest). Per
configuration the layout (per mesh axis, outermost first, the ILP of :mod:`axes`) is solved
without the memory budget once per ZeRO class (see :mod:`space`), sharing each axis's solution
with the configurations that have the same axes before it, and every schedule of :mod:`schedule`
is priced on it. Only at a recomputation level where that layout fits no schedule is it solved
again under the budget. The tie rule (:mod:`ranking`) chooses among every fitting
(configuration, schedule).

Pre: a :class:`CapturedGraph` and :class:`PlanOptions`. Post: a :class:`Plan` naming a
placement per node and parameter, the cost model's prediction, and the search log (each
configuration tried, with its fastest fitting schedule, or pruned, with its rule); or
:class:`MemoryLimitError` with the per-device breakdown of the leanest configuration weighed.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from autopar.ir import (
    DATA_SIZED,
    Axis,
    ConfigError,
    HardwareProfile,
    MemoryLimitError,
    Mesh,
    NodeDecision,
    Plan,
    PlanOptions,
    Recompute,
    Replicate,
    batch_split,
)
from autopar.passes.capture.graph import CapturedGraph, module_path
from autopar.passes.cost.collectives import reshard_collectives
from autopar.passes.cost.evaluate import LayoutTerms, PricedConfiguration, evaluate, stage_mesh
from autopar.passes.cost.facts import NodeFacts, analyze
from autopar.passes.rewrite.gradients import plan_gradients
from autopar.passes.rewrite.stages import layers_out_of_order, out_of_order_error, whole_batch_error, whole_batch_node
from autopar.passes.search.axes import ahead_floors, solve_axes, split_dims
from autopar.passes.search.fold import LayerFolding, fold_layers
from autopar.passes.search.pins import user_pins
from autopar.passes.search.ranking import Candidate, choose, near, within_reach
from autopar.passes.search.schedule import NO_SAVING, accumulations, leanest, levels, price, variants
from autopar.passes.search.space import (
    BOUND,
    MEMORY,
    NO_PIPELINE,
    LowerBounds,
    configurations,
    optional_dims,
    schedule_shapes,
)
from autopar.passes.sharding.rules import rule_for
from autopar.passes.sharding.strategies import Strategy, local_shape

R = Replicate()


@dataclass(frozen=True)
class SearchContext:
    """What every configuration with one number of pipeline stages shares: the (folded)
    graph's facts, the devices of one stage, the hardware, the user's options and the budget."""

    facts: dict[str, NodeFacts]
    mesh: Mesh  # one pipeline stage's devices (the whole mesh without stages)
    hardware: HardwareProfile
    options: PlanOptions
    limit: float  # bytes per device
    stages: int
    batch_dims: dict[str, Strategy]  # node → where its batch dim is (never split by other axes)
    sequence_dims: dict[str, Strategy]  # node → where its sequence dim is (matmuls split it only on cp)
    variable: dict[str, str]  # node → the node whose ILP variable it shares (identical layers)
    twin: dict[str, str]  # node → its counterpart in the first of its identical layers (LayerFolding.twin)
    memo: dict = field(default_factory=dict)  # each node's candidates per axis and local shapes


@dataclass(frozen=True)
class SearchProgress:
    """Where a running search stands (for ``autopar plan``'s progress line)."""

    done: int  # configurations weighed so far, tried or pruned
    total: int
    pruned: int
    best: Candidate | None  # the fastest fitting plan so far
    elapsed_s: float


def search(
    captured: CapturedGraph,
    mesh: Mesh,
    options: PlanOptions = PlanOptions(),
    *,
    fold: bool = True,
    progress: Callable[[SearchProgress], None] | None = None,
) -> Plan:
    """Find the cheapest plan for ``captured`` on ``mesh`` (see the module docstring).

    ``fold=False`` solves every node on its own (the same plan where identical layers are laid
    out alike, which the folded search assumes; for comparison). ``progress`` is called after
    each configuration is weighed.
    """
    with _collector_paused():
        return _search(captured, mesh, options, fold, progress)


@contextmanager
def _collector_paused():
    """Python's cyclic collector rescans the whole heap (the captured graph, the facts, the
    search's memo) every few thousand allocations, and a search allocates millions of short-lived
    objects that free themselves (strategies, terms, cost tables): about a seventh of its time.
    Paused for the search; what it leaves in cycles is collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _search(captured: CapturedGraph, mesh: Mesh, options: PlanOptions, fold: bool, progress) -> Plan:
    started = time.perf_counter()
    cycling = layers_out_of_order(captured.graph)
    if cycling is not None:  # no stage cut by layer can run it
        if (options.stages or 1) > 1:
            raise out_of_order_error(cycling)
        options = dataclasses.replace(options, degrees={**(options.degrees or {}), Axis.PP: 1})
    whole_batch = whole_batch_node(captured.graph)
    if whole_batch is not None:  # the batch runs whole: no pipeline, no accumulation
        if (options.stages or 1) > 1 or (options.microbatches or 1) > 1:
            raise whole_batch_error(whole_batch)
        options = dataclasses.replace(options, degrees={**(options.degrees or {}), Axis.PP: 1}, microbatches=1)
    hardware = options.profile
    whole = analyze(captured, hardware, hardware.contention(mesh.shape), options.precision_policy)
    folding = fold_layers(whole, user_pins(whole, options.constraints or {})) if fold else LayerFolding.unfolded(whole)
    facts = folding.facts
    batch = _batch_size(captured, facts)
    limit = options.memory_limit if options.memory_limit is not None else hardware.memory_bytes
    # the sequence is a dim of its own only where attention mixes it
    batch_dims = split_dims(facts, hardware, Axis.DP, variable=folding.variable)
    sequence_dims = (
        split_dims(facts, hardware, Axis.CP, batch_dims, folding.variable) if Axis.CP in optional_dims(facts) else {}
    )
    memo: dict = {}  # what the search computes once: candidates, edge times, each axis's traffic and shapes after it
    bounds = LowerBounds(facts, hardware, folding.variable, memo)
    weighed = _Weighing(facts, mesh, hardware, options, limit, batch, bounds)
    weighed.run(
        lambda stages: SearchContext(
            facts,
            stage_mesh(mesh, stages),
            hardware,
            options,
            limit,
            stages,
            batch_dims,
            sequence_dims,
            folding.variable,
            folding.twin,
            memo,
        ),
        progress,
        started,
    )
    best = weighed.best()
    stage = stage_mesh(mesh, best.schedule.stages)
    strategies = folding.expand(best.layout)
    cost = evaluate(whole, best.degrees, strategies, stage, hardware, best.zero, best.schedule)
    replicated = sorted(
        {
            str(f.node.target)
            for f in whole.values()
            if f.kind == "op" and f.out_shapes and rule_for(f.node.target) is None
        }
    )
    policy = options.precision_policy  # priced by the cost model (analyze), recorded in the plan
    plan = _to_plan(captured, whole, strategies, dataclasses.replace(best, cost=cost), mesh, hardware)
    return dataclasses.replace(
        plan,
        batch_size=batch,
        search=tuple(weighed.log),
        search_time_s=time.perf_counter() - started,
        replicated_ops=tuple(replicated),
        precision=policy.precision,
        reduce_dtype=policy.reduce_dtype,
    )


class _Weighing:
    """The outer loop's state: the configurations, what was tried and pruned, the fitting plans."""

    def __init__(self, facts, mesh: Mesh, hardware, options: PlanOptions, limit: float, batch: int, bounds):
        self.facts, self.mesh, self.hardware, self.options = facts, mesh, hardware, options
        self.limit, self.batch, self.bounds = limit, batch, bounds
        self.layers = len(
            {f.layer for f in facts.values() if f.layer} | {x for f in facts.values() for x in f.folded_layers}
        )
        self.log: list[dict] = []
        self.candidates: list[Candidate] = []
        self.fastest = math.inf
        self.leanest: tuple[float, dict, str] | None = None  # (peak memory, log entry, breakdown) of the leanest tried
        self.least_state = math.inf  # the least Cost.state_memory of any configuration tried
        self.memory_pruned: list[tuple[float, int, dict[str, int], int]] = []

    def configurations(self) -> list[tuple[int, dict[str, int], int, tuple[tuple[float, int], ...]]]:
        """(stages, degrees, ZeRO stage, its schedules' :func:`schedule_shapes`) of every
        configuration; unpinned stage counts that no schedule runs are left out."""
        found, refusal = [], None
        for stages, degrees in configurations(self.facts, self.mesh, self.options, self.hardware, self.batch):
            local_batch = self.batch // batch_split(degrees)
            try:
                runnable = variants(
                    leanest(self.options, stages, local_batch, NO_SAVING), self.options, local_batch, self.layers
                )
            except ConfigError as error:
                if self.options.stages:
                    raise
                refusal = refusal or error
                continue
            runs = schedule_shapes(runnable)
            dp = degrees[Axis.DP]
            if self.options.zero is not None:
                zeros = [self.options.zero] if self.options.zero == 0 or dp > 1 else []
            else:
                zeros = [0, 1, 2, 3] if dp > 1 else [0]
            found += [(stages, degrees, zero, runs) for zero in zeros]
        if not found and self.options.zero:
            raise ConfigError(
                f"zero={self.options.zero} shards model state over the data-parallel axis: pin a dp degree above 1"
            )
        if not found:
            raise refusal
        return found

    def run(self, context_for, progress, started: float) -> None:
        space = self.configurations()
        bound = {i: self.bounds.step_s(self.mesh, s, d, z, b) for i, (s, d, z, b) in enumerate(space)}
        # lowest bound first; but first, per stage count, the most batch split (dp x ep) with tensor
        # parallelism off and over one node, its ZeRO stage and its ep the lowest bound's (a good plan
        # found early lets the bounds prune)
        seeds = {}
        node = self.mesh.shape[-1]
        for i in sorted(range(len(space)), key=lambda i: (-batch_split(space[i][1]), bound[i])):
            stages, degrees, _, _ = space[i]
            if Axis.CP not in degrees and degrees[Axis.TP] in (1, node):
                seeds.setdefault((stages, degrees[Axis.TP]), i)
        order = list(seeds.values()) + sorted(set(range(len(space))) - set(seeds.values()), key=lambda i: bound[i])
        contexts, caches, layouts = {}, {}, {}
        for done, i in enumerate(order, 1):
            stages, degrees, zero, runs = space[i]
            entry = {"stages": stages, "degrees": degrees, "zero": zero, "bound_s": bound[i]}
            state = self.bounds.model_state_bytes(stages, degrees, zero)
            if state > self.limit:
                self.log.append({**entry, "pruned": MEMORY, "bound_bytes": state})
                self.memory_pruned.append((state, stages, degrees, zero))
            elif len(space) > 1 and not within_reach(bound[i], self.fastest):
                self.log.append({**entry, "pruned": BOUND})
            else:
                ctx = contexts.setdefault(stages, context_for(stages))
                key = (stages, tuple(degrees.items()))
                self._weigh(ctx, degrees, zero, caches.setdefault(stages, {}), layouts.setdefault(key, {}), entry, runs)
            if progress is not None:
                pruned = sum("pruned" in e for e in self.log)
                best = min(self.candidates, key=lambda c: c.cost.step_s, default=None)
                progress(SearchProgress(done, len(space), pruned, best, time.perf_counter() - started))
        if not self.candidates and self.leanest is None and self.memory_pruned:
            _, stages, degrees, zero = min(self.memory_pruned, key=lambda m: m[0])  # for its breakdown
            self._weigh(
                context_for(stages), degrees, zero, {}, {}, {"stages": stages, "degrees": degrees, "zero": zero}
            )

    def _weigh(
        self, ctx: SearchContext, degrees, zero: int, cache: dict, layouts: dict, entry: dict, runs=NO_PIPELINE
    ) -> None:
        """Solve one configuration's layout, price its schedules, keep what the tie rule could choose
        (the rules named here are :mod:`space`'s)."""
        options, hardware = self.options, self.hardware
        local_batch = self.batch // batch_split(degrees)
        # ZeRO-0 and -2 on ZeRO-1's layout, whichever of the three comes first (each priced with its own traffic below)
        solved = zero if options.zero is not None or degrees[Axis.DP] == 1 else 3 if zero == 3 else 1
        zero_class = 3 if solved == 3 else min(solved, 1)
        if zero_class not in layouts:
            base = leanest(options, ctx.stages, local_batch, levels(options)[0][0])
            # the layout's floors bound every ZeRO stage that shares it: the least of theirs (ZeRO-0 and -2
            # can move less than ZeRO-1); the last axis's sync is ZeRO-1's where that axis is dp: left out
            sharing = (0, 1, 2) if solved == 1 and options.zero is None else (solved,)
            dp_last = all(size == 1 for axis, size in degrees.items() if axis != Axis.DP)
            floors = [min(self.bounds.step_s(self.mesh, ctx.stages, degrees, z, runs) for z in sharing)]

            def worth(before, work, sync) -> bool:  # the rule "bound", once the axes before the last are solved
                last = (work, 0.0 if dp_last and len(sharing) > 1 else sync)
                floors.append(
                    min(self.bounds.layout_s(ctx.stages, degrees, z, before, last, ctx.mesh, runs) for z in sharing)
                )
                return within_reach(floors[-1], self.fastest)

            reach = True
            for ahead in ahead_floors(ctx, degrees, solved, base):  # the rule "bound" before any axis is solved
                floors.append(min(self.bounds.ahead_s(ctx.stages, degrees, z, ahead, ctx.mesh, runs) for z in sharing))
                reach = within_reach(floors[-1], self.fastest)
                if not reach:
                    break
            strategies = solve_axes(ctx, degrees, solved, base, cache=cache, worth=worth) if reach else None
            terms = strategies and LayoutTerms.of(ctx.facts, degrees, strategies, ctx.mesh, hardware, solved, ctx.memo)
            layouts[zero_class] = (strategies, terms, max(floors))
        strategies, terms, floor = layouts[zero_class]
        if strategies is None:
            self.log.append({**entry, "pruned": BOUND})
            return
        floor = entry["layout_bound_s"] = max(floor, entry.get("bound_s", floor))  # both bound this ZeRO stage
        # ZeRO-2 moves its own traffic on ZeRO-1's layout (a reduce-scatter per microbatch); so does ZeRO-0
        # (an all-reduce) where ZeRO-1 reduce-scatters (Megatron's distributed optimizer)
        if zero == 2 or zero < solved and hardware.zero1_reduce_scatter:
            key = ("sync", zero)
            if key not in layouts:
                layouts[key] = LayoutTerms.of(ctx.facts, degrees, strategies, ctx.mesh, hardware, zero, ctx.memo)
            terms = layouts[key]
        free = PricedConfiguration.of(ctx.facts, degrees, strategies, ctx.mesh, hardware, zero, layout=terms)
        tried, budgeted = [], {}
        for rung in levels(options):
            fits = False
            for level in rung:
                base = leanest(options, ctx.stages, local_batch, level)
                if base.regather and not free.layout.regathered:
                    continue  # no gathered input to keep as its shard: the level without regather
                schedules = variants(base, options, local_batch, self.layers)
                priced = [(strategies, s, c) for s, c in price(free, schedules)]
                tried += priced
                if any(c.peak_memory <= self.limit for _, _, c in priced):
                    fits = True  # saving more on this layout only adds time
                    continue
                accumulating = accumulations(base, options, local_batch)  # the local batch does not fit at once
                tried += [(strategies, s, c) for s, c in price(free, accumulating)]
                schedules += accumulating
                if solved != zero:  # ZeRO-0 stays on ZeRO-1's layout: under the budget ZeRO-1 holds less (for a gather)
                    continue
                if not within_reach(floor + self.bounds.recompute_s(ctx.stages, degrees, level[0]), self.fastest):
                    continue  # the rule "bound": no layout recomputing this much can win
                if level[0] not in budgeted:  # the layout under the budget (whose ILP counts no regather)
                    bound = solve_axes(ctx, degrees, zero, base, limit=self.limit, cache=cache)
                    budgeted[level[0]] = (
                        bound,
                        PricedConfiguration.of(ctx.facts, degrees, bound, ctx.mesh, hardware, zero),
                    )
                bound, lean = budgeted[level[0]]
                tried += [(bound, s, c) for s, c in price(lean, schedules)]
            if fits:
                break
        fitting = [Candidate(degrees, zero, s, c, layout) for layout, s, c in tried if c.peak_memory <= self.limit]
        self.least_state = min([self.least_state] + [c.state_memory for _, _, c in tried])
        if fitting:
            fastest = min(c.cost.step_s for c in fitting)
            self.fastest = min(self.fastest, fastest)
            self.candidates += near(fitting, fastest)
            shown = min(fitting, key=lambda c: c.cost.step_s)
            schedule, cost = shown.schedule, shown.cost
        else:
            _, schedule, cost = min(tried, key=lambda t: t[2].peak_memory)
            breakdown = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in cost.memory.items())
            if self.leanest is None or cost.peak_memory < self.leanest[0]:
                self.leanest = (cost.peak_memory, entry, breakdown)
        self.log.append(
            {
                **entry,
                "schedule": {**dataclasses.asdict(schedule), "cuts": list(schedule.cuts)},
                "step_s": cost.step_s,
                "peak_memory": cost.peak_memory,
                "feasible": bool(fitting),
            }
        )

    def best(self) -> Candidate:
        if self.candidates:
            return choose(self.candidates)
        peak, entry, breakdown = self.leanest
        raise MemoryLimitError(
            f"no plan fits the memory limit of {self.limit / 2**20:.1f} MiB per device on mesh {self.mesh}. "
            f"The leanest configuration weighed ({_degrees_str(entry)}) needs {peak / 2**20:.1f} MiB: {breakdown}. "
            f"{_memory_advice(self.options, self.least_state > self.limit)}"
        )


def _memory_advice(options: PlanOptions, state_over: bool) -> str:
    """What to change where no plan fits: first the pins that kept leaner plans out, then the rest
    (``state_over``: every configuration's weights, gradients and optimizer state alone exceed the
    limit, which no recomputation, accumulation or smaller batch changes)."""
    rest = "raise memory_limit, use more devices, accumulate gradients (microbatches=N), or shrink the batch or model."
    if state_over:
        rest = (
            "raise memory_limit, use more devices, or shrink the model: its weights, gradients and optimizer state "
            "alone exceed the limit, which recomputation, accumulation or a smaller batch cannot change."
        )
    pins = []
    if options.zero is not None and options.zero < 3:
        pins.append(f"zero={options.zero} (zero=3 shards parameters, gradients and optimizer state)")
    if options.recompute is not None and options.recompute != Recompute.FULL:
        pins.append(f"recompute={str(options.recompute)!r} ('full' keeps only each layer's input)")
    if not pins:
        return rest[0].upper() + rest[1:]
    if len(pins) == 1:
        return f"The pin {pins[0]} keeps leaner plans out: lift it, or {rest}"
    return f"The pins {' and '.join(pins)} keep leaner plans out: lift them, or {rest}"


def _batch_size(captured: CapturedGraph, facts: dict[str, NodeFacts]) -> int:
    shapes = [facts[name].out_shape for name in captured.user_inputs if facts[name].out_shape]
    return shapes[0][0] if shapes else 1


def _degrees_str(entry: dict) -> str:
    stages = f"pp={entry['stages']} x " if entry["stages"] > 1 else ""
    return stages + " x ".join(f"{k}={v}" for k, v in entry["degrees"].items()) + f", ZeRO-{entry['zero']}"


def _to_plan(captured, facts, strategies, best: Candidate, mesh, hardware) -> Plan:
    axes = list(best.degrees)
    nodes, params, inputs = {}, {}, {}
    for name, fact in facts.items():
        per_axis = [strategies[a].get(name) for a in axes]
        if fact.kind == "op" or fact.kind == "output":
            if fact.kind == "output":
                slot_pl = tuple(tuple(R for _ in axes) for _ in fact.slots)
                out = None
            elif any(s is None for s in per_axis):
                if not fact.node.meta.get(DATA_SIZED):
                    continue
                slot_pl, out = tuple(tuple(R for _ in axes) for _ in fact.slots), None  # a size read: alike everywhere
            else:
                slot_pl = tuple(tuple(s.inputs[i] for s in per_axis) for i in range(len(fact.slots)))
                out = tuple(s.output for s in per_axis)
            kernel = next((s.kernel for s in per_axis if s is not None and s.kernel), "")
            nodes[name] = NodeDecision(
                op=str(fact.node.target),
                module=module_path(fact.node),
                inputs=slot_pl,
                output=out,
                comm_bytes=_moved_bytes(fact, slot_pl, strategies, facts, best.degrees),
                kernel=kernel,
            )
        elif fact.kind == "param":
            params[fact.name] = tuple(s.output for s in per_axis)
        elif fact.kind == "input":
            inputs[name] = tuple(s.output for s in per_axis)
    plan = Plan(
        mesh=mesh,
        degrees=dict(best.degrees),
        nodes=nodes,
        params=params,
        grad_sync={},
        inputs=inputs,
        cost=best.cost,
        fingerprint=captured.fingerprint,
        hardware=hardware.name,
        batch_size=0,
        zero=best.zero,
        schedule=best.schedule,
    )
    gradients = plan_gradients(captured.graph, plan, captured.params, captured.user_inputs)
    grad_sync = {captured.params[name]: axes for name, axes in gradients.synced_params.items()}
    return dataclasses.replace(plan, grad_sync=grad_sync)


def _moved_bytes(fact: NodeFacts, wanted, strategies, facts, degrees: dict[str, int]) -> float:
    """Bytes of the collectives that bring ``fact``'s inputs from where their producers leave them
    to ``wanted`` (per slot, one placement per axis), forward and backward, in a step: each counted
    at the size of the value it takes on one rank, as ``autopar plan`` counts the program's (a move
    several consumers share counts with each)."""
    total, sizes = 0.0, list(degrees.values())
    for slot, shape, dst in zip(fact.slots, fact.slot_shapes, wanted):
        src = [strategies[axis].get(slot.name) for axis in degrees]
        if slot.name not in facts or shape is None or any(s is None for s in src):
            continue
        for index, size in enumerate(sizes):
            kinds = reshard_collectives(src[index].output, dst[index], facts[slot.name].needs_grad) if size > 1 else ()
            local = tuple(shape)  # the value on this axis: sharded by the others
            for other, other_size in enumerate(sizes):
                local = local_shape(local, src[other].output, other_size) if other != index else local
            total += len(kinds or ()) * math.prod(local) * facts[slot.name].elem_bytes
    return total
