"""Zero-bubble pipelines, compiled: a stage's backward graph split into an input pass and a weight pass.

A zero-bubble schedule runs each microbatch's backward in two: the input gradients the previous
stage waits for, then, later and into the bubble, the weight gradients. torch's schedules split
an eager backward by walking autograd's graph; a compiled stage's backward is one autograd node
running one graph, so the split is made in that graph (torchtitan's graph trainer splits it so
too): AOTAutograd's backward graph is cut into what the input gradients need (the node's
backward, returning no weight gradients) and the rest (the weight pass, run when the schedule
says, from the values the first part kept for it).

:class:`WeightPasses` is one compiled stage's: its inductor backend (``wrap``) makes the split,
and each backward leaves its weight pass for the pipeline stage's ``dw_builder`` to take right
after (:meth:`take`), so the schedule's W action runs it. (torch's schedules also run one input
pass on their first step to learn the gradients' shapes; its weight pass is never taken.)

Example::

    passes = WeightPasses(weights=("param_0", "param_1"))
    run = torch.compile(program, backend=passes.wrap(inductor_backend), fullgraph=True)
    loss = run(*params, x); loss.backward()     # input gradients only
    weight_grads = passes.take()()               # {"param_0": grad, "param_1": grad}
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir import CompileError


class WeightPasses:
    """The weight passes of one compiled program whose placeholders ``weights`` are the weights."""

    def __init__(self, weights: tuple[str, ...]):
        self.weights = frozenset(weights)
        self.last: Callable[[], dict] | None = None  # the weight pass the last backward left
        self._inputs = 0  # the compiled graph's inputs, each with its gradient out of backward
        self._outputs: dict[int, str] = {}  # backward output position -> the weight it is the gradient of

    def wrap(self, backend: Callable) -> Callable:
        """``backend(gm, example_inputs, split=...)`` (inductor with its options bound:
        ``autopar.runtime.compile._locked_inductor``) made to split each backward graph it compiles."""

        def compile_split(graph_module: fx.GraphModule, example_inputs):
            # AOTAutograd's backward returns one gradient per graph input, in Dynamo's order (first use)
            placeholders = graph_module.graph.find_nodes(op="placeholder")
            sources = [getattr(node.meta.get("grapharg"), "source", None) for node in placeholders]
            names = [getattr(source, "local_name", None) for source in sources]
            self._inputs = len(names)
            self._outputs = {k: name for k, name in enumerate(names) if name in self.weights}
            return backend(graph_module, example_inputs, split=self._split)

        return compile_split

    def take(self) -> Callable[[], dict]:
        """The weight pass the last backward left (the schedule's ``dw_builder``): called, it
        returns each weight's gradient by placeholder name."""
        if self.last is None:
            raise CompileError("a weight pass was asked for, but no compiled backward left one")
        run, self.last = self.last, None
        return run

    def _split(self, inner_compile: Callable, graph_module: fx.GraphModule, example_inputs, **kwargs):
        """Compile ``graph_module`` (a backward graph) as its input pass and its weight pass."""
        (grads,) = graph_module.graph.find_nodes(op="output")[0].args
        if len(grads) != self._inputs:  # then which gradient is a weight's is not known
            raise CompileError(
                f"the compiled backward of a zero-bubble stage returns {len(grads)} gradients for {self._inputs} "
                "inputs, so autopar cannot split it into input and weight passes: run this pipeline uncompiled "
                "(compile=False) or on a schedule without a weight pass (pipeline='1f1b' or 'interleaved-1f1b')"
            )
        weight_at = {k: g for k, g in enumerate(grads) if k in self._outputs and isinstance(g, fx.Node)}
        input_at = {k: g for k, g in enumerate(grads) if k not in self._outputs and isinstance(g, fx.Node)}
        cut = _cut(graph_module, list(input_at.values()), list(weight_at.values()))
        first = inner_compile(cut.first, example_inputs, **kwargs)
        kept_examples = [node.meta["val"] for node in cut.kept] + [example_inputs[i] for i in cut.reads]
        static = {key: value for key, value in kwargs.items() if key != "static_input_idxs"}
        second = inner_compile(cut.second, kept_examples, **static)
        names = [self._outputs[k] for k in weight_at]
        return _InputPass(first, second, cut, len(grads), list(input_at), names, self)


@dataclass(frozen=True)
class _Cut:
    """A backward graph cut in two: ``first`` takes every input and returns the input gradients
    then ``kept`` (its values the second part needs); ``second`` takes ``kept`` then the inputs
    at positions ``reads`` and returns the weight gradients."""

    first: fx.GraphModule
    second: fx.GraphModule
    kept: list[fx.Node]
    reads: list[int]


def _cut(graph_module: fx.GraphModule, inputs_grads: list[fx.Node], weight_grads: list[fx.Node]) -> _Cut:
    graph = graph_module.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    first = _ancestors(inputs_grads)
    # ops no output reads but that must run (a collective's side effects): the weight pass runs them
    effects = [n for n in graph.nodes if n.op == "call_function" and n not in first and n.is_impure()]
    second = _ancestors([*weight_grads, *effects]) - first
    kept = [n for n in graph.nodes if n in first and n.op != "placeholder" and any(u in second for u in n.users)]
    kept += [g for g in weight_grads if g in first and g not in kept]  # a weight gradient the input pass made
    reads = [i for i, p in enumerate(placeholders) if p in second or any(u in second for u in p.users)]
    return _Cut(
        _subgraph(graph_module, placeholders, first, [*inputs_grads, *kept]),
        _subgraph(graph_module, [*kept, *(placeholders[i] for i in reads)], second, weight_grads),
        kept,
        reads,
    )


def _ancestors(nodes: list) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _subgraph(graph_module: fx.GraphModule, inputs: list[fx.Node], computed: set, outputs: list) -> fx.GraphModule:
    """The graph taking ``inputs`` (nodes of ``graph_module``) that computes the ``computed``
    nodes, in their order, and returns ``outputs``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in graph_module.graph.nodes:
        if node in computed and node not in env and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(tuple(env[node] for node in outputs))
    return fx.GraphModule(graph_module, graph)


class _InputPass:
    """The compiled backward AOTAutograd calls: runs the input pass, queues the weight pass with
    what it needs, and returns the input gradients (None for the weights)."""

    def __init__(self, first, second, cut: _Cut, outputs: int, input_at: list[int], names: list[str], owner):
        # AOTAutograd hands over its list of inputs (the pass may free them); an instance attribute,
        # which the wrapper AOTAutograd puts around a compiled backward copies
        self._boxed_call = True
        self._first, self._second, self._cut = first, second, cut
        self._outputs, self._input_at, self._names, self._owner = outputs, input_at, names, owner

    def __call__(self, inputs: list):
        read = [inputs[i] for i in self._cut.reads]
        values = self._first(inputs)
        grads, kept = values[: len(self._input_at)], values[len(self._input_at) :]
        self._owner.last = functools.partial(self._weight_pass, [*kept, *read])
        out = [None] * self._outputs
        for position, grad in zip(self._input_at, grads):
            out[position] = grad
        return out

    def _weight_pass(self, inputs: list) -> dict:
        with torch.no_grad():  # as a backward runs (the schedule calls it outside autograd)
            return dict(zip(self._names, self._second(inputs), strict=True))


def adding_weight_gradients(passes: WeightPasses, leaves: Callable[[], dict], weight_of: dict):
    """The W action of the last backward (a pipeline stage's ``dw_builder``): its weight pass,
    the gradients added to the weights' through ``leaves()`` (a 16-bit copy passes them on to its
    master; ``weight_of``: placeholder → leaf name)."""
    run = passes.take()

    def add() -> None:
        grads = run()
        current = leaves()
        torch.autograd.backward([current[weight_of[name]] for name in grads], list(grads.values()))

    return add
