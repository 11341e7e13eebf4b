"""One choice per node, pairwise costs on edges, a memory budget: the intra-op ILP.

Variables (Alpa's formulation):
  x[v, s] ∈ {0, 1}   node v takes option s;                 Σ_s x[v, s] = 1
  y[e, s, t] ≥ 0     edge e = (u, v) takes options (s, t);   Σ_t y[e, s, t] = x[u, s],  Σ_s y[e, s, t] = x[v, t]
Objective:  Σ unary[v][s]·x[v, s] + Σ pair[e][s, t]·y[e, s, t]
Memory:     Σ memory[v][s]·x[v, s] ≤ limit
With x integral the marginal constraints force y to the product x[u, s]·x[v, t], so y
needs no integrality. Solved with HiGHS; infeasibility is reported, never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import highspy
import numpy as np


@dataclass
class ChoiceProblem:
    unary: list[np.ndarray]  # per variable: cost of each option
    pairs: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # (u, v, cost[s_u, s_v])
    memory: list[np.ndarray] | None = None  # per variable: bytes of each option
    memory_limit: float | None = None


@dataclass(frozen=True)
class ChoiceSolution:
    choice: tuple[int, ...]
    objective: float


def solve_choices(problem: ChoiceProblem, time_limit_s: float = 60.0) -> ChoiceSolution | None:
    """Minimize the objective; ``None`` when the memory budget cannot be met."""
    offsets = np.cumsum([0] + [len(u) for u in problem.unary])
    n_x = int(offsets[-1])
    costs = [np.concatenate(problem.unary)] if problem.unary else [np.zeros(0)]
    rows: list[tuple[float, float, list[int], list[float]]] = []
    for v, options in enumerate(problem.unary):
        rows.append((1.0, 1.0, list(range(offsets[v], offsets[v + 1])), [1.0] * len(options)))
    n_cols = n_x
    for u, v, matrix in problem.pairs:
        su, sv = matrix.shape
        base = n_cols
        n_cols += su * sv
        costs.append(matrix.reshape(-1))
        for s in range(su):  # Σ_t y[s, t] = x[u, s]
            rows.append((0.0, 0.0, [base + s * sv + t for t in range(sv)] + [offsets[u] + s], [1.0] * sv + [-1.0]))
        for t in range(sv):  # Σ_s y[s, t] = x[v, t]
            rows.append((0.0, 0.0, [base + s * sv + t for s in range(su)] + [offsets[v] + t], [1.0] * su + [-1.0]))
    if problem.memory is not None and problem.memory_limit is not None:
        memory = np.concatenate(problem.memory)
        rows.append((-highspy.kHighsInf, float(problem.memory_limit), list(range(n_x)), list(memory)))

    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", time_limit_s)
    highs.setOptionValue("mip_rel_gap", 1e-6)
    cost = np.concatenate(costs).astype(np.float64)
    highs.addCols(n_cols, cost, np.zeros(n_cols), np.ones(n_cols), 0, np.array([], np.int32), np.array([], np.int32), np.array([]))
    highs.changeColsIntegrality(n_x, np.arange(n_x, dtype=np.int32), np.ones(n_x, dtype=np.uint8))
    starts, indices, values, lower, upper = [], [], [], [], []
    for lo, hi, idx, val in rows:
        starts.append(len(indices))
        indices += idx
        values += val
        lower.append(lo)
        upper.append(hi)
    highs.addRows(
        len(rows), np.array(lower), np.array(upper), len(indices),
        np.array(starts, np.int32), np.array(indices, np.int32), np.array(values, np.float64),
    )
    highs.run()
    status = highs.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None
    if status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
        raise RuntimeError(f"HiGHS could not solve the sharding ILP: {highs.modelStatusToString(status)}")
    x = np.asarray(highs.getSolution().col_value[:n_x])
    if status == highspy.HighsModelStatus.kTimeLimit and not np.isfinite(highs.getInfo().objective_function_value):
        raise RuntimeError("HiGHS found no sharding within its time limit; pin degrees to shrink the search")
    choice = tuple(int(np.argmax(x[offsets[v] : offsets[v + 1]])) for v in range(len(problem.unary)))
    return ChoiceSolution(choice, float(highs.getInfo().objective_function_value))
