"""Capture: a model and example inputs → an aten-level fx graph with module paths (``graph``),
its eager attention fused into SDPA (``attention_pattern``, ``causal_mask``) and its
mixture-of-experts blocks made one ``autopar.moe`` node each (``moe``), a linear-attention
layer's chunked gated delta rule one ``autopar.gated_delta_rule`` node (``recurrences``)."""
