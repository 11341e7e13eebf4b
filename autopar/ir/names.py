"""Names that planning and running must agree on: mesh axes, parallel kernels, pipeline
schedules, recomputation levels, the torch op namespace, and which layer a name belongs to.

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
    "selective" keeps what matmuls, attention and collectives produce, "full" only each layer's input."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Precision(StrEnum):
    """What a plan trains in. The mixed ones keep fp32 master weights and optimizer state and
    compute with 16-bit copies (FSDP2's MixedPrecisionPolicy; DeepSpeed's bf16/fp16 modes);
    fp16 adds dynamic loss scaling. See :mod:`autopar.ir.precision`."""

    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"


OP_NAMESPACE = "autopar"  # torch.ops.autopar.*: the collectives and kernels rewritten graphs call


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
