"""The loss alone: a rank's program returning only its first output, the scalar loss.

Pre: a program of :func:`rewrite` (or a captured graph) whose outputs may hold more than the
loss (a Hugging Face model returns its logits too, gathered whole on every rank).
Post: :func:`loss_only` gives a program with one output, the first, and without the nodes
only the others needed (the logits' gather), or ``None`` when the first output is not a
scalar (a model returning logits computes no loss). ``train_step`` runs it, and pipelines
split it into stages, so neither pays for outputs nobody reads.
"""

from __future__ import annotations

import torch
import torch.fx as fx


def loss_only(program: fx.GraphModule) -> fx.GraphModule | None:
    """``program`` with its first output alone, or None if that is not a scalar.

    >>> loss_only(torch.fx.symbolic_trace(lambda x: (x.sum(), x))) is not None  # doctest: +SKIP
    True
    """
    graph = fx.Graph()
    outputs = graph.graph_copy(program.graph, {})
    loss = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    if first_output_shape(loss) != ():
        return None
    graph.output((loss,))
    graph.eliminate_dead_code()
    return fx.GraphModule(program, graph)


def first_output_shape(node) -> tuple | None:
    """The traced shape of ``node``'s value, looking through inserted collectives (which keep the
    shape of their first argument and carry no traced value); None when unknown."""
    while isinstance(node, fx.Node) and "val" not in node.meta and node.args:
        node = node.args[0]
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None
