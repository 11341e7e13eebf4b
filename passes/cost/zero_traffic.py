"""What ZeRO moves on the data-parallel axis, per parameter and per layer (Rajbhandari et al.
2020, §5-7), as autopar's runtime moves it and as the stacks a hardware profile describes do.

:func:`autopar.passes.cost.axis_terms.partial_gradients` prices each parameter with
:func:`param_sync`; :func:`autopar.passes.cost.axis_terms.traffic` adds each layer's latency
(:func:`zero3_layer_s`) and the gathers a recomputed forward adds (:func:`recompute_gathers_s`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from autopar.ir import Axis
from autopar.passes.cost.collectives import GRAD_BUCKET_BYTES, collective_time, grad_sync_time
from autopar.passes.sharding.strategies import numel

if TYPE_CHECKING:
    from autopar.passes.cost.axis_terms import AxisContext


def param_sync(
    param_bytes: float,
    grad_bytes: float,
    ctx: AxisContext,
    master_bytes: float | None = None,
    trainable: bool = True,
    reduced: bool = True,
    elements: float = math.inf,
) -> tuple[float, float]:
    """(seconds, seconds once per step) of one parameter's data-parallel traffic under ZeRO.
    Stages 0-1 all-reduce the gradient once per step; stage 1 then all-gathers the stepped weight
    (``master_bytes``: fp32 masters under mixed precision), as autopar's runtime and DeepSpeed's
    bf16 pipeline do; a stack that reduce-scatters the gradient instead (``zero1_reduce_scatter``:
    Megatron's distributed optimizer) then gathers the stepped compute copy (``param_bytes``: bf16
    under mixed precision). Stage 2 reduce-scatters the gradient every microbatch and gathers the
    stepped weight once per step; stage 3 reduce-scatters it and gathers the parameter's compute
    copy (``param_bytes``) for forward and again for backward, every microbatch (for stages 2-3 the
    first figure is per microbatch: :class:`autopar.passes.cost.evaluate.PricedConfiguration`
    counts it so). Gradients and stepped weights go in the stack's buckets (``grad_bucket_bytes``),
    each paying a collective's latency once; ZeRO-3 moves a layer's parameters in one collective
    each way, whose latency :func:`zero3_layer_s` adds per layer, or, for a stack that moves each
    parameter alone (``zero3_per_parameter``), each gather and reduce-scatter its own (with one copy
    per rank where the stack passes a tensor per rank: :func:`_rank_copies_s`). A parameter
    of fewer ``elements`` than the stack's ``zero3_persist_elements`` stays whole on every rank:
    only its gradient moves (its one gather after the step, coalesced with the others', is left
    out: a few biases' and norms' bytes). Under ZeRO-3 a gradient that is not ``reduced`` (its op
    ran whole on every rank) is cut to the rank's chunk, not reduce-scattered; a frozen parameter
    (not ``trainable``) moves nothing but the forward gather: the runtime saves its whole copy for
    backward rather than gathering it again (:mod:`autopar.runtime.zero.gather`)."""
    if not trainable and (ctx.name != Axis.DP or ctx.zero != 3):
        return 0.0, 0.0
    bucket = (ctx.hardware.grad_bucket_bytes if ctx.hardware else 0.0) or GRAD_BUCKET_BYTES
    if ctx.name != Axis.DP or ctx.zero == 0:
        return grad_sync_time(grad_bytes, ctx.size, ctx.link, bucket), 0.0
    stepped = grad_sync_time(
        param_bytes if master_bytes is None else master_bytes, ctx.size, ctx.link, bucket, kind="all_gather"
    )
    if ctx.zero == 1:
        if ctx.hardware is not None and ctx.hardware.zero1_reduce_scatter:  # the stepped compute copies gathered
            scatter = grad_sync_time(grad_bytes, ctx.size, ctx.link, bucket, kind="reduce_scatter")
            return scatter, grad_sync_time(param_bytes, ctx.size, ctx.link, bucket, kind="all_gather")
        return grad_sync_time(grad_bytes, ctx.size, ctx.link, bucket), stepped
    if ctx.zero == 2:
        return grad_sync_time(grad_bytes, ctx.size, ctx.link, bucket, kind="reduce_scatter"), stepped
    # bandwidth only: the layer pays the latency (zero3_layer_s), or each collective its own (a stack that moves alone)
    alone = _alone(ctx)
    bucket = grad_bytes if alone else math.inf
    scatter = grad_sync_time(grad_bytes, ctx.size, ctx.link, bucket, kind="reduce_scatter") if reduced else 0.0
    scatter += _rank_copies_s(ctx) if reduced and alone else 0.0
    if ctx.hardware is not None and elements < ctx.hardware.zero3_persist_elements:
        return scatter, 0.0
    gather = zero3_gather_s(param_bytes, ctx)
    return (scatter + 2 * gather if trainable else gather), 0.0


def zero3_gather_s(param_bytes: float, ctx: AxisContext) -> float:
    """One ZeRO-3 gather of a parameter's compute copy: bandwidth only where the layer's
    collective pays the latency (:func:`zero3_layer_s`), its own latency for a stack that gathers
    each parameter alone."""
    alone = _alone(ctx)
    bucket = param_bytes if alone else math.inf
    return grad_sync_time(param_bytes, ctx.size, ctx.link, bucket, kind="all_gather") + (
        _rank_copies_s(ctx) if alone else 0.0
    )


def zero3_layer_s(ctx: AxisContext) -> float:
    """The latency ZeRO-3 pays per layer on the data-parallel axis, per microbatch: the runtime
    gathers a layer's parameters in one collective for forward and again for backward, and
    reduce-scatters their gradients in one (:mod:`autopar.runtime.zero.gather`, as FSDP2 does
    per block), with a stack's copies per rank (:func:`_rank_copies_s`); 0 elsewhere, and for a
    stack whose every collective moves one parameter (:func:`param_sync` charges those)."""
    if ctx.name != Axis.DP or ctx.zero != 3 or ctx.size <= 1 or _alone(ctx):
        return 0.0
    quiet = dataclasses.replace(ctx.link, sync_s=0.0)
    return (
        collective_time("reduce_scatter", 1.0, ctx.size, quiet)
        + 2 * collective_time("all_gather", 1.0, ctx.size, quiet)
        + 3 * _rank_copies_s(ctx)
    )


def recompute_gathers_s(facts, params: list[str], ctx: AxisContext, param_shapes: dict) -> float:
    """Seconds per microbatch that a fully recomputed forward adds to ZeRO-3's gathers, for a
    stack that releases a gathered parameter after each use unless the parameters used before
    its next use number fewer than ``zero3_reuse_elements`` (DeepSpeed's
    ``stage3_max_reuse_distance``; 0: not such a stack). Such a stack gathers a layer's weights
    for its forward, again for the recomputed forward, and again for backward each weight but
    those used last: between a weight's recomputed forward and its backward lie the forward and
    the backward of the layer's weights after it (twice their elements). autopar's runtime, as
    FSDP, gathers a layer once for its recomputed forward and backward together: 0.

    ``params``: what the axis moves (parameters and activations), in the order ops use them."""
    hardware = ctx.hardware
    if ctx.name != Axis.DP or ctx.zero != 3 or ctx.size <= 1 or hardware is None or not hardware.zero3_reuse_elements:
        return 0.0
    by_layer: dict[str, list[str]] = {}
    for name in params:
        fact = facts[name]
        if fact.kind == "param" and fact.needs_grad and fact.gather_group:  # outside layers: not recomputed
            by_layer.setdefault(fact.gather_group, []).append(name)
    seconds = 0.0
    for names in by_layer.values():
        after = 0.0  # elements of the layer's parameters used after this one
        for name in reversed(names):
            elements = numel(param_shapes[name])
            released = 2 * after >= hardware.zero3_reuse_elements
            if released and elements >= hardware.zero3_persist_elements:
                seconds += zero3_gather_s(elements * facts[name].elem_bytes, ctx) * facts[name].weight
            after += elements
    return seconds


def _alone(ctx: AxisContext) -> bool:
    return ctx.hardware is not None and ctx.hardware.zero3_per_parameter


def _rank_copies_s(ctx: AxisContext) -> float:
    """What one ZeRO-3 collective of a stack that passes one tensor per rank adds
    (``zero3_copies_per_rank``): torch's NCCL process group copies each of them to or from a
    flat buffer, one launch per rank of the group."""
    hardware = ctx.hardware
    return ctx.size * hardware.op_overhead_s if hardware is not None and hardware.zero3_copies_per_rank else 0.0
