"""A small GPT for long sequences (8192 tokens by default), the context-parallel example.

The model is examples/gpt.py's, with one difference that matters at this length: the loss
keeps the sequence dimension (``cross_entropy(logits [B, V, S], labels [B, S])``) instead of
flattening batch and sequence together, so a plan that splits the sequence over ranks can
compute the loss on each rank's tokens without ever gathering the logits.

``build(attention="eager")`` writes attention out, as models from before
``scaled_dot_product_attention`` do: ``softmax(q @ kᵀ * scale + causal_mask) @ v``. autopar's
capture turns that back into one attention node (passes/capture/attention_pattern.py), so both variants
get the same plans; given the same weights they compute the same loss.

Example::

    model = build()                      # seq=8192
    loss = model(*model.example_inputs(1))
    # autopar.plan(model, 4, model.example_inputs(1), memory_limit=...) splits the sequence
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))  # the sibling example, however this file is loaded
from gpt import GPT, Attention  # noqa: E402


class LongContextGPT(GPT):
    """``forward(tokens [B, S], labels [B, S]) -> mean cross-entropy`` over every token."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.transpose(1, 2), labels)  # [B, V, S]: the sequence dim stays


class EagerAttention(Attention):
    """:class:`gpt.Attention` with the attention math written out instead of calling SDPA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) * self.head_dim**-0.5
        if self.causal:  # -inf above the diagonal: each position sees itself and the ones before
            scores = scores + torch.full((seq, seq), float("-inf"), dtype=scores.dtype, device=x.device).triu(1)
        out = torch.softmax(scores, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def build(
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 8,
    vocab: int = 256,
    seq: int = 8192,
    ffn: int | None = None,
    causal: bool = True,
    attention: str = "sdpa",
) -> LongContextGPT:
    """Build the model; module names as in examples/gpt.py's ``build``. ``causal=False`` makes
    every token attend to every other (an encoder's attention). ``attention="eager"`` uses
    :class:`EagerAttention` (same weights as "sdpa" for the same seed)."""
    if hidden % heads != 0:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention={attention!r} is not known: pass 'sdpa' or 'eager'")
    model = LongContextGPT(
        hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, ffn=ffn or 4 * hidden, causal=causal
    )
    if attention == "eager":
        for layer in model.layers:
            eager = EagerAttention(hidden, heads, causal)
            eager.load_state_dict(layer.attn.state_dict())  # the initialized weights, not fresh ones
            layer.attn = eager
    return model
