"""Models of the bad-input table (tests/helpers/bad_inputs.py): each holds a construct a model
family has (sizes the data decides, a configuration value left unset, sizes that disagree, fewer
positions than a call has) and fails where the table says, as that family does."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class SplitByCounts(torch.nn.Module):
    """Rows split into two groups by a count computed from the data (a router's choice)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        chosen = x[:, 0] > 0
        counts = torch.stack([chosen.sum(), (~chosen).sum()]).tolist()
        first, rest = (x * self.weight)[chosen.argsort(descending=True)].split(counts)
        return first.sum() - rest.sum()


class UnsetTopK(torch.nn.Module):
    """A router whose configuration leaves ``top_k`` unset (Hugging Face's DeepSeek-V2 default)."""

    top_k = None

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.topk(self.gate(x), k=self.top_k, dim=-1).values.sum()


class RotaryTooShort(torch.nn.Module):
    """Heads of 8 dimensions rotated by a table of 4 (a configuration whose head and rotary sizes disagree)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos", torch.ones(4))

    def forward(self, x):
        return (x.view(x.shape[0], 2, 8) * self.cos).sum()


class OffsetPositions(torch.nn.Module):
    """A config of 8 positions whose table starts past its padding index (row 0), as ProphetNet's:
    it holds 7, and a call of 8 tokens adds 7 rows to 8 tokens."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=8)
        self.embed = torch.nn.Embedding(64, 4)
        self.positions = torch.nn.Parameter(torch.randn(8, 4))

    def forward(self, input_ids):
        return (self.embed(input_ids) + self.positions[1 : input_ids.shape[1] + 1]).square().mean()


class LearnedPositions(torch.nn.Module):
    """A table of learned positions looked up at ``arange`` over the sequence, as GPT-2's ``wpe``."""

    def __init__(self, positions: int):
        super().__init__()
        self.wpe = torch.nn.Embedding(positions, 4)

    def forward(self, x):
        return (x + self.wpe(torch.arange(x.shape[1]))).square().mean()


def gpt_neo(positions: int):
    """A small GPT-Neo from its config: a causal-mask buffer of ``positions`` x ``positions``."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    config = GPTNeoConfig(
        vocab_size=64, max_position_embeddings=positions, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=4, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)
