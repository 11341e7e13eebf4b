"""Parallel kernels: ring and Ulysses context-parallel attention (``context_parallel``), the
head-and-tail sequence layout they run on (``zigzag``), expert-parallel MoE (``expert_parallel``),
the embedding and cross-entropy over a split vocabulary (``vocab_parallel``)."""
