"""The models of published training runs, as those runs computed them, for benchmarks/published.py.

Each builder returns a module with ``example_inputs(batch, device)`` and a scalar loss, built on
whatever device is current (the benchmark builds them on "meta": nothing is allocated).

- :func:`megatron_gpt`: Megatron-LM's GPT of 2021-22 (Narayanan et al. SC'21; Korthikanti et al.;
  MT-NLG; BLOOM): learned positions, pre-LayerNorm, one fused QKV projection, biases, GELU,
  dropout 0.1 on the embeddings, the attention probabilities and after each block, the output
  layer tied to the token embedding. Dropout runs as :func:`dropout`, a product with a keep mask
  of its own size, all ones (the same passes over the data and the same mask saved for backward;
  autopar has no sharding rule for ``native_dropout``, and a node without one would run
  replicated). Attention is *unfused*, as before FlashAttention: q·kᵀ,
  the causal mask, softmax, dropout and the product with v run as separate kernels on
  [batch, heads, seq, seq] scores (Megatron fuses scale, mask and softmax into one kernel; here
  the scale rides on q and mask and softmax are two, one more pass over the scores).
- GPT with fused attention (Megatron-Core on H100; MosaicML's MPT, its output tied): ``examples/gpt.py``.
- :func:`llama`: Llama 3's shapes: RMSNorm, SwiGLU, grouped-query attention (fused causal
  attention reading the K/V heads as they are, each serving its group of query heads, as Llama
  3's flash attention does: no copy of them repeated to every query head), no biases, an untied
  output layer. RoPE is left out: elementwise work on q and k, a few passes over
  [batch, seq, hidden] per layer.

Both Megatron GPTs take their loss over fp32 logits, as Megatron does (:func:`megatron_loss`).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _inputs(vocab: int, seq: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (batch, seq)
    if torch.device(device).type == "meta":
        return tuple(torch.empty(shape, dtype=torch.int64, device=device) for _ in range(2))
    stream = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return stream[:, :-1].contiguous().to(device), stream[:, 1:].contiguous().to(device)


def megatron_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Megatron's cross-entropy, over the logits in fp32 whatever the compute dtype: Megatron-LM
    2021 called ``vocab_parallel_cross_entropy(output.float(), labels)`` (gpt_model.py, unless
    --fp16-lm-cross-entropy), Megatron-Core casts inside it (megatron/core/tensor_parallel/
    cross_entropy.py, ``VocabParallelCrossEntropy.calculate_logits_max``)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1))


def dropout(x: torch.Tensor) -> torch.Tensor:
    """Dropout's passes over the data, as its kernel runs them: forward writes a keep mask of one
    byte per element and the product; backward reads the saved mask again (all ones here: the
    values do not matter to planning)."""
    return x * torch.ones_like(x, dtype=torch.bool)


class UnfusedAttention(nn.Module):
    """Megatron-LM's self-attention before FlashAttention: a fused QKV projection, explicit scores."""

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.register_buffer("future", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its heads
        q, k, v = self.qkv(x).view(batch, seq, -1, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        scores = torch.matmul(q * (1 / math.sqrt(self.head_dim)), k.transpose(-2, -1))
        scores = scores.masked_fill(self.future[:seq, :seq], float("-inf"))
        probs = dropout(torch.softmax(scores, dim=-1))
        out = torch.matmul(probs, v).transpose(1, 2).reshape(batch, seq, -1)
        return self.proj(out)


class Residual(nn.Module):
    """``x + branch``, the branch dropped out first where ``dropped``: a module of its own, so that a
    row can pin where the residual stream lives (whole on every tensor-parallel rank, or split along
    the sequence under sequence parallelism: ``published_rows.options_for``)."""

    def __init__(self, dropped: bool = False) -> None:
        super().__init__()
        self.dropped = dropped

    def forward(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        return x + (dropout(branch) if self.dropped else branch)


class MegatronBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, seq: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = UnfusedAttention(hidden, heads, seq)
        self.attn_residual = Residual(dropped=True)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.mlp_residual = Residual(dropped=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_residual(x, self.attn(self.attn_norm(x)))
        return self.mlp_residual(x, self.fc2(F.gelu(self.fc1(self.mlp_norm(x)))))


class MegatronGPT(nn.Module):
    """``forward(tokens, labels) -> mean cross-entropy``; the output layer is the token embedding."""

    def __init__(self, *, hidden: int, layers: int, heads: int, vocab: int, seq: int, ffn: int) -> None:
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.pos_embeddings = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(MegatronBlock(hidden, heads, ffn, seq) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        for layer in self.layers:
            h = layer(h)
        return megatron_loss(F.linear(self.norm(h), self.tok_embeddings.weight), labels)

    def example_inputs(self, batch_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        return _inputs(self.vocab, self.seq, batch_size, device or self.tok_embeddings.weight.device)


def megatron_gpt(*, hidden: int, layers: int, heads: int, vocab: int, seq: int, ffn: int | None = None) -> MegatronGPT:
    """Megatron-LM's GPT as its 2021-22 runs computed it (see the module docstring).

    >>> with torch.device("meta"):
    ...     model = megatron_gpt(hidden=2304, layers=24, heads=24, vocab=51200, seq=2048)
    """
    return MegatronGPT(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, ffn=ffn or 4 * hidden)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GroupedAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim, self.repeats = hidden // heads, heads // kv_heads
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.repeats > 1)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class LlamaBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = GroupedAttention(hidden, heads, kv_heads)
        self.attn_residual = Residual()
        self.mlp_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.mlp_residual = Residual()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_residual(x, self.attn(self.attn_norm(x)))
        h = self.mlp_norm(x)
        return self.mlp_residual(x, self.down(F.silu(self.gate(h)) * self.up(h)))


class Llama(nn.Module):
    def __init__(self, *, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaBlock(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.output(self.norm(h)).flatten(0, 1), labels.flatten(0, 1))

    def example_inputs(self, batch_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        return _inputs(self.vocab, self.seq, batch_size, device or self.output.weight.device)


def llama(*, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> Llama:
    """Llama 3's architecture at the given shapes (see the module docstring).

    >>> with torch.device("meta"):
    ...     model = llama(hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248, vocab=128256, seq=8192)
    """
    return Llama(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq=seq)


def fused_gpt(
    *, hidden: int, layers: int, heads: int, vocab: int, seq: int, ffn: int | None = None, tied: bool = False
) -> nn.Module:
    """``examples/gpt.py``: a GPT whose attention is one fused (flash) kernel; its loss over fp32
    logits (Megatron's; torch autocast's too); ``tied``: the output layer is the token embedding (MPT)."""
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, ffn=ffn)
    model.loss = megatron_loss  # the example's forward ends in self.loss(logits, labels)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    return model


BUILDERS = {"megatron-gpt": megatron_gpt, "gpt": fused_gpt, "llama": llama}


def build(kind: str, shapes: dict) -> nn.Module:
    """The model of ``kind`` ("megatron-gpt", "gpt", "llama") with a row's ``shapes``."""
    if kind == "llama":
        keys = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq")
    else:
        keys = ("hidden", "layers", "heads", "vocab", "seq", "ffn")
    extra = {"tied": True} if shapes.get("tied") else {}  # the fused GPT's output layer tied (MPT)
    return BUILDERS[kind](**{key: shapes[key] for key in keys}, **extra)
