"""Recompute: run each transformer layer of a program under activation checkpointing.

The plan's ``schedule.recompute`` says what autograd keeps between forward and backward
(its cost is modeled in :mod:`autopar.passes.cost.schedule`); this pass makes the program do it. A layer is the
ops under one numbered module (``layers.3``, :func:`autopar.ir.layer_of`), the unit Megatron and
torchtitan checkpoint; the ops outside layers (embeddings, head, loss) run as they are.

- "full": each layer runs under ``torch.utils.checkpoint`` (non-reentrant), keeping only its
  inputs; backward reruns the layer's forward, its collectives included (every rank reruns
  the same layers in the same order, so they pair up as in the first forward).
- "selective": the same, but the outputs of the ops in :data:`SAVED_BY_SELECTIVE` (matmuls,
  attention) and of the autopar collectives are kept (:func:`kept_by_selective`) and the rest
  (norms, activations, views) is recomputed, so backward communicates no more. A kept output
  is held until the layer's backward unless only collectives read it (through views): a
  row-parallel linear's partial sum, which the recompute never reads, as its reduction is
  served kept (:class:`_KeptOutputs`; the cost model counts the same:
  :func:`autopar.passes.cost.schedule.selective_held`).
- "selective-op": as "selective", but of the layer's matmuls (:data:`MATMULS`) in forward
  order the second, fourth, ... are recomputed too: torchtitan's op-level policy, which counts
  its ``mm`` calls and saves all but every second. The runtime counts the matmul kernels a
  layer call runs, the cost model the layer's matmul ops (:func:`kept_at`, the rule both
  share): the same wherever one op runs as one kernel, not where async tensor parallelism
  runs a linear in pieces (the pieces alternate) or two layers' ops interleave (one count).

Pre: a program from :func:`rewrite` (op nodes keep ``meta["nn_module_stack"]``; the
collectives it inserted have none and join the layer they sit in) and a recompute mode.
Post: the same program in which each layer's span of ops, from its first op to its last, is
one call of a :class:`CheckpointedLayer` whose outputs are unpacked by ``getitem`` nodes
named and annotated like the values they stand for (so :func:`autopar.passes.rewrite.stages.split_stages`
puts the call in its layer's stage). ZeRO-3's ``zero_gather`` ops stay outside the call:
the runtime batches them per layer, and the checkpoint saves a gathered weight as an
input, which ZeRO-3's pack hook turns into a regather in backward.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.ir import OP_NAMESPACE, RECOMPUTE, ConfigError, Recompute
from autopar.passes.capture.graph import node_layer

aten = torch.ops.aten
# Ops whose outputs selective recomputation keeps: the FLOP-heavy ones. The runtime sees the
# kernels ops dispatch to (mm, addmm, flash attention), the cost model the graph's ops (linear,
# matmul, sdpa): both are listed, so the two keep the same tensors.
SAVED_BY_SELECTIVE = frozenset(
    {
        aten.linear,
        aten.matmul,
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.baddbmm,
        aten._scaled_mm,
        aten.convolution,
        aten.scaled_dot_product_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
    }
)


# The ops "selective-op" counts: matmuls as the graph names them and as they dispatch.
MATMULS = frozenset({aten.linear, aten.matmul, aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm})

# autopar's collectives (the rewrite's moves between placements): each one's backward is its
# dual and saves no tensor, so once kept, neither the recompute nor backward reads its input.
COLLECTIVES = frozenset(
    {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "chunk", "keep_on_first", "grad_all_reduce", "zigzag"}
)


@dataclass(frozen=True)
class LayerSegment:
    """The ops one checkpoint runs: ``members`` in program order, the values they read from
    outside (``inputs``) and the values read after them (``outputs``)."""

    layers: tuple[str, ...]
    members: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]


def layer_segments(graph: fx.Graph) -> list[LayerSegment]:
    """The layers of ``graph``, one segment per layer (layers whose ops interleave share one).

    >>> [s.layers for s in layer_segments(captured.graph)]   # doctest: +SKIP
    [('layers.0',), ('layers.1',)]
    """
    nodes = list(graph.nodes)
    spans: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        if node.op == "call_function" and (layer := node_layer(node)) is not None:
            spans.setdefault(layer, [index, index])[1] = index
    merged: list[list] = []  # [layers, first index, last index]
    for layer, (first, last) in spans.items():  # in order of first op
        if merged and first <= merged[-1][2]:
            merged[-1][0].append(layer)
            merged[-1][2] = max(last, merged[-1][2])
        else:
            merged.append([[layer], first, last])
    gather = _zero_gather()
    return [_segment(tuple(layers), nodes[first : last + 1], gather) for layers, first, last in merged]


def _segment(layers: tuple[str, ...], span: list[fx.Node], gather) -> LayerSegment:
    members = [n for n in span if n.op == "call_function" and (gather is None or n.target is not gather)]
    inside = set(members)
    for node in span:
        assert node in inside or not any(arg in inside for arg in node.all_input_nodes), (
            f"{node.format_node()} reads its layer"
        )
    inputs = dict.fromkeys(arg for n in members for arg in n.all_input_nodes if arg not in inside)
    outputs = [n for n in members if any(user not in inside for user in n.users)]
    return LayerSegment(layers, tuple(members), tuple(inputs), tuple(outputs))


def _zero_gather():
    """ZeRO-3's gather op, once the runtime registered it (passes name runtime ops, never import them)."""
    namespace = getattr(torch.ops, OP_NAMESPACE)
    return namespace.zero_gather.default if hasattr(namespace, "zero_gather") else None


@functools.cache  # asked for every node of every layout the search prices
def kept_by_selective(op) -> bool:
    """Whether selective recomputation keeps this op's output: matmuls, attention, and autopar's
    collectives and kernels (recomputing those would communicate again). The one rule the cost
    model and the runtime share."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    return op.overloadpacket in SAVED_BY_SELECTIVE or op.namespace == OP_NAMESPACE


@functools.cache
def is_collective(op) -> bool:
    """Whether ``op`` is one of autopar's :data:`COLLECTIVES`."""
    return isinstance(op, torch._ops.OpOverload) and op.namespace == OP_NAMESPACE and op._opname in COLLECTIVES


@functools.cache
def is_matmul(op) -> bool:
    """Whether ``op`` is one of the matmuls "selective-op" counts (:data:`MATMULS`)."""
    return isinstance(op, torch._ops.OpOverload) and op.overloadpacket in MATMULS


def kept_at(level: str, op, matmuls_before: int) -> bool:
    """Whether recomputation at ``level`` keeps the output of ``op``, an op inside a layer, where
    ``matmuls_before`` of the layer's matmuls ran before it in forward: every output under
    "none", none under "full", what :func:`kept_by_selective` keeps under "selective", and that
    but every second matmul (the second, the fourth, ...) under "selective-op". The one rule the
    cost model and the runtime share."""
    if level in (Recompute.NONE, Recompute.FULL):
        return level == Recompute.NONE
    if not kept_by_selective(op):
        return False
    return level == Recompute.SELECTIVE or not (is_matmul(op) and matmuls_before % 2 == 1)


class _KeptOutputs(TorchDispatchMode):
    """Selective checkpointing of one layer call: in forward, remembers what the kept ops
    return (by op and call number); in each recompute, serves those instead of rerunning them.

    An output only collectives read (through views: ops whose output shares its storage) is
    not needed again: the recompute serves the collectives kept and their backward saves
    nothing. When the forward ends such outputs are let go, a storage-free stand-in of the same
    shape served in their place (a row-parallel linear's partial sum, read by its reduction).

    torch's ``create_selective_checkpoint_contexts`` does the same but serves each output to
    one backward only, holds every output (read again or not), and the zero-bubble schedules
    recompute a layer twice (for the input gradients, then for the weight gradients).
    """

    def __init__(self, kept: dict, recomputing: bool, level: str):
        super().__init__()
        self.kept, self.recomputing, self.level = kept, recomputing, level

    def __enter__(self):
        self.calls: dict = {}
        self.matmuls = 0
        self.owners: dict[int, tuple] = {}  # forward: a kept output's storage → its key
        self.needed: set[tuple] = set()  # keys of the outputs something other than a collective reads
        return super().__enter__()

    def __exit__(self, *exc):
        if not self.recomputing:
            for key in set(self.owners.values()) - self.needed:
                self.kept[key] = tree_map_only(torch.Tensor, _stand_in, self.kept[key])
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.matmuls
        self.matmuls += is_matmul(func)
        kept = kept_at(self.level, func, before)
        if not kept:
            out = func(*args, **(kwargs or {}))
            if not self.recomputing:
                self._read(args, kwargs, aliases=_storages(out))
            return out
        index = self.calls.get(func, 0)
        self.calls[func], key = index + 1, (func, index)
        if self.recomputing:  # a fresh alias: autograd records the recompute's history on it
            return tree_map_only(torch.Tensor, torch.Tensor.detach, self.kept[key])
        if not is_collective(func):  # a kept matmul or kernel saves its inputs for backward
            self._read(args, kwargs)
        out = func(*args, **(kwargs or {}))
        self.kept[key] = tree_map_only(torch.Tensor, torch.Tensor.detach, out)
        self.owners.update(dict.fromkeys(_storages(out), key))
        return out

    def _read(self, args, kwargs, aliases: frozenset = frozenset()) -> None:
        """Kept outputs among ``args`` are needed again, but where the op only views them (its
        output shares their storage: whatever reads the view reads them)."""
        if self.owners:
            read = _storages((args, kwargs)) - aliases
            self.needed.update(self.owners[storage] for storage in read if storage in self.owners)


def _storages(values) -> frozenset[int]:
    tensors = [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]
    return frozenset(t.untyped_storage().data_ptr() for t in tensors) - {0}  # 0: no storage (empty)


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of ``tensor``'s shape, dtype and device holding one element (every stride 0)."""
    return tensor.new_empty_strided(tensor.shape, (0,) * tensor.dim())


def _selective_contexts(level: str) -> tuple[_KeptOutputs, _KeptOutputs]:
    kept: dict = {}
    return _KeptOutputs(kept, recomputing=False, level=level), _KeptOutputs(kept, recomputing=True, level=level)


def _compiled_selective_contexts(level: str):
    matmuls = {False: 0, True: 0}  # counted apart in forward and in the recompute (ctx.is_recompute)

    def keep_or_recompute(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        before = matmuls[ctx.is_recompute]
        matmuls[ctx.is_recompute] += is_matmul(op)
        return CheckpointPolicy.MUST_SAVE if kept_at(level, op, before) else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(keep_or_recompute)


class CheckpointedLayer:
    """A layer's ops as one call of the program: ``graph_module(*inputs)`` under
    ``torch.utils.checkpoint`` (non-reentrant), selective or full. fx calls it like a function
    and names it by ``__name__`` in the generated code."""

    def __init__(self, layers: tuple[str, ...], graph_module: fx.GraphModule, mode: str):
        self.layers, self.graph_module, self.mode = layers, graph_module, mode
        self.__name__ = "checkpointed_" + "_".join(layer.replace(".", "_") for layer in layers)

    def __call__(self, *inputs):
        if self.mode in (Recompute.SELECTIVE, Recompute.SELECTIVE_OP):
            # torch.compile traces only torch's own selective contexts; it recomputes once per backward
            contexts = _compiled_selective_contexts if torch.compiler.is_compiling() else _selective_contexts
            context_fn = functools.partial(contexts, self.mode)
            return checkpoint(self.graph_module, *inputs, use_reentrant=False, context_fn=context_fn)
        return checkpoint(self.graph_module, *inputs, use_reentrant=False)

    def __repr__(self) -> str:
        return f"CheckpointedLayer({', '.join(self.layers)}, {self.mode})"


def apply_recompute(program: fx.GraphModule, mode: str) -> fx.GraphModule:
    """``program`` with every layer checkpointed as ``mode`` says (see the module docstring);
    ``mode="none"`` returns it as it is.

    >>> program = apply_recompute(rewrite(captured, plan, groups=groups, device="cpu"), "selective")   # doctest: +SKIP
    >>> [n.name for n in program.graph.nodes if isinstance(n.target, CheckpointedLayer)]   # doctest: +SKIP
    ['checkpointed_layers_0', 'checkpointed_layers_1']
    """
    if mode not in RECOMPUTE:
        raise ConfigError(f"recompute={mode!r}: choose one of {list(RECOMPUTE)}")
    segments = layer_segments(program.graph) if mode != Recompute.NONE else []
    if not segments:
        return program
    by_last = {segment.members[-1]: segment for segment in segments}
    members = {node for segment in segments for node in segment.members}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in program.graph.nodes:
        if node in by_last:
            _emit_call(graph, env, by_last[node], mode)
        elif node not in members:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.lint()
    return fx.GraphModule(program, graph)


def _emit_call(graph: fx.Graph, env: dict[fx.Node, fx.Node], segment: LayerSegment, mode: str) -> None:
    """The segment's ops as a graph of their own, called once, its outputs unpacked."""
    inner = fx.Graph()
    inner_env: dict[fx.Node, fx.Node] = {}
    for value in segment.inputs:
        inner_env[value] = inner.placeholder(value.name)
        inner_env[value].meta = dict(value.meta)
    for node in segment.members:
        inner_env[node] = inner.node_copy(node, inner_env.__getitem__)
    inner.output(tuple(inner_env[node] for node in segment.outputs))
    inner.lint()
    target = CheckpointedLayer(segment.layers, fx.GraphModule(torch.nn.Module(), inner), mode)
    call = graph.create_node(
        "call_function", target, tuple(env[value] for value in segment.inputs), name=target.__name__
    )
    # the layer's module path: the stage split places the call, and its unpacking, by it
    stack = next(n.meta["nn_module_stack"] for n in segment.members if node_layer(n) == segment.layers[0])
    call.meta = {"nn_module_stack": stack, "val": tuple(node.meta.get("val") for node in segment.outputs)}
    for index, node in enumerate(segment.outputs):
        env[node] = graph.create_node("call_function", operator.getitem, (call, index), name=node.name)
        env[node].meta = {**node.meta, "nn_module_stack": stack}
