"""A model's recurrences over time as one op each: the chunked gated delta rule (Qwen3-Next's linear
attention, and its kin's) as ``autopar::gated_delta_rule``, Mamba's selective scan as
``autopar::selective_scan``, Griffin's linear recurrence (Recurrent Gemma) as
``autopar::linear_recurrence``.

Without their fused kernels (flash-linear-attention's, mamba_ssm's), a model computes these with a
Python loop (over 64-token chunks; over every token), which torch.export unrolls: Qwen3-Next's
default configuration captured as 84,520 nodes, and Mamba's 4096 steps in each of 64 layers do not
capture in any time a search can wait. Captured as one op
(:func:`autopar.passes.capture.recurrences.composite_recurrences`), each is one node per layer.

The first two ops' math is exactly the model's own function (``source``: the module that defines
it, which picks the fused kernel where it is installed), called on this rank's tensors; the linear
recurrence's, a method in the model, is written here as its loop runs it. All are independent over
the batch and over heads (channels), so a rank holding a batch or head shard of every input
computes that shard of the output (:mod:`autopar.passes.sharding.composite`). Backward keeps only
the inputs, as a fused kernel's does: it runs the function again under autograd and takes its
vector-Jacobian product (the linear recurrence: its states again, then its gradient back in time).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

DELTA_RULE = "torch_chunk_gated_delta_rule"  # the names transformers' models give their torch paths
SELECTIVE_SCAN = "mamba_selective_scan"
ORIGINAL = "__autopar_original__"  # on capture's stand-in: the function it stands in for


def reference(source: str, name: str):
    """The model's own function ``name`` in module ``source`` (while capture has put its stand-in
    there, the function it stands in for)."""
    function = getattr(importlib.import_module(source), name)
    return getattr(function, ORIGINAL, function)


def _vjp(function, inputs: tuple[Tensor, ...], grad: Tensor) -> tuple[Tensor, ...]:
    """The gradients of ``inputs``: ``function`` run again under autograd, its VJP with ``grad``,
    each contiguous (the layout the backward ops' fake kernels promise)."""
    _, vjp = torch.func.vjp(function, *inputs)
    return tuple(g.contiguous() for g in vjp(grad))


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
    rule = reference(source, DELTA_RULE)
    out, _ = rule(query, key, value, g=g, beta=beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=l2norm)
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
    """The gradients of q, k, v, g and beta."""
    return _vjp(lambda *tensors: _rule(*tensors, chunk_size, l2norm, source), (query, key, value, g, beta), grad)


@gated_delta_rule_backward.register_fake
def _(grad, query, key, value, g, beta, chunk_size, l2norm, source):
    return tuple(t.new_empty(t.shape) for t in (query, key, value, g, beta))


@torch.library.custom_op("autopar::selective_scan", mutates_args=())
def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    z: Tensor,
    delta_bias: Tensor,
    softplus: bool,
    mambapy: bool,
    source: str,
) -> Tensor:
    """Mamba's selective scan over u, delta, z [batch, D, T] with A [D, N], B, C [batch, N, T], D and
    delta_bias [D], from a zero state: the gated output [batch, D, T] (in the dtype the model's
    function gives, :func:`scan_dtype`). ``mambapy``: the model's choice of mambapy's parallel scan
    where it is installed. Example::

        source = "transformers.models.mamba.modeling_mamba"
        out = torch.ops.autopar.selective_scan(u, delta, A, B, C, D, z, bias, True, False, source)
    """
    return _scan(u, delta, A, B, C, D, z, delta_bias, softplus, mambapy, source).contiguous()


def _scan(u, delta, A, B, C, D, z, delta_bias, softplus: bool, mambapy: bool, source: str) -> Tensor:
    scan = reference(source, SELECTIVE_SCAN)
    return scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=softplus, use_mambapy=mambapy)


def scan_dtype(u: Tensor, D: Tensor, z: Tensor) -> torch.dtype:
    """The output dtype of the scan: its states read out in u's dtype, plus u·D, times silu(z)."""
    return torch.promote_types(torch.promote_types(u.dtype, D.dtype), z.dtype)


@selective_scan.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, softplus, mambapy, source):
    return u.new_empty(u.shape, dtype=scan_dtype(u, D, z))


@torch.library.custom_op("autopar::selective_scan_backward", mutates_args=())
def selective_scan_backward(
    grad: Tensor,
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    z: Tensor,
    delta_bias: Tensor,
    softplus: bool,
    mambapy: bool,
    source: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of u, delta, A, B, C, D, z and delta_bias."""
    inputs = (u, delta, A, B, C, D, z, delta_bias)
    return _vjp(lambda *tensors: _scan(*tensors, softplus, mambapy, source), inputs, grad)


@selective_scan_backward.register_fake
def _(grad, u, delta, A, B, C, D, z, delta_bias, softplus, mambapy, source):
    return tuple(t.new_empty(t.shape) for t in (u, delta, A, B, C, D, z, delta_bias))


def _keep_inputs(options: int):
    """An op's autograd context: its tensors saved, its last ``options`` arguments kept as they are."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:-options])
        ctx.options = inputs[-options:]

    return setup_context


def _gradients_through(backward_op, options: int):
    def backward(ctx, grad):
        return (*backward_op(grad, *ctx.saved_tensors, *ctx.options), *[None] * options)

    return backward


@torch.library.custom_op("autopar::linear_recurrence", mutates_args=())
def linear_recurrence(x: Tensor, a: Tensor) -> Tensor:
    """Griffin's linear recurrence over x, a [batch, T, width] (Recurrent Gemma's RG-LRU,
    ``_rnn_scan`` in its linear mode, reset already folded into a): h_t = a_t·h_(t-1) + x_t from a zero
    state, accumulated in float32 and read out in x's dtype. The model's is a method, so its math is
    written here, step for step as the model's loop does it. Example::

        h = torch.ops.autopar.linear_recurrence(x, a)
    """
    return _states(x, a).to(x.dtype)


def _states(x: Tensor, a: Tensor) -> Tensor:
    """The float32 states h_t of :func:`linear_recurrence`, [batch, T, width]."""
    states = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    state = torch.zeros(x[:, 0].shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[1]):
        state = a[:, t].to(torch.float32) * state + x[:, t].to(torch.float32)
        states[:, t] = state
    return states


@linear_recurrence.register_fake
def _(x, a):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("autopar::linear_recurrence_backward", mutates_args=())
def linear_recurrence_backward(grad: Tensor, x: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of x and a: the states again (only the inputs are kept), then back in time,
    the state's gradient g_t = dy_t + a_(t+1)·g_(t+1) giving dx_t = g_t and da_t = g_t·h_(t-1)."""
    states = _states(x, a)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    da = torch.zeros(a.shape, dtype=a.dtype, device=a.device)  # h_(-1) = 0: nothing reaches a_0
    g = torch.zeros(x[:, 0].shape, dtype=torch.float32, device=x.device)
    for t in reversed(range(x.shape[1])):
        g = grad[:, t].to(torch.float32) + (a[:, t + 1].to(torch.float32) * g if t + 1 < x.shape[1] else 0)
        dx[:, t] = g
        if t > 0:
            da[:, t] = g * states[:, t - 1]
    return dx, da


@linear_recurrence_backward.register_fake
def _(grad, x, a):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        a, memory_format=torch.contiguous_format
    )


gated_delta_rule.register_autograd(_gradients_through(gated_delta_rule_backward, 3), setup_context=_keep_inputs(3))
selective_scan.register_autograd(_gradients_through(selective_scan_backward, 3), setup_context=_keep_inputs(3))
linear_recurrence.register_autograd(
    lambda ctx, grad: linear_recurrence_backward(grad, *ctx.saved_tensors),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs),
)
