"""BatchNorm in training, as the means and products it computes: synchronized batch norm for free.

Export lowers a training BatchNorm to one op, ``_native_batch_norm_legit_functional`` (with
running statistics; ``_native_batch_norm_legit.no_stats`` without), which no sharding rule can
split along the batch: the statistics are over the whole batch. Decomposed into its two means
(of the input, and of its centred square) and pointwise ops, the batch splits like any other
dim: each mean over a split batch is a partial average, summed over the ranks before use, which
is what ``torch.nn.SyncBatchNorm`` does by hand (two small all-reduces per norm), and the
statistics are the whole batch's, as one process computes them. The running statistics are
updated from them as ``nn.BatchNorm`` does (the variance unbiased), outside autograd.

Decomposed nodes keep the BatchNorm op as ``meta["original_aten"]`` (torch.export's record):
:func:`autopar.passes.rewrite.stages.whole_batch_node` finds them there, since a batch run in
microbatches would take each microbatch's statistics instead.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _normalized(input: torch.Tensor, weight, bias, eps: float):
    """The input normalized by its batch statistics (per channel, dim 1), with the affine
    parameters; its reciprocal standard deviation, mean and biased variance."""
    dims = [0, *range(2, input.dim())]
    shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
    mean = input.mean(dims)
    centered = input - mean.view(shape)
    variance = (centered * centered).mean(dims)
    return _normalized_by(centered, torch.rsqrt(variance + eps), weight, bias, shape) + (mean, variance)


def _normalized_by(centered, rstd, weight, bias, shape):
    out = centered * rstd.view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out, rstd


def _with_running_statistics(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:  # normalized by the running statistics: per example, nothing to synchronize
        shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
        rstd = torch.rsqrt(running_var + eps)
        out, _ = _normalized_by(input - running_mean.view(shape), rstd, weight, bias, shape)
        return out, running_mean, rstd, running_mean, running_var
    out, rstd, mean, variance = _normalized(input, weight, bias, eps)
    count = input.numel() // input.shape[1]
    new_mean = running_mean * (1 - momentum) + mean.detach() * momentum
    new_var = running_var * (1 - momentum) + variance.detach() * (momentum * count / max(count - 1, 1))
    return out, mean, rstd, new_mean, new_var


def _without_running_statistics(input, weight, bias, training, momentum, eps):
    out, rstd, mean, _ = _normalized(input, weight, bias, eps)
    return out, mean, rstd


BATCH_NORM_DECOMPOSITIONS = {
    aten._native_batch_norm_legit_functional.default: _with_running_statistics,
    aten._native_batch_norm_legit.no_stats: _without_running_statistics,
}
