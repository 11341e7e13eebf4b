"""Small configs for Hugging Face causal-LM families, built from each family's defaults.

``small_model("qwen3")`` is ``AutoModelForCausalLM.from_config`` on the family's default config
with its sizes shrunk (hidden 64, 2 layers, 4 heads, 2 KV heads, FFN 128, vocab 128, 32
positions; MoE 4 experts, top-2), dropout and router noise off, special tokens inside the
vocabulary, per-layer lists cut to 2 layers. Which field holds a size differs by family; the
names below are the ones the installed transformers uses (found by the HF survey,
research/hf_families.md). No hub access.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, POSITIONS = 64, 2, 4, 2, 128, 128, 32
SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads"), KV_HEADS),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim"), FFN),
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_seq_len"), POSITIONS),
    "head_dim": HIDDEN // HEADS,
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), 4),
    "num_experts_per_tok": 2,
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), FFN // 2),
    "rotary_dim": 8,
    **dict.fromkeys(("n_group", "topk_group", "n_shared_experts", "first_k_dense_replace"), 1),
}
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
PER_LAYER = (
    "layer_types", "mlp_layer_types", "layers_block_type", "attn_layer_indices", "no_rope_layers", "block_types",
)  # fmt: skip
# Beyond the generic shrink, what a family needs (the survey's findings).
SPECIAL = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "mamba": {"expand": 2, "state_size": 16, "time_step_rank": 8},
    **dict.fromkeys(
        ("deepseek_v3", "deepseek_v2", "minicpm3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "sarvam_mla",
         "axk1", "youtu", "longcat_flash"),
        {"num_key_value_heads": HEADS, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16,
         "qk_nope_head_dim": 16, "v_head_dim": 16},  # MLA: as many KV heads as heads, its head sizes its own
    ),
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},  # one Mamba layer, one attention layer
    "bamba": {"attn_layer_indices": [1]},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": KV_HEADS, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": FFN, "moe_num_experts": 4, "moe_top_k": 2, "hidden_size": HIDDEN}},
}  # fmt: skip


def small_config(family: str):
    """The family's default config with the sizes above (see the module docstring)."""
    default = AutoConfig.for_model(family)
    fields = set(default.to_dict()) | set(vars(default))
    overrides = {}
    overrides.update(
        {name: value for name, value in SIZES.items() if name in fields and _number_or_none(default, name)}
    )
    for name in fields:
        current = getattr(default, name, None)
        if ("dropout" in name or "pdrop" in name or "jitter" in name) and isinstance(current, float):
            overrides[name] = 0.0
        if name in TOKENS and isinstance(current, int) and current >= VOCAB:
            overrides[name] = TOKENS[name]
        if name == "sliding_window" and isinstance(current, int) and current > 8:
            overrides[name] = 8  # shorter than the sequence: the windowed mask is real
        if name in PER_LAYER and isinstance(current, list) and len(current) > LAYERS:
            kinds = _attention_second(list(dict.fromkeys(current)))
            overrides[name] = (kinds + kinds)[:LAYERS] if not isinstance(current[0], int) else current[:LAYERS]
    overrides.update(SPECIAL.get(family, {}))
    return AutoConfig.for_model(family, **overrides)


def _attention_second(kinds: list) -> list:
    """Layer kinds with an attention kind second when the first is not one: a hybrid shrunk to two
    layers keeps one of each (transformers' hybrids fail without an attention layer)."""
    attention = lambda kind: isinstance(kind, str) and "attention" in kind and "linear" not in kind  # noqa: E731
    if len(kinds) < 2 or attention(kinds[0]):
        return kinds
    first = next((k for k in kinds[1:] if attention(k)), None)
    return kinds if first is None else [kinds[0], first, *(k for k in kinds[1:] if k != first)]


def small_model(family: str):
    """``AutoModelForCausalLM.from_config(small_config(family))``, unmodified."""
    return AutoModelForCausalLM.from_config(small_config(family))


def _number_or_none(config, name: str) -> bool:
    value = getattr(config, name, None)
    return value is None or isinstance(value, int) and not isinstance(value, bool)
