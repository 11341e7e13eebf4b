"""The intra-op search: one ILP per mesh axis choosing a :class:`Strategy` per node.

Axes are solved outermost first, each on the local shapes the earlier ones leave. The ILP
(:mod:`ilp`) minimizes the node and edge terms of :mod:`autopar.passes.cost.evaluate`:

- variables: one strategy per node with a tensor output (:mod:`candidates`: the sharding
  rules' options, narrowed by what the axis fixes);
- objective: compute + communication + gradient sync of each node's strategy, plus the
  redistribution time on every edge whose producer's output placement differs from what the
  consumer wants;
- constraints: data-like axes (dp, ep, cp) pin user inputs to their batch or sequence dim and
  parameters to replicated (:mod:`pins`); the tensor-parallel axis is free but for user
  pins; the memory budget binds on the last sharded axis, where all sharding is known;
  elementwise followers take their producer's placement (:func:`followers`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from autopar.ir import (
    BATCH_DIMS,
    KERNEL_DIMS,
    Axis,
    HardwareProfile,
    Schedule,
    Shard,
)
from autopar.passes.cost.axis_terms import (
    IMPOSSIBLE_S,
    AxisContext,
    axis_spans,
    edge_times,
    edges,
    local_slot_shapes,
    node_memory,
    node_terms,
    node_transient,
    partial_gradients,
    shapes_after,
    unsharded_shapes,
)
from autopar.passes.cost.facts import NodeFacts, ShardedShapes
from autopar.passes.search.candidates import all_candidates
from autopar.passes.search.ilp import ChoiceProblem, budget_used, least_objective, solve_choices
from autopar.passes.search.pins import (
    SPLIT_DIM,
    R,
    axis_pins,
    chunks_per_rank,
    expert_params,
    kernel_pins,
)
from autopar.passes.sharding.rules import pointwise, rule_for
from autopar.passes.sharding.strategies import Strategy, work_fraction


def solve_axes(
    search,
    degrees: dict[str, int],
    zero: int,
    schedule: Schedule,
    limit: float | None = None,
    cache=None,
    worth=None,
) -> dict[str, dict[str, Strategy]] | None:
    """One ILP per axis, outermost first. With a ``limit``, the memory budget binds on the last
    sharded axis (the leanest layout when nothing fits, which ``evaluate`` then reports).
    ``search`` is the :class:`~autopar.passes.search.search.SearchContext`; its ``variable``
    ties nodes of identical layers to one variable.

    Where the budget does not bind, an axis's solution depends only on the axes before it, their
    sizes, the devices after it and what ZeRO changes of its costs; ``cache`` (a dict) keeps it
    for every configuration sharing that prefix. ``worth(solved, work, sync)``, asked before the last
    sharded axis's ILP with the (context, strategies) of the axes before it and that axis's cost
    floor (:func:`floor_of`), may answer False: then the layout is not solved and the result is None.
    The floors are kept in ``cache`` too, and asked again first where that axis's layout is reused or
    was pruned before (another ZeRO stage's bound may differ)."""
    facts = search.facts
    axes = list(degrees)
    last_sharded = max((i for i, a in enumerate(axes) if degrees[a] > 1), default=-1)
    experts = expert_params(facts)
    local = unsharded_shapes(facts, search.memo)
    strategies: dict[str, dict[str, Strategy]] = {}
    solved: list[tuple[AxisContext, dict[str, Strategy]]] = []
    before: tuple = ()  # the axes solved so far and their solutions: what the next axis starts from
    for index, axis in enumerate(axes):
        later = math.prod(degrees[a] for a in axes[index + 1 :])
        # ZeRO changes a dp axis's costs at stage 3 (weights regathered), the others' from stage 1 (optimizer share)
        zero_key = zero == 3 if axis == Axis.DP else zero > 0 and degrees[Axis.DP] > 1
        key = (axis, degrees[axis], later, zero_key, degrees[Axis.DP], before)
        free = limit is None or index != last_sharded  # the budget binds on the last sharded axis only
        bounded = worth is not None and index == last_sharded
        # the floors this axis's layout had before (a function of the key, as its solution is), asked again
        # first: the configuration's own bound may rule it out with no term computed, or the layout reused
        known = cache.get(("floors", key), []) if bounded and cache is not None else []
        if any(not worth(solved, work, sync) for work, sync in known):
            return None
        if free and cache is not None and key in cache:
            strategies[axis] = cache[key]
            solved.append((_context(search, degrees, zero, schedule, index, local, experts), cache[key]))
            local = shapes_after(local, cache[key], degrees[axis], search.memo)
            before += ((axis, degrees[axis], id(cache[key])),)
            continue
        ctx = _context(search, degrees, zero, schedule, index, local, experts)
        asked: list[tuple[float, float]] = []

        def floor(work: float, sync: float) -> bool:
            asked.append((work, sync))
            return worth(solved, work, sync)

        floor = floor if bounded else None
        try:
            chosen = None if free else solve_axis(facts, ctx, limit, search.variable, search.memo, floor, search.twin)
            if chosen is None and not free and cache is not None and key in cache:
                chosen = cache[key]  # nothing keeps the budget: the layout without it, solved before
            chosen = chosen or solve_axis(facts, ctx, None, search.variable, search.memo, floor, search.twin)
        except Pruned:
            return None
        finally:
            if bounded and cache is not None and len(asked) >= len(known):
                cache[("floors", key)] = asked
        if free and cache is not None:
            chosen = cache.setdefault(("solution", _fingerprint(chosen)), chosen)  # one object per distinct solution
            cache[key] = chosen
        strategies[axis] = chosen
        solved.append((ctx, chosen))
        local = shapes_after(local, chosen, ctx.size, search.memo)
        before += ((axis, degrees[axis], id(chosen)),)
    return strategies


def _context(search, degrees, zero: int, schedule: Schedule, index: int, local, experts) -> AxisContext:
    """The AxisContext of the ``index``-th axis of ``degrees``, starting from ``local``."""
    facts, hardware, mesh = search.facts, search.hardware, search.mesh
    axes = list(degrees)
    axis = axes[index]
    return AxisContext(
        name=axis,
        size=degrees[axis],
        link=hardware.link(mesh.shape, axis_spans(degrees)[axis], degrees[axis]),
        pins=axis_pins(facts, axis, degrees[axis], search.options.constraints or {}, experts),
        kernels=kernel_pins(facts, search.options.constraints or {}) if axis in KERNEL_DIMS.values() else {},
        local=local,
        overlap=hardware.hidden(hardware.overlap),
        bind_memory=index == max((i for i, a in enumerate(axes) if degrees[a] > 1), default=-1),
        batch=None if axis in BATCH_DIMS else search.batch_dims,
        sequence=None if axis == Axis.CP else search.sequence_dims,
        data_parallel=degrees[Axis.DP],
        zero=zero,
        hardware=hardware,
        contention=hardware.contention(mesh.shape),
        schedule=schedule,
        later=math.prod(degrees[a] for a in axes[index + 1 :]),
    )


def _fingerprint(chosen: dict[str, Strategy]) -> tuple:
    return tuple(chosen.items())


def split_dims(
    facts, hardware: HardwareProfile, axis: str, batch: dict[str, Strategy] | None = None, variable=None
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
        tracking=True,
    )
    chosen = solve_axis(facts, ctx, None, variable)
    return {name: s for name, s in chosen.items() if not _splits_a_weight(facts[name], s, facts)}


def _splits_a_weight(fact: NodeFacts, strategy: Strategy, facts) -> bool:
    return any(
        isinstance(placement, Shard) and facts[slot.name].kind == "param"
        for slot, placement in zip(fact.slots, strategy.inputs)
    )


class Pruned(Exception):
    """An axis's ILP left unsolved: its cost floor already rules the configuration out."""


def solve_axis(
    facts,
    ctx: AxisContext,
    limit,
    variable: dict[str, str] | None = None,
    memo: dict | None = None,
    worth=None,
    twin: dict[str, str] | None = None,
) -> dict[str, Strategy] | None:
    """The ILP of one axis (see the module docstring); None when ``limit`` cannot be met.

    ``variable`` ties nodes to one ILP variable (identical layers, :mod:`fold`): a node takes
    the strategy of the node it maps to, and each variable's costs and memory are its nodes'
    sums, a node and an edge counted ``weight`` times (:attr:`NodeFacts.weight`). ``memo`` keeps
    each node's candidates across the axes of one search (they depend on its local shapes only).
    ``worth(work, sync)``, given a floor of what the axis's layout costs (the least work of its
    ops, and the least of work and sync together less that: :func:`floor_of`), may answer False:
    then :class:`Pruned` is raised. It is asked twice: with each op's cheapest option, then with
    the least any layout of the axis costs with its moves too (a small ILP), before the ILP
    itself. ``twin`` maps a node of an identical layer to its counterpart
    (:attr:`LayerFolding.twin`): where their local shapes agree, their candidates and costs are
    computed once.
    """
    names, var_of, reps, weight = _variables(facts, variable)
    index = {rep: i for i, rep in enumerate(reps)}
    twin = twin or {}
    options = all_candidates(facts, ctx, reps, memo, twin)
    if ctx.size == 1:  # every strategy of a node is the same on one device
        return {n: options[var_of[n]][0] for n in names}
    temporary = None
    if ctx.bind_memory and limit is not None:
        memory = [weight[r] * np.array([node_memory(facts[r], s, ctx) for s in options[r]]) for r in reps]
        temporary = [np.array([node_transient(facts[r], s, ctx) for s in options[r]]) for r in reps]
        if budget_used(memory, temporary) > limit:
            return None  # not even the leanest option of every node keeps the budget
    terms = _terms(facts, ctx, options, reps, twin)
    # the rule "bound" (see ``worth``): a layout's work and sync weigh differently in a step (the
    # pipeline bubble stretches work), so the floor is the least work, and the least of both less it
    floors = floor_of(facts, ctx, options, terms) if worth is not None else {}
    least_work = sum(weight[r] * float(w.min()) for r, (w, _) in floors.items())
    least_both = sum(weight[r] * float((w + s).min()) for r, (w, s) in floors.items())
    if worth is not None and not worth(least_work, least_both - least_work):
        raise Pruned
    unary = [weight[r] * np.array([sum(t) for t in terms[r]]) for r in reps]
    if not (ctx.bind_memory and limit is not None):
        memory = None
    moved, counts, least_counts = _edges(facts, ctx, options, index, var_of, memo)
    leaders, penalties = followers(facts, options, index, var_of)
    if worth is not None:
        # tighter, before the ILP: the least any layout costs with its moves; followers follow in every layout
        bound = _least_layout(floors, options, reps, weight, moved, least_counts, leaders, penalties)
        if not worth(least_work, bound - least_work):
            raise Pruned
    unary, pairs = _with_edges(unary, moved, counts)
    problem = ChoiceProblem(unary, pairs + penalties, memory, limit if memory is not None else None, temporary, leaders)
    solution = solve_choices(problem)
    if solution is None:
        return None
    return {n: options[var_of[n]][solution.choice[index[var_of[n]]]] for n in names}


def _variables(facts, variable: dict[str, str] | None):
    """The nodes an axis places, the variable each maps to, the variables, and how many nodes (each
    counted its ``weight`` times) each stands for."""
    names = [n for n, f in facts.items() if f.kind != "output" and f.out_shapes]
    var_of = {n: (variable or {}).get(n, n) for n in names}
    reps = list(dict.fromkeys(var_of.values()))
    weight = dict.fromkeys(reps, 0)
    for n in names:
        weight[var_of[n]] += facts[n].weight
    return names, var_of, reps, weight


def _edges(facts, ctx: AxisContext, options, index: dict[str, int], var_of: dict[str, str], memo):
    """The ILP's edges: per (producer variable, consumer variable or None for the output, slot, shape),
    (u, v or None, matrix, class_u, class_v) and its count, and for the bound what a step moves of it
    at least (its count there)."""
    edge_weight: dict[tuple, list[float]] = {}
    found = [
        (producer, consumer, slot_index, shape)
        for producer, consumer, slot_index, shape in edges(facts, ctx)
        if facts[consumer].kind == "output" or consumer in var_of
    ]
    least_reader: dict[str, float] = {}
    for producer, consumer, _, _ in found:
        least_reader[producer] = min(least_reader.get(producer, math.inf), facts[consumer].weight)
    for producer, consumer, slot_index, shape in found:
        output = facts[consumer].kind == "output"
        key = (var_of[producer], None, 0, shape) if output else (var_of[producer], var_of[consumer], slot_index, shape)
        weights = edge_weight.setdefault(key, [0.0, 0.0])
        weights[0] += facts[consumer].weight
        # a value moves once for readers that want it alike, counted at its first reader's weight: at
        # least its readers' least weight times their mean move
        weights[1] += least_reader[producer] / max(1, facts[producer].consumers)
    moved, counts, least_counts = [], [], []  # (producer, consumer or None, matrix, classes), per edge key
    move = edge_times(memo, ctx)  # kept across the search's axes
    # edges alike (the same candidate lists, slot, shape and bytes: identical layers) share their
    # matrix; so do the search's other layouts, whose candidate lists are the memo's same (ids kept)
    alike = (
        {}
        if memo is None
        else memo.setdefault(("edge matrices", ctx.name, ctx.size, repr(ctx.link), ctx.comm_share), {})
    )
    for (producer, consumer, slot_index, shape), (count, least_count) in edge_weight.items():
        fact = facts[producer]
        consumed = None if consumer is None else options[consumer]
        key = (id(options[producer]), id(consumed), slot_index, shape, fact.elem_bytes, fact.needs_grad)
        if key not in alike:
            # an edge costs by the producer's output placement and the one the consumer wants: classes of options
            sources = list(dict.fromkeys(s.output for s in options[producer]))
            wanted = [R] if consumed is None else list(dict.fromkeys(s.inputs[slot_index] for s in consumed))
            alike[key] = (
                np.array([[move(fact, a, b, shape) for b in wanted] for a in sources]),
                np.array([sources.index(s.output) for s in options[producer]]),
                None if consumed is None else np.array([wanted.index(s.inputs[slot_index]) for s in consumed]),
            )
        matrix, class_u, class_v = alike[key]
        moved.append((index[producer], None if consumer is None else index[consumer], matrix, class_u, class_v))
        counts.append(count)
        least_counts.append(least_count)
    return moved, counts, least_counts


def _least_layout(floors, options, reps: list[str], weight, moved, counts, leaders, penalties) -> float:
    """The least any layout costs: each op's option at its floor (:func:`floor_of`'s work and sync),
    the edges' moves (weighed by ``counts``), followers following (a small ILP without the memory
    budget, or a floor of it where only HiGHS could solve it: :func:`least_objective`)."""
    least = [np.zeros(len(options[r])) if r not in floors else weight[r] * sum(floors[r]) for r in reps]
    least, shared = _with_edges(least, moved, counts)
    return least_objective(ChoiceProblem(least, shared + penalties, followers=leaders))


def _terms(facts, ctx: AxisContext, options, reps: list[str], twin: dict[str, str]) -> dict[str, list[tuple]]:
    """:func:`node_terms` of each variable's options, computed once for twins whose local shapes agree."""
    terms, by_twin = {}, {}
    for r in reps:
        key = (twin.get(r, r), ctx.local.work.get(r), tuple(ctx.local.slot_shapes[r]), tuple(ctx.local.shapes[r]))
        if key not in by_twin:
            by_twin[key] = [node_terms(facts[r], s, ctx, facts) for s in options[r]]
        terms[r] = by_twin[key]
    return terms


def ahead_floors(search, degrees: dict[str, int], zero: int, schedule: Schedule):
    """The last sharded axis's layout floors as :func:`solve_axis` asks them once the axes ahead are
    solved ((least work, least of work and gradient sync less that), then with the least its layout
    moves too), before they are: taken on the unsharded shapes, over the product of the sizes ahead;
    yielded cheapest first, so a caller that prunes on the first skips the second's small ILP. Floors,
    as the cost model is sub-homogeneous: an op or a move on 1/k of a dim costs at least 1/k of it
    (tiles and waves round up, a collective pays its latency whole, a kernel's efficiency never grows
    as it shrinks), and an axis of size k splits an op's work and a tensor's bytes k ways at most (a
    parameter's sync, which dp and cp leave whole, counts 1/k of itself: less than it is). Nothing
    where no axis comes before it. Kept in ``search.memo`` for every configuration with that last
    axis."""
    axes = list(degrees)
    last = max((i for i, a in enumerate(axes) if degrees[a] > 1), default=-1)
    ahead = math.prod(degrees[a] for a in axes[: max(last, 0)])
    if ahead == 1:
        return
    facts, memo, axis = search.facts, search.memo, axes[last]
    link = search.hardware.link(search.mesh.shape, axis_spans(degrees)[axis], degrees[axis])
    # ZeRO and dp change a dp axis's op costs only (and parameters', which floors leave out)
    alike = (zero, degrees[Axis.DP]) if axis == Axis.DP else ()
    key = ("ahead floor", axis, degrees[axis], repr(link), *alike)
    if key not in memo:
        # taken at one microbatch, a floor for every count: an op run in pieces runs no faster, and an
        # axis behind others is not dp, whose parameters' sync alone has a once-per-step part to spread
        schedule = dataclasses.replace(schedule, microbatches=1)
        ctx = _context(search, degrees, zero, schedule, last, unsharded_shapes(facts, memo), expert_params(facts))
        _, var_of, reps, weight = _variables(facts, search.variable)
        options = all_candidates(facts, ctx, reps, memo, search.twin)
        floors = floor_of(facts, ctx, options, _terms(facts, ctx, options, reps, search.twin))
        work = sum(weight[r] * float(w.min()) for r, (w, _) in floors.items())
        both = sum(weight[r] * float((w + s).min()) for r, (w, s) in floors.items())
        memo[key] = (work, both, (ctx, var_of, reps, weight, options, floors))
    work, both, layout = memo[key]
    yield work / ahead, (both - work) / ahead
    moves = ("ahead moves", *key[1:])
    if moves not in memo:  # the small ILP, once per last axis
        ctx, var_of, reps, weight, options, floors = layout
        index = {rep: i for i, rep in enumerate(reps)}
        moved, _, least_counts = _edges(facts, ctx, options, index, var_of, memo)
        leaders, penalties = followers(facts, options, index, var_of)
        memo[moves] = _least_layout(floors, options, reps, weight, moved, least_counts, leaders, penalties)
    yield work / ahead, (memo[moves] - work) / ahead


def floor_of(facts, ctx: AxisContext, options, terms) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per op, each option's (work, gradient sync) seconds at least, whichever schedule prices the
    layout: its compute (its batch in one piece: a GEMM split into microbatches runs no faster),
    kernel traffic and partial gradients (each shared among the ops it comes from, so one
    all-reduced once is never counted twice; a parameter's counts as gradient sync). Edges are the
    caller's; parameters' optimizer steps are left to the caller. ``terms``: :func:`node_terms` of
    each option under ``ctx``'s schedule."""
    floors, alike = {}, {}  # twins share their terms' list, and so their floors
    for rep, rep_terms in terms.items():
        fact = facts[rep]
        if fact.kind != "op":
            continue
        if id(rep_terms) in alike:
            floors[rep] = alike[id(rep_terms)]
            continue
        works, syncs = [], []
        for strategy, (compute, comm, _) in zip(options[rep], rep_terms):
            if ctx.schedule.microbatches > 1:
                whole = ctx.local.work[rep] * work_fraction(strategy, ctx.size)
                compute = min(compute, fact.seconds(whole, local_slot_shapes(fact, strategy, ctx)))
            synced = sum(
                (share + once / max(1, ctx.schedule.microbatches)) * (1 - ctx.overlap) / max(1, facts[slot].consumers)
                for slot, share, once in partial_gradients(fact, strategy, ctx, facts)
                if facts[slot].kind == "param"
            )
            works.append(compute + comm)
            syncs.append(synced)
        floors[rep] = alike[id(rep_terms)] = (np.array(works), np.array(syncs))
    return floors


def _with_edges(
    unary: list[np.ndarray], moved: list[tuple], counts: list[float]
) -> tuple[list[np.ndarray], list[tuple]]:
    """The ILP's terms from the edges ((u, v or None for the output, matrix, class_u, class_v), each
    weighed by its count): an edge to the output adds to its producer's own costs."""
    unary, joined = list(unary), []
    for (u, v, matrix, class_u, class_v), count in zip(moved, counts):
        if v is None:
            unary[u] = unary[u] + count * matrix[class_u, 0]
        else:
            joined.append((u, v, count * matrix, class_u, class_v))
    return unary, joined


def followers(facts, options, index, var_of) -> tuple[dict[int, tuple[int, list[int]]], list]:
    """Elementwise ops with one tensor input follow their producer: for each of its options,
    the candidate that takes its output as it is (Alpa's merge of followers).

    Returns variable → (leader variable, tie), from the node that is the variable itself (its
    leader comes earlier in the graph, so chains end), and the pairs that forbid a tied node's
    other options where it follows another variable (a folded layer's first op follows the
    previous layer where the first layer's follows the embedding).
    """
    own: dict[str, tuple[str, list[int]]] = {}
    tied: dict[tuple[str, str], list[int]] = {}
    for name, rep in var_of.items():
        fact = facts[name]
        if fact.kind != "op" or len(fact.slots) != 1 or rule_for(fact.node.target) is not pointwise:
            continue
        if fact.slots[0].name not in var_of:
            continue
        lead = var_of[fact.slots[0].name]
        tie = [next((t for t, s in enumerate(options[rep]) if s.inputs[0] == o.output), None) for o in options[lead]]
        if None in tie:
            continue
        if name == rep and lead != rep:
            own[rep] = (lead, tie)
        else:
            tied[(rep, lead)] = tie
    penalties = []
    for (rep, lead), tie in tied.items():
        if own.get(rep, (None,))[0] == lead:
            continue
        forbid = np.full((len(options[lead]), len(options[rep])), IMPOSSIBLE_S)
        forbid[np.arange(len(tie)), tie] = 0.0
        penalties.append((index[lead], index[rep], forbid))
    return {index[rep]: (index[lead], tie) for rep, (lead, tie) in own.items()}, penalties
