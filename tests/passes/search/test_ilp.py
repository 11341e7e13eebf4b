import itertools

import numpy as np
import pytest

from autopar.passes.cost.axis_terms import IMPOSSIBLE_S
from autopar.passes.search import elimination, ilp
from autopar.passes.search.elimination import eliminate, elimination_order
from autopar.passes.search.ilp import ChoiceProblem, least_objective, solve_choices


def _brute_force(problem):
    best = None
    for choice in itertools.product(*(range(len(u)) for u in problem.unary)):
        if problem.memory is not None:
            held = sum(m[c] for m, c in zip(problem.memory, choice))
            held += max(t[c] for t, c in zip(problem.temporary, choice)) if problem.temporary else 0.0
            if held > problem.memory_limit:
                continue
        cost = sum(u[c] for u, c in zip(problem.unary, choice))
        cost += sum(matrix[choice[a], choice[b]] for a, b, matrix in problem.pairs)
        if best is None or cost < best[0]:
            best = (cost, choice)
    return best


@pytest.mark.parametrize("presolve_up_to", [0, 1000])  # HiGHS without presolve (large problems), with it
def test_matches_brute_force_on_a_random_chain_with_memory(monkeypatch, presolve_up_to):
    monkeypatch.setattr(ilp, "PRESOLVE_UP_TO", presolve_up_to)
    rng = np.random.default_rng(0)
    unary = [rng.random(3) for _ in range(5)]
    pairs = [(i, i + 1, rng.random((3, 3))) for i in range(4)] + [(0, 4, rng.random((3, 3)))]
    memory = [rng.random(3) for _ in range(5)]
    problem = ChoiceProblem(unary, pairs, memory, memory_limit=2.0)
    unbounded, _ = eliminate(unary, [(a, b, m, np.arange(3), np.arange(3)) for a, b, m in pairs])
    assert sum(m[c] for m, c in zip(memory, unbounded)) > 2.0  # the budget binds: HiGHS solves it
    cost, choice = _brute_force(problem)
    solution = solve_choices(problem)
    assert solution.choice == choice
    assert np.isclose(solution.objective, cost)


@pytest.mark.parametrize("presolve_up_to", [0, 1000])
@pytest.mark.parametrize("unit", [1.0, 2.0**30])  # in bytes, a layout's memory is tens of GiB
def test_the_memory_row_holds_the_largest_transient_once(monkeypatch, presolve_up_to, unit):
    """The budget binds on each variable's memory plus the largest transient of the options chosen
    (a maximum, not a sum): the optimum of the row without it does not keep the budget with it."""
    monkeypatch.setattr(ilp, "PRESOLVE_UP_TO", presolve_up_to)
    rng = np.random.default_rng(3)
    unary = [rng.random(3) for _ in range(6)]
    pairs = [(i, i + 1, rng.random((3, 3))) for i in range(5)]
    memory = [unit * 10 * rng.random(3) for _ in range(6)]
    temporary = [unit * 10 * rng.random(3) for _ in range(6)]
    without = _brute_force(ChoiceProblem(unary, pairs, memory, memory_limit=25 * unit))
    limit = sum(m[c] for m, c in zip(memory, without[1])) + 0.5 * max(t[c] for t, c in zip(temporary, without[1]))
    problem = ChoiceProblem(unary, pairs, memory, memory_limit=limit, temporary=temporary)
    cost, choice = _brute_force(problem)
    assert choice != without[1]  # the transient moved the optimum
    solution = solve_choices(problem)
    assert solution.choice == choice and np.isclose(solution.objective, cost)
    assert ilp.budget_used(memory, temporary, choice) <= limit < ilp.budget_used(memory, temporary, without[1])
    floor = sum(m.min() for m in memory) + max(t.min() for t in temporary)
    assert np.isclose(ilp.budget_used(memory, temporary), floor)
    assert solve_choices(ChoiceProblem(unary, pairs, memory, memory_limit=floor * 0.99, temporary=temporary)) is None


@pytest.mark.parametrize("presolve_up_to", [0, 1000])
def test_memory_from_hundreds_of_bytes_to_a_hundred_gib_solves_as_brute_force_does(monkeypatch, presolve_up_to):
    """A layout's options hold from a bias's few hundred bytes to a stage's 100 GiB: in bytes, HiGHS's
    presolve once found such a feasible problem infeasible."""
    monkeypatch.setattr(ilp, "PRESOLVE_UP_TO", presolve_up_to)
    rng = np.random.default_rng(1)
    n = int(rng.integers(5, 11))
    unary = [rng.random(3) for _ in range(n)]
    pairs = [(i, i + 1, rng.random((3, 3))) for i in range(n - 1)] + [(0, n - 1, rng.random((3, 3)))]
    memory = [10 ** rng.uniform(2, 11, 3) for _ in range(n)]
    temporary = [10 ** rng.uniform(8, 9.6, 3) for _ in range(n)]
    limit = sum(m.min() for m in memory) + max(t.min() for t in temporary)
    limit += rng.random() * sum(m.max() - m.min() for m in memory) * 0.5
    problem = ChoiceProblem(unary, pairs, memory, limit, temporary)
    cost, choice = _brute_force(problem)
    solution = solve_choices(problem)
    assert solution is not None and solution.choice == choice and np.isclose(solution.objective, cost)


@pytest.mark.parametrize("presolve_up_to", [0, 1000])
def test_a_move_that_cannot_be_done_is_avoided_exactly_beside_millisecond_costs(monkeypatch, presolve_up_to):
    """A small model's costs (milliseconds) beside IMPOSSIBLE_S (1e3 s) on moves that cannot be done,
    under a budget that binds: HiGHS once ended such problems up to 1.5e-4 above the optimum, and where
    no choice avoids those moves, up to 1e-3 s above it."""
    monkeypatch.setattr(ilp, "PRESOLVE_UP_TO", presolve_up_to)
    unavoidable = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(5, 8))
        unary = [rng.random(3) * 1e-3 for _ in range(n)]
        pairs = [(i, (i + 1) % n, rng.random((3, 3)) * 1e-3) for i in range(n)]
        for _, _, matrix in pairs:
            matrix[rng.random((3, 3)) < 0.3] = IMPOSSIBLE_S
        memory = [rng.random(3) for _ in range(n)]
        limit = sum(m.min() for m in memory) + rng.random() * sum(m.max() - m.min() for m in memory) * 0.5
        problem = ChoiceProblem(unary, pairs, memory, limit)
        cost, choice = _brute_force(problem)
        solution = solve_choices(problem)
        assert np.isclose(solution.objective, cost, rtol=1e-9, atol=0), seed
        assert np.isclose(ilp._objective(problem, solution.choice), solution.objective, rtol=1e-12, atol=0)
        unavoidable += cost >= IMPOSSIBLE_S
    assert 0 < unavoidable < 100  # both paths: impossible moves avoided, and the fewest taken where none can be


def test_a_followers_transient_joins_its_leaders_as_the_larger():
    unary = [np.array([0.0, 1.0]), np.array([0.0, 0.0])]
    memory = [np.array([1.0, 1.0]), np.array([0.0, 0.0])]
    temporary = [np.array([1.0, 1.0]), np.array([5.0, 0.0])]  # option 0 of the follower holds a large transient
    problem = ChoiceProblem(unary, [], memory, 3.0, temporary, followers={1: (0, [0, 1])})
    merged, _ = ilp.merge_followers(problem)
    assert list(merged.temporary[0]) == [5.0, 1.0]
    assert solve_choices(problem).choice == (1, 1)  # the cheaper option's follower would hold 1 + 5 > 3


def test_infeasible_memory_returns_none():
    problem = ChoiceProblem([np.array([1.0, 2.0])], [], [np.array([5.0, 6.0])], memory_limit=1.0)
    assert solve_choices(problem) is None


def test_a_follower_is_folded_into_its_leader():
    rng = np.random.default_rng(1)
    unary = [rng.random(3) for _ in range(3)]
    pairs = [(0, 1, rng.random((3, 3))), (1, 2, rng.random((3, 3)))]
    tie = [2, 0, 1]  # variable 1 takes tie[s] whenever variable 0 takes s
    problem = ChoiceProblem(unary, pairs, followers={1: (0, tie)})
    solution = solve_choices(problem)
    assert solution.choice[1] == tie[solution.choice[0]]
    # the same optimum as brute force over the tied assignments
    best = min(
        (unary[0][a] + unary[1][tie[a]] + unary[2][c] + pairs[0][2][a, tie[a]] + pairs[1][2][tie[a], c], (a, tie[a], c))
        for a in range(3)
        for c in range(3)
    )
    assert solution.choice == best[1] and np.isclose(solution.objective, best[0])


def test_elimination_matches_brute_force_on_a_graph_with_cycles():
    rng = np.random.default_rng(2)
    unary = [rng.random(3) for _ in range(7)]
    links = [(0, 1), (1, 2), (2, 0), (2, 3), (3, 4), (4, 5), (5, 6), (6, 3), (1, 5)]
    classes = np.arange(3)
    pairs = [(a, b, rng.random((3, 3)), classes, classes) for a, b in links]
    choice, objective = eliminate(unary, pairs)
    cost, best = _brute_force(ChoiceProblem(unary, [(a, b, m) for a, b, m, _, _ in pairs]))
    assert choice == best and np.isclose(objective, cost)


def test_elimination_sums_a_large_table_one_option_at_a_time_as_it_sums_a_small_one_whole(monkeypatch):
    """Both ways of adding up a step's factors (whole, or one option of the eliminated variable at
    a time) find the brute-force optimum and, among equal optima (integer costs tie often), the
    same choice: the first option, as argmin takes it."""
    rng = np.random.default_rng(3)
    unary = [rng.integers(0, 3, 4).astype(float) for _ in range(6)]
    classes = np.arange(4)
    pairs = [
        (a, b, rng.integers(0, 3, (4, 4)).astype(float), classes, classes)
        for a, b in itertools.combinations(range(6), 2)
    ]
    flat = [np.zeros(4)] * 6, [(a, b, np.zeros((4, 4)), c, d) for a, b, _, c, d in pairs]  # every choice ties
    found, tied = [], []
    for small in (0, 4**6):  # every table summed one option at a time; every table summed whole
        monkeypatch.setattr(elimination, "SMALL_TABLE", small)
        found.append(eliminate(unary, pairs))
        tied.append(eliminate(*flat))
    assert found[0] == found[1]
    cost, _ = _brute_force(ChoiceProblem(unary, [(a, b, m) for a, b, m, _, _ in pairs]))
    assert found[0][1] == cost
    assert tied[0] == tied[1] == ((0,) * 6, 0.0)


def test_elimination_declines_before_building_a_table_too_large():
    classes = np.arange(4)
    clique = [(a, b, np.zeros((4, 4)), classes, classes) for a, b in itertools.combinations(range(6), 2)]
    assert elimination_order([4] * 6, clique, max_entries=4**6) is not None  # the first table: 4^6 entries
    assert elimination_order([4] * 6, clique, max_entries=4**6 - 1) is None
    assert eliminate([np.zeros(4)] * 6, clique, max_entries=4**6 - 1) is None


def test_the_least_objective_is_the_optimum_where_elimination_solves_it_and_a_floor_where_it_cannot(monkeypatch):
    """The pruning bound's ILP: exact on a narrow problem; on one too wide to eliminate, each factor at
    its least, below the optimum HiGHS finds, and without calling HiGHS."""
    rng = np.random.default_rng(3)
    narrow = ChoiceProblem([rng.random(3) for _ in range(5)], [(i, i + 1, rng.random((3, 3))) for i in range(4)])
    assert np.isclose(least_objective(narrow), _brute_force(narrow)[0])
    clique = [(a, b, rng.random((11, 11))) for a, b in itertools.combinations(range(7), 2)]  # 11^7 > 2^23 entries
    wide = ChoiceProblem([rng.random(11) for _ in range(7)], clique)
    optimum = solve_choices(wide).objective
    monkeypatch.setattr(ilp, "_solve", lambda *args: pytest.fail("the bound solved the wide problem with HiGHS"))
    floor = least_objective(wide)
    assert floor == pytest.approx(sum(u.min() for u in wide.unary) + sum(m.min() for _, _, m in clique))
    assert floor < optimum
