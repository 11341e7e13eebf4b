"""Sizes the data decides: the example call's, recorded where torch.export has none.

A model that splits tokens by counts it computes (``x.split(counts.tolist())``: JetMoE's
experts) exports sizes only the data decides, torch.export's *unbacked* symbols (``u12``), each
read from a tensor by an ``item`` node. The graph still runs (each call computes its own
counts), but planning prices and places values by their sizes. So the capture runs the graph
once on the real weights and inputs (as the experts' load is measured:
:func:`autopar.passes.capture.moe.record_expert_load`) and gives every symbol the value it had
then, in each ``meta["val"]``: the graph's nodes still compute each call's sizes.

Every rank must compute the same sizes, or their collectives differ in size (or their programs'
runtime assertions fail): the nodes that read a size from a tensor or make or read a value of
such a size are marked (``meta[DATA_SIZED]``) and run whole on every rank, their inputs
replicated (:func:`autopar.passes.sharding.rules.node_strategies`; the ``item`` nodes, which
output no tensor and have no strategies, get replicated inputs in the plan:
``autopar.passes.search.search._to_plan``). On the meta device nothing runs: a graph with such
sizes there is a :class:`ConfigError` naming the first node that reads one
(:func:`size_readers`).
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_map

from autopar.ir import DATA_SIZED, ConfigError


def record_data_sizes(graph_module: fx.GraphModule, args: list, module_of) -> None:
    """Give the unbacked sizes of ``graph_module``'s values those a run on ``args`` (its
    placeholders' values, in order) makes, and mark the nodes they concern (see the module
    docstring); ``module_of(node)`` names a node's module for the error on the meta device."""
    readers = size_readers(graph_module.graph)
    if not readers:
        return
    if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
        node = readers[0]
        raise ConfigError(
            f"{node.name} ({node.target}) in {module_of(node) or 'the model'} reads a size from the data "
            f"({node.meta['val']}: e.g. tokens per expert), which a model on the meta device cannot compute: plan it "
            "with real weights, or write the experts as autopar recognizes them (passes/capture/moe.py)"
        )
    symbols = {node: node.meta["val"].node.expr for node in readers}
    values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if node in symbols:
                values[symbols[node]] = int(result)
            return result

    with torch.no_grad():
        Recorder(graph_module).run(*args)

    def recorded(value):
        symbolic = isinstance(value, torch.SymInt | torch.SymBool | torch.SymFloat)
        if symbolic and free_unbacked_symbols(value):  # a size, or a check on sizes (u0 + u1 == 8)
            return {torch.SymInt: int, torch.SymBool: bool, torch.SymFloat: float}[type(value)](
                value.node.expr.xreplace(values)
            )
        if isinstance(value, torch.Tensor) and free_unbacked_symbols(value):
            with value.fake_mode:
                shape, stride = [recorded(s) for s in value.shape], [recorded(s) for s in value.stride()]
                return torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
        return value

    for node in graph_module.graph.nodes:
        if node.op == "call_function" and free_unbacked_symbols(node.meta.get("val")):
            for marked in (node, *node.users):
                marked.meta[DATA_SIZED] = True
    for node in graph_module.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = tree_map(recorded, node.meta["val"])


def size_readers(graph: fx.Graph) -> list[fx.Node]:
    """The nodes that read a size from a tensor's values (``item`` of a count: an unbacked symbol)."""
    return [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and isinstance(node.meta.get("val"), torch.SymInt)
        and isinstance(node.meta["val"].node.expr, sympy.Symbol)
        and free_unbacked_symbols(node.meta["val"])
    ]
