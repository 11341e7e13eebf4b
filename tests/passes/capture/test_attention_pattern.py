"""fuse_eager_attention: softmax(q kᵀ · scale + mask) v becomes one scaled_dot_product_attention
node with the same values and gradients (fp32), in hand-written variants, the long-context
example and Hugging Face's eager attention; an sdpa node's provably causal mask becomes
is_causal=True (hand-written masks, Hugging Face's sdpa attention); masks it cannot prove causal
leave the graph alone; and context parallelism runs on the eager example and on Hugging Face Llama."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from equivalence import load_example

from autopar.passes.capture.attention_pattern import buffer_values, fuse_eager_attention
from autopar.passes.capture.graph import capture, module_path

SDPA = torch.ops.aten.scaled_dot_product_attention.default
BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 12, 8
HIDDEN = HEADS * HEAD_DIM


class Attend(torch.nn.Module):
    """One attention over a projection of x, masked as ``variant`` says; returns [B, H, S, D]."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.register_buffer("additive", torch.full((16, 16), float("-inf")).triu(1))  # longer than SEQ: sliced
        self.register_buffer("tril", torch.ones(16, 16, dtype=torch.bool).tril().view(1, 1, 16, 16))
        self.register_buffer("noise", torch.randn(SEQ, SEQ))

    def forward(self, x: torch.Tensor, input_mask: torch.Tensor):
        variant, (batch, seq, _) = self.variant, x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if variant == "bmm":  # [B·H, S, D] views and bmm, as older code writes it
            q3, k3, v3 = (t.reshape(batch * HEADS, seq, HEAD_DIM) for t in (q, k, v))
            probs = (torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(HEAD_DIM)).softmax(-1)
            return torch.bmm(probs, v3).view(batch, HEADS, seq, HEAD_DIM)
        if variant == "key_pretransposed":  # kᵀ [B, H, D, S] made directly, no k node
            key_t = self.qkv(x)[..., HIDDEN : 2 * HIDDEN].view(batch, seq, HEADS, HEAD_DIM).permute(0, 2, 3, 1)
            return torch.softmax(q @ key_t * 0.5, dim=-1) @ v
        scores = q @ k.transpose(-2, -1) * HEAD_DIM**-0.5
        i = torch.arange(seq, device=x.device)
        if variant in ("buffer_add", "buffer_on_meta"):
            scores = scores + self.additive[:seq, :seq]
        elif variant == "buffer_fill":  # nanoGPT
            scores = scores.masked_fill(self.tril[:, :, :seq, :seq] == 0, float("-inf"))
        elif variant == "arange_fill":
            scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
        elif variant == "where_min":  # Hugging Face's fill value: the dtype's minimum
            scores = torch.where(i[None, :] <= i[:, None], scores, torch.finfo(scores.dtype).min)
        elif variant == "sliding_window":
            scores = scores.masked_fill((i[None, :] > i[:, None]) | (i[None, :] < i[:, None] - 3), float("-inf"))
        elif variant == "one_future_key":  # causal but for key i + 1
            scores = scores + torch.full((seq, seq), float("-inf")).triu(2)
        elif variant == "noise_mask":
            scores = scores + self.noise
        elif variant == "input_mask":
            scores = scores + input_mask
        probs = F.softmax(scores.float(), dim=-1).type_as(q)  # an upcast softmax, as in mixed precision
        probs = F.dropout(probs, 0.1 if variant == "dropout" else 0.0, training=True)
        out = probs @ v
        return (out, probs) if variant == "weights_returned" else out


FUSED = {  # variant → is_causal of the fused node
    "none": False,
    "bmm": False,
    "key_pretransposed": False,
    "buffer_add": True,
    "buffer_fill": True,
    "arange_fill": True,
    "where_min": True,
}
LEFT_ALONE = [
    "sliding_window",
    "one_future_key",
    "noise_mask",
    "input_mask",
    "buffer_on_meta",
    "weights_returned",
    "dropout",
]


def _exported(variant: str, decompose: bool = False):
    torch.manual_seed(0)
    with torch.device("meta" if variant == "buffer_on_meta" else "cpu"):  # a meta buffer has no value to prove
        model = Attend(variant)
        inputs = (torch.randn(BATCH, SEQ, HIDDEN), torch.randn(SEQ, SEQ))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        exported = torch.export.export(model, inputs, strict=False).run_decompositions(None if decompose else {})
    return model, inputs, exported


def _outputs_and_grads(graph_module, model, inputs):
    """Outputs and the gradients of a fixed random functional of them w.r.t. weight and x."""
    weight = model.qkv.weight.detach().clone().requires_grad_()
    x = inputs[0].clone().requires_grad_()
    outputs = graph_module(weight, *model.buffers(), x, inputs[1])
    probes = torch.Generator().manual_seed(1)
    loss = sum((out * torch.randn(out.shape, generator=probes)).sum() for out in outputs)
    return outputs, torch.autograd.grad(loss, (weight, x))


def _sdpa_nodes(graph):
    return [node for node in graph.nodes if node.target is SDPA]


@pytest.mark.parametrize("variant, decompose", [(v, False) for v in FUSED] + [("buffer_add", True), ("bmm", True)])
def test_eager_attention_becomes_one_sdpa_node_with_equal_values_and_gradients(variant, decompose):
    model, inputs, exported = _exported(variant, decompose)
    unfused = copy.deepcopy(exported.graph_module)
    softmax = next(node for node in unfused.graph.nodes if "softmax" in str(node.target))
    assert fuse_eager_attention(exported.graph_module, buffer_values(exported)) == 1
    (node,) = _sdpa_nodes(exported.graph)
    assert node.args[5] is FUSED[variant] and node.kwargs["scale"] == pytest.approx(
        0.5 if "key" in variant else 8**-0.5
    )
    assert node.meta["nn_module_stack"] == softmax.meta["nn_module_stack"]
    eager_ops = ("aten.softmax", "aten._softmax", "aten.bmm", "aten.matmul")
    assert not any(str(n.target).startswith(eager_ops) for n in exported.graph.nodes)
    expected, expected_grads = _outputs_and_grads(unfused, model, inputs)
    got, grads = _outputs_and_grads(exported.graph_module, model, inputs)
    assert node.meta["val"].shape == (BATCH, HEADS, SEQ, HEAD_DIM) and got[0].shape == expected[0].shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads, expected_grads, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", LEFT_ALONE)
def test_masks_not_proved_causal_and_shared_weights_leave_the_graph_alone(variant):
    _, _, exported = _exported(variant)
    before = [(node.name, node.target) for node in exported.graph.nodes]
    assert fuse_eager_attention(exported.graph_module, buffer_values(exported)) == 0
    assert [(node.name, node.target) for node in exported.graph.nodes] == before


KV_HEADS = 2


class AttendMasked(torch.nn.Module):
    """One ``scaled_dot_product_attention`` call over a projection of x, k and v in ``KV_HEADS``
    groups (enable_gqa), with the ``attn_mask`` ``variant`` names; returns [B, H, Sq, D]."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.qkv = torch.nn.Linear(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.register_buffer("tril", torch.ones(16, 16, dtype=torch.bool).tril().view(1, 1, 16, 16))
        self.register_buffer("additive", torch.full((16, 16), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor, padding: torch.Tensor):
        variant, (batch, seq, _) = self.variant, x.shape
        q, k, v = self.qkv(x).split([HIDDEN, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q, k, v = (t.view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        i = torch.arange(seq, device=x.device)
        masks = {
            "bool_buffer": lambda: self.tril[:, :, :seq, :seq],
            "additive_buffer": lambda: self.additive[:seq, :seq],
            "arange_bool": lambda: (i[None, :] <= i[:, None]).expand(batch, 1, seq, seq),  # Hugging Face's shape
            "dtype_min": lambda: torch.full((seq, seq), torch.finfo(x.dtype).min).triu(1),
            "dropout": lambda: self.tril[:, :, :seq, :seq],
            "sliding_window": lambda: (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4),
            "one_future_key": lambda: i[None, :] <= i[:, None] + 1,
            "padding_input": lambda: padding & (i[None, :] <= i[:, None]),
            "shorter_queries": lambda: torch.ones(4, seq, dtype=torch.bool).tril(),  # causal, but Sq != Sk
        }
        if variant == "shorter_queries":
            q = q[:, :, :4]
        dropout = 0.3 if variant == "dropout" else 0.0
        return F.scaled_dot_product_attention(q, k, v, masks[variant](), dropout, scale=0.3, enable_gqa=True)


UNMASKED = ["bool_buffer", "additive_buffer", "arange_bool", "dtype_min", "dropout"]
MASK_KEPT = ["sliding_window", "one_future_key", "padding_input", "shorter_queries"]


def _exported_masked(variant: str):
    torch.manual_seed(0)
    model = AttendMasked(variant)
    padding = torch.ones(BATCH, 1, 1, SEQ, dtype=torch.bool)
    padding[1, ..., -3:] = False  # the second sequence's last three tokens are padding
    inputs = (torch.randn(BATCH, SEQ, HIDDEN), padding)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model, inputs, torch.export.export(model, inputs, strict=False).run_decompositions({})


def _masked_outputs_and_grads(graph_module, model, inputs, seed: int = 2):
    """As _outputs_and_grads, with the dropout draws ``seed`` makes."""
    weight = model.qkv.weight.detach().clone().requires_grad_()
    x = inputs[0].clone().requires_grad_()
    torch.manual_seed(seed)
    (out,) = graph_module(weight, *model.buffers(), x, inputs[1])
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return out, torch.autograd.grad((out * probe).sum(), (weight, x))


def _dead_nodes(graph) -> list[str]:
    """Computations nothing reads (an assert only checks metadata)."""
    return [
        node.name
        for node in graph.nodes
        if node.op == "call_function"
        and node.target is not torch.ops.aten._assert_tensor_metadata.default
        and all(user.target is torch.ops.aten._assert_tensor_metadata.default for user in node.users)
    ]


@pytest.mark.parametrize("variant", UNMASKED)
def test_a_provably_causal_sdpa_mask_becomes_is_causal_with_equal_values_and_gradients(variant):
    model, inputs, exported = _exported_masked(variant)
    masked = copy.deepcopy(exported.graph_module)
    assert _dead_nodes(exported.graph) == []
    assert fuse_eager_attention(exported.graph_module, buffer_values(exported)) == 1
    (node,) = _sdpa_nodes(exported.graph)
    assert node.args[3:] == (None, 0.3 if variant == "dropout" else 0.0, True)
    assert node.kwargs == {"scale": 0.3, "enable_gqa": True}
    assert _dead_nodes(exported.graph) == []  # the mask's computation is gone
    expected, expected_grads = _masked_outputs_and_grads(masked, model, inputs)
    got, grads = _masked_outputs_and_grads(exported.graph_module, model, inputs)
    if variant == "dropout":  # equal because both drew the same dropout, which really drops
        assert not torch.allclose(_masked_outputs_and_grads(exported.graph_module, model, inputs, seed=3)[0], got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", MASK_KEPT)
def test_an_sdpa_mask_not_proved_causal_is_kept(variant):
    _, _, exported = _exported_masked(variant)
    before = [(node.name, node.target, node.args, node.kwargs) for node in exported.graph.nodes]
    assert fuse_eager_attention(exported.graph_module, buffer_values(exported)) == 0
    assert [(node.name, node.target, node.args, node.kwargs) for node in exported.graph.nodes] == before


def _placeholder_values(captured, model, inputs):
    values, user_inputs = [], iter(inputs)
    for node in captured.graph.nodes:
        if node.op == "placeholder":
            name = node.name
            if name in captured.params:
                values.append(model.get_parameter(captured.params[name]))
            elif name in captured.buffers:
                values.append(model.get_buffer(captured.buffers[name]))
            else:
                values.append(next(user_inputs))
    return values


def _assert_same_loss_and_grads(captured, model, inputs):
    """The captured graph, run on ``model``'s weights, against ``model`` itself."""
    params = [p for p in model.parameters()]
    loss = captured.graph_module(*_placeholder_values(captured, model, inputs))[0]
    grads = torch.autograd.grad(loss, params)
    expected = model(*inputs)
    expected_grads = torch.autograd.grad(expected, params)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


def _ops(graph) -> list[str]:
    """The ops in order; the reshape after attention copies an eager output (clone, _unsafe_view)
    but views SDPA's, whose layout is already [B, S, H, D]: count both as a view."""
    ops = [str(node.target).replace("_unsafe_view", "view") for node in graph.nodes]
    return [op for op in ops if op != "aten.clone.default"]


@pytest.mark.parametrize("causal", [True, False])
def test_the_eager_long_context_example_captures_as_the_sdpa_one(causal):
    example = load_example("long_context_gpt.py")
    sizes = dict(hidden=32, layers=2, heads=4, vocab=64, seq=32, causal=causal)
    torch.manual_seed(0)
    eager = example.build(**sizes, attention="eager")
    torch.manual_seed(0)
    sdpa = example.build(**sizes)
    inputs = eager.example_inputs(4)
    captured, reference = capture(eager, inputs), capture(sdpa, inputs)
    nodes = _sdpa_nodes(captured.graph)
    assert [module_path(node) for node in nodes] == ["layers.0.attn", "layers.1.attn"]
    assert all(node.args[5] is causal and node.kwargs["scale"] == pytest.approx(8**-0.5) for node in nodes)
    # the sdpa model's ops: no mask, transpose, scale or softmax node is left over
    assert _ops(captured.graph) == _ops(reference.graph)
    assert captured.fingerprint == capture(eager, inputs).fingerprint
    _assert_same_loss_and_grads(captured, sdpa, inputs)  # the eager graph on the sdpa model's weights
    with torch.device("meta"):  # planning on "meta": the on-the-fly mask is still evaluated, on the CPU
        on_meta = example.build(**sizes, attention="eager")
    assert len(_sdpa_nodes(capture(on_meta, on_meta.example_inputs(4)).graph)) == 2


def test_an_unknown_attention_option_is_a_clear_error():
    with pytest.raises(ValueError, match="attention='flash' is not known: pass 'sdpa' or 'eager'"):
        load_example("long_context_gpt.py").build(seq=16, attention="flash")


@pytest.mark.parametrize(
    "builder, path", [("build_llama", "model.layers.{}.self_attn"), ("build_gpt2", "transformer.h.{}.attn")]
)
def test_hugging_face_eager_attention_is_fused_with_its_arange_built_causal_mask(builder, path):
    torch.manual_seed(0)
    model = getattr(load_example("hf.py"), builder)(layers=2, attn_implementation="eager")
    inputs = model.example_inputs(2)
    captured = capture(model, inputs)
    nodes = _sdpa_nodes(captured.graph)
    assert [module_path(node) for node in nodes] == [path.format(0), path.format(1)]
    assert all(node.args[5] is True for node in nodes)
    assert not any(str(n.target) in ("aten.where.ScalarOther", "aten.softmax.int") for n in captured.graph.nodes)
    _assert_same_loss_and_grads(captured, model, inputs)


HF_MASKS = [
    ("build_llama", "model.layers.{}.self_attn"),
    ("build_gpt2", "transformer.h.{}.attn"),
    ("build_mixtral", "model.layers.{}.self_attn"),
]


@pytest.mark.parametrize("builder, path", HF_MASKS)
def test_hugging_face_sdpa_attention_drops_its_materialized_causal_mask(builder, path):
    torch.manual_seed(0)
    model = getattr(load_example("hf.py"), builder)(layers=2)
    inputs = model.example_inputs(2)
    captured = capture(model, inputs)
    nodes = _sdpa_nodes(captured.graph)
    assert [module_path(node) for node in nodes] == [path.format(0), path.format(1)]
    assert all(node.args[3:] == (None, 0.0, True) and node.kwargs == {"scale": 0.25} for node in nodes)
    bool_masks = [n for n in captured.graph.nodes if getattr(n.meta.get("val"), "dtype", None) == torch.bool]
    assert bool_masks == [] and _dead_nodes(captured.graph) == []  # nor the packed-sequence check it came with
    _assert_same_loss_and_grads(captured, model, inputs)


class PaddedLlama(torch.nn.Module):
    """Hugging Face Llama given a padding mask as an input: its sdpa mask depends on that input."""

    def __init__(self) -> None:
        super().__init__()
        self.model = load_example("hf.py").build_llama(layers=1).model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.square().mean()


def test_hugging_face_attention_under_a_padding_mask_input_keeps_its_mask():
    torch.manual_seed(0)
    model = PaddedLlama()
    padding = torch.ones(2, 32, dtype=torch.int64)
    padding[1, :5] = 0  # left padding
    inputs = (torch.randint(0, 256, (2, 32)), padding)
    captured = capture(model, inputs)
    (node,) = _sdpa_nodes(captured.graph)
    mask = node.args[3]
    assert isinstance(mask, torch.fx.Node) and len(node.args) < 6 and mask.meta["val"].shape == (2, 1, 32, 32)
    _assert_same_loss_and_grads(captured, model, inputs)
