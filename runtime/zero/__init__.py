"""ZeRO over the data-parallel axis: the sharded layout and optimizer of stages 1-3 (``layout``),
ZeRO-3 parameter gathers per layer (``gather``) and gradient reduce-scatters (``reduce_scatter``)."""
