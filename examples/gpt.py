"""A GPT in the torchtitan/Llama layout, with LayerNorm, GELU and learned positions.

Attention keeps separate ``wq``/``wk``/``wv``/``wo`` projections and reshapes heads with
``view(batch, seq, -1, head_dim)``, so column-sharding the projections over a mesh axis
simply leaves each rank with fewer heads. Batch and sequence length are read from the
input, so the same module runs on a data-parallel slice of the batch.

Example::

    model = build(hidden=128, layers=2, heads=4)
    loss = model(*model.example_inputs(8))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.causal = causal
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, hidden, bias=False)
        self.wv = nn.Linear(hidden, hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 rather than a head count: under tensor parallelism each rank holds only its heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, causal: bool = True) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, causal)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = FeedForward(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """``forward(tokens [B, S] int64, labels [B, S] int64) -> mean cross-entropy``."""

    def __init__(
        self, *, hidden: int, layers: int, heads: int, vocab: int, seq: int, ffn: int, causal: bool = True
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.seq = seq
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.pos_embeddings = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(TransformerBlock(hidden, heads, ffn, causal) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """GPT-2 init: N(0, std) for embeddings and projections; LayerNorms stay (1, 0)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.loss(self.output(self.norm(h)), labels)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token plus learned position embeddings: [B, S] -> [B, S, hidden]."""
        seq = tokens.shape[1]
        if seq > self.seq:
            raise ValueError(f"input sequence length {seq} exceeds the model's seq={self.seq}; build with seq>={seq}")
        positions = torch.arange(seq, device=tokens.device)
        return self.tok_embeddings(tokens) + self.pos_embeddings(positions)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over every token of the batch."""
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))

    def example_inputs(self, batch_size: int, device=None) -> tuple[torch.Tensor, ...]:
        """A global batch ``(tokens, labels)`` of next-token pairs, deterministic (seed 0).

        ``device`` defaults to the model's; on "meta" the tensors are empty.
        """
        device = torch.device(device) if device is not None else next(self.parameters()).device
        shape = (batch_size, self.seq)
        if device.type == "meta":
            return tuple(torch.empty(shape, dtype=torch.int64, device=device) for _ in range(2))
        generator = torch.Generator().manual_seed(0)
        stream = torch.randint(0, self.vocab, (batch_size, self.seq + 1), generator=generator)
        return stream[:, :-1].contiguous().to(device), stream[:, 1:].contiguous().to(device)


def build(
    *, hidden: int = 128, layers: int = 2, heads: int = 4, vocab: int = 512, seq: int = 64, ffn: int | None = None
) -> GPT:
    """Build the GPT; ``ffn`` defaults to ``4 * hidden``.

    Module names: ``tok_embeddings``, ``pos_embeddings``, ``layers.N.attn_norm``,
    ``layers.N.attn.{wq,wk,wv,wo}``, ``layers.N.mlp_norm``, ``layers.N.mlp.{fc1,fc2}``,
    ``norm``, ``output``.

    Example::

        with torch.device("meta"):
            model = build(hidden=4096, layers=32, heads=32, vocab=32000, seq=2048)
    """
    if hidden % heads != 0:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    return GPT(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, ffn=ffn or 4 * hidden)
