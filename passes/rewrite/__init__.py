"""From a plan to the programs ranks run: which gradients to complete (``gradients``), the
per-rank program with its collectives (``rewrite``), activation recomputation (``recompute``),
the split into pipeline stages (``stages``) and ``autopar export`` (``export``)."""
