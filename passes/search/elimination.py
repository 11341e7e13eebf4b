"""The choice problem without a memory budget, solved exactly by variable elimination.

Min-sum over the factors of a :class:`~autopar.passes.search.ilp.ChoiceProblem` (a cost vector
per variable, a cost matrix per pair): eliminate one variable at a time — add up every factor
that holds it, keep the minimum over its options for each combination of its neighbours' (a
new factor over them) and remember the argmin; then read the choices back in reverse order.
The next variable is the one whose joint table is smallest (a greedy elimination order, which
the options' counts alone decide: :func:`elimination_order` finds it before any table is built,
and :func:`_steps` what each step adds up, once per problem shape: a search solves one shape many
times with other costs).
The tables stay small when the variables' graph is narrow, as a transformer's layer folded to
one set of variables is (a chain with residual and attention branches; a mixture-of-experts
router's branches widen it); a problem whose table would exceed ``max_entries`` is left to
HiGHS (:func:`eliminate` returns None), as is every problem with a memory budget (a knapsack
constraint that elimination cannot hold).

Exact: the same optimal objective as the ILP; among equal optima it takes the first option.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math

import numpy as np

MAX_ENTRIES = 2**23  # 64 MiB of float64 in the largest table; HiGHS beyond
SMALL_TABLE = 2**14  # entries: a table this small is summed whole (one numpy call per factor)


def elimination_order(sizes: list[int], pairs: list[tuple], max_entries: int = MAX_ENTRIES) -> list[int] | None:
    """The greedy order (smallest joint table first), from the options' counts alone; None when
    some table of it would hold more than ``max_entries`` entries (before any table is built)."""
    linked: list[set[int]] = [set() for _ in sizes]
    for u, v, *_ in pairs:
        linked[u].add(v)
        linked[v].add(u)
    width = [sizes[v] * math.prod(sizes[w] for w in linked[v]) for v in range(len(sizes))]
    queue = [(width[v], v) for v in range(len(sizes))]  # stale entries are skipped when popped
    heapq.heapify(queue)
    order, done = [], [False] * len(sizes)
    while queue:
        entry, v = heapq.heappop(queue)
        if done[v] or entry != width[v]:
            continue
        if entry > max_entries:
            return None
        order.append(v)
        done[v] = True
        for w in linked[v]:  # its neighbours become one another's: the new table holds them all
            linked[w].discard(v)
            linked[w] |= linked[v] - {w}
            width[w] = sizes[w] * math.prod(sizes[x] for x in linked[w])
            heapq.heappush(queue, (width[w], w))
    return order


def eliminate(unary: list[np.ndarray], pairs: list[tuple], max_entries: int = MAX_ENTRIES):
    """(choice per variable, objective) minimizing Σ unary[v][s_v] + Σ matrix[class_u[s_u], class_v[s_v]]
    over ``pairs`` of (u, v, matrix, class_u, class_v) with u ≠ v; None when a table would be too large."""
    sizes = tuple(len(u) for u in unary)
    steps = _steps(sizes, tuple((u, v) for u, v, *_ in pairs), max_entries)
    if steps is None:
        return None
    tables = [np.asarray(costs, dtype=float) for costs in unary]
    tables += [matrix[class_u][:, class_v] for _, _, matrix, class_u, class_v in pairs]
    trace: list[tuple[int, tuple[int, ...], np.ndarray]] = []  # (variable, its neighbours, argmin over it)
    constant = 0.0
    for v, around, inputs in steps:
        if inputs is None:  # its own costs alone
            table = tables[v]
            best = table.argmin()
            trace.append((v, (), best))
            constant += float(table[best])
            continue
        views = [tables[key].transpose(order_in).reshape(shape) for key, order_in, shape in inputs]
        best, reduced = _least(views, sizes[v], tuple(sizes[w] for w in around))
        trace.append((v, around, best))
        if around:
            tables.append(reduced)
        else:
            constant += float(reduced)
    choice = [0] * len(unary)
    for v, around, best in reversed(trace):
        choice[v] = int(best[tuple(choice[w] for w in around)]) if around else int(best)
    return tuple(choice), constant


def _least(views: list[np.ndarray], options: int, rest: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(argmin, min) over axis 0 (the eliminated variable's options) of the sum of ``views``,
    which broadcast over (options, *rest); the first of equal options, as argmin takes it.
    A large table is summed one option at a time: each slice, a table over the neighbours alone,
    stays in cache, and the table over the options is never built."""
    if options * math.prod(rest) <= SMALL_TABLE:
        joint = sum(views[1:], views[0])
        best = joint.argmin(axis=0)
        return best, np.minimum.reduce(joint, axis=0)
    reduced, row = np.empty(rest), np.empty(rest)
    best, better = np.zeros(rest, np.intp), np.empty(rest, bool)
    for s in range(options):
        row[...] = views[0][s]
        for x in views[1:]:
            row += x[s]
        if s == 0:
            reduced[...] = row
            continue
        np.less(row, reduced, out=better)  # strictly: an equal later option does not displace the first
        np.minimum(reduced, row, out=reduced)
        np.copyto(best, s, where=better)
    return best, reduced


@functools.lru_cache(maxsize=256)
def _steps(sizes: tuple[int, ...], links: tuple[tuple[int, int], ...], max_entries: int):
    """What eliminating in :func:`elimination_order` does, from the problem's shape alone (a search
    solves one shape many times, with other costs): per variable, (it, its neighbours, and the
    factors to add up: (index, axes' order, broadcast shape over (it, *neighbours))), or (it, (),
    None) where only its own costs hold it. Factors are numbered as :func:`eliminate` lists them:
    each variable's costs, the pairs', then each step's new factor over its neighbours."""
    order = elimination_order(list(sizes), list(links), max_entries)
    if order is None:
        return None
    factors: dict[int, tuple[int, ...]] = {}
    holding: list[set[int]] = [set() for _ in sizes]
    keys = itertools.count()

    def add(variables: tuple[int, ...]) -> None:
        key = next(keys)
        factors[key] = variables
        for w in variables:
            holding[w].add(key)

    for v in range(len(sizes)):
        add((v,))
    for link in links:
        add(link)
    steps = []
    for v in order:
        if len(holding[v]) == 1 and len(factors[next(iter(holding[v]))]) == 1:
            factors.pop(holding[v].pop())
            steps.append((v, (), None))
            continue
        around = tuple(sorted({w for key in holding[v] for w in factors[key]} - {v}))
        position = {w: i for i, w in enumerate((v, *around))}  # v's options first
        inputs = []
        for key in holding[v]:
            variables = factors.pop(key)
            for w in variables:
                if w != v:
                    holding[w].discard(key)
            order_in = tuple(sorted(range(len(variables)), key=lambda i: position[variables[i]]))
            shape = [1] * len(position)
            for w in variables:
                shape[position[w]] = sizes[w]
            inputs.append((key, order_in, tuple(shape)))
        holding[v].clear()
        steps.append((v, around, inputs))
        if around:
            add(around)
    return steps
