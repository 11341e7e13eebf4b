from planning import meta_model, plan_example

from autopar.passes.capture.graph import capture
from autopar.passes.rewrite.gradients import plan_gradients

GPT = dict(hidden=64, layers=2, heads=4, vocab=128, seq=16)
TP = {"layers.*.attn.w[qkv]": "S(-1)", "layers.*.attn.wo": "P", "layers.*.mlp.fc1": "S(-1)", "layers.*.mlp.fc2": "P"}


def _gradients(plan, batch=8):
    model = meta_model("gpt.py", **GPT)
    captured = capture(model, model.example_inputs(batch, device="meta"))
    return captured, plan_gradients(captured.graph, plan, captured.params, captured.user_inputs)


def test_data_parallel_sums_every_parameter_in_the_runtime_and_nothing_in_the_graph():
    plan = plan_example("gpt.py", 2, batch=8, model_kwargs=GPT, degrees={"dp": 2})
    captured, gradients = _gradients(plan)
    assert set(gradients.synced_params) == set(captured.params)
    assert not gradients.completed_edges


def test_tensor_parallel_norm_weights_are_summed_and_mixed_residuals_completed_on_the_edge():
    plan = plan_example("gpt.py", 2, batch=8, model_kwargs=GPT, degrees={"tp": 2}, constraints=TP)
    captured, gradients = _gradients(plan)
    synced = {captured.params[name] for name in gradients.synced_params}
    # Norms run replicated, feeding column-parallel projections: their gradients are partial.
    assert {"layers.0.attn_norm.weight", "layers.1.mlp_norm.bias"} <= synced
    # Column/row-parallel weights are sharded: their gradients are complete where they are.
    assert not any("attn.w" in name or "mlp.fc" in name for name in synced)
    # The residual stream feeds both a norm (partial gradient) and the next residual add
    # (complete): those edges are all-reduced in backward where they arise.
    assert gradients.completed_edges and all(axis == "tp" for _, _, axis in gradients.completed_edges)
