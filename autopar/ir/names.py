"""Names that planning and running must agree on: mesh axes, parallel kernels, pipeline
schedules, recomputation levels, the torch op namespace, which layer a name belongs to (and how
tables name a run of identical layers once), and how a compiled program's waits are named.

The word sets are ``StrEnum`` s: code names them (``Axis.DP``), while data — degrees, plans,
JSON, fx code — holds the plain strings they equal (``"dp"``)."""

from __future__ import annotations

import re
from enum import StrEnum


class Axis(StrEnum):
    """A parallel dimension of the mesh. Members are strings (``Axis.DP == "dp"``), so plans,
    JSON and user pins (``degrees={"dp": 2}``) use the plain words."""

    DP = "dp"  # data parallel: splits the batch; gradients are summed over it
    EP = "ep"  # expert parallel: splits a mixture-of-experts layer's experts (and the batch)
    CP = "cp"  # context parallel: splits the sequence, in head-and-tail chunks
    TP = "tp"  # tensor parallel: splits weights inside layers (and, as Megatron's SP, the sequence between them)
    PP = "pp"  # pipeline parallel: splits the layers into stages over the outermost mesh dimension


class Kernel(StrEnum):
    """A parallel kernel a node may run as (instead of one op on local shards)."""

    RING = "ring"  # context-parallel attention: K/V blocks pass around the ring
    ULYSSES = "ulysses"  # context-parallel attention: all-to-all between sequence and heads
    EXPERTS = "experts"  # expert-parallel mixture of experts: tokens travel to their experts by all-to-all
    VOCAB = "vocab"  # the vocabulary split: embedding rows looked up where they live, cross-entropy over split classes


class PipelineKind(StrEnum):
    """torch.distributed.pipelining schedules: GPipe, 1F1B, Interleaved1F1B,
    InterleavedZeroBubble, ZBVZeroBubble."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    INTERLEAVED_ZB = "interleaved-zb"
    ZBV = "zbv"


class Recompute(StrEnum):
    """What autograd keeps between forward and backward: "none" recomputes nothing,
    "selective" keeps what matmuls, attention and collectives produce, "selective-op" the same
    but the output of every second matmul of a layer (torchtitan's op-level policy), "full" only
    each layer's input. Listed from the most kept to the least."""

    NONE = "none"
    SELECTIVE = "selective"
    SELECTIVE_OP = "selective-op"
    FULL = "full"


class Precision(StrEnum):
    """What a plan trains in. The mixed ones keep fp32 master weights and optimizer state and
    compute with 16-bit copies (FSDP2's MixedPrecisionPolicy; DeepSpeed's bf16/fp16 modes);
    fp16 adds dynamic loss scaling. See :mod:`autopar.ir.precision`."""

    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"


OP_NAMESPACE = "autopar"  # torch.ops.autopar.*: the collectives and kernels rewritten graphs call
# A node's meta key: it reads a size from the data, or makes or reads a value of such a size
# (tokens per expert: autopar.passes.capture.data_sizes), so it runs whole on every rank
DATA_SIZED = "autopar_data_sized"
# A compiled program's meta: what it takes after the call's inputs, in order, as (kind, parameter
# name) pairs: EARLIER_GRAD, the gradient the step's earlier microbatches accumulated (the last
# one's program sums it with its own); GRAD_CHUNK, ZeRO-2's chunk of the parameter, into which
# the program reduce-scatters its gradient (autopar.passes.rewrite.compiled; the runtime reads it)
EXTRA_INPUTS = "autopar_extra_inputs"
EARLIER_GRAD, GRAD_CHUNK = "earlier grad", "grad chunk"
# A compiled program's meta: True where, under mixed precision, it takes the fp32 masters and casts
# them itself (it sums gradients itself, in the reduce dtype); else it takes the runtime's copies
CASTS_IN_PROGRAM = "autopar_casts_in_program"
# A node's meta: True on the count a mean loss divides its sum by (the targets it counts, summed over
# the shards that split them): over microbatches, the runtime weighs each microbatch's loss by it
LOSS_COUNT = "autopar_loss_count"


def module_label(path: str) -> str:
    """A module as plans print it and constraints match it: its path, ``"<top>"`` for the model's own forward."""
    return path or "<top>"


_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def layer_of(name: str) -> str | None:
    """The first numbered module in a module path or parameter name (``layers.3.attn.wq.weight``
    → ``layers.3``): an entry of a ModuleList, the unit Megatron and torchtitan checkpoint,
    gather (ZeRO-3) and split into pipeline stages. None outside numbered modules.

    >>> layer_of("layers.3.attn.wq.weight"), layer_of("head.weight")
    ('layers.3', None)
    """
    match = _LAYER.match(name or "")
    return match.group(1) if match else None


def fold_rows(rows: list[dict], field: str = "module", ignore: tuple[str, ...] = ()) -> list[dict]:
    """Table rows (dicts) with identical layers shown once, where the first of them is: rows whose
    ``field`` (a module path or parameter name) lies in ``layers.0`` are renamed ``layers.0-95...``
    when layers 1-95 have rows alike (every other field equal, but those in ``ignore``), and theirs
    are left out; the layer's own row (``field`` the layer itself) reads ``layers.0-95 x96``.
    Layers that repeat with others between them (sliding-window and global attention, dense and
    expert MLPs) read ``layers.{0-2,4-6,...,44-46}``. The shown rows keep the first layer's values."""
    blocks: list[tuple[str | None, list[dict]]] = []  # (layer, its rows), in order
    for row in rows:
        layer = layer_of(row[field])
        if blocks and blocks[-1][0] == layer and layer is not None:
            blocks[-1][1].append(row)
        else:
            blocks.append((layer, [row]))

    def shape(layer: str, block: list[dict]) -> tuple:
        return tuple(
            (row[field][len(layer) :], *(repr(v) for k, v in row.items() if k != field and k not in ignore))
            for row in block
        )

    numbers: dict[tuple, list[int]] = {}  # (prefix, shape) → the numbers of the layers alike, in order
    shown: list[tuple[tuple | None, str | None, list[dict]]] = []  # (key, first layer, its rows)
    for layer, block in blocks:
        prefix, _, number = (layer or "").rpartition(".")
        if layer is None or not number.isdigit():
            shown.append((None, layer, block))
            continue
        key = (prefix, shape(layer, block))
        if key not in numbers:
            numbers[key] = []
            shown.append((key, layer, block))
        numbers[key].append(int(number))
    out: list[dict] = []
    for key, layer, block in shown:
        if key is None or len(numbers[key]) == 1:
            out += block
            continue
        span = f"{key[0]}.{_numbers_text(numbers[key])}"
        for row in block:
            rest = row[field][len(layer) :]
            out.append({**row, field: span + rest if rest else f"{span} x{len(numbers[key])}"})
    return out


def folded_note(names: list[str], lists: str) -> str:
    """The line under a table :func:`fold_rows` folded (``names``: its ``field`` column), naming its
    first run of identical layers and where ``lists`` every one; empty when nothing folded."""
    spans = (re.match(r"(.*?\.(\d+-\d+|\{[^}]*\}))(\.| x|$)", name) for name in names)
    span = next((m for m in spans if m), None)
    if span is None:
        return ""
    ranges = [[int(n) for n in part.split("-")] for part in span[2].strip("{}").split(",") if part != "..."]
    count = sum(r[-1] - r[0] + 1 for r in ranges)
    head = f"{span[1]}: identical layers" if "..." in span[2] else f"{span[1]} x{count}: {count} identical layers"
    return f"{head}, shown once with one layer's numbers ({lists} every one)."


def _numbers_text(numbers: list[int]) -> str:
    """``0-95``; ``{0-2,4}``; ``{0-2,4-6,...,44-46}`` where the ranges are evenly spaced and alike."""
    ranges: list[list[int]] = []
    for number in numbers:
        if ranges and number == ranges[-1][1] + 1:
            ranges[-1][1] = number
        else:
            ranges.append([number, number])
    texts = [f"{first}-{last}" if last > first else f"{first}" for first, last in ranges]
    if len(ranges) == 1:
        return texts[0]
    steps = {b[0] - a[0] for a, b in zip(ranges, ranges[1:])}
    if len(ranges) > 3 and len(steps) == 1 and len({last - first for first, last in ranges}) == 1:
        texts = [texts[0], texts[1], "...", texts[-1]]
    return "{" + ",".join(texts) + "}"


# How a compiled graph's waits are named (``wait_name``): inductor writes a node's name in the
# comment above its call, so a wait that fails (a peer stalled or died) can name its plan nodes.
_WAIT, _BACKWARD, _SHOWN = "wait_for_", "backward_of_", 3


def wait_name(plan_nodes: list[str], backward: bool) -> str:
    """The name a compiled graph gives the wait of the collective(s) of ``plan_nodes`` (the
    program's nodes; several for a bucket): ``wait_for_all_gather_3`` or, in a backward graph,
    ``wait_for_backward_of_all_gather_3__all_gather_5``; :func:`waited_for` reads it back."""
    shown = plan_nodes[:_SHOWN] + ([f"and_{len(plan_nodes) - _SHOWN}_more"] if len(plan_nodes) > _SHOWN else [])
    return _WAIT + (_BACKWARD if backward else "") + "__".join(shown)


def waited_for(name: str) -> str:
    """What :func:`wait_name` named, in words: ``"node all_gather_3"``, ``"the backward of nodes
    a, b, c and 2 more"``; "" for a name it did not make."""
    if not name.startswith(_WAIT):
        return ""
    rest = name.removeprefix(_WAIT)
    nodes = rest.removeprefix(_BACKWARD).split("__")
    counted = re.fullmatch(r"and_(\d+)_more", nodes[-1])
    if counted:
        nodes.pop()
    more = int(counted.group(1)) if counted else 0
    text = ("nodes " if len(nodes) + more > 1 else "node ") + ", ".join(nodes) + (f" and {more} more" if more else "")
    return f"the backward of {text}" if rest.startswith(_BACKWARD) else text
