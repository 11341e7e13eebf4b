"""Parallel kernels: ring and Ulysses context-parallel attention (``context_parallel``), the
head-and-tail sequence layout they run on (``zigzag``), expert-parallel MoE (``expert_parallel``),
the embedding and cross-entropy over a split vocabulary (``vocab_parallel``), the linears of an
all-gathered input that keep only its shard for backward (``gathered_linear``); and a model's
recurrences over time, its gated delta rule and its selective scan, as one op each (``recurrences``)."""
