"""A GPT whose feed-forward layers are mixtures of experts (Mixtral-style routing).

Attention, embeddings and the loss head are ``examples/gpt.py``'s. Each block's MLP is a
:class:`MoEFeedForward`: a bias-free router ``gate`` [E, H], softmax over its logits, the top-k
experts per token with their probabilities renormalized, and SwiGLU experts stacked as
``experts.gate_up_proj`` [E, 2F, H] (gate rows, then up rows) and ``experts.down_proj``
[E, H, F], Mixtral's layout, so ``passes/capture/moe.py`` turns each block into one ``autopar::moe``
node. The loss adds the Switch/Mixtral load-balancing loss of all layers' router logits,
times ``aux_loss_coef``.

The eager experts are dense: every expert runs on every token and the unchosen ones get weight
0. That costs E/k times the routed FLOPs but has static shapes, so the eager model exports too.

Example::

    model = build(hidden=64, layers=2, heads=4)
    loss = model(*model.example_inputs(4))
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn


def _sibling(name: str):
    """Another example by file path, as the CLI loads examples (they are not a package)."""
    spec = importlib.util.spec_from_file_location(f"autopar_example_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpt = _sibling("gpt")


class Experts(nn.Module):
    """E SwiGLU experts in stacked weights; ``forward(x [T, H], combine [T, E]) -> [T, H]``."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("th,efh->etf", x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("etf,ehf->eth", self.act_fn(gate) * up, self.down_proj)
        return torch.einsum("te,eth->th", combine, out)


class MoEFeedForward(nn.Module):
    """``forward(x [B, S, H]) -> (out [B, S, H], router_logits [B·S, E])``."""

    returns_router_logits = True  # passes/capture/moe.py: the composite forward returns the logits too

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, ffn)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        router_logits = self.gate(tokens)
        probs = torch.softmax(router_logits.float(), dim=-1)
        top_probs, chosen = probs.topk(self.top_k, dim=-1)
        top_probs = top_probs / top_probs.sum(-1, keepdim=True)
        combine = torch.zeros_like(probs).scatter(1, chosen, top_probs).to(x.dtype)
        return self.experts(tokens, combine).view(x.shape), router_logits


class MoETransformerBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = gpt.Attention(hidden, heads)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.moe = MoEFeedForward(hidden, ffn, experts, top_k)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x))
        out, router_logits = self.moe(self.mlp_norm(x))
        return x + out, router_logits


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as Hugging Face's ``load_balancing_loss_func`` computes it.

    Over the tokens of all layers together: E · Σ_e f_e · P_e, with f_e the top-k slots routed
    to expert e per token and P_e the mean router probability of e; uniform routing gives top_k.
    """
    logits = torch.cat(router_logits)
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = probs.topk(top_k, dim=-1).indices.reshape(-1)
    slots = torch.zeros_like(probs[0]).scatter_add(0, chosen, torch.ones_like(chosen, dtype=probs.dtype))
    num_experts = probs.shape[-1]
    return num_experts * (slots / logits.shape[0] * probs.mean(0)).sum()


class MoEGPT(nn.Module):
    """``forward(tokens [B, S] int64, labels [B, S] int64) -> cross-entropy + coef · load-balancing loss``."""

    def __init__(
        self,
        *,
        hidden: int,
        layers: int,
        heads: int,
        vocab: int,
        seq: int,
        ffn: int,
        experts: int,
        top_k: int,
        aux_loss_coef: float,
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.seq = seq
        self.top_k = top_k
        self.aux_loss_coef = aux_loss_coef
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.pos_embeddings = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(MoETransformerBlock(hidden, heads, ffn, experts, top_k) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """N(0, std) for embeddings, projections, routers and experts; LayerNorms stay (1, 0)."""
        gpt.GPT.init_weights(self, std)
        for module in self.modules():
            if isinstance(module, Experts):
                nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
                nn.init.normal_(module.down_proj, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        router_logits = []
        for layer in self.layers:
            h, layer_logits = layer(h)
            router_logits.append(layer_logits)
        loss = gpt.GPT.loss(self, self.output(self.norm(h)), labels)
        if self.aux_loss_coef:
            loss = loss + self.aux_loss_coef * load_balancing_loss(router_logits, self.top_k)
        return loss

    embed = gpt.GPT.embed
    example_inputs = gpt.GPT.example_inputs


def build(
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    vocab: int = 512,
    seq: int = 64,
    ffn: int | None = None,
    experts: int = 8,
    top_k: int = 2,
    aux_loss_coef: float = 0.01,
) -> MoEGPT:
    """Build the MoE GPT; ``ffn`` (each expert's width) defaults to ``2 * hidden``.

    Module names: ``tok_embeddings``, ``pos_embeddings``, ``layers.N.attn_norm``,
    ``layers.N.attn.{wq,wk,wv,wo}``, ``layers.N.mlp_norm``, ``layers.N.moe.gate``,
    ``layers.N.moe.experts`` (``gate_up_proj``, ``down_proj``), ``norm``, ``output``.

    Example::

        model = build(hidden=64, layers=2, heads=4, experts=8, top_k=2)
    """
    if hidden % heads != 0:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
    return MoEGPT(
        hidden=hidden,
        layers=layers,
        heads=heads,
        vocab=vocab,
        seq=seq,
        ffn=ffn or 2 * hidden,
        experts=experts,
        top_k=top_k,
        aux_loss_coef=aux_loss_coef,
    )
