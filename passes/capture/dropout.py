"""Dropout: the mask drawn whole, the product split like any elementwise op.

``native_dropout(x, p, train)`` draws its mask from the random stream at ``x``'s shape. On a
shard it would draw another mask than one process draws, so its one exact placement was the
whole tensor on every rank: data parallelism gathered every dropout's input over the batch
(GPT-2's 25 dropouts on 64 simulated GPUs: 0.1 s of communication a step, more than its compute).
Capture splits it in two: the mask, ``native_dropout`` of ones at ``x``'s shape and memory layout
(the stream sees only the shape, layout, dtype and device, so it draws what it draws on ``x``), and
``x`` times it. The mask reads no input: every rank draws it whole, alike, without communication (as a
replicated-only factory), and the product splits like any elementwise op, each rank multiplying
its part of ``x`` by its part of the one-process mask. (Compiled programs draw with inductor's
own random numbers, as before.)

Attention's own dropout (``scaled_dot_product_attention(..., dropout_p > 0)``, BERT's and its kin's
in training) is drawn inside the fused op, per shard where the op is split. While capturing,
:func:`attention_dropout_as_math` has such a call traced as the op's math form (scores, softmax,
``dropout``, values), whose mask is then drawn whole as above; on the CPU that form draws the
mask the fused op draws (the same ``bernoulli`` over the same shape), so one process's result
stands. It holds the whole attention matrix, as the fused op's math path does.

Pre: an exported aten graph whose nodes carry ``meta["val"]``.
Post: each ``native_dropout`` reads a ``ones`` of its shape (permuted to ``x``'s layout where ``x``
is a permuted one); its scaled output is ``mul(x, mask)``.
"""

from __future__ import annotations

import contextlib
import math
import operator

import torch
import torch.fx as fx

from autopar.passes.capture.attention_pattern import new_node

aten = torch.ops.aten


def draw_dropout_masks_whole(graph_module: fx.GraphModule) -> None:
    """Rewrite every ``native_dropout(x, p, train)`` of ``graph_module`` in place (module docstring).

    >>> draw_dropout_masks_whole(exported.graph_module)   # doctest: +SKIP
    """
    graph = graph_module.graph
    for dropout in list(graph.find_nodes(op="call_function", target=aten.native_dropout.default)):
        x = dropout.args[0]
        meta = {key: dropout.meta[key] for key in ("nn_module_stack", "stack_trace") if key in dropout.meta}
        with graph.inserting_before(dropout):
            ones = _ones_laid_out_like(graph, x, meta)
        dropout.replace_input_with(x, ones)
        for user in list(dropout.users):
            if user.target is operator.getitem and user.args[1] == 0 and user.users:
                with graph.inserting_after(user):
                    product = new_node(graph, aten.mul.Tensor, (x, user), meta)
                user.replace_all_uses_with(product, delete_user_cb=lambda node: node is not product)
    graph_module.recompile()


def _ones_laid_out_like(graph: fx.Graph, x: fx.Node, meta: dict) -> fx.Node:
    """Ones of ``x``'s shape laid out in memory as ``x`` is: the mask is drawn in memory order, so
    a transposed ``x`` (nn.MultiheadAttention's output, batch first) draws another mask than a
    contiguous one. A permutation of a contiguous layout is made as ones in memory order, permuted."""
    value = x.meta["val"]
    order = sorted(range(value.dim()), key=lambda d: -value.stride(d))
    permuted = order != list(range(value.dim())) and value.permute(order).is_contiguous()
    shape = [value.shape[d] for d in order] if permuted else list(value.shape)
    ones = new_node(graph, aten.ones.default, (shape,), meta, like=x, dtype=value.dtype, device=value.device)
    if not permuted:
        return ones
    return new_node(graph, aten.permute.default, (ones, [order.index(d) for d in range(value.dim())]), meta)


@contextlib.contextmanager
def attention_dropout_as_math():
    """While active, ``torch.nn.functional.scaled_dot_product_attention`` with a dropout runs its
    math form, its dropout an ``F.dropout`` of the probabilities (module docstring); without one,
    the fused op as before."""
    fused = torch.nn.functional.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not dropout_p:
            return fused(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa:  # each key and value head serves a group of query heads
            key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
            value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
        scores = query @ key.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(query.shape[-1]))
        if is_causal:
            attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        elif attn_mask is not None:
            scores = scores + attn_mask
        return torch.nn.functional.dropout(scores.softmax(-1), dropout_p) @ value

    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = fused
