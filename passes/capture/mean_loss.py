"""Mean cross-entropy as a sum over a count, so that it stays exact however the batch is split.

``cross_entropy(reduction="mean", ignore_index=i)`` divides by the number of targets that are
not ``i``. Split over the batch, each shard's mean divides by its own count, and the mean of
the shards' means is the whole batch's mean only when every shard counts as many targets: not
so when padding is labelled -100 (Hugging Face models also label each row's last position
-100, after the shift). Written as ``cross_entropy(reduction="sum") / sum(target != i)``, the
numerator and the denominator are both sums over the batch, which split into partial sums:
the loss is the whole batch's under any split.

Pre: a captured graph whose nodes carry ``meta["val"]``.
Post: every unweighted ``aten.cross_entropy_loss`` with mean reduction and no label smoothing
is that sum over that count (nodes with ``meta["val"]`` and the original's module path);
the value is the same up to rounding.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
MEAN, SUM = 1, 2  # torch's reduction enum (none 0, mean 1, sum 2)
_DEFAULTS = (None, MEAN, -100, 0.0)  # weight, reduction, ignore_index, label_smoothing


def split_mean_cross_entropy(graph_module: fx.GraphModule) -> int:
    """Rewrite each mean cross-entropy of ``graph_module`` in place; returns how many.

    >>> split_mean_cross_entropy(capture(model, inputs).graph_module)   # doctest: +SKIP
    1
    """
    graph, count = graph_module.graph, 0
    for node in list(graph.nodes):
        if node.target is not aten.cross_entropy_loss.default:
            continue
        names = ("weight", "reduction", "ignore_index", "label_smoothing")
        weight, reduction, ignore, smoothing = (
            node.args[2 + i] if len(node.args) > 2 + i else node.kwargs.get(name, _DEFAULTS[i])
            for i, name in enumerate(names)
        )
        if weight is not None or reduction != MEAN or smoothing != 0.0:
            continue
        logits, target = node.args[:2]
        with graph.inserting_before(node):
            total = _call(graph, node, aten.cross_entropy_loss.default, (logits, target, None, SUM, ignore))
            counted = _call(graph, node, aten.ne.Scalar, (target, ignore))
            targets = _call(graph, node, aten.sum.default, (counted,))
            mean = _call(graph, node, aten.div.Tensor, (total, targets))
        node.replace_all_uses_with(mean)
        graph.erase_node(node)
        count += 1
    if count:
        graph_module.recompile()
    return count


def _call(graph: fx.Graph, like: fx.Node, target, args: tuple) -> fx.Node:
    """A node computing ``target(*args)``, its value traced on the inputs' fake values, in
    ``like``'s module."""
    node = graph.call_function(target, args)
    values = [arg.meta["val"] if isinstance(arg, fx.Node) else arg for arg in args]
    node.meta = {key: value for key, value in like.meta.items() if key != "val"}
    node.meta["val"] = target(*values)
    return node
