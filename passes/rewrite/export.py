"""Export: a rewritten per-rank program + its Plan → files a person can read.

Pre: ``program`` is :func:`rewrite`'s output for ``plan`` with ``groups={axis: axis}``
(collective calls then name their mesh axis, ``torch.ops.autopar.all_reduce.default(x,
'tp', 'sum')``). Its placeholders are the parameters (in ``plan.params`` order), buffers
and user inputs, as capture made them.
Post: text only; nothing is executed and no process group is needed.

- :func:`program_code`: one rank's Python, with a header naming the rank's coordinates and
  groups and what the runtime adds to the program (microbatches, recomputation, regather,
  stages: its own stage modules follow), each placeholder annotated with its placement and
  local shape;
- :func:`plan_json`: the plan as JSON (what ``Plan.load`` reads);
- :func:`graph_dot`: the program as Graphviz DOT, collectives filled, clustered by module;

``autopar export`` writes them into a folder (one ``rank{r}.py`` per rank).

The program is SPMD: its text is the same on every rank (of a pipeline stage); only the header differs.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir import (
    OP_NAMESPACE,
    Axis,
    Kernel,
    Partial,
    Placement,
    Plan,
    Recompute,
    Replicate,
    Shard,
    format_placements,
)
from autopar.passes.capture.graph import module_path
from autopar.passes.cost.kernels import experts_top_k, kernel_bytes
from autopar.passes.rewrite.regather import regather_gathered_inputs
from autopar.passes.rewrite.stages import StageProgram

AXIS_MEANING = {
    Axis.DP: "data parallel: the batch is split, gradients are summed",
    Axis.TP: "tensor parallel: weights and activations are split inside layers",
    Axis.PP: "pipeline parallel: layers are split into stages",
    Axis.CP: "context parallel: the sequence is split",
    Axis.EP: "expert parallel: experts are split",
}
KERNEL_TRAFFIC = {
    "ring_attention": Kernel.RING,
    "ulysses_attention": Kernel.ULYSSES,
    "moe": Kernel.EXPERTS,
    "moe_experts": Kernel.EXPERTS,
    "vocab_embedding": Kernel.VOCAB,
    "vocab_cross_entropy": Kernel.VOCAB,
}
RECEIVED = "received_"  # a stage program's placeholder for a value the previous stage module sends
COLLECTIVE_COLOR = "orange"
PARAM_COLOR = "lightblue"
INPUT_COLOR = "palegreen"


@dataclass(frozen=True)
class PlaceholderInfo:
    """What one placeholder of the program holds on a rank."""

    name: str  # placeholder name in the program
    kind: str  # "param", "buffer", "input" or "received" (from the previous stage module)
    label: str  # parameter name for params, else the placeholder name
    placements: tuple[Placement, ...]
    full_shape: tuple[int, ...] | None
    local_shape: tuple[int, ...] | None


@dataclass(frozen=True)
class CollectiveCall:
    """One ``torch.ops.autopar.*`` call of the program, described for reports."""

    name: str  # fx node name
    op: str  # "all_gather", "all_reduce", ...
    axis: str  # the group argument: the mesh axis when groups are axis names
    module: str  # module path of the op that consumes the result ("" at top level)
    before: tuple[Placement, ...] | None  # placement of its input
    after: tuple[Placement, ...] | None  # placement of its output
    nbytes: int  # local bytes of the tensor it takes (0 when unknown)


# -- ranks and shapes ------------------------------------------------------------------


def rank_coordinates(plan: Plan, rank: int) -> dict[str, int]:
    """This rank's index along every dimension of the mesh; ranks run row-major over
    :attr:`~autopar.ir.Plan.full_degrees`.

    >>> rank_coordinates(plan, 5)   # degrees {"dp": 2, "tp": 4}   # doctest: +SKIP
    {'dp': 1, 'tp': 1}
    """
    degrees = plan.full_degrees
    world = math.prod(degrees.values())
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the {world} ranks of degrees {degrees}")
    coords, inner = {}, world
    for axis, size in degrees.items():
        inner //= size
        coords[axis] = (rank // inner) % size
    return coords


def axis_group(plan: Plan, rank: int, axis: str) -> list[int]:
    """The ranks that differ from ``rank`` only along ``axis``: its group for that axis."""
    degrees = plan.full_degrees
    inner = math.prod(list(degrees.values())[list(degrees).index(axis) + 1 :])
    base = rank - rank_coordinates(plan, rank)[axis] * inner
    return [base + k * inner for k in range(degrees[axis])]


def local_shape(shape: tuple[int, ...], placements: tuple[Placement, ...], degrees: dict[str, int]) -> tuple[int, ...]:
    """The shape one rank holds: each ``Shard(dim)`` divides ``dim`` by its axis' degree.

    >>> local_shape((128, 64), (Shard(0), Shard(0)), {"dp": 2, "tp": 4})   # doctest: +SKIP
    (16, 64)
    """
    local = list(shape)
    for placement, size in zip(placements, degrees.values()):
        if isinstance(placement, Shard) and local:
            local[placement.dim % len(local)] //= size
    return tuple(local)


def _tensor(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _mangle(fqn: str) -> str:
    # torch.export's placeholder names: "p_" + the FQN, lowercased, non-alphanumerics as "_"
    return "p_" + re.sub(r"[^a-zA-Z0-9]", "_", fqn.lower())


def placeholders(program: fx.GraphModule, plan: Plan) -> list[PlaceholderInfo]:
    """Every placeholder of ``program`` with its placement, full and local shape.

    >>> [p.label for p in placeholders(program, plan)][:2]   # doctest: +SKIP
    ['tok_embeddings.weight', 'pos_embeddings.weight']
    """
    nodes = [n for n in program.graph.nodes if n.op == "placeholder"]
    fqns = list(plan.params)
    by_position = dict(zip((n.name for n in nodes), fqns))
    if not all(name.startswith(_mangle(fqn)) for name, fqn in by_position.items()):
        by_mangled = {_mangle(fqn): fqn for fqn in fqns}
        by_position = {n.name: by_mangled[n.name] for n in nodes if n.name in by_mangled}
    replicated = tuple(Replicate() for _ in plan.degrees)
    infos = []
    for node in nodes:
        if node.name in by_position:
            kind, label, placements = "param", by_position[node.name], plan.params[by_position[node.name]]
        elif node.name in plan.inputs:
            kind, label, placements = "input", node.name, plan.inputs[node.name]
        elif node.name.startswith(RECEIVED) and node.name[len(RECEIVED) :] in plan.nodes:
            kind, label = "received", node.name[len(RECEIVED) :]
            placements = plan.nodes[label].output or replicated
        else:
            kind, label, placements = "buffer", node.name, replicated
        val = _tensor(node)
        full = tuple(val.shape) if val is not None else None
        local = local_shape(full, placements, plan.degrees) if full is not None else None
        infos.append(PlaceholderInfo(node.name, kind, label, placements, full, local))
    return infos


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` calls one of the runtime's ``torch.ops.autopar.*`` collectives or
    parallel kernels (a mixture of experts given no group runs locally: not one)."""
    if node.op != "call_function" or getattr(node.target, "namespace", None) != OP_NAMESPACE:
        return False
    return not _collective_name(node).startswith("moe") or bool(_group(node))


def _group(node: fx.Node) -> str:
    """The group (axis) a collective or kernel talks over: its first string argument."""
    return next((arg for arg in node.args if isinstance(arg, str)), "")


def _collective_name(node: fx.Node) -> str:
    return node.target.name().split("::")[-1].split(".")[0]


def _after(op: str, args: tuple, before: tuple[Placement, ...], axes: tuple[str, ...]) -> tuple[Placement, ...]:
    """The placement a collective leaves (see ``passes.rewrite._Collectives._one_axis``)."""
    if args[1] not in axes:
        return before
    index = axes.index(args[1])
    result = {
        "all_reduce": Replicate(),
        "all_gather": Replicate(),
        "chunk": Shard(args[2]) if len(args) > 2 else None,
        "reduce_scatter": Shard(args[2]) if len(args) > 2 else None,
        "all_to_all": Shard(args[2]) if len(args) > 2 else None,
        "keep_on_first": Partial(),
    }.get(op, before[index])
    return before if result is None else before[:index] + (result,) + before[index + 1 :]


def collective_calls(program: fx.GraphModule, plan: Plan) -> list[CollectiveCall]:
    """The program's collectives in execution order, with the module each serves and its bytes.

    ``nbytes`` is the local size of the tensor the collective takes on one rank; the module
    is that of the first non-collective op using its result.

    >>> [(c.op, c.axis, c.module) for c in collective_calls(program, plan)][:1]   # doctest: +SKIP
    [('all_gather', 'tp', 'layers.0.attn')]
    """
    axes = tuple(plan.degrees)
    placements: dict[str, tuple[Placement, ...] | None] = {p.name: p.placements for p in placeholders(program, plan)}
    placements.update({name: decision.output for name, decision in plan.nodes.items()})
    sources: dict[str, fx.Node] = {}  # collective → the node whose value (full shape, dtype) it moves
    calls = []
    for node in program.graph.nodes:
        if not is_collective(node):
            continue
        value = node.args[0]
        source = sources.get(value.name, value)
        sources[node.name] = source
        before = placements.get(value.name)
        after = _after(_collective_name(node), node.args, before, axes) if before is not None else None
        placements[node.name] = after
        val = _tensor(source)
        nbytes = 0
        if val is not None and before is not None:
            nbytes = math.prod(local_shape(tuple(val.shape), before, plan.degrees)) * val.element_size()
        op, group, module = _collective_name(node), _group(node), _consumer_module(node)
        if op in KERNEL_TRAFFIC:  # what the kernel itself sends, for its input's size; its output is a new value
            tokens = _local_numel(node.args[1], placements, plan) if op == "vocab_cross_entropy" else 0
            nbytes = kernel_bytes(
                KERNEL_TRAFFIC[op],
                nbytes,
                plan.degrees.get(group, 1),
                experts_top_k(node) if op.startswith("moe") else 1,
                tokens,
            )
            sources[node.name], module = node, module_path(node)  # a kernel serves its own module
            placements[node.name] = plan.nodes[node.name].output if node.name in plan.nodes else after
        calls.append(CollectiveCall(node.name, op, group, module, before, after, nbytes))
    return calls


def _local_numel(value: fx.Node, placements: dict, plan: Plan) -> int:
    val, placement = _tensor(value), placements.get(value.name)
    return math.prod(local_shape(tuple(val.shape), placement, plan.degrees)) if val is not None and placement else 0


def _consumer_module(node: fx.Node) -> str:
    seen = set()
    frontier = list(node.users)
    while frontier:
        user = frontier.pop(0)
        if user in seen:
            continue
        seen.add(user)
        if not is_collective(user):
            return module_path(user)
        frontier.extend(user.users)
    return ""


# -- program text ----------------------------------------------------------------------


def program_code(
    program: fx.GraphModule,
    plan: Plan,
    rank: int,
    stages: list[StageProgram] | None = None,
    schedule: list[str] | None = None,
) -> str:
    """Readable Python of ``rank``'s program: a header, then fx's code with annotated inputs.

    The header names the rank's coordinate per parallel dimension, the degrees and the ranks
    each group name stands for, and what the runtime adds to the program (:func:`schedule_lines`);
    every placeholder is annotated with its placement and its full → local shape. With pipeline
    ``stages`` (``program`` split by :func:`~autopar.passes.rewrite.stages.split_stages`), the
    rank's own stage modules follow, one function each. ``schedule``: :func:`schedule_lines`, when
    the caller writes every rank's (the same for all).

    >>> text = program_code(program, plan, rank=1)   # doctest: +SKIP
    >>> "torch.ops.autopar.all_reduce.default(" in text   # doctest: +SKIP
    True
    """
    coords, degrees = rank_coordinates(plan, rank), plan.full_degrees
    lines = [
        f"# autopar program for rank {rank} of {math.prod(degrees.values())} on mesh {plan.mesh} ({plan.hardware}, "
        f"global batch {plan.batch_size})",
        "# degrees: "
        + " x ".join(f"{axis}={size}" for axis, size in degrees.items())
        + "; this rank's coordinates: "
        + ", ".join(f"{a}={c}" for a, c in coords.items()),
        f"#   ranks are laid out row-major over the degrees ({', '.join(degrees)}; the last varies fastest)",
        "# group names in the collectives below:",
    ]
    for axis, size in degrees.items():
        lines.append(
            f"#   '{axis}': ranks {axis_group(plan, rank, axis)} (this rank's {axis} group of {size}; "
            f"{AXIS_MEANING.get(axis, 'a parallel dimension')})"
        )
    synced = {axes for axes in plan.grad_sync.values()}
    lines += [
        "# collectives: torch.ops.autopar.<op>.default(tensor, group, ...), autograd ops from",
        "#   autopar.runtime.collectives whose backward is their dual (all-reduce <-> identity, ...)",
        f"# after backward the runtime sums {len(plan.grad_sync)} parameters' gradients over "
        + (", ".join("+".join(a) for a in sorted(synced)) or "no axis")
        + " (not part of this graph)",
        f"# plan {plan.fingerprint}: predicted step {plan.cost.step_s * 1e3:.2f} ms, "
        f"peak memory {plan.cost.peak_memory / 2**20:.1f} MiB per device",
        *(schedule if schedule is not None else schedule_lines(program, plan)),
        "",
        "import torch",
        "from math import inf, nan",
        "from torch import device",
        "",
        "import autopar  # noqa: F401  (registers torch.ops.autopar.*: collectives and parallel kernels)",
        "",
    ]
    if stages is None:
        return "\n".join(lines) + "\n" + _annotated_code(program, plan)
    for module in plan.schedule.device_modules()[coords[Axis.PP]]:
        stage = stages[module]
        lines += [
            "",
            f"# stage module {module}: {', '.join(stage.layers)}; "
            + (f"receives {', '.join(stage.received)} from module {module - 1}; " if stage.received else "")
            + (f"sends {', '.join(stage.sent)} to module {module + 1}" if stage.sent else "returns the loss"),
            _annotated_code(stage.graph_module, plan).replace("def forward(", f"def stage{module}(", 1),
        ]
    return "\n".join(lines)


def schedule_lines(program: fx.GraphModule, plan: Plan) -> list[str]:
    """The header's account of what the runtime does to this program beyond the text below
    (``passes/program.py``): the microbatches it runs it on, the layers it checkpoints, the
    gathers it fuses with their linears, the stages it splits it into."""
    schedule = plan.schedule
    lines = [f"# schedule: {schedule}"]
    if schedule.microbatches > 1:
        lines.append(
            f"#   the runtime runs this program on 1/{schedule.microbatches} of the batch at a time "
            "(shapes below: the whole batch), gradients accumulated"
        )
    if schedule.recompute != Recompute.NONE:
        lines.append(
            f"#   recompute {schedule.recompute}: each layer's span of ops runs under activation checkpointing"
            + {
                Recompute.SELECTIVE: ", the outputs of its matmuls, attention and collectives kept",
                Recompute.SELECTIVE_OP: ", the outputs of its attention, collectives and every other matmul "
                "(the first, the third, ...) kept",
            }.get(schedule.recompute, "")
        )
    if schedule.regather:
        gathers = regather_gathered_inputs(copy.deepcopy(program))[1]
        lines.append(
            f"#   regather: {len(gathers)} all-gather(s) read only by linears run fused with them "
            "(torch.ops.autopar.gathered_linears: the shard kept for backward, gathered again there): "
            + ", ".join(gathers)
        )
    if schedule.stages > 1:
        lines.append(f"#   split into {schedule.modules} stage modules; this rank's are below, one function each")
    return lines


def _annotated_code(program: fx.GraphModule, plan: Plan) -> str:
    code = program.code.strip("\n") + "\n"
    infos = placeholders(program, plan)
    signature = "def forward(self, " + ", ".join(p.name for p in infos) + "):"
    axes = ", ".join(plan.degrees)
    rows = [
        f"    {p.name},  # {p.label if p.kind == 'param' else p.kind} {format_placements(p.placements)} "
        f"{_shape(p.full_shape)} -> local {_shape(p.local_shape)}"
        for p in infos
    ]
    annotated = f"def forward(\n    self,  # inputs: placement over ({axes}), full shape -> this rank's shape\n"
    annotated += "\n".join(rows) + "\n):"
    if signature in code:
        return code.replace(signature, annotated, 1)
    table = [
        f"# {p.label}: {format_placements(p.placements)} {_shape(p.full_shape)} -> local {_shape(p.local_shape)}"
        for p in infos
    ]
    return "\n".join(table) + "\n" + code


def _shape(shape: tuple[int, ...] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def plan_json(plan: Plan) -> str:
    """The plan as JSON text, the format ``Plan.load`` reads.

    >>> Plan.from_json(json.loads(plan_json(plan))) == plan   # doctest: +SKIP
    True
    """
    return json.dumps(plan.to_json(), indent=1)


# -- graph -----------------------------------------------------------------------------


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def graph_dot(program: fx.GraphModule, plan: Plan) -> str:
    """Graphviz DOT of the program: a box per fx node (name, op, output placement), collectives
    filled orange, parameters blue, inputs green, clustered by module path.

    >>> Path("graph.dot").write_text(graph_dot(program, plan))   # doctest: +SKIP
    >>> # dot -Tsvg graph.dot -o graph.svg
    """
    infos = {p.name: p for p in placeholders(program, plan)}
    calls = {c.name: c for c in collective_calls(program, plan)}
    axes = ", ".join(plan.degrees)
    clusters: dict[str, list[str]] = {}
    lines = [
        "digraph program {",
        "  rankdir=TB;",
        f"  label={_quote(f'autopar program, mesh {plan.mesh}, placements over ({axes})')};",
        '  node [shape=box, fontname="monospace", fontsize=10];',
    ]
    for node in program.graph.nodes:
        attributes = {"label": _node_label(node, plan, infos, calls)}
        if node.name in calls:
            attributes.update(style="filled", fillcolor=COLLECTIVE_COLOR)
        elif node.name in infos:
            color = PARAM_COLOR if infos[node.name].kind == "param" else INPUT_COLOR
            attributes.update(style="filled", fillcolor=color, shape="ellipse")
        lines.append(f"  {_quote(node.name)} [" + ", ".join(f"{k}={_quote(v)}" for k, v in attributes.items()) + "];")
        module = calls[node.name].module if node.name in calls else module_path(node)
        if node.name in infos and infos[node.name].kind == "param":
            module = infos[node.name].label.rpartition(".")[0]
        clusters.setdefault(module, []).append(node.name)
    lines += _clusters(clusters)
    for node in program.graph.nodes:
        for source in node.all_input_nodes:
            lines.append(f"  {_quote(source.name)} -> {_quote(node.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node_label(node: fx.Node, plan: Plan, infos, calls) -> str:
    if node.name in calls:
        call = calls[node.name]
        extra = ", ".join(map(repr, node.args[1:]))
        placement = f"{format_placements(call.before)} -> {format_placements(call.after)}" if call.after else ""
        return f"{node.name}\nautopar.{call.op}({extra})\n{placement}".rstrip()
    if node.name in infos:
        info = infos[node.name]
        return f"{info.label}\n{format_placements(info.placements)} local {_shape(info.local_shape)}"
    op = str(node.target) if node.op == "call_function" else node.op
    decision = plan.nodes.get(node.name)
    placement = format_placements(decision.output) if decision is not None and decision.output is not None else ""
    return f"{node.name}\n{op}\n{placement}".rstrip()


def _clusters(members: dict[str, list[str]]) -> list[str]:
    """Nested ``subgraph cluster_*`` blocks: ``layers.0.attn`` sits inside ``layers.0``."""
    paths = set()
    for path in members:
        parts = path.split(".") if path else []
        paths.update(".".join(parts[: k + 1]) for k in range(len(parts)))
    children: dict[str, list[str]] = {}
    for path in sorted(paths):
        children.setdefault(path.rpartition(".")[0], []).append(path)
    ids = {path: f"cluster_{index}" for index, path in enumerate(sorted(paths))}

    def emit(path: str, depth: int) -> list[str]:
        pad = "  " * depth
        out = [f"{pad}subgraph {ids[path]} {{", f"{pad}  label={_quote(path)}; style=rounded; color=gray60;"]
        out += [f"{pad}  {_quote(name)};" for name in members.get(path, [])]
        for child in children.get(path, []):
            out += emit(child, depth + 1)
        return out + [f"{pad}}}"]

    lines = []
    for top in children.get("", []):
        lines += emit(top, 1)
    return lines
