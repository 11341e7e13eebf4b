"""The loss alone: a rank's program returning only its first output, the scalar loss.

Pre: a program of :func:`rewrite` (or a captured graph) whose outputs may hold more than the
loss (a Hugging Face model returns its logits too, gathered whole on every rank).
Post: :func:`loss_only` gives a program with one output, the first, and without the nodes
only the others needed (the logits' gather), or ``None`` when the first output is not a
scalar (a model returning logits computes no loss). ``train_step`` runs it, and pipelines
split it into stages, so neither pays for outputs nobody reads.

Over microbatches a mean loss is exact only if each microbatch's mean weighs as many targets as
it counts (a microbatch of padding counts fewer): :func:`loss_count` gives the part of the loss
program that counts them (what the mean divides by, from the inputs alone), which the runtime
runs on every microbatch first and weighs each one's loss by its share (HF's
``num_items_in_batch``, torchtitan's global valid tokens).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.ir import LOSS_COUNT

aten = torch.ops.aten
# Between the mean and the program's output: its cast back to a 16-bit dtype, a view of it, the
# reduction over the shards that split the targets (the loss's own all-reduce)
_PASSED = (aten._to_copy.default, aten.reshape.default, aten.view.default, torch.ops.autopar.all_reduce.default)


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


def loss_count(program: fx.GraphModule) -> LossCount | None:
    """What the loss ``program`` (one scalar output) divides its sum by: the targets it counts
    (summed over the shards that split them), as a :class:`LossCount`, or None where the loss is
    not such a mean (:data:`LOSS_COUNT`, marked by the rewrite over microbatches)."""
    (loss,) = program.graph.output_node().args[0]
    while loss.op == "call_function" and loss.target in _PASSED:
        loss = loss.args[0]
    if loss.target is not aten.div.Tensor or not loss.args[1].meta.get(LOSS_COUNT):
        return None
    return LossCount(program, loss.args[1])


class LossCount:
    """Counts the targets of many microbatches: each one's local count (the nodes of the loss
    program that compute it, run on that microbatch's values of the placeholders it ``reads``: the
    targets, any class weights), then the program's own sums over the shards, for all at once."""

    def __init__(self, program: fx.GraphModule, count: fx.Node):
        self.reductions = []  # (group, op) of each all-reduce after the local count, in order
        while count.target is torch.ops.autopar.all_reduce.default:
            self.reductions.insert(0, count.args[1:])
            count = count.args[0]
        cone, stack = set(), [count]
        while stack:
            node = stack.pop()
            if node not in cone:
                cone.add(node)
                stack.extend(node.all_input_nodes)
        graph, env = fx.Graph(), {}
        for node in program.graph.nodes:
            if node in cone:
                env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(env[count])
        self.local = fx.GraphModule(program, graph)
        self.reads = tuple(node.name for node in graph.find_nodes(op="placeholder"))
        self.placeholders = tuple(node.name for node in program.graph.find_nodes(op="placeholder"))  # the program's

    def shares(self, pieces: list[dict[str, torch.Tensor]]) -> list[float]:
        """Each microbatch's weight in the step's mean loss, its share of the step's targets, for the
        microbatches whose placeholder values are ``pieces``."""
        counts = torch.stack([self.local(*(values[name] for name in self.reads)) for values in pieces])
        for reduction in self.reductions:
            counts = torch.ops.autopar.all_reduce.default(counts, *reduction)
        return (counts / counts.sum()).tolist()
