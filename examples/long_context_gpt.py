"""A small GPT for long sequences (8192 tokens by default), the context-parallel example.

The model is examples/gpt.py's, with one difference that matters at this length: the loss
keeps the sequence dimension (``cross_entropy(logits [B, V, S], labels [B, S])``) instead of
flattening batch and sequence together, so a plan that splits the sequence over ranks can
compute the loss on each rank's tokens without ever gathering the logits.

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
from gpt import GPT  # noqa: E402


class LongContextGPT(GPT):
    """``forward(tokens [B, S], labels [B, S]) -> mean cross-entropy`` over every token."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.seq:
            raise ValueError(f"input sequence length {seq} exceeds the model's seq={self.seq}; build with seq>={seq}")
        positions = torch.arange(seq, device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.transpose(1, 2), labels)


def build(
    *, hidden: int = 128, layers: int = 2, heads: int = 8, vocab: int = 256, seq: int = 8192, ffn: int | None = None,
    causal: bool = True,
) -> LongContextGPT:
    """Build the model; module names as in examples/gpt.py's ``build``. ``causal=False`` makes
    every token attend to every other (an encoder's attention)."""
    if hidden % heads != 0:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    return LongContextGPT(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, ffn=ffn or 4 * hidden, causal=causal)
