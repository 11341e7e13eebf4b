"""Hugging Face causal LMs (GPT-2, Llama, Mixtral, Qwen2) built from small configs.

:func:`from_config` returns the unmodified Hugging Face model, as
``AutoModelForCausalLM.from_config`` builds it: ``autopar.parallelize(model, mesh)`` takes it
as it is (``pmodel(input_ids=..., labels=...).loss``). The ``build_*`` builders wrap one in a
:class:`CausalLM` whose ``forward(input_ids, labels)`` is the mean next-token cross-entropy
over already shifted labels, with ``example_inputs`` (what the CLI plans). Submodule names
match the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj``,
``transformer.h.0.attn.c_attn``, ``lm_head``), so a plan written against Hugging Face names
applies unchanged. No hub access: configs only.

Export notes (transformers 5.x, ``torch.export.export(..., strict=False)``):

- Under export, Hugging Face never takes SDPA's ``is_causal=True`` shortcut; it materializes a
  ``[batch, 1, seq, seq]`` boolean mask (plus a packed-sequence check on ``position_ids``) and
  passes it to ``scaled_dot_product_attention``.
- Mixtral's default ``experts_implementation="grouped_mm"`` exports, but as the opaque custom op
  ``transformers.grouped_mm_fallback`` (fp32 under tracing); ``"eager"`` (a loop over the experts
  that were hit) fails on a data-dependent shape. ``"batched_mm"``, the default here, gathers each
  token's expert weights and uses ``aten.bmm``: static shapes and only aten ops.

Example::

    model = build_llama(hidden=64, layers=2)
    loss = model(*model.example_inputs(4))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    GPT2Config,
    GPT2LMHeadModel,
    JetMoeConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func


class CausalLM(nn.Module):
    """A Hugging Face ``*ForCausalLM`` split into its base model and ``lm_head``, plus the loss.

    The base model keeps its Hugging Face attribute name (``model`` for Llama and Mixtral,
    ``transformer`` for GPT-2). The loss is computed here rather than by Hugging Face, so labels
    are already aligned with the inputs (``example_inputs`` gives next-token pairs) and the mean
    runs over every token, as in ``examples/gpt.py``.
    """

    def __init__(self, hf_model: PreTrainedModel, *, seq: int) -> None:
        super().__init__()
        # the base model's attribute: its prefix, or "model" where the prefix names another (Llama 4's)
        self.base_name = next(n for n in (hf_model.base_model_prefix, "model") if hasattr(hf_model, n))
        self.add_module(self.base_name, getattr(hf_model, self.base_name))
        self.lm_head = hf_model.get_output_embeddings()
        self.config = hf_model.config
        self.seq = seq

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        base = getattr(self, self.base_name)
        outputs = base(input_ids=input_ids, use_cache=False)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
        if getattr(self.config, "output_router_logits", False):  # a mixture of experts' load-balancing loss
            experts, top_k = self.config.num_local_experts, self.config.num_experts_per_tok
            loss = loss + self.config.router_aux_loss_coef * load_balancing_loss_func(
                outputs.router_logits, experts, top_k
            )
        return loss

    def example_inputs(self, batch_size: int, device=None) -> tuple[torch.Tensor, ...]:
        """A global batch ``(input_ids, labels)`` of next-token pairs, deterministic (seed 0).

        ``device`` defaults to the model's; on "meta" the tensors are empty.
        """
        device = torch.device(device) if device is not None else next(self.parameters()).device
        shape = (batch_size, self.seq)
        if device.type == "meta":
            return tuple(torch.empty(shape, dtype=torch.int64, device=device) for _ in range(2))
        generator = torch.Generator().manual_seed(0)
        stream = torch.randint(0, self.config.vocab_size, (batch_size, self.seq + 1), generator=generator)
        return stream[:, :-1].contiguous().to(device), stream[:, 1:].contiguous().to(device)


def build_gpt2(
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    vocab: int = 256,
    seq: int = 32,
    tie_embeddings: bool = True,
    attn_implementation: str = "sdpa",
) -> CausalLM:
    """GPT-2 (fused ``c_attn``, ``Conv1D`` layers, ``lm_head`` tied to ``transformer.wte`` by default).

    Example::

        model = build_gpt2(hidden=64, layers=2, heads=4)
    """
    config = GPT2Config(
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        vocab_size=vocab,
        n_positions=seq,
        bos_token_id=vocab - 1,  # GPT-2's <|endoftext|> is its last token
        eos_token_id=vocab - 1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        tie_word_embeddings=tie_embeddings,
        attn_implementation=attn_implementation,
    )
    return CausalLM(GPT2LMHeadModel(config), seq=seq)


def _llama_config(
    *, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int, **extra
) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=seq,
        attention_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=False,
        **extra,
    )


def build_llama(
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 256,
    seq: int = 32,
    attn_implementation: str = "sdpa",
) -> CausalLM:
    """Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU ``gate_proj``/``up_proj``/``down_proj``).

    Example::

        model = build_llama(hidden=64, layers=2, heads=4, kv_heads=2)
    """
    config = _llama_config(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        vocab=vocab,
        seq=seq,
        attn_implementation=attn_implementation,
    )
    return CausalLM(LlamaForCausalLM(config), seq=seq)


# Llama 3's published shapes (Dubey et al., "The Llama 3 Herd of Models", 2024, Table 3)
LLAMA3 = {
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "70b": dict(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672),
    "405b": dict(hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248),
}


def build_llama3(size: str = "8b", *, layers: int | None = None, seq: int = 8192) -> CausalLM:
    """A Llama-3-shaped model (``size``: "8b", "70b" or "405b"), always on the meta device (for planning).

    Vocabulary 128256, RMSNorm eps 1e-5, RoPE theta 500000 (the long-context RoPE scaling is left
    out: it only changes the values of a buffer); ``layers`` overrides the depth. Far too large to
    materialize here (the 8B model's embedding alone is 0.5e9 parameters), so it is built on "meta".

    Example::

        model = build_llama3("405b", layers=2)
        tokens, labels = model.example_inputs(1)  # meta tensors of shape [1, 8192]
    """
    if size not in LLAMA3:
        raise ValueError(f"size={size!r}: choose one of {sorted(LLAMA3)}")
    shape = {**LLAMA3[size], **({"layers": layers} if layers is not None else {})}
    config = _llama_config(
        **shape,
        vocab=128256,
        seq=seq,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        return CausalLM(LlamaForCausalLM(config), seq=seq)


def build_default_config(family: str, *, seq: int = 4096, **overrides) -> CausalLM:
    """``family``'s Hugging Face default configuration (most are a released checkpoint's shapes,
    DeepSeek-V3's its 671B model; not all: BLOOM's is a two-layer toy), its fields ``overrides``
    replaced, in a :class:`CausalLM`, on the meta device (for planning).

    Example::

        model = build_default_config("deepseek_v3")
        plan = autopar.plan(model, (32, 8), model.example_inputs(512, device="meta"), hardware="h100-80gb")
    """
    with torch.device("meta"):
        return CausalLM(AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **overrides)), seq=seq)


def build_llama70b_shaped(*, layers: int = 2, seq: int = 4096) -> CausalLM:
    """A Llama-3-70B-shaped model with ``layers`` layers on the meta device (:func:`build_llama3`).

    Example::

        model = build_llama70b_shaped(layers=2)
        tokens, labels = model.example_inputs(1)  # meta tensors of shape [1, 4096]
    """
    return build_llama3("70b", layers=layers, seq=seq)


def build_mixtral(
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    experts: int = 4,
    top_k: int = 2,
    vocab: int = 256,
    seq: int = 32,
    attn_implementation: str = "sdpa",
    experts_implementation: str = "batched_mm",
    aux_loss_coef: float = 0.0,
) -> CausalLM:
    """Mixtral (Llama attention, top-k routed SwiGLU experts in ``model.layers.N.mlp``).

    ``aux_loss_coef`` > 0 adds the router's load-balancing loss (Switch Transformer's, as
    Hugging Face computes it with ``output_router_logits``) times that coefficient.
    ``experts_implementation`` is a transformers 5 option; see the module docstring for which
    choices export.

    Example::

        model = build_mixtral(experts=4, top_k=2)
    """
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
    config = MixtralConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        vocab_size=vocab,
        max_position_embeddings=seq,
        sliding_window=None,
        attention_dropout=0.0,
        router_jitter_noise=0.0,
        output_router_logits=aux_loss_coef > 0,
        router_aux_loss_coef=aux_loss_coef,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )
    return CausalLM(MixtralForCausalLM(config), seq=seq)


def from_config(
    family: str,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 128,
    seq: int = 32,
    experts: int = 4,
    tie_embeddings: bool | None = None,
    dropout: float = 0.0,
) -> PreTrainedModel:
    """An unmodified ``AutoModelForCausalLM.from_config`` model of ``family`` ("llama", "mixtral",
    "deepseek_v3", "jetmoe", "gpt2", "qwen2") with a small config: no dropout but GPT-2's residual and embedding dropout
    ``dropout`` (its attention dropout stays 0: SDPA draws it per shard, not as one process does), no router
    jitter; ``tie_embeddings`` None keeps the family's default (GPT-2 and small Qwen2 tie the embedding and the head).

    Example::

        model = from_config("qwen2", layers=4)
        loss = model(input_ids=ids, labels=ids).loss
    """
    common = dict(vocab_size=vocab, use_cache=True)  # as a user's config has it: autopar drops the cache
    if tie_embeddings is not None:
        common["tie_word_embeddings"] = tie_embeddings
    if family == "gpt2":
        config = GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq, bos_token_id=vocab - 1,
            eos_token_id=vocab - 1, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0, **common,
        )  # fmt: skip
    else:
        sizes = dict(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            intermediate_size=ffn, max_position_embeddings=seq, attention_dropout=0.0, **common,
        )  # fmt: skip
        if family == "llama":
            config = LlamaConfig(**sizes)
        elif family == "qwen2":
            config = Qwen2Config(**{"tie_word_embeddings": True, **sizes})
        elif family == "mixtral":
            config = MixtralConfig(num_local_experts=experts, num_experts_per_tok=2, router_jitter_noise=0.0, **sizes)
        elif family == "deepseek_v3":  # MLA (as many KV heads as heads); layer 0 dense, the rest MoE
            head = hidden // heads // 2
            config = DeepseekV3Config(
                **{**sizes, "num_key_value_heads": heads}, n_routed_experts=experts, num_experts_per_tok=2,
                moe_intermediate_size=ffn // 2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                kv_lora_rank=hidden // 2, q_lora_rank=hidden // 2, qk_rope_head_dim=head, qk_nope_head_dim=head,
                v_head_dim=head,
            )  # fmt: skip
        elif family == "jetmoe":  # experts over the attention heads and the MLP, tokens split by counts
            config = JetMoeConfig(
                hidden_size=hidden, num_hidden_layers=layers, num_key_value_heads=heads // 2,
                kv_channels=hidden // heads, intermediate_size=ffn, max_position_embeddings=seq,
                num_local_experts=experts, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, **common,
            )  # fmt: skip
        else:
            raise ValueError(f"family {family!r}: choose llama, mixtral, deepseek_v3, jetmoe, gpt2 or qwen2")
    return AutoModelForCausalLM.from_config(config)
