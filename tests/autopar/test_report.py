"""What `autopar plan` and `explain` show: identical layers once, the search's progress on a terminal,
each node's input moves."""

import io

from planning import meta_model, plan_example

import autopar
from autopar.cli.progress import ProgressLine
from autopar.ir.names import fold_rows
from autopar.report import decisions_text


def _row(module: str, output: str = "(S(0), R)", param_bytes: int = 64) -> dict:
    return {
        "module": module,
        "params": {"weight": "(R, R)"} if param_bytes else {},
        "output": output,
        "collectives": {},
        "collective_bytes": 0,
        "param_bytes": param_bytes,
        "grad_sum": ["dp"],
    }


def _layer(index: int, output: str = "(S(0), R)") -> list[dict]:
    return [_row(f"layers.{index}", param_bytes=0), _row(f"layers.{index}.fc", output)]


def test_identical_layers_fold_and_a_differing_one_is_shown_apart():
    rows = [_row("embed"), *_layer(0), *_layer(1), *_layer(2), *_layer(3, output="(R, R)"), *_layer(4), _row("head")]
    modules = [row["module"] for row in fold_rows(rows)]
    assert modules == ["embed", "layers.{0-2,4} x4", "layers.{0-2,4}.fc", "layers.3", "layers.3.fc", "head"]
    assert fold_rows(rows)[2]["param_bytes"] == 64  # one layer's numbers
    assert [row["module"] for row in fold_rows([*_layer(0), *_layer(1)])] == ["layers.0-1 x2", "layers.0-1.fc"]


def test_layers_that_alternate_fold_into_one_entry_each():
    """Three layers of one kind, then one of another, twelve times (Llama 4's dense and expert MLPs)."""
    rows = [row for index in range(48) for row in _layer(index, "(R, R)" if index % 4 == 3 else "(S(0), R)")]
    modules = [row["module"] for row in fold_rows(rows)]
    assert modules == [
        "layers.{0-2,4-6,...,44-46} x36",
        "layers.{0-2,4-6,...,44-46}.fc",
        "layers.{3,7,...,47} x12",
        "layers.{3,7,...,47}.fc",
    ]


def test_a_plan_and_its_node_decisions_show_identical_layers_once():
    """``print(plan)`` and ``autopar explain``: layers placed alike once, a layer placed otherwise apart."""
    split = {"layers.1.mlp.fc1": "S(-1)", "layers.1.mlp.fc2": "P", "layers.[02].mlp.fc[12]": "R"}
    kwargs = dict(hidden=32, layers=3, heads=2, vocab=64, seq=8)
    plan = plan_example("gpt.py", 2, 4, model_kwargs=kwargs, degrees={"tp": 2}, constraints=split, hardware="a100-80gb")
    text = str(plan)
    assert "layers.{0,2}.attn.wq.weight" in text and "layers.1.mlp.fc1.weight  " in text
    assert "layers.2.attn.wq.weight" not in text and f"schedule: {plan.schedule}" in text
    assert "layers.{0,2} x2: 2 identical layers" in text
    assert "layers.1.mlp.fc1 " in decisions_text(plan)  # its nodes (and its neighbours' boundaries) differ
    plan = plan_example("gpt.py", 2, 4, model_kwargs=kwargs, degrees={"dp": 2}, hardware="a100-80gb")
    decisions = decisions_text(plan)
    assert "layers.0-2.attn.wq" in decisions and "layers.2.attn" not in decisions
    assert "layers.0-2 x3: 3 identical layers" in decisions and "Node names are the first layer's." in decisions
    assert len(decisions.splitlines()) < len(plan.nodes)  # every node is in the plan file


def test_the_search_reports_progress_and_the_line_shows_the_best_so_far():
    model = meta_model("gpt.py", layers=4)
    seen = []
    plan = autopar.plan(model, "2x2", model.example_inputs(8, device="meta"), progress=seen.append)
    assert seen and seen[-1].done == seen[-1].total == len(plan.search)
    assert [p.done for p in seen] == sorted(p.done for p in seen)
    assert seen[-1].best is not None and seen[-1].best.cost.step_s <= min(
        e["step_s"] for e in plan.search if e.get("feasible")
    ) * (1 + 1e-9)
    stream = io.StringIO()
    with ProgressLine(stream, interval_s=0.0) as line:
        for progress in seen:
            line(progress)
    text = stream.getvalue()
    assert text.endswith("\n") and f"{len(plan.search)}/{len(plan.search)} configurations" in text
    assert "best " in text and "ms/step" in text


MEGATRON = {
    "layers.*.attn.w[qkv]": "S(-1)",
    "layers.*.attn.wo": "P",
    "layers.*.mlp.fc1": "S(-1)",
    "layers.*.mlp.fc2": "P",
}


def test_each_node_shows_the_bytes_its_inputs_move():
    """Megatron's layers on dp2 x tp2, priced on the A100 preset (computed prices: this CPU's
    profile times ops as it plans, and where its loss reads the head's output varies from run to
    run): the embedding's lookup split by hidden columns gathered where the first norm reads it and
    the row-parallel output's partial sum all-reduced over tp where the next norm reads it (each
    its [4, 64, 128] fp32 share of the batch), the head's vocabulary-split logits gathered where
    the loss reshapes them ([4, 64, 512]), the loss's mean over dp where the step returns it;
    nothing else moves."""
    pins = dict(degrees={"dp": 2, "tp": 2}, constraints=MEGATRON, zero=0, hardware="a100-80gb", precision="fp32")
    plan = plan_example("gpt.py", "2x2", 8, **pins)
    moved = {name: d.comm_bytes for name, d in plan.nodes.items() if d.comm_bytes}
    assert moved == {
        "layer_norm": 4 * 64 * 128 * 4,
        "layer_norm_1": 4 * 64 * 128 * 4,
        "layer_norm_2": 4 * 64 * 128 * 4,
        "layer_norm_3": 4 * 64 * 128 * 4,
        "layer_norm_4": 4 * 64 * 128 * 4,
        "view_8": 4 * 64 * 512 * 4,
        "output": 4,
    }
    assert "128.0 KiB" in decisions_text(plan)
    assert autopar.Plan.from_json(plan.to_json()).nodes["output"].comm_bytes == 4  # kept in the plan file
