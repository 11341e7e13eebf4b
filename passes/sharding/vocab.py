"""Rules of the ops indexed by a vocabulary: embedding lookups and classification losses.

Besides splitting their batch, both may split the vocabulary itself over the tensor-parallel
axis, as Megatron-LM and torchtitan do, with the ``vocab`` kernel
(:mod:`autopar.runtime.kernels.vocab_parallel`):

- ``embedding(weight [V, H], ids)`` with the table split by rows, ids whole: each rank looks up
  the ids in its range, zeros elsewhere, so the output is a partial sum (completed on its edge
  by an all-reduce, or a reduce-scatter into sequence parallelism);
- ``cross_entropy_loss(logits [N, V], target [N])`` with the class dim split (the output
  projection split by columns before it): log-softmax by max and sum all-reduces, the target
  logit taken on the rank that owns it, so no rank holds the full logits; the loss comes out whole.
"""

from __future__ import annotations

from autopar.ir import Kernel, Partial, Replicate, Shard
from autopar.passes.sharding.strategies import OpView, Strategy

R = Replicate()


def embedding(view: OpView) -> list[Strategy]:
    """Look up rows of W by index: shard the indices (output follows) or W's columns; or W's rows
    (the vocabulary) with the indices whole, as the ``vocab`` kernel, giving partial sums.

    ``scale_grad_by_freq`` and ``sparse`` keep the vocabulary whole: their gradients are not
    the per-rank lookups' (the kernel runs the dense gradient).
    """
    weight_ndim, idx_ndim = len(view.in_shapes[0]), len(view.in_shapes[1])
    strategies = [Strategy((R, Shard(d)), Shard(d)) for d in range(idx_ndim)]
    strategies.append(Strategy((Shard(weight_ndim - 1), R), Shard(idx_ndim)))
    if weight_ndim == 2 and not view.arg(3, "scale_grad_by_freq", False) and not view.arg(4, "sparse", False):
        strategies.append(Strategy((Shard(0), R), Partial(), Kernel.VOCAB))
    return strategies


def loss(view: OpView) -> list[Strategy]:
    """cross_entropy / nll_loss(input [N, C, ...], target [N, ...]): shard N or a trailing dim.

    A mean over a sharded dim is the average of the shards' means (P(avg)); the rewrite makes
    each shard's value its sum over the global count of targets not ignored, times the shard
    count, so the average is exact however the ignored targets fall. With class weights a mean
    divides by the targets' total weight, which differs from shard to shard: no split then.
    """
    reduction = view.arg(3, "reduction", 1)
    if reduction == 1 and view.arg(2, "weight", None) is not None:
        return []
    in_ndim = len(view.in_shapes[0])
    out = {0: None, 1: Partial("avg"), 2: Partial("sum")}[reduction]
    strategies = []
    for d in [0] + list(range(2, in_ndim)):
        target_dim = 0 if d == 0 else d - 1
        placements = (Shard(d), Shard(target_dim)) + (R,) * (len(view.in_shapes) - 2)
        strategies.append(Strategy(placements, out or Shard(target_dim)))
    return strategies


def cross_entropy(view: OpView) -> list[Strategy]:
    """:func:`loss`, and the class dim of [N, C] logits split with the targets whole (the
    ``vocab`` kernel: the loss, of any reduction, comes out whole). Class weights keep C whole."""
    strategies = loss(view)
    logits, *others = view.in_shapes
    if len(logits) == 2 and len(others) == 1 and len(others[0]) == 1:  # no weight slot
        strategies.append(Strategy((Shard(1), R), R, Kernel.VOCAB))
    return strategies
