"""Search: choose the parallel degrees and every node's placement with the cost model.

Outer loop: every split of the devices into data × tensor parallel degrees (or the pinned
one). Inner loop, per mesh axis, outermost first: the ILP of :mod:`ilp` picks one
:class:`Strategy` per node. The data-parallel axis pins user inputs to their batch dim and
parameters to replicated; the tensor-parallel axis is free but for user pins
(``constraints``). The memory budget binds on the last axis, where all sharding is known.

Pre: a :class:`CapturedGraph`. Post: a :class:`Plan` naming a placement per node and
parameter, and the cost model's prediction; or :class:`MemoryLimitError` with the
per-device breakdown of the leanest configuration.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import time
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from autopar.ir import (
    Cost,
    HardwareProfile,
    MemoryLimitError,
    Mesh,
    NodeDecision,
    Placement,
    Plan,
    Replicate,
    Shard,
    ShardingRuleError,
    check_degrees,
    degree_choices,
    parse_placement,
)

from .capture import CapturedGraph, module_path
from .gradients import plan_gradients
from .cost import PARAM_STATE_BYTES, OpProfile, collective_time, compute_time, grad_sync_time, model_state_bytes, op_profile, reshard_time
from .ilp import ChoiceProblem, solve_choices
from .rules import node_strategies, pointwise, rule_for
from .strategies import OpView, Strategy, local_shape, numel, output_tensors, tensor_inputs, work_fraction

R = Replicate()
TIE_TOLERANCE = 0.05  # configurations this close in predicted time count as equally fast
IMPOSSIBLE_S = 1e3  # cost of a redistribution that cannot be done; never chosen when avoidable


@dataclass
class NodeFacts:
    """What the search needs to know about one node, computed once per graph."""

    node: fx.Node
    kind: str  # "param", "buffer", "input", "op", "output"
    slots: list[fx.Node]
    slot_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    elem_bytes: int
    full_time_s: float  # forward + backward on one device, unsharded
    needs_grad: bool
    name: str = ""  # parameter / buffer name
    profile: OpProfile = OpProfile(0.0, 0.0, 0.0)
    saved: bool = False  # autograd keeps this node's output for some backward

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.out_shapes[0] if self.out_shapes else ()


@dataclass
class ShardedShapes:
    """Local shapes of every node's output and inputs, as axes are solved one after another."""

    shapes: dict[str, list[tuple[int, ...]]]  # node → local output shapes
    slot_shapes: dict[str, list[tuple[int, ...]]]  # node → local shape of each tensor input
    work: dict[str, float]  # node → fraction of its work one rank still does

    @classmethod
    def unsharded(cls, facts: dict[str, NodeFacts]) -> "ShardedShapes":
        return cls(
            {n: list(f.out_shapes) for n, f in facts.items()},
            {n: list(f.slot_shapes) for n, f in facts.items()},
            {n: 1.0 for n in facts},
        )

    def after(self, chosen: dict[str, Strategy], size: int) -> "ShardedShapes":
        """The shapes once every node in ``chosen`` is placed on an axis of ``size``."""
        def out(n, shapes):
            return [local_shape(x, chosen[n].output, size) for x in shapes] if n in chosen else shapes

        def ins(n, shapes):
            return [local_shape(x, p, size) for x, p in zip(shapes, chosen[n].inputs)] if n in chosen else shapes

        return ShardedShapes(
            {n: out(n, shp) for n, shp in self.shapes.items()},
            {n: ins(n, shp) for n, shp in self.slot_shapes.items()},
            {n: w * (work_fraction(chosen[n], size) if n in chosen else 1.0) for n, w in self.work.items()},
        )


@dataclass
class AxisContext:
    name: str
    size: int
    link: object
    pins: dict[str, Placement]
    local: ShardedShapes  # before this axis
    overlap: float  # share of gradient sync hidden behind backward
    bind_memory: bool = False
    batch: dict[str, Strategy] | None = None  # node → its batch-dim sharding; never used on this axis


@dataclass
class ConfigResult:
    degrees: dict[str, int]
    strategies: dict[str, dict[str, Strategy]]  # axis → node → strategy
    cost: Cost
    feasible: bool = True
    replicated_ops: set[str] = field(default_factory=set)


def analyze(captured: CapturedGraph, hardware: HardwareProfile) -> dict[str, NodeFacts]:
    """Per-node facts: slots, shapes, unsharded cost, whether a gradient flows through it."""
    facts: dict[str, NodeFacts] = {}
    params, buffers = captured.params, captured.buffers
    for node in captured.graph.nodes:
        outputs = output_tensors(node)
        slots = tensor_inputs(node) if node.op in ("call_function", "output") else []
        slot_shapes = [_slot_shape(node, slot) for slot in slots]
        if node.op == "placeholder":
            kind = "param" if node.name in params else "buffer" if node.name in buffers else "input"
            needs_grad = kind == "param"
        elif node.op == "output":
            kind, needs_grad = "output", False
        else:
            kind = "op"
            needs_grad = any(facts[s.name].needs_grad for s in slots if s.name in facts) and any(
                t.dtype.is_floating_point for t in outputs
            )
        profile = op_profile(node, needs_grad) if kind == "op" else OpProfile(0.0, 0.0, 0.0)
        facts[node.name] = NodeFacts(
            node=node,
            kind=kind,
            slots=slots,
            slot_shapes=slot_shapes,
            out_shapes=[tuple(t.shape) for t in outputs],
            elem_bytes=outputs[0].element_size() if outputs else 4,
            full_time_s=compute_time(profile, hardware, needs_grad) if kind == "op" else 0.0,
            needs_grad=needs_grad,
            name=params.get(node.name) or buffers.get(node.name) or node.name,
            profile=profile,
        )
    for fact in facts.values():  # mark what autograd keeps: activation memory
        if fact.kind == "op" and fact.needs_grad:
            fact.saved = fact.saved or fact.profile.saves_output
            for slot in fact.profile.saved_inputs:
                facts[fact.slots[slot].name].saved = True
    return facts


def _slot_shape(node: fx.Node, slot: fx.Node) -> tuple[int, ...]:
    val = slot.meta.get("val")
    if isinstance(val, (tuple, list)):
        index = node.args[1] if node.target.__name__ == "getitem" else 0
        val = val[index]
    return tuple(val.shape)


def search(
    captured: CapturedGraph,
    mesh: Mesh,
    hardware: HardwareProfile,
    *,
    degrees: dict[str, int] | None = None,
    memory_limit: float | None = None,
    constraints: dict[str, object] | None = None,
) -> Plan:
    """Find the cheapest plan for ``captured`` on ``mesh`` (see the module docstring)."""
    started = time.perf_counter()
    facts = analyze(captured, hardware)
    batch = _batch_size(captured, facts)
    configs = [check_degrees(degrees, mesh.size)] if degrees else degree_choices(mesh.size)
    configs = [c for c in configs if batch % c["dp"] == 0] or configs
    limit = memory_limit if memory_limit is not None else hardware.memory_bytes
    batch_placements = _batch_strategies(facts, hardware)
    results = [_solve_config(facts, cfg, mesh, hardware, limit, constraints or {}, batch_placements) for cfg in configs]
    feasible = [r for r in results if r.feasible]
    if not feasible:
        leanest = min(results, key=lambda r: r.cost.peak_memory)
        breakdown = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in leanest.cost.memory.items())
        raise MemoryLimitError(
            f"no plan fits the memory limit of {limit / 2**20:.1f} MiB per device on mesh {mesh}. "
            f"The leanest configuration ({_degrees_str(leanest.degrees)}) needs {leanest.cost.peak_memory / 2**20:.1f} MiB: "
            f"{breakdown}. Raise memory_limit, use more devices, or shrink the batch or model."
        )
    fastest = min(r.cost.step_s for r in feasible)
    # Within the model's resolution, prefer the simplest plan: the most data parallelism.
    near = [r for r in feasible if r.cost.step_s <= fastest * (1 + TIE_TOLERANCE)]
    best = max(near, key=lambda r: (r.degrees["dp"], -r.cost.step_s))
    return _to_plan(captured, facts, mesh, hardware, best, results, batch, time.perf_counter() - started)


def _batch_size(captured: CapturedGraph, facts: dict[str, NodeFacts]) -> int:
    shapes = [facts[name].out_shape for name in captured.user_inputs if facts[name].out_shape]
    return shapes[0][0] if shapes else 1


def _degrees_str(degrees: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in degrees.items())


def _axis_spans(degrees: dict[str, int]) -> dict[str, int]:
    """Devices each axis's groups span: itself and every axis inside it (tp innermost)."""
    spans, inner = {}, 1
    for axis in reversed(list(degrees)):
        inner *= degrees[axis]
        spans[axis] = inner
    return spans


def _solve_config(facts, degrees, mesh, hardware, limit, constraints, batch) -> ConfigResult:
    axes = list(degrees)
    last_sharded = max((i for i, a in enumerate(axes) if degrees[a] > 1), default=-1)
    spans = _axis_spans(degrees)
    local = ShardedShapes.unsharded(facts)
    strategies: dict[str, dict[str, Strategy]] = {}
    feasible = True
    for index, axis in enumerate(axes):
        ctx = AxisContext(
            name=axis,
            size=degrees[axis],
            link=hardware.link(mesh.shape, spans[axis]),
            pins=_pins(facts, axis, degrees[axis], constraints),
            local=local,
            overlap=hardware.overlap,
            bind_memory=index == last_sharded,
            batch=None if axis == "dp" else batch,
        )
        chosen = _solve_axis(facts, ctx, limit)
        if chosen is None:
            feasible = False
            chosen = _solve_axis(facts, ctx, None)
        strategies[axis] = chosen
        local = local.after(chosen, ctx.size)
    cost = _evaluate(facts, degrees, strategies, mesh, hardware)
    if last_sharded < 0 and cost.peak_memory > limit:
        feasible = False
    replicated = {str(f.node.target) for f in facts.values() if f.kind == "op" and f.out_shapes and rule_for(f.node.target) is None}
    return ConfigResult(degrees, strategies, cost, feasible, replicated)


def _pins(facts, axis: str, size: int, constraints) -> dict[str, Placement]:
    pins = {}
    for name, fact in facts.items():
        if fact.kind == "buffer":
            pins[name] = R
        elif axis == "dp" and fact.kind == "param":
            pins[name] = R
        elif fact.kind == "input":
            batch_dim_ok = axis == "dp" and fact.out_shape and fact.out_shape[0] % size == 0
            pins[name] = Shard(0) if batch_dim_ok and size > 1 else R
    if axis == "tp":
        pins.update(_constraint_pins(facts, constraints))
    return pins


def _constraint_pins(facts, constraints) -> dict[str, Placement]:
    pins = {}
    for pattern, value in constraints.items():
        placement = parse_placement(value) if isinstance(value, str) else value
        matched = [
            name
            for name, f in facts.items()
            if (f.kind == "param" and fnmatch.fnmatchcase(f.name, pattern))
            or (f.kind == "op" and f.out_shapes and fnmatch.fnmatchcase(module_path(f.node), pattern))
        ]
        if not matched:
            raise ShardingRuleError(f"constraint {pattern!r} matches no parameter and no module: check the name")
        for name in matched:
            ndim = len(facts[name].out_shape)
            pins[name] = Shard(placement.dim % ndim) if isinstance(placement, Shard) else placement
    return pins


def _candidates(fact: NodeFacts, ctx: AxisContext) -> tuple[list[Strategy], bool]:
    name = fact.node.name
    if fact.kind in ("param", "buffer", "input"):
        shape = ctx.local.shapes[name][0]
        options = [Strategy((), R)] + [Strategy((), Shard(d)) for d in range(len(shape)) if ctx.size > 1 and shape[d] % ctx.size == 0]
        has_rule = True
    else:
        shapes = ctx.local.shapes[name]
        view = OpView(fact.node, tuple(ctx.local.slot_shapes[name]), shapes[0] if shapes else ())
        options, has_rule = node_strategies(view, ctx.size)
    if ctx.batch and name in ctx.batch:
        options = [s for s in options if not _shards_batch(s, ctx.batch[name])] or options[:1]
    if name in ctx.pins:
        pinned = [s for s in options if s.output == ctx.pins[name]]
        if not pinned:
            raise ShardingRuleError(
                f"node {fact.node.format_node()} (module {module_path(fact.node) or '<top>'!r}) cannot be placed "
                f"{ctx.pins[name]} on axis {ctx.name!r}: its candidates are {[str(s.output) for s in options]}. "
                "Change the constraint or the degrees."
            )
        options = pinned
    return options, has_rule


def _batch_strategies(facts, hardware) -> dict[str, Strategy]:
    """Where the batch dim of every tensor is: the data-parallel solution on a virtual axis."""
    batch_sizes = [f.out_shape[0] for f in facts.values() if f.kind == "input" and f.out_shape]
    size = next((k for k in range(2, (batch_sizes[0] if batch_sizes else 1) + 1) if batch_sizes[0] % k == 0), 1)
    if size == 1:
        return {}
    ctx = AxisContext(
        name="dp",
        size=size,
        link=hardware.links[0],
        pins=_pins(facts, "dp", size, {}),
        local=ShardedShapes.unsharded(facts),
        overlap=hardware.overlap,
    )
    return _solve_axis(facts, ctx, None)


def _shards_batch(strategy: Strategy, batch: Strategy) -> bool:
    """Whether a strategy splits a tensor along the dim the batch runs along."""
    pairs = list(zip(strategy.inputs, batch.inputs)) + [(strategy.output, batch.output)]
    return any(isinstance(mine, Shard) and mine == theirs for mine, theirs in pairs)


def _node_terms(fact: NodeFacts, s: Strategy, ctx: AxisContext, facts) -> tuple[float, float, float]:
    """(compute, communication, gradient sync) seconds a node's strategy costs on this axis.

    Compute counts the work left after earlier axes. A replicated input of an op that
    splits its work gets a partial gradient, all-reduced in backward: bucketed with the
    gradient sync for parameters, on its own for activations.
    """
    compute = fact.full_time_s * ctx.local.work[fact.node.name] * work_fraction(s, ctx.size)
    comm = sync = 0.0
    if ctx.size > 1 and not isinstance(s.output, Replicate):
        for slot, placement, shape in zip(fact.slots, s.inputs, ctx.local.slot_shapes[fact.node.name]):
            if isinstance(placement, Replicate) and facts[slot.name].needs_grad:
                nbytes = numel(shape) * facts[slot.name].elem_bytes
                if facts[slot.name].kind == "param":
                    sync += grad_sync_time(nbytes, ctx.size, ctx.link) * (1 - ctx.overlap)
                else:
                    comm += collective_time("all_reduce", nbytes, ctx.size, ctx.link)
    return compute, comm, sync


def _edge_time(producer: NodeFacts, src: Placement, dst: Placement, local_shape: tuple[int, ...], ctx: AxisContext) -> float:
    """Seconds to bring a producer's output from ``src`` to ``dst`` on this axis (fwd + bwd)."""
    nbytes = numel(local_shape) * producer.elem_bytes
    return min(reshard_time(src, dst, nbytes, ctx.size, ctx.link, producer.needs_grad), IMPOSSIBLE_S)


def _edges(facts, ctx: AxisContext):
    """Every (producer, consumer, slot index, local shape of the value on that edge)."""
    for consumer, fact in facts.items():
        for slot_index, slot in enumerate(fact.slots):
            if slot.name not in facts or not facts[slot.name].out_shapes:
                continue
            if fact.kind == "output":
                yield slot.name, consumer, slot_index, ctx.local.shapes[slot.name][0]
            else:
                yield slot.name, consumer, slot_index, ctx.local.slot_shapes[consumer][slot_index]


def _memory(fact: NodeFacts, s: Strategy, ctx: AxisContext) -> float:
    shapes = ctx.local.shapes[fact.node.name]
    frac = 1 / ctx.size if isinstance(s.output, Shard) else 1.0
    if fact.kind == "param":
        return numel(shapes[0]) * sum(PARAM_STATE_BYTES.values()) * frac
    return _activation_bytes(fact, shapes, ctx.local.work[fact.node.name] * work_fraction(s, ctx.size), frac)


def _activation_bytes(fact: NodeFacts, local_shapes, work: float, output_fraction: float = 1.0) -> float:
    """Bytes autograd keeps for this node: its output if saved, plus what the op saves itself."""
    if fact.kind not in ("op", "input"):
        return 0.0
    output = sum(numel(sh) for sh in local_shapes) * fact.elem_bytes * output_fraction if fact.saved else 0.0
    return output + fact.profile.saved_extra_bytes * work


def _solve_axis(facts, ctx: AxisContext, limit) -> dict[str, Strategy] | None:
    names = [n for n, f in facts.items() if f.kind != "output" and f.out_shapes]
    index = {n: i for i, n in enumerate(names)}
    options = {n: _candidates(facts[n], ctx)[0] for n in names}
    unary = [np.array([sum(_node_terms(facts[n], s, ctx, facts)) for s in options[n]]) for n in names]
    memory = [np.array([_memory(facts[n], s, ctx) for s in options[n]]) for n in names]
    pairs = []
    for producer, consumer, slot_index, shape in _edges(facts, ctx):
        if facts[consumer].kind == "output":
            wanted = [R]
        elif consumer in index:
            wanted = [s.inputs[slot_index] for s in options[consumer]]
        else:
            continue
        matrix = np.array([[_edge_time(facts[producer], s.output, dst, shape, ctx) for dst in wanted] for s in options[producer]])
        if facts[consumer].kind == "output":
            unary[index[producer]] = unary[index[producer]] + matrix[:, 0]
        else:
            pairs.append((index[producer], index[consumer], matrix))
    problem = ChoiceProblem(
        unary, pairs, memory if ctx.bind_memory else None, limit if ctx.bind_memory else None, _followers(facts, options, index)
    )
    solution = solve_choices(problem)
    if solution is None:
        return None
    return {n: options[n][solution.choice[index[n]]] for n in names}


def _followers(facts, options, index) -> dict[int, tuple[int, list[int]]]:
    """Elementwise ops with one tensor input follow their producer: for each of its options,
    the candidate that takes its output as it is (Alpa's merge of followers)."""
    followers = {}
    for name, i in index.items():
        fact = facts[name]
        if fact.kind != "op" or len(fact.slots) != 1 or rule_for(fact.node.target) is not pointwise:
            continue
        leader = fact.slots[0].name
        if leader not in index:
            continue
        tie = [next((t for t, s in enumerate(options[name]) if s.inputs[0] == lead.output), None) for lead in options[leader]]
        if None not in tie:
            followers[i] = (index[leader], tie)
    return followers


def _evaluate(facts, degrees, strategies, mesh, hardware) -> Cost:
    """Predicted step time and memory of a fully chosen configuration (the same terms the
    ILP minimized, summed by category, with compute counted once over all axes)."""
    comm = sync = 0.0
    spans = _axis_spans(degrees)
    local = ShardedShapes.unsharded(facts)
    for axis, chosen in strategies.items():
        ctx = AxisContext(axis, degrees[axis], hardware.link(mesh.shape, spans[axis]), {}, local, hardware.overlap)
        for name, s in chosen.items():
            _, node_comm, node_sync = _node_terms(facts[name], s, ctx, facts)
            comm, sync = comm + node_comm, sync + node_sync
        for producer, consumer, slot_index, shape in _edges(facts, ctx):
            dst = R if facts[consumer].kind == "output" else chosen[consumer].inputs[slot_index] if consumer in chosen else None
            if producer in chosen and dst is not None:
                comm += _edge_time(facts[producer], chosen[producer].output, dst, shape, ctx)
        local = local.after(chosen, degrees[axis])
    compute = sum(f.full_time_s * local.work[n] for n, f in facts.items())
    memory = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
    for name, fact in facts.items():
        elements = sum(numel(s) for s in local.shapes[name])
        if fact.kind == "param":
            for category, nbytes in model_state_bytes(elements).items():
                memory[category] += nbytes
        else:
            memory["activations"] += _activation_bytes(fact, local.shapes[name], local.work[name])
    return Cost(compute_s=compute, comm_s=comm, grad_sync_s=sync, memory=memory)


def _to_plan(captured, facts, mesh, hardware, best: ConfigResult, results, batch, elapsed) -> Plan:
    axes = list(best.degrees)
    nodes, params, inputs = {}, {}, {}
    for name, fact in facts.items():
        per_axis = [best.strategies[a].get(name) for a in axes]
        if fact.kind == "op" or fact.kind == "output":
            if fact.kind == "output":
                slot_pl = tuple(tuple(R for _ in axes) for _ in fact.slots)
                out = None
            elif any(s is None for s in per_axis):
                continue
            else:
                slot_pl = tuple(tuple(s.inputs[i] for s in per_axis) for i in range(len(fact.slots)))
                out = tuple(s.output for s in per_axis)
            nodes[name] = NodeDecision(op=str(fact.node.target), module=module_path(fact.node), inputs=slot_pl, output=out)
        elif fact.kind == "param":
            params[fact.name] = tuple(s.output for s in per_axis)
        elif fact.kind == "input":
            inputs[name] = tuple(s.output for s in per_axis)
    search_log = tuple(
        {"degrees": r.degrees, "step_s": r.cost.step_s, "peak_memory": r.cost.peak_memory, "feasible": r.feasible}
        for r in results
    )
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
        batch_size=batch,
        search=search_log,
        search_time_s=elapsed,
        replicated_ops=tuple(sorted(best.replicated_ops)),
    )
    gradients = plan_gradients(captured.graph, plan, captured.params, captured.user_inputs)
    grad_sync = {captured.params[name]: axes for name, axes in gradients.synced_params.items()}
    return dataclasses.replace(plan, grad_sync=grad_sync)
