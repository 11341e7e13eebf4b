"""HiGHS presolve on the layout ILPs a memory budget binds: each problem a search hands HiGHS,
solved again with presolve and without, side by side.

    python benchmarks/ilp_presolve.py            # writes BENCHMARKS.md (run it alone: it times solves)
    python benchmarks/ilp_presolve.py --quick    # the smallest case only, printed

A layout goes to HiGHS only where the memory budget binds (variable elimination solves the rest).
Each case is planned free (``precision="bf16-mixed"``) with every HiGHS problem of the search
recorded; each is then solved both ways in this process with the search's own time limit, and the
search is timed again with presolve on every problem. Cases:
Inkling-2's default configuration cut to 16 of its 48 layers (its layers do not fold, so its problems
are the largest), and the two rows of the "Planning at scale" table whose searches pose such problems.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import python_loop_s  # noqa: E402
from planning_scale import build, rows  # noqa: E402
from publish import publish  # noqa: E402

TIME_LIMIT_S = 60.0  # the search's (``solve_choices``)
INKLING = {
    "name": "Inkling-2, 16 layers",
    "model": {"builder": "default_config", "kwargs": {"family": "inkling2_text", "seq": 4096, "num_hidden_layers": 16}},
    "gpus": 256,
    "batch": 1024,
    "hardware": "h100-80gb",
}


def cases(quick: bool) -> list[dict]:
    table = {row["name"]: row for row in rows()}
    return [table["Llama-3 405B"]] + ([] if quick else [table["DeepSeek-V3 671B"], INKLING])


def searched(row: dict) -> tuple[list, dict[str, float], bool]:
    """The HiGHS problems of ``row``'s free search, its wall time under autopar's rule and with presolve
    on every problem (the same captured graph, one search after the other), and whether both chose
    the same plan."""
    import autopar
    from autopar.passes.search import ilp

    model = build(row["model"])
    captured = autopar.capture(model, model.example_inputs(row["batch"], device="meta"))
    recorded, solve, kept, times, plans = [], ilp._solve, ilp.PRESOLVE_UP_TO, {}, []

    def recording(problem, time_limit_s):
        recorded.append(problem)
        return solve(problem, time_limit_s)

    try:
        for rule, up_to, solver in (("rule", kept, recording), ("always", math.inf, solve)):
            ilp.PRESOLVE_UP_TO, ilp._solve = up_to, solver
            started = time.perf_counter()
            plan = autopar.plan(captured, (row["gpus"] // 8, 8), hardware=row["hardware"], precision="bf16-mixed")
            times[rule] = time.perf_counter() - started
            plans.append((dict(plan.degrees), str(plan.schedule), plan.zero, plan.cost.step_s))
    finally:
        ilp.PRESOLVE_UP_TO, ilp._solve = kept, solve
    return recorded, times, plans[0] == plans[1]


def both_ways(problem) -> dict:
    """(seconds, solution) of ``problem`` solved with presolve and without, each a fresh HiGHS run."""
    from autopar.passes.search import ilp

    out, kept = {}, ilp.PRESOLVE_UP_TO
    try:
        for way, up_to in (("on", math.inf), ("off", 0)):
            ilp.PRESOLVE_UP_TO = up_to
            started = time.perf_counter()
            solution = ilp._solve(problem, TIME_LIMIT_S)
            out[way] = (time.perf_counter() - started, solution)
    finally:
        ilp.PRESOLVE_UP_TO = kept
    return out


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f}" + (" (time limit)" if seconds >= TIME_LIMIT_S else "")


def _objective(solution) -> str:
    return "infeasible" if solution is None else f"{solution.objective:.6f}"


def render(results: list[tuple[dict, dict, bool, list]], elapsed: float, probes: list[float]) -> str:
    from autopar.passes.search.ilp import PRESOLVE_UP_TO

    lines = [
        "## Planning at scale: HiGHS presolve on layouts under a memory budget",
        "",
        f"- command: `python benchmarks/ilp_presolve.py` ({elapsed:.0f} s); date {datetime.date.today()}; "
        "this machine: 2 shared CPU cores (a pure-Python loop of 10^7 additions took "
        f"{probes[0]:.2f} s before and {probes[-1]:.2f} s after, median of 3 each; normal is about 0.25 s)",
        "- each case planned free (bf16-mixed, mesh (GPUs/8)x8), every problem its search handed HiGHS "
        "recorded, then each solved again here with presolve and without, one after the other, with the "
        f"search's time limit ({TIME_LIMIT_S:.0f} s). autopar presolves problems of up to {PRESOLVE_UP_TO} "
        "variables (`passes/search/ilp.PRESOLVE_UP_TO`).",
        "",
        "| case | search s: autopar's rule / presolve always | problem | variables | options "
        "| presolve on s | presolve off s | objective on | objective off | same choice |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row, times, same_plan, solved in results:
        same_plan = "same plan" if same_plan else "another plan"
        search_s = f"{times['rule']:.1f} / {times['always']:.1f} ({same_plan})"
        if not solved:
            lines.append(f"| {row['name']} | {search_s} | none | - | - | - | - | - | - | - |")
        for i, (problem, ways) in enumerate(solved, 1):
            (on_s, on), (off_s, off) = ways["on"], ways["off"]
            same = "yes" if (on and on.choice) == (off and off.choice) else "no"
            lines.append(
                f"| {row['name']} | {search_s} | {i} | {len(problem.unary)} | {sum(len(u) for u in problem.unary)} "
                f"| {_seconds(on_s)} | {_seconds(off_s)} | {_objective(on)} | {_objective(off)} | {same} |"
            )
    large = [w for *_, solved in results for p, w in solved if len(p.unary) > PRESOLVE_UP_TO]
    small = [w for *_, solved in results for p, w in solved if len(p.unary) <= PRESOLVE_UP_TO]
    lines.append("")
    for label, group in (("above", large), ("up to", small)):
        if group:
            ratios = [w["off"][0] / w["on"][0] for w in group]
            lines.append(
                f"- {label} {PRESOLVE_UP_TO} variables: {len(group)} problem(s), off / on time median "
                f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}); "
                f"{sum(w['on'][0] >= TIME_LIMIT_S for w in group)} with presolve and "
                f"{sum(w['off'][0] >= TIME_LIMIT_S for w in group)} without stopped at the time limit"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smallest case, printed, BENCHMARKS.md untouched")
    args = parser.parse_args()
    probes, started, results = [python_loop_s()], time.perf_counter(), []
    for row in cases(args.quick):
        problems, times, same_plan = searched(row)
        results.append((row, times, same_plan, [(p, both_ways(p)) for p in problems]))
        done = f"{len(problems)} problem(s), search {times['rule']:.1f} s"
        print(f"[presolve] {row['name']}: {done}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started
    publish("presolve", render(results, elapsed, probes + [python_loop_s()]), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
