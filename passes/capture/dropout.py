"""Dropout: the mask drawn whole, the product split like any elementwise op.

``native_dropout(x, p, train)`` draws its mask from the random stream at ``x``'s shape. On a
shard it would draw another mask than one process draws, so its one exact placement was the
whole tensor on every rank: data parallelism gathered every dropout's input over the batch
(GPT-2's 25 dropouts on 64 simulated GPUs: 0.1 s of communication a step, more than its compute).
Capture splits it in two: the mask, ``native_dropout`` of ones at ``x``'s shape (the stream sees
only the shape, dtype and device, so it draws what it draws on ``x``), and ``x`` times it. The
mask reads no input: every rank draws it whole, alike, without communication (as a
replicated-only factory), and the product splits like any elementwise op, each rank multiplying
its part of ``x`` by its part of the one-process mask. (Compiled programs draw with inductor's
own random numbers, as before.)

Pre: an exported aten graph whose nodes carry ``meta["val"]``.
Post: each ``native_dropout`` reads a ``ones`` of its shape; its scaled output is ``mul(x, mask)``.
"""

from __future__ import annotations

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
        value = x.meta["val"]
        meta = {key: dropout.meta[key] for key in ("nn_module_stack", "stack_trace") if key in dropout.meta}
        with graph.inserting_before(dropout):
            shape = (list(value.shape),)
            ones = new_node(graph, aten.ones.default, shape, meta, like=x, dtype=value.dtype, device=value.device)
        dropout.replace_input_with(x, ones)
        for user in list(dropout.users):
            if user.target is operator.getitem and user.args[1] == 0 and user.users:
                with graph.inserting_after(user):
                    product = new_node(graph, aten.mul.Tensor, (x, user), meta)
                user.replace_all_uses_with(product, delete_user_cb=lambda node: node is not product)
    graph_module.recompile()
