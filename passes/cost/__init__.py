"""The cost model: per-node facts (``facts``), op, collective and memory costs (``ops``), GEMM
and attention efficiency from shapes on GPU profiles (``efficiency``), what overlaps hide
(``overlap``), the parallel kernels (``kernels``), whole-layer techniques (``schedule``:
recomputation, microbatches, pipeline bubbles), a configuration's prediction (``evaluate``),
costs symbolic in batch and sequence (``symbolic``) and the fit of measured profiles
(``calibration``)."""
