"""The example models: build on meta and CPU, give a finite scalar loss, backward, and export.

The examples are loaded by file path, as the CLI does (``examples/hf.py:build_llama``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BATCH = 4


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"autopar_examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mlp, gpt, hf, cnn = load_example("mlp"), load_example("gpt"), load_example("hf"), load_example("cnn")

# name -> (builder, expected example_inputs as (shape, dtype) pairs at batch size BATCH)
CASES = {
    "mlp": (mlp.build, [((BATCH, 64), torch.float32)] * 2),
    "gpt": (gpt.build, [((BATCH, 64), torch.int64)] * 2),
    "gpt2": (hf.build_gpt2, [((BATCH, 32), torch.int64)] * 2),
    "llama": (hf.build_llama, [((BATCH, 32), torch.int64)] * 2),
    "mixtral": (hf.build_mixtral, [((BATCH, 32), torch.int64)] * 2),
    "cnn": (cnn.build, [((BATCH, 3, 16, 16), torch.float32), ((BATCH,), torch.int64)]),
}


def build_on(name: str, device: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return CASES[name][0]()


@pytest.fixture(scope="module", params=list(CASES))
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def cpu_model(name) -> nn.Module:
    return build_on(name, "cpu")


def test_builds_and_exports_on_meta(name):
    model = build_on(name, "meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    inputs = model.example_inputs(BATCH)  # device defaults to the model's
    assert all(t.device.type == "meta" for t in inputs)
    assert [(tuple(t.shape), t.dtype) for t in inputs] == CASES[name][1]
    torch.export.export(model, inputs, strict=False)


def test_example_inputs_are_deterministic(name, cpu_model):
    first, second = cpu_model.example_inputs(BATCH), cpu_model.example_inputs(BATCH, device="cpu")
    assert [(tuple(t.shape), t.dtype) for t in first] == CASES[name][1]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert all(t.device.type == "meta" for t in cpu_model.example_inputs(BATCH, device="meta"))


def test_init_is_deterministic(name, cpu_model):
    again = build_on(name, "cpu")
    for (key, a), b in zip(cpu_model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


def test_forward_backward(name, cpu_model):
    assert all(p.dtype == torch.float32 for p in cpu_model.parameters())
    cpu_model.zero_grad()
    loss = cpu_model(*cpu_model.example_inputs(BATCH))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for param_name, param in cpu_model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), param_name


def test_export_matches_eager(name, cpu_model):
    inputs = cpu_model.example_inputs(BATCH)
    exported = torch.export.export(cpu_model, inputs, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(*inputs), cpu_model(*inputs), rtol=1e-6, atol=1e-6)


def test_mlp_module_names():
    names = dict(build_on("mlp", "meta").named_modules())
    assert {"blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"} <= names.keys()
    assert tuple(names["blocks.0.fc1"].weight.shape) == (256, 64)


def test_gpt_module_names():
    names = dict(build_on("gpt", "meta").named_modules())
    expected = {"tok_embeddings", "pos_embeddings", "norm", "output"} | {
        f"layers.1.{suffix}"
        for suffix in ("attn_norm", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp_norm", "mlp.fc1", "mlp.fc2")
    }
    assert expected <= names.keys()
    assert tuple(names["layers.0.mlp.fc1"].weight.shape) == (512, 128)  # ffn defaults to 4 * hidden


def test_gpt_loss_on_a_batch_slice_is_the_slice_loss():
    # Data parallelism: the same module runs on half the batch, and equal halves average to the whole.
    model = build_on("gpt", "cpu")
    tokens, labels = model.example_inputs(BATCH)
    halves = [model(tokens[i : i + BATCH // 2], labels[i : i + BATCH // 2]) for i in (0, BATCH // 2)]
    torch.testing.assert_close((halves[0] + halves[1]) / 2, model(tokens, labels))


def test_gpt_attention_with_column_sharded_projections_sums_to_the_whole():
    # Megatron attention: wq/wk/wv split by output rows (whole heads), wo by input columns; the
    # partial outputs sum to the unsharded output because heads are reshaped with view(..., -1, head_dim).
    torch.manual_seed(0)
    full = gpt.Attention(hidden=32, heads=4)
    x = torch.randn(2, 8, 32)
    shards = []
    for rank in range(2):
        shard = gpt.Attention(hidden=32, heads=4)
        rows = slice(16 * rank, 16 * (rank + 1))
        for proj in ("wq", "wk", "wv"):
            getattr(shard, proj).weight = nn.Parameter(getattr(full, proj).weight[rows])
        shard.wo.weight = nn.Parameter(full.wo.weight[:, rows])
        shards.append(shard(x))
    torch.testing.assert_close(shards[0] + shards[1], full(x))


def test_gpt_rejects_too_long_input():
    model = build_on("gpt", "meta")
    tokens = torch.empty(1, model.seq + 1, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="seq"):
        model(tokens, tokens)


def test_hf_module_names_match_hugging_face_checkpoints():
    llama = dict(build_on("llama", "meta").named_modules())
    expected = {"model.embed_tokens", "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"}
    assert expected <= llama.keys()
    gpt2 = build_on("gpt2", "meta")
    assert {"transformer.h.1.attn.c_attn", "lm_head"} <= dict(gpt2.named_modules()).keys()
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied by default, as in GPT-2
    mixtral = dict(build_on("mixtral", "meta").named_parameters())
    assert tuple(mixtral["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 256, 64)
    assert tuple(mixtral["model.layers.0.mlp.gate.weight"].shape) == (4, 64)


def test_mixtral_exports_to_aten_ops_only():
    # The default experts implementation ("grouped_mm") would export an opaque transformers:: op.
    model = build_on("mixtral", "meta")
    graph = torch.export.export(model, model.example_inputs(2), strict=False).graph
    namespaces = {node.target.namespace for node in graph.nodes if isinstance(node.target, torch._ops.OpOverload)}
    assert namespaces == {"aten"}


def test_llama70b_shaped_on_meta():
    model = hf.build_llama70b_shaped(layers=2)
    params = dict(model.named_parameters())
    assert all(p.device.type == "meta" for p in params.values())
    shapes = {
        "model.embed_tokens.weight": (128256, 8192),
        "model.layers.0.self_attn.q_proj.weight": (8192, 8192),
        "model.layers.0.self_attn.k_proj.weight": (1024, 8192),
        "model.layers.0.mlp.gate_proj.weight": (28672, 8192),
        "model.layers.1.mlp.down_proj.weight": (8192, 28672),
        "lm_head.weight": (128256, 8192),
    }
    assert {key: tuple(params[key].shape) for key in shapes} == shapes
    tokens, labels = model.example_inputs(1)
    assert tokens.shape == labels.shape == (1, 4096) and tokens.device.type == "meta"
    torch.export.export(model, (tokens, labels), strict=False)
