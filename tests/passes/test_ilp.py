import itertools

import numpy as np

from autopar.passes.ilp import ChoiceProblem, solve_choices


def _brute_force(problem):
    best = None
    for choice in itertools.product(*(range(len(u)) for u in problem.unary)):
        if problem.memory is not None and sum(m[c] for m, c in zip(problem.memory, choice)) > problem.memory_limit:
            continue
        cost = sum(u[c] for u, c in zip(problem.unary, choice))
        cost += sum(matrix[choice[a], choice[b]] for a, b, matrix in problem.pairs)
        if best is None or cost < best[0]:
            best = (cost, choice)
    return best


def test_matches_brute_force_on_a_random_chain_with_memory():
    rng = np.random.default_rng(0)
    unary = [rng.random(3) for _ in range(5)]
    pairs = [(i, i + 1, rng.random((3, 3))) for i in range(4)] + [(0, 4, rng.random((3, 3)))]
    memory = [rng.random(3) for _ in range(5)]
    problem = ChoiceProblem(unary, pairs, memory, memory_limit=2.0)
    cost, choice = _brute_force(problem)
    solution = solve_choices(problem)
    assert solution.choice == choice
    assert np.isclose(solution.objective, cost)


def test_infeasible_memory_returns_none():
    problem = ChoiceProblem([np.array([1.0, 2.0])], [], [np.array([5.0, 6.0])], memory_limit=1.0)
    assert solve_choices(problem) is None
