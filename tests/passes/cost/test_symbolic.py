"""Costs symbolic in batch and sequence: at the captured sizes they are the cost model; at other
sizes they are the cost model run on the graph captured there (same placements, no search);
their terms grow as the textbook says.

A plan made for one graph is evaluated on a graph captured at other sizes by its node names:
captures of one model at two sizes name every node alike (``symbolic.sample_facts`` checks it),
so ``plan.nodes``, ``plan.params`` and ``plan.inputs`` apply as they are; only the fingerprint
and batch size are the new graph's. Searched pipeline plans carry their cut points, so the
stages stay where they were.
"""

import dataclasses
import functools
import json

import pytest
import sympy
import torch
from planning import meta_model

import autopar
from autopar.cli import main
from autopar.ir import ConfigError, Cost, Plan, get_profile
from autopar.passes.capture.graph import capture
from autopar.passes.cost.evaluate import evaluate_plan
from autopar.passes.cost.symbolic import BATCH, SEQ, symbolic_cost, symbolic_facts

A100 = get_profile("a100-80gb")
HIDDEN, FFN, LAYERS = 64, 256, 2
BATCH0, SEQ0 = 8, 64
ROUNDING = 1e-9  # the same arithmetic in another order: observed ~2e-15
GPT = dict(hidden=HIDDEN, layers=LAYERS, heads=4, vocab=128, ffn=FFN, seq=2 * SEQ0)  # positions for twice the sequence


def gpt_inputs(model, batch, seq):
    # contiguous: a sliced input would capture other ops (a clone before each flatten)
    return tuple(x[:, :seq].contiguous() for x in model.example_inputs(batch, device="meta"))


@functools.cache
def gpt_graphs():
    model = meta_model("gpt.py", **GPT)
    sizes = [(BATCH0, SEQ0), (2 * BATCH0, SEQ0), (BATCH0, 2 * SEQ0)]
    # as the A100 plans run: in bf16 (the preset's natural precision, bf16-mixed)
    return model, {size: capture(model, gpt_inputs(model, *size), param_dtype=torch.bfloat16) for size in sizes}


@functools.cache
def planned_cost(kind: str):
    model, graphs = gpt_graphs()
    inputs = gpt_inputs(model, BATCH0, SEQ0)
    if kind == "dp2-tp2":
        plan = autopar.plan(model, "2x2", inputs, degrees={"dp": 2, "tp": 2}, hardware=A100)
    else:
        plan = autopar.plan(model, "2x2", inputs, degrees={"pp": 2, "tp": 2}, microbatches=2, hardware=A100)
        assert plan.schedule.stages == 2 and plan.schedule.cuts
    assert plan.degrees.get("tp") == 2
    return plan, symbolic_cost(graphs[BATCH0, SEQ0], plan, A100, model=model, example_inputs=inputs)


@pytest.fixture
def gpt():
    return gpt_graphs()


@pytest.fixture(params=["dp2-tp2", "pp2-tp2"])
def planned(request):
    return planned_cost(request.param)


def assert_same_cost(got: Cost, expected: Cost, rel: float) -> None:
    for term in (
        "compute_s",
        "comm_s",
        "grad_sync_s",
        "optimizer_s",
        "pipeline_s",
        "model_flops",
        "step_s",
        "peak_memory",
    ):
        assert getattr(got, term) == pytest.approx(getattr(expected, term), rel=rel, abs=1e-30), term
    assert got.memory.keys() == expected.memory.keys()
    for category, nbytes in expected.memory.items():
        assert got.memory[category] == pytest.approx(nbytes, rel=rel, abs=1e-30), category


def test_at_the_captured_sizes_it_is_the_cost_model(gpt, planned):
    _, graphs = gpt
    plan, symbolic = planned
    expected = evaluate_plan(graphs[BATCH0, SEQ0], plan, A100)
    assert_same_cost(symbolic.at(), expected, ROUNDING)
    assert_same_cost(symbolic.at(batch=BATCH0, seq=SEQ0), plan.cost, ROUNDING)
    if plan.schedule.stages > 1:
        assert expected.pipeline_s > 0


@pytest.mark.parametrize("size", [(2 * BATCH0, SEQ0), (BATCH0, 2 * SEQ0)], ids=["2x-batch", "2x-seq"])
def test_at_other_sizes_it_is_the_cost_model_on_the_graph_captured_there(gpt, planned, size):
    _, graphs = gpt
    plan, symbolic = planned
    graph = graphs[size]
    same_placements = dataclasses.replace(plan, fingerprint=graph.fingerprint, batch_size=size[0])
    expected = evaluate_plan(graph, same_placements, A100)
    assert expected.step_s > 1.01 * plan.cost.step_s  # the sizes matter: a constant would fail
    assert_same_cost(symbolic.at(batch=size[0], seq=size[1]), expected, ROUNDING)


def test_weight_sized_terms_are_constant(planned):
    plan, symbolic = planned
    for constant in ("memory.params", "memory.grads", "memory.optimizer", "optimizer_s"):
        assert not symbolic.expressions[constant].free_symbols, constant
    # gradient sync is weight-sized; what backward hides of it is capped by backward's time, in b and s
    assert symbolic.expressions["grad_sync_s"].has(sympy.Min)
    assert symbolic.expressions["step_s"].xreplace({BATCH: BATCH0, SEQ: SEQ0}) == pytest.approx(
        plan.cost.step_s, rel=ROUNDING
    )


def test_flops_activations_and_compute_grow_as_the_textbook_says():
    plan, symbolic = planned_cost("dp2-tp2")
    e = symbolic.expressions
    flops = sympy.Poly(e["model_flops"], BATCH, SEQ)  # matmuls b·s, attention b·s²
    assert set(flops.monoms()) == {(1, 1), (1, 2)}
    activations = sympy.Poly(e["memory.activations"], BATCH, SEQ)  # fused attention keeps no s x s scores
    assert activations.degree(BATCH) == 1 and activations.degree(SEQ) == 1
    # at long sequences attention dominates: doubling s quadruples the compute
    long, longer = (symbolic.at(batch=BATCH0, seq=2**k).compute_s for k in (24, 25))
    assert longer / long == pytest.approx(4, rel=0.01)


def test_node_facts_are_the_textbook_polynomials(gpt):
    model, graphs = gpt
    facts = symbolic_facts(graphs[BATCH0, SEQ0], A100, model=model, example_inputs=gpt_inputs(model, BATCH0, SEQ0))
    by_target = {}
    for fact in facts.values():
        by_target.setdefault(str(fact.node.target), []).append(fact)
    attention = by_target["aten.scaled_dot_product_attention.default"][0].profile
    assert sympy.expand(attention.forward_flops - 4 * BATCH * SEQ**2 * HIDDEN) == 0  # QKᵀ and PV
    fc1 = next(f for f in by_target["aten.linear.default"] if f.slot_shapes[1] == (FFN, HIDDEN)).profile
    assert sympy.expand(fc1.forward_flops - 2 * BATCH * SEQ * HIDDEN * FFN) == 0
    assert sympy.expand(fc1.backward_flops - 2 * fc1.forward_flops) == 0
    tokens = facts["tokens"]
    assert tokens.out_shapes == [(BATCH, SEQ)]
    assert facts["p_layers_0_attn_wq_weight"].out_shapes == [(HIDDEN, HIDDEN)]  # plain ints: constant


class ShapeBranch(torch.nn.Module):
    """Runs another op once the sequence is longer than 40: no one graph for all sizes."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return (y * 2 if x.shape[1] > 40 else y).sum()

    def example_inputs(self, batch, device=None):
        return (torch.empty(batch, 64, 8, device=device),)


def test_a_graph_that_changes_with_shape_is_refused():
    with torch.device("meta"):
        model = ShapeBranch()
    inputs = model.example_inputs(4, device="meta")
    plan = autopar.plan(model, "2", inputs, degrees={"dp": 2}, hardware=A100)
    with pytest.raises(ConfigError, match="graph changes with shape.*node #"):
        symbolic_cost(capture(model, inputs), plan, A100, model=model, example_inputs=inputs)


def test_sizes_the_plan_cannot_split_are_refused(planned):
    plan, symbolic = planned
    with pytest.raises(ConfigError, match="batch=7: .* pick a multiple of 2"):
        symbolic.at(batch=7)
    assert all(ranks > 1 and size.free_symbols for _, size, ranks in symbolic.splits)
    if "dp" in plan.degrees and plan.degrees["dp"] > 1:
        assert any(size == BATCH and ranks == 2 for _, size, ranks in symbolic.splits)  # the batch over dp
    split_sequence = dataclasses.replace(symbolic, splits=(("x's dim 1", SEQ, 4),))
    with pytest.raises(ConfigError, match=r"seq=66: x's dim 1 \(size 66\) does not split evenly over 4 ranks"):
        split_sequence.at(seq=66)
    assert split_sequence.at(seq=68).step_s > 0


class Pairwise(torch.nn.Module):
    """Every token against every token of the whole batch: its bytes grow as b², not b."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x).flatten()
        return (y[:, None] * y[None, :]).sum()


def test_a_cost_beyond_the_polynomials_is_named():
    with torch.device("meta"):
        model = Pairwise()
    inputs = (torch.empty(4, 16, 8, device="meta"),)
    plan = autopar.plan(model, "2", inputs, degrees={"dp": 2}, hardware=A100)
    with pytest.raises(ConfigError, match="node mul: .* not a polynomial of degree 1 in the batch"):
        symbolic_cost(capture(model, inputs), plan, A100, model=model, example_inputs=inputs)


def test_inputs_without_a_sequence_give_costs_in_the_batch_alone():
    mlp = meta_model("mlp.py", hidden=32, ffn=64)
    inputs = mlp.example_inputs(8, device="meta")
    mlp_plan = autopar.plan(mlp, "2", inputs, degrees={"dp": 2}, hardware=A100)
    captured = capture(mlp, inputs, param_dtype=torch.bfloat16)  # as the A100 plan runs
    batch_only = symbolic_cost(captured, mlp_plan, A100, model=mlp, example_inputs=inputs, seq_dim=None)
    assert set().union(*(e.free_symbols for e in batch_only.expressions.values())) == {BATCH}
    assert_same_cost(batch_only.at(), mlp_plan.cost, ROUNDING)
    with pytest.raises(ConfigError, match="seq=16: .* seq_dim"):
        batch_only.at(seq=16)


def test_cli_plan_at_prints_both_predictions(capsys):
    spec = f"examples/gpt.py:build(hidden={HIDDEN}, layers={LAYERS}, vocab=128, seq={SEQ0})"
    options = [spec, "--mesh", "2x2", "--batch", str(BATCH0), "--hardware", "a100-80gb", "--degrees", "dp=2,tp=2"]
    assert main(["plan", *options, "--at", f"batch={4 * BATCH0}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = Plan.from_json(report["plan"])
    model = meta_model("gpt.py", hidden=HIDDEN, layers=LAYERS, vocab=128, seq=SEQ0)
    graph = capture(model, model.example_inputs(4 * BATCH0, device="meta"), param_dtype=torch.bfloat16)  # as on an A100
    expected = evaluate_plan(
        graph, dataclasses.replace(plan, fingerprint=graph.fingerprint, batch_size=4 * BATCH0), A100
    )
    assert report["at"]["batch"] == 4 * BATCH0
    assert report["at"]["step_s"] == pytest.approx(expected.step_s, rel=ROUNDING)
    assert report["at"]["peak_memory"] == pytest.approx(expected.peak_memory, rel=ROUNDING)

    assert main(["plan", *options, "--at", "batch=16,seq=128"]) == 0
    out = capsys.readouterr().out
    assert f"planned at batch {BATCH0}, seq {SEQ0}: step" in out and "re-evaluated at batch 16, seq 128: step" in out
    assert main(["plan", *options, "--at", "tokens=5"]) == 2
    assert "write batch=N and/or seq=N" in capsys.readouterr().err
