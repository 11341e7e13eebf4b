"""Stage split: one rank's program → one program per pipeline stage module.

Pre: ``program`` is the per-rank program of :func:`rewrite` (placeholders: parameters,
buffers, user inputs; outputs: the scalar loss first), whose op nodes keep their module paths,
and a :class:`Schedule` with ``modules`` stage modules.
Post: ``schedule.modules`` :class:`StageProgram` s. Stage module k runs the layers the
schedule's cuts give it (an even split of the layers without cuts); an op outside the layers
runs with its earliest consumer (embeddings with the first layer, the head and the loss at the
end), never before what it reads, and a check with no consumer (``_assert_tensor_metadata``)
runs with what it checks. Module k takes its parameters, buffers and user inputs by name (any
module may read any input: labels reach the last) and, positionally, what module k − 1 sends:
every value made before it and needed at or after it (a value skipping a module is passed
through it). The last module returns the loss alone: the other outputs (logits) and what only
they need are dropped, not sent. A parameter several modules use is in each one's ``params``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir import ConfigError, Schedule
from autopar.passes.capture.batch_norm import BATCH_NORM_DECOMPOSITIONS
from autopar.passes.capture.graph import module_path, node_layer
from autopar.passes.rewrite.loss import first_output_shape, loss_only


@dataclass(frozen=True)
class StageProgram:
    """One stage module's program: ``graph_module(*params, *buffers, *inputs, *received)``."""

    index: int
    graph_module: fx.GraphModule
    params: tuple[str, ...]  # placeholder names, as in the whole program
    buffers: tuple[str, ...]
    inputs: tuple[str, ...]  # user inputs it reads
    received: tuple[str, ...]  # values module index − 1 sends, in order
    sent: tuple[str, ...]  # values it sends to module index + 1 (empty for the last: it returns the loss)
    layers: tuple[str, ...]


def layer_stages(layers: list[str], schedule: Schedule) -> dict[str, int]:
    """Which stage module runs each layer (``layers`` in execution order)."""
    modules = schedule.modules
    if len(layers) < modules:
        raise ConfigError(
            f"{modules} pipeline stage modules need at least as many layers (numbered modules such as "
            f"layers.0), the model has {len(layers)}: lower pp or the virtual stages"
        )
    if not schedule.cuts:
        return {layer: i * modules // len(layers) for i, layer in enumerate(layers)}
    unknown = [cut for cut in schedule.cuts if cut not in layers]
    if unknown:
        raise ConfigError(f"stage cut points {unknown} are not layers of the model; its layers are {layers}")
    starts = [layers.index(cut) for cut in schedule.cuts]
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ConfigError(f"stage cut points {list(schedule.cuts)} must name distinct layers after the first, in order")
    return {layer: sum(i >= start for start in starts) for i, layer in enumerate(layers)}


def split_stages(
    program: fx.GraphModule, params: set[str], buffers: set[str], schedule: Schedule
) -> list[StageProgram]:
    """Split ``program`` into ``schedule.modules`` stage programs (see the module docstring)."""
    whole, program = program, loss_only(program)
    if program is None:
        raise ConfigError(
            "pipeline stages need a model whose first output is its scalar loss (a Hugging Face model called with "
            f"labels=...); this one's first output has shape {first_output_shape(_first_output(whole))}: pass "
            "the labels, or return the loss first"
        )
    graph = program.graph
    nodes = list(graph.nodes)
    layers = list(dict.fromkeys(layer for n in nodes if n.op == "call_function" and (layer := node_layer(n))))
    by_layer = layer_stages(layers, schedule)
    stage = _assign(nodes, by_layer, schedule.modules)
    last = schedule.modules - 1
    produced = {n: stage[n] for n in nodes if n.op == "call_function"}
    crossing: list[list[fx.Node]] = [[] for _ in range(last)]  # crossing[k]: sent from module k to k + 1
    for node in nodes:
        if node in produced:
            latest = max((stage[user] for user in node.users), default=produced[node])
            for k in range(produced[node], latest):
                crossing[k].append(node)
    return [
        _stage_program(program, nodes, stage, k, crossing, params, buffers, by_layer) for k in range(schedule.modules)
    ]


def layers_out_of_order(graph: fx.Graph) -> fx.Node | None:
    """The first op of a layer that reads what a later layer computes (a model running its layers
    again, in cycles), or None: only layers that run in order can be cut into stages by layer."""
    place: dict[str, int] = {}  # layer → its place in execution order
    latest: dict[fx.Node, int] = {}  # node → the latest layer it depends on (-1: none)
    for node in graph.nodes:
        after = max((latest.get(arg, -1) for arg in node.all_input_nodes), default=-1)
        if node.op == "call_function" and (layer := node_layer(node)) is not None:
            if place.setdefault(layer, len(place)) < after:
                return node
            after = place[layer]
        latest[node] = after
    return None


def out_of_order_error(node: fx.Node) -> ConfigError:
    return ConfigError(
        f"node {node.name} ({node.target}) of {node_layer(node)} reads a value a later layer computes: the layers "
        "do not run in order (a model that runs its layers again, in cycles, cannot be cut into stages by layer); "
        "plan it without pipeline stages (degrees={'pp': 1})"
    )


BATCH_NORM_OPS = {str(op) for op in BATCH_NORM_DECOMPOSITIONS}


def whole_batch_node(graph: fx.Graph) -> fx.Node | None:
    """The first node whose result the batch decides as a whole, or None: statistics over the batch
    (BatchNorm in training) and buffer updates (its running statistics), which a batch run in
    microbatches (a pipeline's, gradient accumulation's) would compute per microbatch instead."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.copy_.default:
            return node
        # BatchNorm in training, decomposed into its means (autopar.passes.capture.batch_norm) or whole;
        # by name: export records another object of the same op
        if {str(node.meta.get("original_aten")), str(node.target)} & BATCH_NORM_OPS:
            return node
    return None


def whole_batch_error(node: fx.Node) -> ConfigError:
    buffer = node.target is torch.ops.aten.copy_.default
    what = "updates a buffer (as BatchNorm's running statistics)" if buffer else "takes statistics over the batch"
    return ConfigError(
        f"node {node.name} ({node.target}) of {module_path(node) or 'the model'} {what}: run in microbatches, "
        "the model would compute it per microbatch and no longer equal one process; plan it without pipeline "
        "stages or microbatches (degrees={'pp': 1}, microbatches=1), or switch a BatchNorm to eval() or to a "
        "per-example norm (GroupNorm, LayerNorm)"
    )


def _assign(nodes: list[fx.Node], by_layer: dict[str, int], modules: int) -> dict[fx.Node, int]:
    """Stage module of every call and of the output: layers where the schedule puts them,
    other ops at their earliest consumer but never before their inputs."""
    earliest: dict[fx.Node, int] = {}
    for node in nodes:
        inputs = [earliest.get(arg, 0) for arg in node.all_input_nodes]
        lower = max(inputs, default=0)
        if node.op == "call_function" and (layer := node_layer(node)) is not None:
            if by_layer[layer] < lower:
                raise out_of_order_error(node)
            lower = by_layer[layer]
        earliest[node] = lower
    stage: dict[fx.Node, int] = {}
    checks = [n for n in nodes if n.op == "call_function" and not n.users and node_layer(n) is None]
    for node in reversed(nodes):
        if node.op == "output":
            stage[node] = modules - 1
        elif node.op == "call_function" and node_layer(node) is not None:
            stage[node] = earliest[node]
        elif node.op == "call_function" and node not in checks:
            users = [stage[user] for user in node.users if user not in checks]
            stage[node] = max(earliest[node], min(users, default=earliest[node]))
    for node in checks:  # a check follows what it checks, rather than pulling it to an earlier stage
        stage[node] = max((stage[arg] for arg in node.all_input_nodes if arg in stage), default=earliest[node])
    return stage


def _first_output(program: fx.GraphModule):
    outputs = next(n for n in program.graph.nodes if n.op == "output").args[0]
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs


def _stage_program(program, nodes, stage, k, crossing, params, buffers, by_layer) -> StageProgram:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    used = {arg for n in nodes if stage.get(n) == k for arg in n.all_input_nodes if arg.op == "placeholder"}
    own = [n for n in placeholders if n in used]
    kinds = {"params": [n for n in own if n.name in params], "buffers": [n for n in own if n.name in buffers]}
    kinds["inputs"] = [n for n in own if n.name not in params and n.name not in buffers]
    for node in kinds["params"] + kinds["buffers"] + kinds["inputs"]:
        env[node] = graph.node_copy(node)
    received = crossing[k - 1] if k > 0 else []
    for node in received:
        env[node] = graph.placeholder(f"received_{node.name}")
        env[node].meta = dict(node.meta)
    for node in nodes:
        if node.op == "call_function" and stage[node] == k:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
    if k == len(crossing):
        output = next(n for n in nodes if n.op == "output")
        graph.output(fx.map_arg(output.args[0], lambda arg: env[arg]))
    else:
        # a value passed through is copied: a stage's output must not be its own input
        sent = [
            env[n] if n not in received else graph.call_function(torch.ops.aten.clone.default, (env[n],))
            for n in crossing[k]
        ]
        graph.output(tuple(sent))
    graph.lint()
    return StageProgram(
        index=k,
        graph_module=fx.GraphModule(program, graph),
        params=tuple(n.name for n in kinds["params"]),
        buffers=tuple(n.name for n in kinds["buffers"]),
        inputs=tuple(n.name for n in kinds["inputs"]),
        received=tuple(n.name for n in received),
        sent=tuple(n.name for n in crossing[k]) if k < len(crossing) else (),
        layers=tuple(layer for layer, s in by_layer.items() if s == k),
    )
