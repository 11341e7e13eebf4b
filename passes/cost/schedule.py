"""Whole-layer techniques and what they do to a plan's cost: activation recomputation,
microbatches (gradient accumulation) and pipeline stages under each pipeline schedule.

Per schedule, for p stages, v stage modules per device and m microbatches: the idle share
of a step (the bubble) and the microbatches whose activations a device holds at the peak:

- GPipe: bubble (p − 1)/m; all m microbatches in flight.
- 1F1B: bubble (p − 1)/m; up to p in flight (the first stage).
- Interleaved 1F1B: bubble (p − 1)/(v·m); p·(1 + (p − 1)/(p·v)) in flight (Megatron-LM).
- Interleaved zero-bubble: weight gradients fill about two thirds of that bubble (ZB-H1), same memory.
- ZB-V: no bubble when forward, input- and weight-backward take as long; about 2p in flight
  (ZB-H2's price for a zero bubble).

A layer is the ops under one numbered module (``layers.3``: an entry of a ModuleList), the
unit Megatron and torchtitan checkpoint and split into stages. Everything outside layers
(embedding, final norm, head, loss) stays as it is.

Pre: the cost of a configuration run as one batch, without recomputation, and the local
shapes it was computed from. Post: the same configuration's cost under a :class:`Schedule`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.ir import Cost, HardwareProfile, LinkTier, PipelineKind, Recompute, Schedule
from autopar.passes.cost.efficiency import GEMMS
from autopar.passes.cost.facts import NodeFacts, ShardedShapes, saved_bytes
from autopar.passes.cost.ops import maximum
from autopar.passes.cost.overlap import boundary_seconds, exposed_grad_sync, exposed_tp_comm, pipeline_messages
from autopar.passes.rewrite.recompute import kept_by_selective
from autopar.passes.search.partition import partition
from autopar.passes.sharding.strategies import numel

BUBBLE_FACTOR = {
    PipelineKind.GPIPE: 1.0,
    PipelineKind.ONE_F_ONE_B: 1.0,
    PipelineKind.INTERLEAVED_1F1B: 1.0,
    PipelineKind.INTERLEAVED_ZB: 1 / 3,
    PipelineKind.ZBV: 0.0,
}


def in_flight(schedule: Schedule) -> float:
    """Microbatches whose saved activations one device holds at the peak (of its own layers)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    if p == 1:
        return 1.0
    if schedule.kind == PipelineKind.GPIPE:
        return float(m)
    if schedule.kind == PipelineKind.ZBV:
        return float(min(2 * p, m))
    if schedule.kind == PipelineKind.ONE_F_ONE_B:
        return float(min(p, m))
    return min(p, m) * (1 + (p - 1) / (p * v))


def bubble_share(schedule: Schedule) -> float:
    """The share of a device's busy time it idles in the pipeline's fill and drain."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    return BUBBLE_FACTOR[schedule.kind] * (p - 1) / (v * m) if p > 1 else 0.0


def kept_share(fact: NodeFacts, schedule: Schedule) -> float:
    """The share of what autograd saves for this node that one device holds at the peak:
    the stage's microbatches in flight (:func:`in_flight`), nothing inside a
    layer under full recomputation (only layer inputs, counted in :func:`schedule_cost`),
    only what matmuls and attention save under selective recomputation."""
    share = min(1.0, in_flight(schedule) / schedule.microbatches)
    if fact.layer is None:
        return share
    if schedule.recompute == Recompute.FULL or (
        schedule.recompute == Recompute.SELECTIVE and not kept_by_selective(fact.node.target)
    ):
        return 0.0
    return share / schedule.stages


def forward_share(fact: NodeFacts) -> float:
    """The share of a node's forward + backward time its forward takes: by FLOPs, half for a
    memory-bound op (as many bytes each way)."""
    flops = fact.profile.forward_flops + fact.profile.backward_flops
    return fact.profile.forward_flops / flops if flops else 0.5


@dataclass(frozen=True)
class StepParts:
    """What :func:`autopar.passes.cost.evaluate.evaluate` knows of a step (one batch, one stage, all
    microbatches) that placing its overlaps needs (:mod:`autopar.passes.cost.overlap`)."""

    compute_s: float = 0.0  # compute of the step (all stages), of which:
    backward_s: float = 0.0  # compute in backward passes
    gemm_s: float = 0.0  # compute in GEMMs, forward and backward
    tp_comm_s: float = 0.0  # tensor-parallel collectives (part of cost.comm_s), before any overlap
    scatter: int = 1  # tensor-parallel ranks: a boundary they hold whole crosses as 1/scatter each
    scatter_link: LinkTier | None = None  # the link those pieces are all-gathered over
    replicated: frozenset[str] = frozenset()  # nodes whose output every tensor-parallel rank holds whole
    zero: int = 0  # the ZeRO stage: when data-parallel traffic flows (overlap.exposed_grad_sync)


def schedule_cost(
    cost: Cost,
    facts: dict[str, NodeFacts],
    local: ShardedShapes,
    schedule: Schedule,
    hardware: HardwareProfile,
    link,
    parts: StepParts = StepParts(),
) -> Cost:
    """``cost`` (one batch, everything saved, one stage, no overlap) under ``schedule``.

    Recomputation adds the forward of what it drops. Microbatches divide what is in flight;
    a pipeline gives each device its stage modules' layers (cut by :func:`autopar.passes.search.partition.partition`:
    the busiest device sets the pace) and their state, holds :func:`in_flight` microbatches,
    idles :func:`bubble_share` of its step and sends each microbatch's boundary activation
    forward and its gradient back over ``link``. What overlaps hide of tensor-parallel
    collectives, gradient sync and boundary transfers is :mod:`autopar.passes.cost.overlap`'s.
    """
    stages, micro = schedule.stages, schedule.microbatches
    kept = outside = recompute_s = recompute_gemm_s = 0.0
    layer_saved: dict[str, float] = {}
    layer_inputs: dict[str, set[str]] = {}
    saved_by_node = saved_bytes(facts, local)  # moved inputs an op saves count as the copies they are
    for name, fact in facts.items():
        if fact.kind not in ("op", "input"):
            continue
        saved = saved_by_node[name]
        layer = fact.layer
        if layer is None:
            outside += saved
            continue
        layer_saved[layer] = layer_saved.get(layer, 0.0) + saved
        inputs = layer_inputs.setdefault(layer, set())
        inputs.update(
            s.name for s in fact.slots if facts[s.name].kind in ("op", "input") and facts[s.name].layer != layer
        )
        forward_s = fact.seconds(local.work[name], local.slot_shapes[name], micro) * forward_share(fact)
        if schedule.recompute == Recompute.FULL or (
            schedule.recompute == Recompute.SELECTIVE and not kept_by_selective(fact.node.target)
        ):
            recompute_s += forward_s
            recompute_gemm_s += forward_s if fact.node.target in GEMMS else 0.0
        if schedule.recompute == Recompute.SELECTIVE and kept_by_selective(fact.node.target):
            kept += saved
    checkpoints = {
        layer: sum(_bytes(facts[n], local.shapes[n]) for n in names) for layer, names in layer_inputs.items()
    }
    if schedule.recompute == Recompute.FULL:
        in_layers = sum(checkpoints.values()) + maximum(0.0, *layer_saved.values())
    elif schedule.recompute == Recompute.SELECTIVE:
        in_layers = kept
    else:
        in_layers = sum(layer_saved.values())
    split = partition(facts, local, schedule, link) if stages > 1 else None
    time_share, param_share = (split.time_share, split.param_share) if split else (1.0, 1.0)
    memory = dict(cost.memory)
    memory["activations"] = (in_layers / stages + outside) / micro * min(in_flight(schedule), micro)
    memory["temporary"] = cost.memory.get("temporary", 0.0) / micro
    for category in ("params", "grads", "optimizer", "grad_buckets"):
        memory[category] = cost.memory.get(category, 0.0) * param_share
    # full recomputation runs each layer's forward again, its collectives too: about half the step's
    again = 1.5 if schedule.recompute == Recompute.FULL else 1.0
    tp_comm = parts.tp_comm_s * again
    comm = (cost.comm_s - parts.tp_comm_s) * again + exposed_tp_comm(
        tp_comm, parts.gemm_s + recompute_gemm_s, hardware.tp_overlap
    )
    work = (cost.compute_s + recompute_s + comm) * time_share
    sync_window = sync_window_s(parts, time_share, micro)
    return dataclasses.replace(
        cost,
        compute_s=(cost.compute_s + recompute_s) * time_share,
        comm_s=comm * time_share,
        grad_sync_s=exposed_grad_sync(cost.grad_sync_s * param_share, sync_window, hardware.overlap),
        optimizer_s=cost.optimizer_s * param_share,
        pipeline_s=work * bubble_share(schedule)
        + _boundary_transfers(checkpoints, layer_inputs, schedule, hardware, link, parts),
        model_flops=cost.model_flops * time_share,
        memory=memory,
    )


def sync_window_s(parts: StepParts, time_share: float, microbatches: int) -> float:
    """The compute data-parallel traffic can hide behind, on the busiest device (``time_share``
    of the step's compute): the last microbatch's backward (buckets reduce as it produces them),
    every microbatch's backward under ZeRO-2 (reduce-scatter per microbatch), the whole step's
    compute under ZeRO-3 (parameter gathers are prefetched in forward and backward)."""
    if parts.zero >= 3:
        return parts.compute_s * time_share
    backward = parts.backward_s * time_share
    return backward if parts.zero == 2 else backward / microbatches


def _boundary_transfers(checkpoints, layer_inputs, schedule: Schedule, hardware: HardwareProfile, link, parts) -> float:
    """Seconds of stage-boundary transfers on the critical path (:mod:`overlap`): the largest
    layer input of one microbatch, scattered over the tensor-parallel ranks when they all hold it."""
    if schedule.stages <= 1:
        return 0.0
    if not checkpoints:
        return 0.0
    whole = all(names <= parts.replicated for names in layer_inputs.values())
    seconds = boundary_seconds(
        maximum(0.0, *checkpoints.values()) / schedule.microbatches,
        link,
        parts.scatter if whole else 1,
        parts.scatter_link,
    )
    messages = pipeline_messages(schedule.stages, schedule.microbatches, schedule.virtual, hardware.p2p_overlap)
    return messages * seconds


def _bytes(fact: NodeFacts, shapes) -> float:
    return sum(numel(s) for s in shapes) * fact.elem_bytes
