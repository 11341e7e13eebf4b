"""passes/moe.py: which blocks are MoE blocks, one ``autopar.moe`` node per layer at capture
(``moe_experts`` for experts behind a router of the model's own), and the same loss and
gradients under ``composite_moe`` as in eager mode."""

import operator

import pytest
import torch
from equivalence import load_example
from planning import meta_model
from torch import nn
from transformers import (
    DbrxConfig,
    DbrxForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from autopar.ir import ConfigError
from autopar.passes.capture.graph import capture, module_path
from autopar.passes.capture.moe import _expert_weights, composite_moe, expert_modules, moe_modules, routed_experts

moe_gpt, hf, hf_configs = load_example("moe_gpt.py"), load_example("hf.py"), load_example("hf_configs.py", "benchmarks")
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
SMALL_MOE = dict(  # the Hugging Face MoE configs' sizes here
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48,
    num_experts_per_tok=2, vocab_size=64,
)  # fmt: skip
# what capture may leave of a block besides the op: the reshapes around it
_RESHAPES = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"}


def test_recognizes_moe_gpt_and_mixtral_blocks_and_nothing_else():
    model = meta_model("moe_gpt.py", hidden=32, layers=3, heads=2, vocab=64, seq=8)
    assert list(moe_modules(model)) == ["layers.0.moe", "layers.1.moe", "layers.2.moe"]
    mixtral = meta_model("hf.py", "build_mixtral", layers=2)
    assert list(moe_modules(mixtral)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert moe_modules(meta_model("gpt.py", hidden=32, layers=1, heads=2, vocab=64, seq=8)) == {}
    assert moe_modules(meta_model("hf.py", "build_llama")) == {}


def test_blocks_whose_math_differs_are_not_recognized():
    def block():
        return moe_gpt.MoEFeedForward(hidden=8, ffn=4, experts=4, top_k=2)

    shared_expert = block()
    shared_expert.shared_expert = nn.Linear(8, 8)  # its forward would add a dense expert
    tanh = block()  # no gated activation the expert ops know
    tanh.experts.act_fn = nn.Tanh()
    biased_router = block()
    biased_router.gate = nn.Linear(8, 4)
    other_routing = block()  # a router of the op's shape routing otherwise (as PhiMoE's samples)
    other_routing.gate = _LeastLikelyRouter(8, 4, bias=False)
    assert list(moe_modules(block())) == [""]
    for model in (shared_expert, tanh, biased_router, other_routing):
        assert moe_modules(model) == {}


class _LeastLikelyRouter(nn.Linear):
    """Returns (logits, weights, experts) as transformers' routers do, but picks the least likely experts."""

    def forward(self, x):
        logits = super().forward(x)
        weights, experts = (-logits).softmax(dim=-1).topk(2, dim=-1)
        return logits, weights / weights.sum(dim=-1, keepdim=True), experts


def _op_nodes(graph):
    return [node for node in graph.nodes if node.op == "call_function"]


def _assert_one_op_per_block(captured, blocks: list[str]) -> None:
    moe_nodes = [node for node in _op_nodes(captured.graph) if str(node.target) == "autopar.moe.default"]
    assert [module_path(node) for node in moe_nodes] == blocks
    for node in _op_nodes(captured.graph):
        if any(module_path(node).startswith(block) for block in blocks) and node not in moe_nodes:
            assert node.target is operator.getitem or str(node.target) in _RESHAPES, node.format_node()
        assert "nonzero" not in str(node.target) and "_local_scalar_dense" not in str(node.target)


def test_capture_makes_one_moe_node_per_layer():
    model = meta_model("moe_gpt.py", hidden=32, layers=2, heads=2, vocab=64, seq=8)
    with composite_moe(model):
        captured = capture(model, model.example_inputs(4, device="meta"))
    _assert_one_op_per_block(captured, ["layers.0.moe", "layers.1.moe"])
    assert "forward" not in vars(model.layers[0].moe)  # the class's forward is back

    mixtral = meta_model("hf.py", "build_mixtral", layers=2)
    with composite_moe(mixtral):
        captured = capture(mixtral, mixtral.example_inputs(2, device="meta"))
    _assert_one_op_per_block(captured, ["model.layers.0.mlp", "model.layers.1.mlp"])
    assert "forward" not in vars(mixtral.model.layers[0].mlp) and "forward" not in vars(
        mixtral.model.layers[0].mlp.gate
    )


def _loss_and_grads(model, inputs):
    loss = model(*inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def _assert_composite_equals_eager(model, inputs) -> None:
    eager_loss, eager_grads = _loss_and_grads(model, inputs)
    with composite_moe(model):
        loss, grads = _loss_and_grads(model, inputs)
    torch.testing.assert_close(loss, eager_loss, **TOLERANCE)
    for name, expected in eager_grads.items():
        # gradients here are ~1e-3: the absolute floor scales with each one, as for unit-scale values
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item(), msg=name)


def test_moe_gpt_loss_and_gradients_under_composite_equal_eager():
    torch.manual_seed(0)
    model = moe_gpt.build(hidden=32, layers=2, heads=2, vocab=64, seq=8, aux_loss_coef=0.5)
    inputs = model.example_inputs(4)
    _assert_composite_equals_eager(model, inputs)
    captured = capture(model, inputs)  # capture makes each MoE block one node
    assert sum(str(node.target) == "autopar.moe.default" for node in captured.graph.nodes) == 2


class _LossOf(nn.Module):
    """A Hugging Face causal LM called on ids as inputs and labels, returning its loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss


def test_qwen2_moe_blocks_with_their_gated_shared_expert_are_recognized_and_equal_eager():
    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        **SMALL_MOE, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
        max_position_embeddings=16, use_cache=False,
    )  # fmt: skip
    model = _LossOf(Qwen2MoeForCausalLM(config))
    assert list(moe_modules(model)) == ["model.model.layers.0.mlp", "model.model.layers.1.mlp"]
    _assert_composite_equals_eager(model, (torch.randint(0, 64, (3, 8)),))
    model.model.model.layers[0].mlp.shared_expert_gate = nn.Linear(32, 1)  # a gate with a bias: another block
    assert list(moe_modules(model)) == ["model.model.layers.1.mlp"]


def test_deepseek_v3_experts_behind_its_own_router_become_moe_experts_nodes_and_equal_eager():
    """DeepSeek-V3's grouped sigmoid router (score-correction bias, group-limited top-k) stays
    ordinary ops; the experts it calls become one moe_experts node per MoE layer."""
    torch.manual_seed(0)
    config = DeepseekV3Config(  # MLA: as many KV heads as heads
        **{**SMALL_MOE, "num_key_value_heads": 2}, moe_intermediate_size=24, n_routed_experts=8, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=16, use_cache=False,
    )  # fmt: skip
    model = _LossOf(DeepseekV3ForCausalLM(config))
    model.model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)  # the bias changes the choice
    assert moe_modules(model) == {}
    assert list(routed_experts(model)) == ["model.model.layers.1.mlp.experts"]  # layer 0 is dense
    ids = torch.randint(0, 64, (3, 8))
    _assert_composite_equals_eager(model, (ids,))
    captured = capture(model, (ids,))
    nodes = [node for node in captured.graph.nodes if str(node.target) == "autopar.moe_experts.default"]
    assert [module_path(node) for node in nodes] == ["model.model.layers.1.mlp.experts"]
    load = nodes[0].meta["expert_load"]  # 24 tokens x 2 slots, measured on the real routing
    assert len(load) == 8 and sum(load) == pytest.approx(1.0) and 24 * 2 * max(load) == round(24 * 2 * max(load))


def test_dbrx_experts_in_their_own_layout_become_moe_experts_nodes_and_equal_eager():
    """DBRX keeps each expert's gate, up and transposed down weights as row blocks of three
    [E·F, H] parameters and loops over the experts a batch hits (no export): viewed and joined
    into the op's layout in the graph, its experts are one moe_experts node per layer."""
    torch.manual_seed(0)
    ffn = dict(ffn_hidden_size=24, moe_num_experts=4, moe_top_k=2, hidden_size=32)
    config = DbrxConfig(
        d_model=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16, ffn_config=ffn,
        attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0), use_cache=False,
    )  # fmt: skip
    model = _LossOf(DbrxForCausalLM(config))
    with torch.no_grad():  # unit-scale experts (the 0.02 init would make any error look small)
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, 0.3)
    assert list(routed_experts(model)) == [f"model.transformer.blocks.{i}.ffn.experts" for i in range(2)]
    ids = torch.randint(0, 64, (3, 8))
    _assert_composite_equals_eager(model, (ids,))
    captured = capture(model, (ids,))
    nodes = [node for node in captured.graph.nodes if str(node.target) == "autopar.moe_experts.default"]
    assert [module_path(node) for node in nodes] == list(routed_experts(model))


def test_experts_of_another_activation_run_it_in_the_op_and_equal_eager():
    """A GELU block becomes the op with "gelu"; Inkling-2's experts, whose act_fn(gate, up) is a
    softcapped SwiGLU, become moe_experts nodes with its caps read off the probe values; MiniMax-M3's
    clamped SwiGLU (its own ``_apply_gate``), Aria's transposed weights and GPT-OSS's biased
    experts, their gate and up columns interleaved, run in the op too."""
    torch.manual_seed(0)
    model = moe_gpt.build(hidden=32, layers=2, heads=2, vocab=64, seq=8)
    for block in moe_modules(model).values():
        block.experts.act_fn = nn.GELU()
    inputs = model.example_inputs(4)
    _assert_composite_equals_eager(model, inputs)
    nodes = [node for node in capture(model, inputs).graph.nodes if str(node.target) == "autopar.moe.default"]
    assert [node.args[7] for node in nodes] == ["gelu", "gelu"]

    model = _LossOf(_unit_scale_experts(hf_configs.small_model("inkling2_text")))
    assert list(routed_experts(model)) == [f"model.model.layers.{i}.mlp.experts" for i in range(2)]
    ids = torch.randint(0, 64, (2, 8))
    _assert_composite_equals_eager(model, (ids,))
    nodes = [node for node in capture(model, (ids,)).graph.nodes if str(node.target) == "autopar.moe_experts.default"]
    assert [node.args[6] for node in nodes] == ["softcapped_silu:4:25"] * 2

    for family, activation in [
        ("minimax_m3_vl_text", "clamped_swiglu:1.702:7"),
        ("aria_text", "silu"),
        ("gpt_oss", "clamped_swiglu:1.702:7:interleaved"),  # and biases
    ]:
        model = _LossOf(_unit_scale_experts(hf_configs.small_model(family)))
        assert [_expert_weights(m)[1] for m in routed_experts(model).values()] == [activation] * 2, family
        _assert_composite_equals_eager(model, (ids,))


class _BiasedExperts(nn.Module):
    """Stacked experts in the ops' own layout with biases: gate_up [E, 2F, H], down [E, H, F]."""

    def __init__(self, gate_up_bias: tuple[int, ...] = (4, 8)) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Parameter(torch.zeros(4, 8, 6)), nn.Parameter(torch.zeros(4, 6, 4))
        self.gate_up_proj_bias, self.down_proj_bias = (
            nn.Parameter(torch.zeros(gate_up_bias)),
            nn.Parameter(torch.zeros(4, 6)),
        )
        self.act_fn = nn.SiLU()


def test_biased_experts_are_recognized_in_either_layout_with_biases_of_their_shape():
    """Biases [E, 2F] and [E, H] go with either weight layout (GPT-OSS's transposed one is above);
    a bias of another shape is not the ops'."""
    weights, activation = _expert_weights(_BiasedExperts())
    assert activation == "silu" and [tuple(t.shape) for t in weights()] == [(4, 8, 6), (4, 6, 4), (4, 8), (4, 6)]
    assert _expert_weights(_BiasedExperts(gate_up_bias=(4, 6))) == (None, None)


def test_llama4_blocks_weight_their_experts_inputs_in_the_op_and_equal_eager():
    """Llama 4's block runs every expert on every token scaled by its router score (0 off the top
    k): one moe_experts node per block with weighted inputs over the top-k experts; a router
    scoring otherwise (softmax) leaves the block as it is."""
    torch.manual_seed(0)
    model = _LossOf(_unit_scale_experts(hf_configs.small_model("llama4_text")))
    blocks = [f"model.model.layers.{i}.feed_forward" for i in range(2)]
    assert list(expert_modules(model)) == blocks
    ids = torch.randint(0, 64, (2, 8))
    _assert_composite_equals_eager(model, (ids,))
    nodes = [node for node in capture(model, (ids,)).graph.nodes if str(node.target) == "autopar.moe_experts.default"]
    assert [(module_path(node), node.args[6], node.args[9]) for node in nodes] == [(b, "silu", True) for b in blocks]
    router = model.model.model.layers[0].feed_forward.router
    router.forward = lambda x: (torch.softmax(nn.Linear.forward(router, x), dim=-1), nn.Linear.forward(router, x))
    assert list(expert_modules(model)) == blocks[1:]


def _unit_scale_experts(model: nn.Module) -> nn.Module:
    """Experts at a scale where caps and clamps bite (gate values past 4 and 7)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, 0.5)
    return model


def test_mixtral_loss_and_gradients_under_composite_equal_eager():
    torch.manual_seed(0)
    model = hf.build_mixtral(hidden=32, layers=2, heads=2, kv_heads=1, ffn=48, experts=4, seq=8)
    _assert_composite_equals_eager(model, model.example_inputs(3))


class _MixtralWithAuxLoss(nn.Module):
    """Hugging Face's own loss path: ``output_router_logits`` adds coef · load_balancing_loss_func."""

    def __init__(self) -> None:
        super().__init__()
        config = MixtralConfig(
            **SMALL_MOE,
            num_local_experts=4,
            max_position_embeddings=8,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
            use_cache=False,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
            experts_implementation="batched_mm",
        )
        self.model = MixtralForCausalLM(config)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def test_mixtral_router_logits_reach_its_aux_loss_under_composite():
    torch.manual_seed(0)
    model = _MixtralWithAuxLoss()
    inputs = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    _assert_composite_equals_eager(model, inputs)
    with composite_moe(model):
        captured = capture(model, inputs)
    _assert_one_op_per_block(captured, ["model.model.layers.0.mlp", "model.model.layers.1.mlp"])


def test_moe_gpt_aux_loss_is_hugging_faces():
    logits = [torch.randn(12, 8, generator=torch.Generator().manual_seed(layer)) for layer in range(3)]
    expected = load_balancing_loss_func(tuple(logits), num_experts=8, top_k=2)
    torch.testing.assert_close(moe_gpt.load_balancing_loss(logits, top_k=2), expected, **TOLERANCE)


def test_training_jitter_is_refused_with_its_fix():
    model = hf.build_mixtral(hidden=16, layers=1, heads=2, kv_heads=1, ffn=8, experts=2, seq=4)
    block = model.model.layers[0].mlp
    block.jitter_noise = 0.1
    with composite_moe(model), pytest.raises(ConfigError, match="'model.layers.0.mlp'.*router_jitter_noise=0"):
        model(*model.example_inputs(1))
    assert "forward" not in vars(block)  # restored after the error too
