"""Saved activations under a plan: an op that saves an input a collective brings keeps the
collective's output (one per moved input), not its producer's output (passes.cost.facts.saved_bytes)."""

from __future__ import annotations

from planning import meta_model

import autopar
from autopar import capture as _capture
from autopar.ir import get_profile
from autopar.passes.cost.evaluate import strategies_from_plan
from autopar.passes.cost.facts import ShardedShapes, activation_bytes, analyze, saved_bytes

GPT = dict(hidden=64, layers=1, heads=4, vocab=128, seq=32)
BATCH, FLOAT = 4, 4
MEGATRON_TP = {
    "layers.*.attn.w[qkv]": "S(-1)",
    "layers.*.attn.wo": "P",
    "layers.*.mlp.fc1": "S(-1)",
    "layers.*.mlp.fc2": "P",
}
SEQUENCE_PARALLEL = {**MEGATRON_TP, "layers.*.attn_norm": "S(1)", "layers.*.mlp_norm": "S(1)"}


def _saved(constraints, degrees):
    model = meta_model("gpt.py", **GPT)
    inputs = model.example_inputs(BATCH, device="meta")
    hardware = get_profile("a100-80gb")  # roofline: nothing is timed
    plan = autopar.plan(model, 2, inputs, degrees=degrees, constraints=constraints, hardware=hardware)
    facts = analyze(_capture(model, inputs), hardware)
    local = ShardedShapes.unsharded(facts)
    for axis, chosen in strategies_from_plan(plan, facts).items():
        local = local.after(chosen, plan.degrees[axis])

    def by_target(name):
        return [n for n, f in facts.items() if f.kind == "op" and name in str(f.node.target)]

    return facts, local, saved_bytes(facts, local), by_target


def test_sequence_parallel_linears_share_the_gathered_input_they_save():
    facts, local, saved, by_target = _saved(SEQUENCE_PARALLEL, {"dp": 1, "tp": 2})
    full = BATCH * GPT["seq"] * GPT["hidden"] * FLOAT  # the norm output all-gathered over the sequence
    norm, mlp_norm = by_target("layer_norm")[:2]
    q, k, v, wo, fc1 = by_target("linear")[:5]
    for linear in (q, k, v, fc1):
        assert (linear, 0) in local.moved
    # the rewrite gathers the attention norm's output once for q, k and v: one copy, counted at q
    assert saved[q] == activation_bytes(facts[q], local.shapes[q], local.work[q]) + full
    for linear in (k, v):
        assert saved[linear] == activation_bytes(facts[linear], local.shapes[linear], local.work[linear])
    assert saved[fc1] == activation_bytes(facts[fc1], local.shapes[fc1], local.work[fc1]) + full
    for name in (norm, mlp_norm):  # its sequence shard is saved by nobody as it is: only what layer_norm saves itself
        assert saved[name] == activation_bytes(facts[name], local.shapes[name], local.work[name], saved=False)
        assert facts[name].saved and local.shapes[name][0] == (BATCH, GPT["seq"] // 2, GPT["hidden"])


def test_without_moved_saved_inputs_every_node_keeps_what_it_did():
    facts, local, saved, _ = _saved(None, {"dp": 2, "tp": 1})  # data parallel: batch-sharded all along
    assert not local.moved and saved == {
        n: activation_bytes(f, local.shapes[n], local.work[n]) for n, f in facts.items()
    }
    one_device = ShardedShapes.unsharded(facts)
    assert saved_bytes(facts, one_device) == {
        n: activation_bytes(f, one_device.shapes[n], 1.0) for n, f in facts.items()
    }
