"""Activation recomputation: each layer becomes one checkpointed call that really recomputes
(fewer bytes kept after forward, forward ops rerun in backward, same gradients, eager and
compiled), and "selective-op" recomputes the matmuls the cost model counts as dropped. Each
level in parallelized training against one process: tests/equivalence/test_recompute.py."""

import operator

import pytest
import torch
import torch.fx as fx
from equivalence import GPT_TP, load_example
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.ir import ConfigError, get_profile
from autopar.passes.capture.graph import capture
from autopar.passes.capture.graph import node_layer as layer_of
from autopar.passes.cost.facts import analyze
from autopar.passes.cost.schedule import dropped
from autopar.passes.rewrite.recompute import (
    CheckpointedLayer,
    apply_recompute,
    is_matmul,
    kept_by_selective,
    layer_segments,
)
from autopar.passes.rewrite.rewrite import rewrite
from autopar.passes.rewrite.stages import split_stages

GPT = dict(hidden=32, layers=4, heads=4, vocab=64, seq=8)
BATCH = 8
HARDWARE = "a100-80gb"  # a roofline profile: plans made in one process without timing ops
aten = torch.ops.aten


def _gpt():
    torch.manual_seed(0)
    model = load_example("gpt.py").build(**GPT)
    return model, model.example_inputs(BATCH)


def _checkpointed(program: fx.GraphModule) -> list[fx.Node]:
    return [n for n in program.graph.nodes if isinstance(n.target, CheckpointedLayer)]


def test_each_layer_becomes_one_checkpointed_call_and_the_rest_stays():
    model, inputs = _gpt()
    program = capture(model, inputs).graph_module
    assert [s.layers for s in layer_segments(program.graph)] == [(f"layers.{i}",) for i in range(4)]
    assert apply_recompute(program, "none") is program
    for mode in ("selective", "full"):
        recomputed = apply_recompute(program, mode)
        calls = _checkpointed(recomputed)
        assert [c.target.layers for c in calls] == [(f"layers.{i}",) for i in range(4)] and {
            c.target.mode for c in calls
        } == {mode}
        outside = [n.name for n in program.graph.nodes if n.op != "call_function" or layer_of(n) is None]
        kept = [
            n.name
            for n in recomputed.graph.nodes
            if not isinstance(n.target, CheckpointedLayer) and n.target is not operator.getitem
        ]
        assert kept == outside  # embeddings, head and loss untouched; every layer op inside a call
        assert "checkpointed_layers_0" in recomputed.code
    with pytest.raises(ConfigError, match="recompute='sometimes'"):
        apply_recompute(program, "sometimes")


class _Interleaved(torch.nn.Module):
    """blocks.1 runs between two calls of blocks.0: the two layers' spans overlap."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        y = self.blocks[0](x)
        z = torch.relu(self.blocks[1](y))
        return self.blocks[2](self.blocks[0](z) + y).square().mean()


def test_layers_whose_ops_interleave_share_one_checkpoint_and_train_the_same():
    torch.manual_seed(0)
    model, x = _Interleaved(), torch.randn(4, 8)
    captured = capture(model, (x,))
    assert [s.layers for s in layer_segments(captured.graph)] == [("blocks.0", "blocks.1"), ("blocks.2",)]
    reference = _train(captured.graph_module, captured, model, (x,))
    for mode in ("selective", "full"):
        loss, grads, _, counts = _train(apply_recompute(captured.graph_module, mode), captured, model, (x,))
        torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-6)
        for grad, expected in zip(grads, reference[1]):
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
        assert counts.get("relu", 0) == 1 and reference[3].get("relu", 0) == 0  # rerun in backward


def _is_collective(node: fx.Node) -> bool:
    return str(node.target).startswith("autopar.")


def test_collectives_join_their_layer_and_zero3_gathers_stay_outside():
    model, inputs = _gpt()
    captured = capture(model, inputs)
    groups = {"dp": "DP", "tp": "TP"}
    tp = autopar.plan(model, 2, inputs, hardware=HARDWARE, degrees={"tp": 2}, constraints=GPT_TP)
    plain = rewrite(captured, tp, groups=groups, device="cpu")
    nodes = list(plain.graph.nodes)
    layer_ops = [i for i, n in enumerate(nodes) if n.op == "call_function" and layer_of(n) is not None]
    same_layer = [(a, b) for a, b in zip(layer_ops, layer_ops[1:]) if layer_of(nodes[a]) == layer_of(nodes[b])]
    collectives = [i for i, n in enumerate(nodes) if _is_collective(n)]
    amid_layers = {nodes[i].name for i in collectives if any(a < i < b for a, b in same_layer)}
    program = apply_recompute(plain, "full")
    inner = {
        n.name for call in _checkpointed(program) for n in call.target.graph_module.graph.nodes if _is_collective(n)
    }
    outer = {n.name for n in program.graph.nodes if _is_collective(n)}
    assert inner == amid_layers and len(inner) >= GPT["layers"]  # a collective amid a layer's ops reruns with it
    assert outer | inner == {nodes[i].name for i in collectives} and not outer & inner
    zero3 = autopar.plan(model, 2, inputs, hardware=HARDWARE, degrees={"dp": 2}, zero=3)
    program = apply_recompute(rewrite(captured, zero3, groups=groups, device="cpu"), "selective")
    gather = torch.ops.autopar.zero_gather.default
    inner = [n for call in _checkpointed(program) for n in call.target.graph_module.graph.nodes]
    assert len(_checkpointed(program)) == GPT["layers"] and not any(n.target is gather for n in inner)
    assert sum(n.target is gather for n in program.graph.nodes) == len(captured.params)


def test_stage_split_puts_each_checkpointed_layer_in_its_stage():
    model, inputs = _gpt()
    captured = capture(model, inputs)
    plan = autopar.plan(model, 2, inputs, hardware=HARDWARE, degrees={"pp": 2}, microbatches=4, pipeline="1f1b")
    program = rewrite(captured, plan, groups={"dp": "DP", "tp": "TP"}, device="cpu")
    args = set(captured.params), set(captured.buffers), plan.schedule
    plain, recomputed = split_stages(program, *args), split_stages(apply_recompute(program, "full"), *args)
    for before, after in zip(plain, recomputed):
        assert (after.received, after.sent, after.layers) == (before.received, before.sent, before.layers)
        assert [c.target.layers for c in _checkpointed(after.graph_module)] == [(layer,) for layer in before.layers]


def test_selective_recomputation_keeps_matmuls_attention_and_collectives():
    keep = [
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.autopar.all_reduce.default,
        torch.ops.autopar.all_gather.default,
    ]
    assert all(kept_by_selective(op) for op in keep)
    assert not any(
        kept_by_selective(op)
        for op in [aten.gelu.default, aten.native_layer_norm.default, aten.view.default, aten.add.Tensor]
    )


class _Ops(TorchDispatchMode):
    """Counts ops by name, and (while forward runs) remembers the storages they create."""

    def __init__(self, track_storages: bool = False):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.storages: list[tuple[StorageWeakRef, int, int]] | None = (
            [] if track_storages else None
        )  # (ref, address, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket).removeprefix("aten.")
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.storages is not None:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    self.storages.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        return out

    def kept_bytes(self) -> int:
        """Bytes of the tracked storages still alive: what autograd keeps for backward."""
        return sum(dict((ptr, size) for ref, ptr, size in self.storages if not ref.expired()).values())


def _train(program: fx.GraphModule, captured, model, inputs):
    params = [model.get_parameter(captured.params[n]).detach().clone().requires_grad_() for n in captured.params]
    forward = _Ops(track_storages=True)
    with forward:
        (loss,) = program(*params, *inputs)
    kept = forward.kept_bytes()
    backward = _Ops()
    with backward:
        loss.backward()
    return loss.detach(), [p.grad for p in params], kept, backward.counts


def _each_level(train) -> dict[str, tuple]:
    """``train`` (:func:`_train`, :func:`_compiled_counts`) of the GPT under each recomputation
    level, checked to give the loss and gradients of no recomputation."""
    model, inputs = _gpt()
    captured = capture(model, inputs)
    levels = ("none", "selective", "selective-op", "full")
    runs = {mode: train(apply_recompute(captured.graph_module, mode), captured, model, inputs) for mode in levels}
    loss, grads = runs["none"][:2]
    for other_loss, other_grads, *_ in runs.values():
        torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=1e-6)
        for grad, reference in zip(other_grads, grads):
            torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)
    return runs


def test_recomputation_keeps_fewer_bytes_and_reruns_the_forward_in_backward():
    runs = _each_level(_train)
    counts = runs["none"][3]
    held = [runs[mode][2] for mode in ("full", "selective-op", "selective", "none")]
    assert held == sorted(held) and len(set(held)) == 4, held
    layers = GPT["layers"]
    assert counts.get("gelu", 0) == 0  # no recomputation: backward only runs gelu_backward
    assert runs["selective"][3]["gelu"] == runs["full"][3]["gelu"] == layers  # each layer's gelu, rerun once
    # selective reruns no matmul (their outputs are kept); full reruns each layer's forward up to
    # its last saved value: 5 of its 6 projections (fc2 feeds only the residual add, which saves nothing);
    # selective-op the second, fourth and sixth (wk, wo; fc2 again needs no rerun)
    assert runs["selective"][3]["mm"] == counts["mm"] and runs["full"][3]["mm"] == counts["mm"] + 5 * layers
    assert runs["selective-op"][3]["mm"] == counts["mm"] + 2 * layers


def test_selective_op_recomputes_every_second_matmul_of_a_layer_as_the_cost_model_counts_them():
    """The cost model drops what the runtime does not keep: per layer, the matmul ops after an
    odd number of others (its facts, in graph order) are the ones whose outputs the runtime does
    not hold after forward (the matmul kernels it counts as it dispatches them)."""
    model, inputs = _gpt()
    captured = capture(model, inputs)
    facts = analyze(captured, get_profile(HARDWARE))
    dropped_ = [name for name, fact in facts.items() if fact.kind == "op" and dropped(fact, "selective-op")]
    matmuls = [name for name in dropped_ if is_matmul(facts[name].node.target)]
    assert matmuls == [f"linear_{6 * i + k}" for i in range(GPT["layers"]) for k in (1, 3, 5)], matmuls
    assert all(not dropped(facts[name], "selective") for name in matmuls)
    # on one layer, in forward: the outputs the two selective levels hold differ by those matmuls' outputs
    layer = [n for n in captured.graph.nodes if n.op == "call_function" and layer_of(n) == "layers.0"]
    held = {}
    for mode in ("selective", "selective-op"):
        program = apply_recompute(captured.graph_module, mode)
        held[mode] = _train(program, captured, model, inputs)[2]
    out_bytes = {n.name: n.meta["val"].numel() * n.meta["val"].element_size() for n in layer if is_matmul(n.target)}
    # selective holds every kept op's output for the recompute to take, fc2's too (which no backward reads)
    recomputed = sum(out_bytes[name] for name in ("linear_1", "linear_3", "linear_5"))
    assert held["selective"] - held["selective-op"] == recomputed * GPT["layers"]


def test_selective_lets_go_of_an_output_only_a_collective_reads(group):
    """A row-parallel linear's partial sum is read only by its reduction (through a view), which
    the recompute serves kept: selective recomputation holds the reduction's output, which the
    residual add reads, not the partial sum; the gradients are those without recomputation (a
    one-rank group: the all-reduce returns its input)."""

    def layer(x, w1, w2):
        partial = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1)), w2)
        return x + torch.ops.autopar.all_reduce(partial, group, "sum")

    torch.manual_seed(0)
    x, w1, w2 = torch.randn(4, 8, 16), torch.randn(32, 16), torch.randn(16, 32)
    runs = {}
    for mode in ("none", "selective"):
        inputs = [t.clone().requires_grad_() for t in (x, w1, w2)]
        program = fx.symbolic_trace(layer)
        call = CheckpointedLayer(("layers.0",), program, mode) if mode != "none" else program
        forward = _Ops(track_storages=True)
        with forward:
            out = call(*inputs)
        kept = forward.kept_bytes() - sum(t.untyped_storage().nbytes() for t in inputs)  # viewed, not made
        runs[mode] = (kept, out.detach(), inputs)
        out.sum().backward()
    torch.testing.assert_close(runs["selective"][1], runs["none"][1])
    for grad, reference in zip(runs["selective"][2], runs["none"][2]):
        torch.testing.assert_close(grad.grad, reference.grad)
    # after forward: the output, the first linear's (relu reads it) and the all-reduce's; of the
    # partial sum a one-element stand-in
    tokens = x.shape[0] * x.shape[1]
    assert runs["selective"][0] == 4 * (tokens * 16 + tokens * 32 + tokens * 16) + 4


def _compiled_counts(program: fx.GraphModule, captured, model, inputs):
    """The loss, gradients and backward graph's matmuls of ``program`` compiled (AOTAutograd,
    no code generation): what torch's own selective contexts, which compiled programs use, recompute."""
    counts = {}

    def forward(gm, example_inputs):
        return make_boxed_func(gm)

    def backward(gm, example_inputs):
        counts["mm"] = sum(1 for n in gm.graph.nodes if n.op == "call_function" and is_matmul(n.target))
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward, bw_compiler=backward)

    torch._dynamo.reset()
    params = [model.get_parameter(captured.params[n]).detach().clone().requires_grad_() for n in captured.params]
    (loss,) = torch.compile(program, backend=backend)(*params, *inputs)
    loss.backward()
    return loss.detach(), [p.grad for p in params], counts["mm"]


def test_compiled_programs_recompute_what_each_selective_level_drops():
    runs = _each_level(_compiled_counts)
    matmuls = runs["none"][2]
    # selective keeps every matmul's output; selective-op reruns wk and wo of each layer at least
    assert runs["selective"][2] == matmuls
    assert matmuls + 2 * GPT["layers"] <= runs["selective-op"][2] < runs["full"][2]
