"""The chunked gated delta rule (Qwen3-Next's linear attention, and its kin's) as one op:
``autopar::gated_delta_rule``.

Without its fused kernels (flash-linear-attention's), a model computes the rule with a Python
loop over 64-token chunks, which torch.export unrolls: Qwen3-Next's default configuration captured
as 84,520 nodes, and every chunk of a layer reads the layer's chunked q, k, v and decay, a graph
too wide for the search to solve quickly. Captured as one op
(:func:`autopar.passes.capture.recurrences.composite_recurrences`), the rule is one node per layer.

Its math is exactly the model's own function (``source``: the module that defines it, which picks
flash-linear-attention's kernel where it is installed), called on this rank's tensors. The rule is
independent over the batch and over heads, so a rank holding a batch shard or a head shard of
every input computes that shard of the output (:func:`autopar.passes.sharding.composite.recurrence`).
Backward keeps only the inputs, as a fused kernel's does: it runs the function again under
autograd and takes its vector-Jacobian product.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

FUNCTION = "torch_chunk_gated_delta_rule"  # the name transformers' models give their torch path
ORIGINAL = "__autopar_original__"  # on capture's stand-in: the function it stands in for


def reference(source: str):
    """The model's own chunked rule: ``source``'s :data:`FUNCTION` (while capture has put its
    stand-in there, the function it stands in for)."""
    function = getattr(importlib.import_module(source), FUNCTION)
    return getattr(function, ORIGINAL, function)


@torch.library.custom_op("autopar::gated_delta_rule", mutates_args=())
def gated_delta_rule(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int, l2norm: bool, source: str
) -> Tensor:
    """The gated delta rule over q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], decay ``g`` and ``beta``
    [B, T, Hv], from a zero state: the output [B, T, Hv, Dv] in the query's dtype. Example::

        source = "transformers.models.qwen3_next.modeling_qwen3_next"
        out = torch.ops.autopar.gated_delta_rule(q, k, v, g, beta, 64, True, source)
    """
    return _rule(query, key, value, g, beta, chunk_size, l2norm, source).contiguous()


def _rule(query, key, value, g, beta, chunk_size: int, l2norm: bool, source: str) -> Tensor:
    out, _ = reference(source)(query, key, value, g=g, beta=beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=l2norm)
    return out


@gated_delta_rule.register_fake
def _(query, key, value, g, beta, chunk_size, l2norm, source):
    return value.new_empty(value.shape, dtype=query.dtype)


@torch.library.custom_op("autopar::gated_delta_rule_backward", mutates_args=())
def gated_delta_rule_backward(
    grad: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int,
    l2norm: bool,
    source: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of q, k, v, g and beta: the rule run again under autograd, its VJP with ``grad``."""
    inputs = (query, key, value, g, beta)
    _, vjp = torch.func.vjp(lambda *tensors: _rule(*tensors, chunk_size, l2norm, source), *inputs)
    return tuple(g.contiguous() for g in vjp(grad))  # in the layout the fake kernel promises


@gated_delta_rule_backward.register_fake
def _(grad, query, key, value, g, beta, chunk_size, l2norm, source):
    return tuple(t.new_empty(t.shape) for t in (query, key, value, g, beta))


def _save_inputs(ctx, inputs, output):
    *tensors, chunk_size, l2norm, source = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = chunk_size, l2norm, source


def _backward(ctx, grad):
    return (*gated_delta_rule_backward(grad, *ctx.saved_tensors, *ctx.options), None, None, None)


gated_delta_rule.register_autograd(_backward, setup_context=_save_inputs)
