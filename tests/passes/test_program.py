"""A call's programs: the plan's splits must divide the call's inputs; microbatches; the
options that pin where the parameters live when a call's graph is planned again."""

import dataclasses

import pytest
import torch
from equivalence import GPT_SP
from planning import meta_model, plan_example

import autopar
from autopar.ir import Axis, ConfigError
from autopar.passes.capture.calls import bind_call
from autopar.passes.capture.graph import capture
from autopar.passes.program import _same_placements, build_programs, check_inputs, microbatch, pinned_options

GPT = dict(hidden=32, layers=2, heads=4, vocab=64, seq=16)


@pytest.fixture(scope="module")
def dp_cp_plan():
    return plan_example("gpt.py", "2x2", 8, model_kwargs=GPT, degrees={"dp": 2, "cp": 2}, microbatches=2)


def test_an_input_the_plan_cannot_split_names_the_input_and_the_divisor(dp_cp_plan):
    tokens = torch.zeros(8, 16, dtype=torch.long)
    check_inputs({"tokens": tokens, "labels": tokens}, dp_cp_plan)  # 8 = dp 2 x 2 microbatches x 2; 16 = 2 x 2 x 4
    with pytest.raises(ConfigError, match=r"input 'tokens' has 6 along dim 0.*divisible by 4"):
        check_inputs({"tokens": tokens[:6], "labels": tokens[:6]}, dp_cp_plan)  # dp 2 x 2 microbatches
    with pytest.raises(ConfigError, match=r"input 'tokens' has 14 along dim 1.*cp=2 x 2 chunks.*divisible by 4"):
        check_inputs({"tokens": tokens[:, :14], "labels": tokens[:, :14]}, dp_cp_plan)


def test_a_microbatch_takes_the_first_rows_of_every_batched_input():
    call = {"tokens": torch.arange(8).view(8, 1), "positions": torch.arange(3).view(1, 3), "flag": True}
    piece = microbatch(call, 4)
    assert piece["tokens"].tolist() == [[0], [1]] and piece["positions"].shape == (1, 3) and piece["flag"] is True


def test_planning_again_pins_what_places_the_parameters():
    plan = plan_example("gpt.py", "2x2", 8, model_kwargs=GPT, degrees={"dp": 2, "tp": 2}, zero=1)
    options = pinned_options(plan)
    assert options.degrees == plan.degrees and options.zero == 1
    tp = list(plan.degrees).index(Axis.TP)
    assert options.constraints == {name: str(p[tp]) for name, p in plan.params.items()}
    # a compiled plan's schedule says so: planned again, the schedule must come out the same
    compiled = plan_example("gpt.py", "2", 8, model_kwargs=GPT, degrees={"dp": 2}, compile=True, async_tp=True)
    options = pinned_options(compiled)
    assert options.compile and options.async_tp and compiled.schedule.compiled and compiled.schedule.async_tp


def test_a_call_whose_graph_needs_the_parameters_elsewhere_needs_a_new_plan():
    dp = plan_example("gpt.py", "4", 8, model_kwargs=GPT, degrees={"dp": 4})
    # pinned: a model this small runs fastest replicated, which would place everything as dp does
    tp = plan_example(
        "gpt.py", "4", 8, model_kwargs=GPT, degrees={"tp": 4}, constraints={"layers.*.mlp.fc1.weight": "S(0)"}
    )
    assert _same_placements(dp, dp) is dp
    with pytest.raises(ConfigError, match="places the parameters otherwise .*it needs a new plan"):
        _same_placements(dp, tp)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_call_planned_again_completes_its_gradients_for_whoever_sums_them(compiled):
    # the planning call's graph (a one-layer model's) differs from this call's: its plan is searched again;
    # say the first plan left every gradient whole on the tensor-parallel ranks (no sum) where this one does not
    model, planned_on = (meta_model("gpt.py", **dict(GPT, layers=layers)) for layers in (2, 1))
    inputs = model.example_inputs(8, device="meta")
    bound = bind_call(model, inputs, {})
    plan = autopar.plan(model, 2, inputs, degrees={"tp": 2}, constraints=GPT_SP, compile=compiled)
    assert plan.grad_sync, "sequence parallelism sums the norms' partial gradients"
    built = build_programs(
        model,
        bound,
        capture(planned_on, planned_on.example_inputs(8, device="meta")),
        dataclasses.replace(plan, grad_sync={}),
        groups={axis: axis for axis in plan.degrees},
        device="meta",
        replan=lambda graph, pinned: plan,
    )
    summed = built.program.graph.find_nodes(op="call_function", target=torch.ops.autopar.grad_all_reduce.default)
    # eager: the runtime sums what the first plan said (nothing), so the program sums the rest itself; a
    # compiled program sums its gradients as its own plan says later (sync_in_program): none completed here
    assert {node.args[0].name for node in summed if node.args[0].op == "placeholder"} == (
        set() if compiled else {p for p, name in built.captured.params.items() if name in plan.grad_sync}
    )
