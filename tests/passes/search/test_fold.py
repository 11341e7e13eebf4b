"""Identical layers are solved once: the folded search gives the plan and the cost of the
unfolded one, a layer that differs is not folded, and the ILP does not grow with depth."""

import dataclasses

import pytest
import torch
from planning import meta_model

import autopar
from autopar.ir import Mesh, PlanOptions, get_profile
from autopar.passes.cost.evaluate import PricedConfiguration, evaluate, stage_mesh
from autopar.passes.cost.facts import analyze
from autopar.passes.search.fold import fold_layers
from autopar.passes.search.search import search
from autopar.passes.sharding.strategies import Strategy

HARDWARE = "a100-80gb"
MEGATRON = {
    "layers.*.attn.w[qkv]": "S(-1)",
    "layers.*.attn.wo": "P",
    "layers.*.mlp.fc1": "S(-1)",
    "layers.*.mlp.fc2": "P",
}
CASES = {
    "gpt-2-layers": (dict(layers=2), "2x2", {}),
    "gpt-6-layers": (dict(layers=6), "2x2", {}),
    "gpt-6-layers-megatron-pins": (dict(layers=6), "2x2", dict(degrees={"dp": 1, "tp": 4}, constraints=MEGATRON)),
    "gpt-5-layers-pipeline": (dict(layers=5), "2x2", dict(degrees={"pp": 2, "dp": 1, "tp": 2})),
}
# The last layer's row-parallel sum can be taken at its residual add (as in every folded layer) or
# at the final norm after it: the same bytes at the same time, so either is the optimum.
TIED = {"gpt-6-layers-megatron-pins"}


def _captured(layers: int = 4, wider: int | range | None = None, batch: int = 8):
    model = meta_model("gpt.py", hidden=64, heads=4, vocab=256, seq=32, layers=layers)
    for index in [wider] if isinstance(wider, int) else wider or ():  # layers with a wider MLP
        with torch.device("meta"):
            model.layers[index].mlp.fc1 = torch.nn.Linear(64, 512, bias=False)
            model.layers[index].mlp.fc2 = torch.nn.Linear(512, 64, bias=False)
    return autopar.capture(model, model.example_inputs(batch, device="meta"))


def _same_plan(folded, unfolded, same_nodes: bool = True, same_params: bool = True, same_peak: bool = True):
    assert folded.degrees == unfolded.degrees and folded.zero == unfolded.zero
    assert folded.schedule == unfolded.schedule
    if same_params:
        assert folded.params == unfolded.params and folded.inputs == unfolded.inputs
    if same_nodes:
        assert folded.nodes == unfolded.nodes
    assert folded.cost.step_s == pytest.approx(unfolded.cost.step_s, rel=1e-9)
    if same_peak:
        assert folded.cost.peak_memory == pytest.approx(unfolded.cost.peak_memory, rel=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_folding_gives_the_plan_and_cost_of_the_unfolded_search(case):
    model_kwargs, mesh, pins = CASES[case]
    captured = _captured(**model_kwargs)
    options = PlanOptions(hardware=HARDWARE, **pins)
    folded, unfolded = search(captured, Mesh.of(mesh), options), search(captured, Mesh.of(mesh), options, fold=False)
    _same_plan(folded, unfolded, same_nodes=case not in TIED)


def test_folding_gives_the_unfolded_plan_under_a_binding_memory_limit():
    captured = _captured(layers=6, batch=64)
    pins = dict(hardware=HARDWARE, degrees={"dp": 2, "tp": 2})
    free = search(captured, Mesh((2, 2)), PlanOptions(**pins))
    options = PlanOptions(**pins, memory_limit=free.cost.peak_memory / 2)
    folded = search(captured, Mesh((2, 2)), options)
    assert folded.cost.peak_memory <= options.memory_limit < free.cost.peak_memory
    # under the limit only some layers' MLPs can be split, and the first two are interchangeable
    # (the same time and memory whichever is split): the optimum is equal, not always the same nodes.
    # The last layer's sum may also be taken at its add or at the final norm (as in TIED): the same time
    # and the same memory in the ILP's row, which holds the largest transient wherever it falls; the
    # priced peak, which times it, is one activation apart (7.51 or 7.38 MB). Which of those equal
    # optima HiGHS returns is its own: the plans differ only there, each fits, and the step time is the same.
    unfolded = search(captured, Mesh((2, 2)), options, fold=False)
    differ = {folded.nodes[n].module for n in folded.nodes if folded.nodes[n] != unfolded.nodes.get(n)}
    last_sum = differ & {"layers.5", "norm"}
    assert all(module.split(".")[:2] in (["layers", "0"], ["layers", "1"]) for module in differ - last_sum)
    _same_plan(folded, unfolded, same_nodes=False, same_params=False, same_peak=not last_sum)
    assert unfolded.cost.peak_memory <= options.memory_limit


def test_a_layer_that_differs_is_not_folded_with_the_others():
    hardware = get_profile(HARDWARE)
    wide = analyze(_captured(layers=5, wider=2), hardware)
    assert fold_layers(wide, pins={}).classes == (("layers.0", "layers.1", "layers.3", "layers.4"),)
    plain = analyze(_captured(layers=5), hardware)
    pinned = {name: ("S(0)", None) for name, fact in plain.items() if fact.name == "layers.1.mlp.fc1.weight"}
    assert fold_layers(plain, pins=pinned).classes == (("layers.0", "layers.2", "layers.3", "layers.4"),)
    captured = _captured(layers=5, wider=2)
    options = PlanOptions(hardware=HARDWARE, degrees={"dp": 2, "tp": 2})
    _same_plan(search(captured, Mesh((2, 2)), options), search(captured, Mesh((2, 2)), options, fold=False))


def test_the_folded_graph_and_its_ilp_do_not_grow_with_depth():
    hardware = get_profile(HARDWARE)
    sizes = []
    for layers in (4, 12):
        whole = analyze(_captured(layers=layers), hardware)
        folding = fold_layers(whole, pins={})
        sizes.append((len(folding.facts), len(set(folding.variable.values()))))
        in_layers = [f for f in whole.values() if f.kind == "op" and f.layer]
        assert sum(f.weight for f in folding.facts.values() if f.kind == "op" and f.layer) == len(in_layers)
    assert sizes[0] == sizes[1]  # nodes of the reduced graph, ILP variables


def test_alternating_layers_fold_as_repeated_pairs():
    """Layers that alternate (sliding-window and global attention, dense and expert MLPs; here
    every other MLP wider) repeat as groups of two: the reduced graph keeps four groups at any
    depth, and the plan and its cost are the unfolded search's, pipeline cuts included."""
    hardware = get_profile(HARDWARE)
    sizes = []
    for layers in (10, 20):
        folding = fold_layers(analyze(_captured(layers=layers, wider=range(1, layers, 2)), hardware), pins={})
        assert [len(layers) for layers in folding.classes] == [layers // 2, layers // 2]
        sizes.append(len(folding.facts))
    assert sizes[0] == sizes[1]
    captured = _captured(layers=12, wider=range(1, 12, 2))
    for mesh, pins in (((2, 2), {}), ((2, 2), dict(degrees={"pp": 2, "tp": 2})), ((4,), dict(degrees={"pp": 4}))):
        options = PlanOptions(hardware=HARDWARE, **pins)
        folded = search(captured, Mesh(mesh), options)
        _same_plan(folded, search(captured, Mesh(mesh), options, fold=False))


def test_the_folded_graph_prices_a_layout_as_the_whole_graph_does():
    """Every sum of the cost model over the reduced graph (weights on nodes and edges, folded
    stage cuts) equals the sum over every node, pipeline and memory included."""
    hardware = get_profile(HARDWARE)
    captured = _captured(layers=8)
    whole = analyze(captured, hardware)
    folding = fold_layers(whole, pins={})
    plan = autopar.plan(
        captured, "2x2", hardware=HARDWARE, degrees={"pp": 2, "dp": 1, "tp": 2}, recompute="full", precision="fp32"
    )
    mesh = stage_mesh(plan.mesh, plan.schedule.stages)
    strategies = {axis: {} for axis in plan.degrees}
    for index, axis in enumerate(plan.degrees):
        for name, fact in whole.items():
            if name in plan.nodes and plan.nodes[name].output is not None:
                decision = plan.nodes[name]
                strategies[axis][name] = Strategy(
                    tuple(p and p[index] for p in decision.inputs), decision.output[index]
                )
            elif fact.kind == "param":
                strategies[axis][name] = Strategy((), plan.params[fact.name][index])
            elif fact.kind == "input":
                strategies[axis][name] = Strategy((), plan.inputs[name][index])
    reduced = {axis: {n: s for n, s in chosen.items() if n in folding.facts} for axis, chosen in strategies.items()}
    for schedule in (plan.schedule, plan.schedule.__class__(2, 4, "none")):
        full = evaluate(whole, plan.degrees, strategies, mesh, hardware, plan.zero, schedule)
        folded = PricedConfiguration.of(folding.facts, plan.degrees, reduced, mesh, hardware, plan.zero).under(schedule)
        assert folded.step_s == pytest.approx(full.step_s, rel=1e-9)
        assert folded.memory == pytest.approx(full.memory, rel=1e-9)
        assert folded.pipeline_s == pytest.approx(full.pipeline_s, rel=1e-9)
    # the compiled replay weighs an inner layer's compute and collectives by the layers it stands
    # for: the same exposed communication to rounding, not exactly (one replay, not n)
    compiled = dataclasses.replace(plan.schedule, compiled=True)
    full = evaluate(whole, plan.degrees, strategies, mesh, hardware, plan.zero, compiled)
    folded = PricedConfiguration.of(folding.facts, plan.degrees, reduced, mesh, hardware, plan.zero).under(compiled)
    assert folded.comm_s + folded.grad_sync_s == pytest.approx(full.comm_s + full.grad_sync_s, rel=0.01)
