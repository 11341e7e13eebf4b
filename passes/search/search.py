"""Search: choose the parallel degrees and every node's placement with the cost model.

Outer loop: every split of the devices into data × tensor (× context × expert) parallel
degrees (or the pinned one), first without pipeline stages and, only when nothing fits, with
the fewest stages that do (or the pinned ``pp``); per split, ZeRO stages and the schedule
(:mod:`schedule`: recomputation, microbatches, pipeline kind and cut points). Inner loop,
per mesh axis, outermost first: the ILP of :mod:`axes` picks one strategy per node.

Pre: a :class:`CapturedGraph` and :class:`PlanOptions`. Post: a :class:`Plan` naming a
placement per node and parameter, and the cost model's prediction; or
:class:`MemoryLimitError` with the per-device breakdown of the leanest configuration.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from autopar.ir import (
    Axis,
    ConfigError,
    Cost,
    HardwareProfile,
    MemoryLimitError,
    Mesh,
    NodeDecision,
    Plan,
    PlanOptions,
    Replicate,
    Schedule,
    batch_split,
    check_degrees,
    degree_choices,
)
from autopar.passes.capture.graph import CapturedGraph, module_path
from autopar.passes.capture.moe import EXPERTS_OP
from autopar.passes.cost.evaluate import stage_mesh
from autopar.passes.cost.facts import NodeFacts, analyze
from autopar.passes.cost.kernels import ring_hideable_block
from autopar.passes.rewrite.gradients import plan_gradients
from autopar.passes.search.axes import chunks_per_rank, solve_axes, split_dims
from autopar.passes.search.schedule import TIE_TOLERANCE, base_schedules, best_schedule
from autopar.passes.sharding.rules import rule_for
from autopar.passes.sharding.strategies import Strategy

R = Replicate()


@dataclass(frozen=True)
class SearchContext:
    """What every configuration of one search shares: the graph's facts, the devices of one
    pipeline stage, the hardware, the user's options and the memory budget."""

    facts: dict[str, NodeFacts]
    mesh: Mesh  # one pipeline stage's devices (the whole mesh without stages)
    hardware: HardwareProfile
    options: PlanOptions
    limit: float  # bytes per device
    stages: int
    batch_dims: dict[str, Strategy]  # node → where its batch dim is (never split by other axes)
    sequence_dims: dict[str, Strategy]  # node → where its sequence dim is (matmuls split it only on cp)


@dataclass
class ConfigResult:
    degrees: dict[str, int]
    strategies: dict[str, dict[str, Strategy]]  # axis → node → strategy
    cost: Cost
    feasible: bool = True
    zero: int = 0
    replicated_ops: set[str] = field(default_factory=set)
    schedule: Schedule = Schedule()


def search(captured: CapturedGraph, mesh: Mesh, options: PlanOptions = PlanOptions()) -> Plan:
    """Find the cheapest plan for ``captured`` on ``mesh`` (see the module docstring).

    ``options.degrees`` may pin ``pp``, the pipeline stages: the stages split the outermost
    mesh dimension, and the intra-op search runs on one stage's devices with its share of the work.
    """
    started = time.perf_counter()
    hardware = options.profile
    facts = analyze(captured, hardware, hardware.contention(mesh.shape), options.policy)
    batch = _batch_size(captured, facts)
    degrees = options.intra_stage_degrees
    limit = options.memory_limit if options.memory_limit is not None else hardware.memory_bytes
    optional = _optional_dims(facts)
    # the sequence is a dim of its own only where attention mixes it
    batch_dims = split_dims(facts, hardware, Axis.DP)
    sequence_dims = split_dims(facts, hardware, Axis.CP, batch_dims) if Axis.CP in optional else {}
    # Without a pin, stages only when nothing fits without them (the fewest that do).
    layers = len({f.layer for f in facts.values() if f.layer is not None})
    pinned_pp = options.stages
    ladder = (
        [pinned_pp]
        if pinned_pp
        else [1] + [p for p in range(2, min(mesh.shape[0], layers) + 1) if mesh.shape[0] % p == 0]
    )
    results = []
    for pp in ladder:
        ctx = SearchContext(facts, stage_mesh(mesh, pp), hardware, options, limit, pp, batch_dims, sequence_dims)
        configs = [check_degrees(degrees, ctx.mesh.size)] if degrees else degree_choices(ctx.mesh.size, optional)
        configs = [
            c for c in configs if batch % batch_split(c) == 0 and _sequence_splits(facts, c.get(Axis.CP, 1))
        ] or configs
        if not degrees:
            configs = [c for c in configs if c.get(Axis.CP, 1) <= _useful_cp(facts, hardware)]
        for cfg, zero_stages in _with_zero(configs, options.zero):
            local_batch = batch // batch_split(cfg)
            results += _lowest_fitting_zero(
                lambda zero, cfg=cfg: _solve_config(ctx, cfg, zero, local_batch), zero_stages
            )
        if any(r.feasible for r in results):
            break
    feasible = [r for r in results if r.feasible]
    if not feasible:
        leanest = min(results, key=lambda r: r.cost.peak_memory)
        breakdown = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in leanest.cost.memory.items())
        raise MemoryLimitError(
            f"no plan fits the memory limit of {limit / 2**20:.1f} MiB per device on mesh {mesh}. "
            f"The leanest configuration ({_degrees_str(leanest.degrees)}) needs {leanest.cost.peak_memory / 2**20:.1f} "
            "MiB: "
            f"{breakdown}. Raise memory_limit, use more devices, accumulate gradients (microbatches=N), "
            "or shrink the batch or model."
        )
    fastest = min(r.cost.step_s for r in feasible)
    # Within the model's resolution, prefer the simplest plan: the most data parallelism.
    near = [r for r in feasible if r.cost.step_s <= fastest * (1 + TIE_TOLERANCE)]
    best = max(near, key=lambda r: (r.degrees[Axis.DP], -r.zero, -r.cost.step_s))
    precision = options.policy.precision  # priced by the cost model (analyze), recorded in the plan
    return _to_plan(captured, facts, mesh, hardware, best, results, batch, time.perf_counter() - started, precision)


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
    if zero:
        configs = [c for c in configs if c[Axis.DP] > 1]
        if not configs:
            raise ConfigError(f"zero={zero} shards model state over the data-parallel axis: pin a dp degree above 1")
    return [(c, [zero] if zero is not None else [0, 1, 2, 3] if c[Axis.DP] > 1 else [0]) for c in configs]


def _solve_config(ctx: SearchContext, degrees: dict[str, int], zero: int, local_batch: int) -> ConfigResult:
    """Solve every axis for the first recomputation level whose best schedule fits the budget."""
    for base in base_schedules(ctx.options, ctx.stages, local_batch):
        strategies = solve_axes(ctx, degrees, zero, base)
        schedule, cost = best_schedule(ctx, degrees, strategies, zero, base, local_batch)
        if cost.peak_memory <= ctx.limit:
            break
    facts = ctx.facts
    replicated = {
        str(f.node.target)
        for f in facts.values()
        if f.kind == "op" and f.out_shapes and rule_for(f.node.target) is None
    }
    return ConfigResult(degrees, strategies, cost, cost.peak_memory <= ctx.limit, zero, replicated, schedule)


def _optional_dims(facts: dict[str, NodeFacts]) -> tuple[str, ...]:
    """The dimensions worth searching for this graph: cp where attention can run on a split
    sequence, ep where there are experts to split."""
    targets = {str(f.node.target) for f in facts.values() if f.kind == "op"}
    dims = []
    if any("scaled_dot_product_attention" in t for t in targets) and _sequence_splits(facts, 2):
        dims.append(Axis.CP)
    if any(t.startswith(EXPERTS_OP) for t in targets):
        dims.append(Axis.EP)
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
    multiple = chunks_per_rank(Axis.CP) * cp
    return cp == 1 or bool(shapes) and all(len(s) >= 2 and s[1] % multiple == 0 for s in shapes)


def _batch_size(captured: CapturedGraph, facts: dict[str, NodeFacts]) -> int:
    shapes = [facts[name].out_shape for name in captured.user_inputs if facts[name].out_shape]
    return shapes[0][0] if shapes else 1


def _degrees_str(degrees: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in degrees.items())


def _to_plan(captured, facts, mesh, hardware, best: ConfigResult, results, batch, elapsed, precision) -> Plan:
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
        {
            "degrees": r.degrees,
            "zero": r.zero,
            "schedule": {**dataclasses.asdict(r.schedule), "cuts": list(r.schedule.cuts)},
            "step_s": r.cost.step_s,
            "peak_memory": r.cost.peak_memory,
            "feasible": r.feasible,
        }
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
        precision=precision,
    )
    gradients = plan_gradients(captured.graph, plan, captured.params, captured.user_inputs)
    grad_sync = {captured.params[name]: axes for name, axes in gradients.synced_params.items()}
    return dataclasses.replace(plan, grad_sync=grad_sync)
