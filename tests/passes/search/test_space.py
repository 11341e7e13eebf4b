"""The search's bounds are sound: no configuration prices below its bound, and pruning by them
never changes the plan the search chooses."""

import itertools
import random

import pytest
from planning import meta_model, slow_network

import autopar
from autopar.passes.search import search as search_module
from autopar.passes.search.space import busiest_stage_s


def _best_assignment(layers: list[float], first: float, last: float, stages: int) -> float:
    """The busiest device's least work over every assignment of whole layers to devices, the
    extras (embeddings, head) on the devices of the first and the last layer."""
    best = float("inf")
    for owners in itertools.product(range(stages), repeat=len(layers)):
        load = [0.0] * stages
        for owner, seconds in zip(owners, layers):
            load[owner] += seconds
        load[owners[0]] += first
        load[owners[-1]] += last
        best = min(best, max(load))
    return best


def test_the_busiest_stage_bound_is_never_above_the_best_assignment():
    draw = random.Random(0)
    for _ in range(60):
        stages = draw.randint(2, 4)
        layers = [draw.choice([1.0, 1.0, 2.0, draw.uniform(0.5, 3.0)]) for _ in range(draw.randint(stages, 7))]
        first, last = draw.uniform(0, 1), draw.uniform(0, 3)
        bound = busiest_stage_s(layers, first, last, stages)
        assert bound <= _best_assignment(layers, first, last, stages) * (1 + 1e-9)
        assert bound >= (sum(layers) + first + last) / stages * (1 - 1e-9)


def test_the_busiest_stage_bound_is_the_even_split_of_identical_layers():
    # 32 layers over 8 devices: 4 each, the head's device 4 layers and the head (Llama-3 8B's shape)
    assert busiest_stage_s([1.0] * 32, 0.1, 0.8, 8) == pytest.approx(4.8)
    assert busiest_stage_s([1.0] * 32, 0.1, 0.8, 1) == pytest.approx(32.9)
    assert busiest_stage_s([1.0] * 3, 0.2, 0.2, 2) == pytest.approx(2.0)  # both extras beside one layer


CASES = {  # (model file, builder, model kwargs, mesh, batch, plan options): pipelines, tp, cp, ZeRO and folding weighed
    "gpt-pipelines": ("gpt.py", "build", dict(hidden=1024, layers=8, heads=16, vocab=8192, seq=256), (4, 2), 32, {}),
    "gpt-slow-network": (
        "gpt.py",
        "build",
        dict(hidden=1024, layers=8, heads=16, vocab=8192, seq=256),
        (4, 2),
        32,
        dict(hardware=slow_network()),
    ),
    "llama3-8b-shapes": (
        "hf.py",
        "build_llama3",
        dict(size="8b", layers=4, seq=2048),
        (2, 4),
        16,
        dict(hardware="h100-80gb", precision="bf16-mixed"),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_no_configuration_prices_below_its_bound_and_pruning_keeps_the_plan(case, monkeypatch):
    file, builder, kwargs, mesh, batch, options = CASES[case]
    model = meta_model(file, builder, **kwargs)
    captured = autopar.capture(model, model.example_inputs(batch, device="meta"))
    plan = autopar.plan(captured, mesh, **options)
    weighed = [entry for entry in plan.search if "step_s" in entry]
    assert any("pruned" in entry for entry in plan.search) and len(weighed) > 3
    for entry in weighed:
        assert entry["bound_s"] <= entry.get("layout_bound_s", entry["bound_s"]) <= entry["step_s"] * (1 + 1e-9), entry
    # every configuration weighed in full (the bound never prunes): the same plan
    monkeypatch.setattr(search_module, "within_reach", lambda step_s, fastest: True)
    floors = _floors_ahead_and_after(monkeypatch)
    full = autopar.plan(captured, mesh, **options)
    # the last axis's floor before the axes ahead are solved is never above its floor after: the least
    # work, and the least of work, gradient sync and moves together
    compared = [pair for ahead, after in floors.values() if ahead and after for pair in zip(ahead, after[:2])]
    assert len(compared) > 6
    for ahead, after in compared:
        assert ahead[0] <= after[0] * (1 + 1e-9) and sum(ahead) <= sum(after) * (1 + 1e-9), (ahead, after)
    assert not any(entry.get("pruned") == "bound" for entry in full.search)
    assert (full.degrees, full.zero, full.schedule) == (plan.degrees, plan.zero, plan.schedule)
    assert full.cost.step_s == pytest.approx(plan.cost.step_s, rel=1e-12)
    bounded = [entry for entry in full.search if "layout_bound_s" in entry]
    assert len(bounded) > 3
    for entry in full.search:
        if "step_s" in entry:
            assert entry["bound_s"] <= entry.get("layout_bound_s", entry["bound_s"]) <= entry["step_s"] * (1 + 1e-9), (
                entry
            )


def _floors_ahead_and_after(monkeypatch) -> dict:
    """Per configuration solved, the last axis's floors (least work; least with gradient sync, then
    with moves too, less that) from :func:`ahead_floors` and from its layout once the axes ahead
    are solved (the first two the search asks there)."""
    floors, real_ahead, real_solve = {}, search_module.ahead_floors, search_module.solve_axes

    def ahead(ctx, degrees, zero, schedule):
        entry = floors.setdefault((ctx.stages, tuple(degrees.items()), zero), ([], []))
        for floor in real_ahead(ctx, degrees, zero, schedule):
            entry[0].append(floor)
            yield floor

    def solve(ctx, degrees, zero, schedule, limit=None, cache=None, worth=None):
        def asked(before, work, sync):
            floors.setdefault((ctx.stages, tuple(degrees.items()), zero), ([], []))[1].append((work, sync))
            return worth(before, work, sync)

        return real_solve(ctx, degrees, zero, schedule, limit, cache, worth and asked)

    monkeypatch.setattr(search_module, "ahead_floors", ahead)
    monkeypatch.setattr(search_module, "solve_axes", solve)
    return floors


def test_a_configuration_prices_alike_whichever_configuration_is_weighed_first(monkeypatch):
    # ZeRO-0, -1 and -2 share one layout: whichever of them is weighed first, each is priced with its own traffic
    file, builder, kwargs, mesh, batch, options = CASES["llama3-8b-shapes"]
    model = meta_model(file, builder, **kwargs)
    captured = autopar.capture(model, model.example_inputs(batch, device="meta"))
    monkeypatch.setattr(search_module, "within_reach", lambda step_s, fastest: True)
    monkeypatch.setattr(search_module.LowerBounds, "step_s", lambda *args: 0.0)  # weighed in the order listed
    steps = []
    listed = search_module._Weighing.configurations
    for order in (lambda space: space, lambda space: space[::-1]):
        monkeypatch.setattr(search_module._Weighing, "configurations", lambda self, order=order: order(listed(self)))
        plan = autopar.plan(captured, mesh, **options)
        steps.append({(e["stages"], tuple(e["degrees"].items()), e["zero"]): e.get("step_s") for e in plan.search})
    assert steps[0].keys() == steps[1].keys() and sum(step is not None for step in steps[0].values()) > 3
    for key, step in steps[0].items():
        assert steps[1][key] == (step if step is None else pytest.approx(step, rel=1e-12)), key
