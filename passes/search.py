"""Search: choose the parallel degrees and every node's placement with the cost model.

Outer loop: every split of the devices into data × tensor parallel degrees (or the pinned
one), first without pipeline stages and, only when nothing fits, with the fewest stages
that do (or the pinned ``pp``); per split, ZeRO stages and the schedule
(:mod:`schedule_search`: recomputation, microbatches, pipeline kind and cut points). Inner loop, per mesh axis, outermost first: the ILP of :mod:`ilp` picks one
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
import math
import time
from dataclasses import dataclass, field

import numpy as np

from autopar.ir import (
    BATCH_DIMS,
    CONTEXT_PARALLEL,
    KERNEL_DIMS,
    ConfigError,
    Cost,
    HardwareProfile,
    MemoryLimitError,
    Mesh,
    NodeDecision,
    Placement,
    Plan,
    Replicate,
    Shard,
    Schedule,
    ShardingRuleError,
    batch_split,
    check_degrees,
    degree_choices,
    parse_placement,
)

from .capture import CapturedGraph, module_path
from .evaluate import AxisContext, axis_spans, edge_time, edges, node_memory, node_terms, stage_mesh
from .facts import NodeFacts, ShardedShapes, analyze
from .gradients import plan_gradients
from .ilp import ChoiceProblem, solve_choices
from .kernel_cost import ring_hideable_block
from .schedule_search import SchedulePins, base_schedules, best_schedule
from .rules import KERNEL_RULES, MATMULS, node_strategies, pointwise, rule_for
from .strategies import OpView, Strategy

R = Replicate()
EXPERTS_OP = "autopar.moe"  # the composite mixture-of-experts op capture makes of MoE layers
TIE_TOLERANCE = 0.05  # configurations this close in predicted time count as equally fast


@dataclass
class ConfigResult:
    degrees: dict[str, int]
    strategies: dict[str, dict[str, Strategy]]  # axis → node → strategy
    cost: Cost
    feasible: bool = True
    zero: int = 0
    replicated_ops: set[str] = field(default_factory=set)
    schedule: Schedule = Schedule()


def search(
    captured: CapturedGraph,
    mesh: Mesh,
    hardware: HardwareProfile,
    *,
    degrees: dict[str, int] | None = None,
    memory_limit: float | None = None,
    constraints: dict[str, object] | None = None,
    zero: int | None = None,
    recompute: str | None = None,
    microbatches: int | None = None,
    pipeline: str | None = None,
    stage_cuts: list[str] | None = None,
) -> Plan:
    """Find the cheapest plan for ``captured`` on ``mesh`` (see the module docstring).

    ``degrees`` may pin ``pp``, the pipeline stages: the stages split the outermost mesh
    dimension, and the intra-op search runs on one stage's devices with its share of the work.
    """
    started = time.perf_counter()
    facts = analyze(captured, hardware, hardware.contention(mesh.shape))
    batch = _batch_size(captured, facts)
    degrees = dict(degrees or {})
    pinned_pp = degrees.pop("pp", None)
    limit = memory_limit if memory_limit is not None else hardware.memory_bytes
    optional = _optional_dims(facts)
    # the sequence is a dim of its own only where attention mixes it
    batch_dims = _split_strategies(facts, hardware, "dp")
    splits = (batch_dims, _split_strategies(facts, hardware, "cp", batch_dims) if "cp" in optional else {})
    pins = dict(microbatches=microbatches, recompute=recompute, pipeline=pipeline, cuts=tuple(stage_cuts or ()))
    # Without a pin, stages only when nothing fits without them (the fewest that do).
    layers = len({f.layer for f in facts.values() if f.layer is not None})
    ladder = [pinned_pp] if pinned_pp else [1] + [p for p in range(2, min(mesh.shape[0], layers) + 1) if mesh.shape[0] % p == 0]
    results = []
    for pp in ladder:
        stage = stage_mesh(mesh, pp)
        configs = [check_degrees(degrees, stage.size)] if degrees else degree_choices(stage.size, optional)
        configs = [c for c in configs if batch % batch_split(c) == 0 and _sequence_splits(facts, c.get("cp", 1))] or configs
        if not degrees:
            configs = [c for c in configs if c.get("cp", 1) <= _useful_cp(facts, hardware)]
        for cfg, zero_stages in _with_zero(configs, zero):
            def solve(zero_stage, cfg=cfg):
                return _solve_config(
                    facts, cfg, stage, hardware, limit, constraints or {}, splits, zero_stage,
                    SchedulePins(pp, **pins), batch // batch_split(cfg),
                )
            results += _lowest_fitting_zero(solve, zero_stages)
        if any(r.feasible for r in results):
            break
    feasible = [r for r in results if r.feasible]
    if not feasible:
        leanest = min(results, key=lambda r: r.cost.peak_memory)
        breakdown = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in leanest.cost.memory.items())
        raise MemoryLimitError(
            f"no plan fits the memory limit of {limit / 2**20:.1f} MiB per device on mesh {mesh}. "
            f"The leanest configuration ({_degrees_str(leanest.degrees)}) needs {leanest.cost.peak_memory / 2**20:.1f} MiB: "
            f"{breakdown}. Raise memory_limit, use more devices, accumulate gradients (microbatches=N), "
            "or shrink the batch or model."
        )
    fastest = min(r.cost.step_s for r in feasible)
    # Within the model's resolution, prefer the simplest plan: the most data parallelism.
    near = [r for r in feasible if r.cost.step_s <= fastest * (1 + TIE_TOLERANCE)]
    best = max(near, key=lambda r: (r.degrees["dp"], -r.zero, -r.cost.step_s))
    return _to_plan(captured, facts, mesh, hardware, best, results, batch, time.perf_counter() - started)


def _lowest_fitting_zero(solve, zero_stages: list[int]) -> list[ConfigResult]:
    """Results up to the lowest ZeRO stage that fits: a higher stage only saves memory, at no
    less time. When the lowest does not fit, the highest is tried next: if even that does
    not fit, neither do the ones between."""
    results = [solve(zero_stages[0])]
    if results[-1].feasible or len(zero_stages) == 1:
        return results
    highest = solve(zero_stages[-1])
    if highest.feasible:
        for zero_stage in zero_stages[1:-1]:
            results.append(solve(zero_stage))
            if results[-1].feasible:
                break
    return results + [highest]


def _with_zero(configs: list[dict[str, int]], zero: int | None) -> list[tuple[dict[str, int], list[int]]]:
    """Each configuration with the ZeRO stages to try, lowest first (ZeRO needs dp > 1)."""
    if zero is not None and zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero={zero!r}: the ZeRO stage is 0, 1, 2 or 3")
    if zero:
        configs = [c for c in configs if c["dp"] > 1]
        if not configs:
            raise ConfigError(f"zero={zero} shards model state over the data-parallel axis: pin a dp degree above 1")
    return [(c, [zero] if zero is not None else [0, 1, 2, 3] if c["dp"] > 1 else [0]) for c in configs]


def _optional_dims(facts: dict[str, NodeFacts]) -> tuple[str, ...]:
    """The dimensions worth searching for this graph: cp where attention can run on a split
    sequence, ep where there are experts to split."""
    targets = {str(f.node.target) for f in facts.values() if f.kind == "op"}
    dims = []
    if any("scaled_dot_product_attention" in t for t in targets) and _sequence_splits(facts, 2):
        dims.append("cp")
    if any(t.startswith(EXPERTS_OP) for t in targets):
        dims.append("ep")
    return tuple(dims)


def _useful_cp(facts: dict[str, NodeFacts], hardware: HardwareProfile) -> int:
    """The largest cp degree worth searching: each rank's sequence chunk at least the block
    whose ring attention hides its K/V transfer on the innermost link (smaller chunks only add
    communication). Pinned degrees are not limited."""
    attention = [f for f in facts.values() if f.kind == "op" and "scaled_dot_product_attention" in str(f.node.target)]
    if not attention:
        return 1
    fact = attention[0]
    q, k = (tuple(slot.meta["val"].shape) for slot in fact.slots[:2])
    flops = hardware.flops_per_s("float32" if fact.elem_bytes == 4 else "bfloat16")
    causal = bool(fact.node.kwargs.get("is_causal", fact.node.args[5] if len(fact.node.args) > 5 else False))
    block = ring_hideable_block(q[1], k[1], fact.elem_bytes, flops, hardware.links[0].bandwidth, causal=causal)
    return max(1, q[2] // max(block, 1))


def _sequence_splits(facts: dict[str, NodeFacts], cp: int) -> bool:
    """Whether the user inputs' sequence dim (dim 1) splits into 2·cp chunks (a head and a
    tail chunk per rank, which balances causal attention)."""
    shapes = [f.out_shape for f in facts.values() if f.kind == "input" and f.out_shape]
    return cp == 1 or bool(shapes) and all(len(s) >= 2 and s[1] % (2 * cp) == 0 for s in shapes)


def _batch_size(captured: CapturedGraph, facts: dict[str, NodeFacts]) -> int:
    shapes = [facts[name].out_shape for name in captured.user_inputs if facts[name].out_shape]
    return shapes[0][0] if shapes else 1


def _degrees_str(degrees: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in degrees.items())


def _solve_config(facts, degrees, mesh, hardware, limit, constraints, splits, zero: int, pins: SchedulePins, local_batch: int) -> ConfigResult:
    """Solve every axis for the first recomputation level whose best schedule fits ``limit``."""
    for base in base_schedules(pins, local_batch):
        strategies = _solve_axes(facts, degrees, mesh, hardware, limit, constraints, splits, zero, base)
        schedule, cost = best_schedule(facts, degrees, strategies, mesh, hardware, zero, base, pins, local_batch, limit)
        if cost.peak_memory <= limit:
            break
    replicated = {str(f.node.target) for f in facts.values() if f.kind == "op" and f.out_shapes and rule_for(f.node.target) is None}
    return ConfigResult(degrees, strategies, cost, cost.peak_memory <= limit, zero, replicated, schedule)


def _solve_axes(facts, degrees, mesh, hardware, limit, constraints, splits, zero, schedule) -> dict[str, dict[str, Strategy]]:
    """One ILP per axis, outermost first; the memory budget binds on the last sharded axis
    (the leanest layout when nothing fits, which ``evaluate`` then reports)."""
    axes = list(degrees)
    last_sharded = max((i for i, a in enumerate(axes) if degrees[a] > 1), default=-1)
    experts = _expert_params(facts)
    spans = axis_spans(degrees)
    local = ShardedShapes.unsharded(facts)
    strategies: dict[str, dict[str, Strategy]] = {}
    for index, axis in enumerate(axes):
        ctx = AxisContext(
            name=axis,
            size=degrees[axis],
            link=hardware.link(mesh.shape, spans[axis], degrees[axis]),
            pins=_pins(facts, axis, degrees[axis], constraints, experts),
            kernels=_kernel_pins(facts, constraints) if axis in KERNEL_DIMS.values() else {},
            local=local,
            overlap=hardware.overlap,
            bind_memory=index == last_sharded,
            batch=None if axis in BATCH_DIMS else splits[0],
            sequence=None if axis == CONTEXT_PARALLEL else splits[1],
            data_parallel=degrees["dp"],
            zero=zero,
            hardware=hardware,
            contention=hardware.contention(mesh.shape),
            schedule=schedule,
            later=math.prod(degrees[a] for a in axes[index + 1:]),
        )
        chosen = _solve_axis(facts, ctx, limit) or _solve_axis(facts, ctx, None)
        strategies[axis] = chosen
        local = local.after(chosen, ctx.size)
    return strategies


def _pins(facts, axis: str, size: int, constraints, experts: frozenset[str] = frozenset()) -> dict[str, Placement]:
    """What an axis fixes: dp and ep split the inputs' batch dim, cp their sequence dim; all
    three keep parameters whole (but ep the experts' weights, which its kernel may split)."""
    split_dim = {"dp": 0, "ep": 0, "cp": 1}.get(axis)
    multiple = 2 * size if axis == "cp" else size  # cp: a head and a tail chunk per rank
    pins = {}
    for name, fact in facts.items():
        if fact.kind == "buffer":
            pins[name] = R
        elif split_dim is not None and fact.kind == "param" and not (axis == "ep" and name in experts):
            pins[name] = R
        elif fact.kind == "input":
            shape = fact.out_shape
            splits = split_dim is not None and len(shape) > split_dim and shape[split_dim] % multiple == 0
            pins[name] = Shard(split_dim) if splits and size > 1 else R
    if axis == "tp":
        pins.update(_constraint_pins(facts, constraints))
    return pins


def _kernel_pins(facts, constraints) -> dict[str, str]:
    """Nodes pinned to a parallel kernel: ``{"layers.*.attn": "ring"}`` (by module name)."""
    pins = {}
    for pattern, value in constraints.items():
        if value in KERNEL_DIMS:
            matched = [n for n, f in facts.items() if f.kind == "op" and fnmatch.fnmatchcase(module_path(f.node), pattern)]
            pins.update({name: value for name in matched if _has_kernel(facts[name], value)})
            if not any(_has_kernel(facts[name], value) for name in matched):
                raise ShardingRuleError(
                    f"constraint {pattern!r}: {value!r} pins a kernel, but no op of a module matching it has one"
                )
    return pins


def _has_kernel(fact: NodeFacts, kernel: str) -> bool:
    return rule_for(fact.node.target) is KERNEL_RULES[kernel]


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
            or (f.kind == "op" and f.out_shapes and fnmatch.fnmatchcase(module_path(f.node), pattern))
        ]
        if not matched:
            raise ShardingRuleError(f"constraint {pattern!r} matches no parameter and no module: check the name")
        for name in matched:
            ndim = len(facts[name].out_shape)
            pins[name] = Shard(placement.dim % ndim) if isinstance(placement, Shard) else placement
    return pins


def _expert_params(facts) -> frozenset[str]:
    """Parameters that feed an experts op's expert weights (every slot after the router's)."""
    return frozenset(
        slot.name for f in facts.values() if f.kind == "op" and str(f.node.target).startswith(EXPERTS_OP)
        for slot in f.slots[2:] if facts[slot.name].kind == "param"
    )


def _on_axis(strategy: Strategy, view: OpView, ctx: AxisContext) -> bool:
    """Kernels run only on their own axis; on cp every split dim holds 2·p chunks, and
    Ulysses needs the heads left after later axes to split again."""
    if strategy.kernel and KERNEL_DIMS[strategy.kernel] != ctx.name:
        return False
    if strategy.kernel == "ulysses" and view.in_shapes[0][1] % (ctx.size * ctx.later):
        return False
    if ctx.name != CONTEXT_PARALLEL:
        return True
    shapes = list(view.in_shapes) + [view.out_shape]
    placements = list(strategy.inputs) + [strategy.output]
    return all(not isinstance(p, Shard) or shape[p.dim] % (2 * ctx.size) == 0 for p, shape in zip(placements, shapes))


def _candidates(fact: NodeFacts, ctx: AxisContext) -> tuple[list[Strategy], bool]:
    name = fact.node.name
    if fact.kind in ("param", "buffer", "input"):
        shape = ctx.local.shapes[name][0]
        multiple = 2 * ctx.size if ctx.name == CONTEXT_PARALLEL else ctx.size
        options = [Strategy((), R)] + [Strategy((), Shard(d)) for d in range(len(shape)) if ctx.size > 1 and shape[d] % multiple == 0]
        has_rule = True
    else:
        shapes = ctx.local.shapes[name]
        view = OpView(fact.node, tuple(ctx.local.slot_shapes[name]), shapes[0] if shapes else ())
        options, has_rule = node_strategies(view, ctx.size)
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
            raise ShardingRuleError(
                f"node {fact.node.format_node()} (module {module_path(fact.node) or '<top>'!r}) cannot be placed "
                f"{ctx.pins[name]} on axis {ctx.name!r}: its candidates are {[str(s.output) for s in options]}. "
                "Change the constraint or the degrees."
            )
        options = pinned
    return options, has_rule


def _no_kernel(fact: NodeFacts, ctx: AxisContext):
    raise ShardingRuleError(
        f"node {fact.node.format_node()} (module {module_path(fact.node) or '<top>'!r}) cannot run as the "
        f"{ctx.kernels[fact.node.name]!r} kernel on axis {ctx.name!r} of size {ctx.size}: its shapes do not split "
        "that way (Ulysses needs the heads to split over the axis too). Pin the other kernel or change the degrees."
    )


def _split_strategies(facts, hardware, axis: str, batch: dict[str, Strategy] | None = None) -> dict[str, Strategy]:
    """Where the batch (axis "dp") or sequence (axis "cp", never splitting the ``batch`` dim)
    dim of every tensor is: that axis's solution on a virtual axis where gradient sync is
    free (hidden), so the dim stays split wherever it can."""
    dim, multiple = (0, 1) if axis == "dp" else (1, 2)
    sizes = [f.out_shape[dim] for f in facts.values() if f.kind == "input" and len(f.out_shape) > dim]
    size = next((k for k in range(2, (sizes[0] if sizes else 1) + 1) if sizes[0] % (k * multiple) == 0), 1)
    if size == 1:
        return {}
    ctx = AxisContext(
        name=axis,
        size=size,
        link=hardware.links[0],
        pins=_pins(facts, axis, size, {}),
        local=ShardedShapes.unsharded(facts),
        overlap=1.0,
        batch=batch,
    )
    return _solve_axis(facts, ctx, None)


def _shards_batch(strategy: Strategy, batch: Strategy) -> bool:
    """Whether a strategy splits a tensor along the dim the batch runs along."""
    pairs = list(zip(strategy.inputs, batch.inputs)) + [(strategy.output, batch.output)]
    return any(isinstance(mine, Shard) and mine == theirs for mine, theirs in pairs)


def _solve_axis(facts, ctx: AxisContext, limit) -> dict[str, Strategy] | None:
    names = [n for n, f in facts.items() if f.kind != "output" and f.out_shapes]
    index = {n: i for i, n in enumerate(names)}
    options = {n: _candidates(facts[n], ctx)[0] for n in names}
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
        matrix = np.array([[edge_time(facts[producer], s.output, dst, shape, ctx) for dst in wanted] for s in options[producer]])
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
            kernel = next((s.kernel for s in per_axis if s is not None and s.kernel), "")
            nodes[name] = NodeDecision(
                op=str(fact.node.target), module=module_path(fact.node), inputs=slot_pl, output=out, kernel=kernel
            )
        elif fact.kind == "param":
            params[fact.name] = tuple(s.output for s in per_axis)
        elif fact.kind == "input":
            inputs[name] = tuple(s.output for s in per_axis)
    search_log = tuple(
        {"degrees": r.degrees, "zero": r.zero, "schedule": {**dataclasses.asdict(r.schedule), "cuts": list(r.schedule.cuts)}, "step_s": r.cost.step_s,
         "peak_memory": r.cost.peak_memory, "feasible": r.feasible}
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
        zero=best.zero,
        schedule=best.schedule,
    )
    gradients = plan_gradients(captured.graph, plan, captured.params, captured.user_inputs)
    grad_sync = {captured.params[name]: axes for name, axes in gradients.synced_params.items()}
    return dataclasses.replace(plan, grad_sync=grad_sync)
