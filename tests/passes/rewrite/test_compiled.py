"""Sync in program: a program about to be compiled sums its own gradients (one grad_all_reduce
per synced parameter) and gathers ZeRO-3 weights one layer per op; under mixed precision it
casts its fp32 masters itself, on the side of each sum that makes it run in the reduce dtype;
the last microbatch of gradient accumulation takes the earlier ones' gradients as inputs, and a
ZeRO-2 program the chunks it reduce-scatters its gradients into."""

import dataclasses

import torch
from planning import meta_model, plan_example

import autopar.runtime  # noqa: F401  (registers torch.ops.autopar)
from autopar.ir import CASTS_IN_PROGRAM, EARLIER_GRAD, EXTRA_INPUTS, GRAD_CHUNK
from autopar.ir.zero import zero_dims
from autopar.passes.capture.graph import capture
from autopar.passes.rewrite.compiled import sync_in_program
from autopar.passes.rewrite.rewrite import rewrite

GPT = dict(hidden=64, layers=2, heads=4, vocab=128, seq=16)
ops = torch.ops.autopar


def _program(plan, param_dtype=None):
    model = meta_model("gpt.py", **GPT)
    captured = capture(model, model.example_inputs(8, device="meta"), param_dtype=param_dtype)
    program = rewrite(captured, plan, groups={"dp": "dp", "tp": "tp"}, device="cpu")
    return program, captured.params


def _group_of(axes):
    return "+".join(axes)


def test_each_synced_parameter_sums_its_gradient_in_the_program():
    plan = plan_example("gpt.py", 2, batch=8, model_kwargs=GPT, degrees={"dp": 2, "tp": 1})
    program, params = _program(plan)
    program, synced = sync_in_program(program, plan, params, _group_of, whole=True)
    assert synced == set(plan.grad_sync)
    markers = program.graph.find_nodes(op="call_function", target=ops.grad_all_reduce.default)
    marked = {params[node.args[0].name]: node.args[1] for node in markers if node.args[0].op == "placeholder"}
    assert marked == {name: _group_of(axes) for name, axes in plan.grad_sync.items()}
    for node in program.graph.find_nodes(op="placeholder"):  # every use goes through the marker
        if params.get(node.name) in synced:
            assert [user.target for user in node.users] == [ops.grad_all_reduce.default]


def test_zero3_gathers_one_layer_per_op_and_sums_its_gradients():
    base = plan_example("gpt.py", 2, batch=8, model_kwargs=GPT, degrees={"dp": 2, "tp": 1}, zero=0)
    plan = dataclasses.replace(base, zero=3)
    program, params = _program(plan)
    per_parameter = len(program.graph.find_nodes(op="call_function", target=ops.zero_gather.default))
    program, synced = sync_in_program(program, plan, params, _group_of, whole=True)
    assert not program.graph.find_nodes(op="call_function", target=ops.zero_gather.default)
    layers = program.graph.find_nodes(op="call_function", target=ops.zero_gather_layer.default)
    assert len(layers) == 3  # the root's (embeddings, final norm, head), layers.0's, layers.1's
    gathered = [params[shard.name] for layer in layers for shard in layer.args[0]]
    assert len(gathered) == per_parameter and all(all(layer.args[3]) for layer in layers)  # summed over dp
    assert {name.split(".")[1] for name in (params[s.name] for s in layers[1].args[0])} == {"0"}
    assert synced == set(plan.grad_sync)


def test_without_whole_parameters_the_runtime_keeps_their_sync():
    plan = plan_example("gpt.py", 2, batch=8, model_kwargs=GPT, degrees={"dp": 2, "tp": 1})
    program, params = _program(plan)
    program, synced = sync_in_program(program, plan, params, _group_of, whole=False)
    assert not synced and not program.graph.find_nodes(op="call_function", target=ops.grad_all_reduce.default)


def _mixed_plan(reduce_dtype: str, zero: int = 0):
    base = plan_example(
        "gpt.py",
        2,
        batch=8,
        model_kwargs=GPT,
        degrees={"dp": 2, "tp": 1},
        precision="bf16-mixed",
        zero=0,
        reduce_dtype=reduce_dtype,
    )
    return dataclasses.replace(base, zero=zero)


def _path(node) -> list:
    """The targets from a parameter to its first use that is neither a cast nor a sum."""
    path = []
    while len(node.users) == 1 and (user := next(iter(node.users))).target in (CAST, ops.grad_all_reduce.default):
        path.append(user.target)
        node = user
    return path


CAST = torch.ops.aten._to_copy.default


def test_mixed_precision_casts_masters_in_the_program_around_the_sum():
    for reduce_dtype, whole, expected in (
        ("float32", True, [ops.grad_all_reduce.default, CAST]),  # the fp32 gradient summed, then cast
        ("bfloat16", True, [CAST, ops.grad_all_reduce.default]),  # the bf16 gradient summed
        ("float32", False, None),  # sums nothing: takes the runtime's copies (cast once per step)
    ):
        plan = _mixed_plan(reduce_dtype)
        program, params = _program(plan, torch.bfloat16)
        program, _ = sync_in_program(program, plan, params, _group_of, whole=whole)
        assert program.meta[CASTS_IN_PROGRAM] == (expected is not None)
        for node in program.graph.find_nodes(op="placeholder"):
            if node.name in params:
                takes = torch.float32 if expected else torch.bfloat16  # the master, or the runtime's copy
                assert node.meta["val"].dtype == takes and _path(node) == (expected or []), (reduce_dtype, whole, node)


def test_mixed_precision_zero3_gathers_in_the_compute_dtype_and_sums_in_the_reduce_dtype():
    for reduce_dtype, source, compute in (("float32", "placeholder", torch.bfloat16), ("bfloat16", CAST, None)):
        plan = _mixed_plan(reduce_dtype, zero=3)
        program, params = _program(plan, torch.bfloat16)
        program, _ = sync_in_program(program, plan, params, _group_of, whole=True)
        layers = program.graph.find_nodes(op="call_function", target=ops.zero_gather_layer.default)
        for layer in layers:
            # the op reduce-scatters its gradients in its sources' dtype: fp32 shards, or their bf16 casts
            assert {(s.op if s.op == "placeholder" else s.target) for s in layer.args[0]} == {source}
            assert layer.args[4] == compute, layer


def test_the_last_microbatch_takes_the_earlier_gradients_and_sums_them_with_its_own():
    plan = plan_example("gpt.py", 2, batch=8, model_kwargs=GPT, degrees={"dp": 2, "tp": 1}, microbatches=2)
    program, params = _program(plan)
    program, synced = sync_in_program(program, plan, params, _group_of, whole=True, accumulated=True)
    extras = program.meta[EXTRA_INPUTS]
    assert {kind for kind, _ in extras} == {EARLIER_GRAD} and {name for _, name in extras} == synced == set(
        plan.grad_sync
    )
    inputs = program.graph.find_nodes(op="placeholder")[-len(extras) :]
    assert [node.name for node in inputs] == [f"{_placeholder(params, name)}_earlier_grad" for _, name in extras]
    sums = program.graph.find_nodes(op="call_function", target=ops.grad_all_reduce_accumulated.default)
    assert {(params[node.args[0].name], node.args[1].name) for node in sums} == {
        (name, f"{_placeholder(params, name)}_earlier_grad") for _, name in extras
    }
    assert not program.graph.find_nodes(op="call_function", target=ops.grad_all_reduce.default)


def test_zero2_reduce_scatters_one_layer_per_op_into_the_chunks_the_program_takes():
    base = plan_example("gpt.py", 2, batch=8, model_kwargs=GPT, degrees={"dp": 2, "tp": 1}, zero=0)
    plan = dataclasses.replace(base, zero=2)
    program, params = _program(plan)
    shapes = {
        params[n.name]: n.meta["val"].shape for n in program.graph.find_nodes(op="placeholder") if n.name in params
    }
    dims = zero_dims(plan, shapes)
    program, synced = sync_in_program(program, plan, params, _group_of, whole=True, scattered=dims)
    layers = program.graph.find_nodes(op="call_function", target=ops.zero_scatter_layer.default)
    assert len(layers) == 3  # the root's, layers.0's, layers.1's
    extras = program.meta[EXTRA_INPUTS]
    assert {kind for kind, _ in extras} == {GRAD_CHUNK} and {name for _, name in extras} == set(dims) == synced
    chunks = dict(zip((name for _, name in extras), program.graph.find_nodes(op="placeholder")[-len(extras) :]))
    for layer in layers:
        wholes, taken, _, layer_dims = layer.args
        for whole, chunk, dim in zip(wholes, taken, layer_dims):
            name = params[whole.name]
            assert chunk is chunks[name] and dim == dims[name]
            expected = list(shapes[name])
            expected[dim] //= 2
            assert list(chunk.meta["val"].shape) == expected


def _placeholder(params: dict[str, str], name: str) -> str:
    return next(placeholder for placeholder, param in params.items() if param == name)
