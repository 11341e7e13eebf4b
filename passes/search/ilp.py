"""One choice per node, pairwise costs on edges, a memory budget: the intra-op ILP.

Variables (Alpa's formulation):
  x[v, s] ∈ {0, 1}   node v takes option s;                 Σ_s x[v, s] = 1
  y[e, s, t] ≥ 0     edge e = (u, v) takes options (s, t);   Σ_t y[e, s, t] = x[u, s],  Σ_s y[e, s, t] = x[v, t]
Objective:  Σ unary[v][s]·x[v, s] + Σ pair[e][s, t]·y[e, s, t]
Memory:     Σ memory[v][s]·x[v, s] + T ≤ limit,   T ≥ Σ_s temporary[v][s]·x[v, s] for every v
(T, continuous: the largest transient any node's option holds, which the peak adds once)
With x integral the marginal constraints force y to the product x[u, s]·x[v, t], so y
needs no integrality. Solved with HiGHS; infeasibility is reported, never hidden.

A pair may group options into classes that cost alike (an edge's cost depends only on the
producer's output placement and the placement the consumer wants): ``(u, v, cost[a, b],
class_u, class_v)``, option s of u in row ``class_u[s]``. Then y runs over classes, Σ_b y[a, b]
= Σ_{s: class_u[s] = a} x[u, s] (and alike for v): the same optimum with far fewer columns.

Followers (Alpa's merge of elementwise followers) are presolved away: a follower v of
leader u takes option ``tie[s]`` whenever u takes s, so its costs, memory and edges fold
into u's and it needs no variable of its own (:func:`merge_followers`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import highspy
import numpy as np

from autopar.passes.cost.axis_terms import IMPOSSIBLE_S
from autopar.passes.search.elimination import eliminate

# HiGHS presolves problems of up to this many variables. On larger ones (a layout under a memory budget
# over thousands of unfolded nodes) presolving the pairs' marginal rows costs more than it saves: the same
# optima, 15-27 s without it where it ran past 60 s (BENCHMARKS.md, "HiGHS presolve on layouts under a
# memory budget"). On smaller ones neither way was the faster, and presolve's choice among equal optima
# is the one plans were built on.
PRESOLVE_UP_TO = 1000


@dataclass
class ChoiceProblem:
    unary: list[np.ndarray]  # per variable: cost of each option
    # (u, v, cost[s_u, s_v]), or (u, v, cost[a, b], class of each option of u, class of each option of v)
    pairs: list[tuple] = field(default_factory=list)
    memory: list[np.ndarray] | None = None  # per variable: bytes of each option
    memory_limit: float | None = None
    temporary: list[np.ndarray] | None = None  # per variable: transient bytes of each option (the largest counts)
    followers: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # v → (leader u, tie[s_u] = s_v)


@dataclass(frozen=True)
class ChoiceSolution:
    choice: tuple[int, ...]
    objective: float


def merge_followers(problem: ChoiceProblem) -> tuple[ChoiceProblem, list[tuple[int, list[int]]]]:
    """Fold every follower into its leader (chains resolved to the root leader).

    Returns the problem over the same variable indices, each follower reduced to a single
    zero-cost option, and per variable (root, tie) to read its choice back.
    """
    n = len(problem.unary)
    root = [(v, list(range(len(problem.unary[v])))) for v in range(n)]  # choice[v] = tie[choice[root]]

    def resolve(v: int) -> tuple[int, list[int]]:
        if v not in problem.followers:
            return v, list(range(len(problem.unary[v])))
        leader, tie = problem.followers[v]
        top, top_tie = resolve(leader)
        return top, [tie[s] for s in top_tie]

    for v in range(n):
        root[v] = resolve(v)
    unary = [u.astype(float).copy() for u in problem.unary]
    memory = None if problem.memory is None else [m.astype(float).copy() for m in problem.memory]
    temporary = None if problem.temporary is None else [t.astype(float).copy() for t in problem.temporary]
    for v, (r, tie) in enumerate(root):
        if r != v:
            unary[r] += problem.unary[v][tie]
            unary[v] = np.zeros(1)
            if memory is not None:
                memory[r] += problem.memory[v][tie]
                memory[v] = np.zeros(1)
            if temporary is not None:
                temporary[r] = np.maximum(temporary[r], problem.temporary[v][tie])
                temporary[v] = np.zeros(1)
    pairs = []
    for u, v, matrix, class_u, class_v in map(_classed, problem.pairs):
        (ru, tie_u), (rv, tie_v) = root[u], root[v]
        pairs.append((ru, rv, matrix, class_u[tie_u], class_v[tie_v]))
    return ChoiceProblem(unary, pairs, memory, problem.memory_limit, temporary), root


def _classed(pair: tuple) -> tuple:
    """A pair with its option classes (each option its own class where none are given)."""
    if len(pair) == 5:
        return pair
    u, v, matrix = pair
    return u, v, matrix, np.arange(matrix.shape[0]), np.arange(matrix.shape[1])


def fold_fixed(problem: ChoiceProblem) -> ChoiceProblem:
    """Fold edges touching a variable with a single option (and self-edges) into unary costs."""
    unary = [u.copy() for u in problem.unary]
    pairs = []
    for u, v, matrix, class_u, class_v in map(_classed, problem.pairs):
        if len(unary[u]) == 1:
            unary[v] = unary[v] + matrix[class_u[0], class_v]
        elif len(unary[v]) == 1:
            unary[u] = unary[u] + matrix[class_u, class_v[0]]
        elif u == v:
            unary[u] = unary[u] + matrix[class_u, class_v]
        else:
            pairs.append((u, v, matrix, class_u, class_v))
    return ChoiceProblem(unary, pairs, problem.memory, problem.memory_limit, problem.temporary)


def solve_choices(problem: ChoiceProblem, time_limit_s: float = 60.0) -> ChoiceSolution | None:
    """Minimize the objective; ``None`` when the memory budget cannot be met. By variable
    elimination where its tables stay small (:mod:`elimination`), when there is no budget or its
    optimum keeps it; else with HiGHS."""
    merged, root = merge_followers(problem)
    folded = fold_fixed(merged)
    budget = folded.memory_limit if folded.memory is not None else None
    if budget is not None and budget_used(folded.memory, folded.temporary) > budget:
        return None  # not even the leanest option of every variable fits
    found = eliminate(folded.unary, folded.pairs)
    if found is not None and budget is not None:  # the optimum without the budget, if it keeps it
        found = found if budget_used(folded.memory, folded.temporary, found[0]) <= budget else None
    solution = ChoiceSolution(*found) if found is not None else _solve(folded, time_limit_s)
    if solution is None:
        return None
    return ChoiceSolution(tuple(tie[solution.choice[r]] for r, tie in root), solution.objective)


def budget_used(memory: list[np.ndarray], temporary: list[np.ndarray] | None, choice=None) -> float:
    """The memory row's left side for ``choice``: each variable's memory and the largest transient;
    without a choice, a floor of it over every choice (each variable's least of both)."""
    if choice is None:
        return sum(float(m.min()) for m in memory) + max((float(t.min()) for t in temporary or ()), default=0.0)
    held = sum(float(m[c]) for m, c in zip(memory, choice))
    return held + max((float(t[c]) for t, c in zip(temporary or (), choice)), default=0.0)


def least_objective(problem: ChoiceProblem) -> float:
    """A floor of the least objective without the memory budget, for a bound that prunes before a
    solve: the optimum where variable elimination finds it, else every factor at its own least
    (each variable's cheapest option, each pair's cheapest cell), which no choice goes below. Only
    HiGHS solves a problem too wide to eliminate (an unrolled loop's graph), and its exact bound
    would cost what the solve it may spare costs."""
    folded = fold_fixed(merge_followers(problem)[0])
    found = eliminate(folded.unary, folded.pairs)
    if found is not None:
        return found[1]
    return sum(float(u.min()) for u in folded.unary) + sum(float(pair[2].min()) for pair in folded.pairs)


def _solve(problem: ChoiceProblem, time_limit_s: float) -> ChoiceSolution | None:
    offsets = np.cumsum([0] + [len(u) for u in problem.unary])
    n_x = int(offsets[-1])
    costs = [np.concatenate(problem.unary)] if problem.unary else [np.zeros(0)]
    rows: list[tuple[float, float, list[int], list[float]]] = []
    for v, options in enumerate(problem.unary):
        rows.append((1.0, 1.0, list(range(offsets[v], offsets[v + 1])), [1.0] * len(options)))
    n_cols = n_x
    for u, v, matrix, class_u, class_v in map(_classed, problem.pairs):
        su, sv = matrix.shape
        base = n_cols
        n_cols += su * sv
        costs.append(matrix.reshape(-1))
        for a in range(su):  # Σ_b y[a, b] = Σ_{s in class a} x[u, s]
            members = [offsets[u] + s for s in np.flatnonzero(class_u == a)]
            rows.append(
                (0.0, 0.0, [base + a * sv + b for b in range(sv)] + members, [1.0] * sv + [-1.0] * len(members))
            )
        for b in range(sv):  # Σ_a y[a, b] = Σ_{t in class b} x[v, t]
            members = [offsets[v] + t for t in np.flatnonzero(class_v == b)]
            rows.append(
                (0.0, 0.0, [base + a * sv + b for a in range(su)] + members, [1.0] * su + [-1.0] * len(members))
            )
    lower_cols, upper_cols = np.zeros(n_cols), np.ones(n_cols)
    if problem.memory is not None and problem.memory_limit is not None:
        # bytes as shares of the limit: rows of 1e10-byte coefficients beside T's -1 mislead HiGHS's
        # presolve (it found a feasible problem infeasible)
        scale = max(float(problem.memory_limit), 1.0)
        held = (list(range(n_x)), list(np.concatenate(problem.memory) / scale))
        if problem.temporary is not None:  # T, a column of its own: at least each variable's transient
            temporary = [t / scale for t in problem.temporary]
            floor = max(float(t.min()) for t in temporary)
            lower_cols, upper_cols = np.append(lower_cols, floor), np.append(upper_cols, highspy.kHighsInf)
            costs.append(np.zeros(1))
            for v, t in enumerate(temporary):
                if float(t.max()) > floor:  # below the floor T holds anyway
                    idx = list(range(offsets[v], offsets[v + 1]))
                    rows.append((-highspy.kHighsInf, 0.0, idx + [n_cols], list(t) + [-1.0]))
            held = (held[0] + [n_cols], held[1] + [1.0])
            n_cols += 1
        rows.append((-highspy.kHighsInf, float(problem.memory_limit) / scale, *held))

    cost = np.concatenate(costs).astype(np.float64)
    matrix, presolve = _row_matrix(rows), len(problem.unary) <= PRESOLVE_UP_TO
    # A move that cannot be done costs IMPOSSIBLE_S (1e3 s) or a multiple, beside microseconds, and HiGHS's
    # tolerances are absolute (1e-7 of a cost of 1e-3 s is 1e-4 of it): so costs go in as shares of the
    # largest possible one, and those columns are first held at zero. Only where nothing else fits are they
    # allowed, each unit costing twice what any other choice can (never chosen when avoidable, and the
    # fewest of them when not).
    impossible = cost >= IMPOSSIBLE_S
    largest = float(np.max(cost[~impossible], initial=0.0)) or 1.0
    held = np.where(impossible, 0.0, upper_cols)
    found = _run(np.where(impossible, 0.0, cost) / largest, lower_cols, held, n_x, matrix, presolve, time_limit_s)
    if found is None and impossible.any():
        factors = [*problem.unary, *(pair[2] for pair in problem.pairs)]
        unit = 2.0 * sum(float(np.max(f[f < IMPOSSIBLE_S], initial=0.0)) for f in factors) or 1.0
        penalized = np.where(impossible, cost / IMPOSSIBLE_S * unit, cost)
        found = _run(penalized / unit, lower_cols, upper_cols, n_x, matrix, presolve, time_limit_s)
    if found is None:
        return None
    choice = tuple(int(np.argmax(found[offsets[v] : offsets[v + 1]])) for v in range(len(problem.unary)))
    return ChoiceSolution(choice, _objective(problem, choice))


def _objective(problem: ChoiceProblem, choice: tuple[int, ...]) -> float:
    """The objective of ``choice`` in the problem's own costs."""
    total = sum(float(u[c]) for u, c in zip(problem.unary, choice))
    for u, v, matrix, class_u, class_v in map(_classed, problem.pairs):
        total += float(matrix[class_u[choice[u]], class_v[choice[v]]])
    return total


def _row_matrix(rows: list) -> tuple:
    """The rows ``(lower, upper, columns, values)`` as HiGHS takes them: bounds and a sparse matrix by row."""
    starts, indices, values, lower, upper = [], [], [], [], []
    for lo, hi, idx, val in rows:
        starts.append(len(indices))
        indices += idx
        values += val
        lower.append(lo)
        upper.append(hi)
    return (
        len(rows),
        np.array(lower),
        np.array(upper),
        len(indices),
        np.array(starts, np.int32),
        np.array(indices, np.int32),
        np.array(values, np.float64),
    )


def _run(cost, lower_cols, upper_cols, n_x: int, matrix: tuple, presolve: bool, time_limit_s: float):
    """HiGHS on the columns and rows built: the first ``n_x`` columns' values, or ``None`` where infeasible."""
    highs = _new_highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", time_limit_s)
    highs.setOptionValue("mip_rel_gap", 1e-6)
    if not presolve:
        highs.setOptionValue("presolve", "off")
    n_cols = len(cost)
    highs.addCols(n_cols, cost, lower_cols, upper_cols, 0, np.array([], np.int32), np.array([], np.int32), np.array([]))
    highs.changeColsIntegrality(n_x, np.arange(n_x, dtype=np.int32), np.ones(n_x, dtype=np.uint8))
    highs.addRows(*matrix)
    highs.run()
    status = highs.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None
    if status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
        raise RuntimeError(f"HiGHS could not solve the sharding ILP: {highs.modelStatusToString(status)}")
    if status == highspy.HighsModelStatus.kTimeLimit and not np.isfinite(highs.getInfo().objective_function_value):
        raise RuntimeError("HiGHS found no sharding within its time limit; pin degrees to shrink the search")
    return np.asarray(highs.getSolution().col_value[:n_x])


_banner_shown = False


def _new_highs() -> highspy.Highs:
    """A HiGHS instance. The first one of a process prints HiGHS's banner from C++, before any
    option can silence it: it goes to /dev/null, so that ``autopar plan --json`` prints JSON alone."""
    global _banner_shown
    if _banner_shown:
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highs = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _banner_shown = True
    return highs
