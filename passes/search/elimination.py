"""The choice problem without a memory budget, solved exactly by variable elimination.

Min-sum over the factors of a :class:`~autopar.passes.search.ilp.ChoiceProblem` (a cost vector
per variable, a cost matrix per pair): eliminate one variable at a time — add up every factor
that holds it, keep the minimum over its options for each combination of its neighbours' (a
new factor over them) and remember the argmin; then read the choices back in reverse order.
The next variable is the one whose joint table is smallest (a greedy elimination order). The
tables stay small when the variables' graph is narrow, as a transformer's layer folded to one
set of variables is (a chain with residual and attention branches); a problem whose table
would exceed ``max_entries`` is left to HiGHS (:func:`eliminate` returns None), as is every
problem with a memory budget (a knapsack constraint that elimination cannot hold).

Exact: the same optimal objective as the ILP; among equal optima it takes the first option.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

MAX_ENTRIES = 2**20


def eliminate(unary: list[np.ndarray], pairs: list[tuple], max_entries: int = MAX_ENTRIES):
    """(choice per variable, objective) minimizing Σ unary[v][s_v] + Σ matrix[class_u[s_u], class_v[s_v]]
    over ``pairs`` of (u, v, matrix, class_u, class_v) with u ≠ v; None when a table would be too large."""
    sizes = [len(u) for u in unary]
    factors: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    holding: list[set[int]] = [set() for _ in unary]
    keys = itertools.count()

    def add(variables: tuple[int, ...], table: np.ndarray) -> None:
        key = next(keys)
        factors[key] = (variables, table)
        for v in variables:
            holding[v].add(key)

    trace: list[tuple[int, tuple[int, ...], np.ndarray]] = []  # (variable, its neighbours, argmin over it)
    for v, costs in enumerate(unary):
        add((v,), np.asarray(costs, dtype=float))
    for u, v, matrix, class_u, class_v in pairs:
        add((u, v), matrix[np.ix_(class_u, class_v)])

    def neighbours(v: int) -> set[int]:
        return {w for key in holding[v] for w in factors[key][0]} - {v}

    remaining = set(range(len(unary)))
    width = {v: sizes[v] * math.prod(sizes[w] for w in neighbours(v)) for v in remaining}
    queue = [(width[v], v) for v in remaining]  # stale entries are skipped when popped
    heapq.heapify(queue)
    constant = 0.0
    while remaining:
        entry, v = heapq.heappop(queue)
        if v not in remaining or entry != width[v]:
            continue
        if width[v] > max_entries:
            return None
        around = tuple(sorted(neighbours(v)))
        axes = around + (v,)
        joint = np.zeros([sizes[w] for w in axes])
        for key in list(holding[v]):
            variables, table = factors.pop(key)
            for w in variables:
                holding[w].discard(key)
            order = sorted(range(len(variables)), key=lambda i: axes.index(variables[i]))
            shape = [sizes[w] if w in variables else 1 for w in axes]
            joint = joint + table.transpose(order).reshape(shape)
        trace.append((v, around, np.argmin(joint, axis=-1)))
        reduced = joint.min(axis=-1)
        remaining.discard(v)
        if around:
            add(around, reduced)
        else:
            constant += float(reduced)
        for w in around:
            width[w] = sizes[w] * math.prod(sizes[x] for x in neighbours(w))
            heapq.heappush(queue, (width[w], w))
    choice = [0] * len(unary)
    for v, around, best in reversed(trace):
        choice[v] = int(best[tuple(choice[w] for w in around)]) if around else int(best)
    return tuple(choice), constant
