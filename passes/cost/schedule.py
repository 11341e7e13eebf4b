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

from autopar.ir import Cost, HardwareProfile, PipelineKind, Recompute, Schedule
from autopar.passes.cost.facts import NodeFacts, ShardedShapes, saved_bytes
from autopar.passes.cost.ops import collective_time, maximum
from autopar.passes.rewrite.recompute import kept_by_selective
from autopar.passes.search.partition import StageSplit, partition
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
    if dropped(fact, schedule.recompute):
        return 0.0
    return share / schedule.stages


def dropped(fact: NodeFacts, level: str) -> bool:
    """Whether recomputation at ``level`` drops what autograd saves for this node and runs its
    forward again: every op inside a layer under full recomputation, under selective those
    whose outputs it does not keep."""
    return fact.layer is not None and (
        level == Recompute.FULL or level == Recompute.SELECTIVE and not kept_by_selective(fact.node.target)
    )


def forward_share(fact: NodeFacts) -> float:
    """The share of an op's time its forward takes (what recomputing it costs again)."""
    flops = fact.profile.forward_flops + fact.profile.backward_flops
    return fact.profile.forward_flops / flops if flops else 0.5  # memory-bound: as many bytes each way


@dataclass(frozen=True)
class LayerTerms:
    """What a schedule's cost needs of one solved configuration, summed once over its nodes
    (each weighed by :attr:`NodeFacts.weight`) for every schedule priced on it."""

    outside: float  # bytes autograd saves outside layers
    in_layers: dict[str, float]  # recomputation level → bytes a device keeps inside layers (one stage, one batch)
    recompute_s: dict[str, float]  # recomputation level → the forward it runs again
    boundary: float  # the largest layer input: what a stage boundary sends per batch


def layer_terms(facts: dict[str, NodeFacts], local: ShardedShapes) -> LayerTerms:
    """:class:`LayerTerms` of the configuration whose local shapes are ``local``."""
    outside = kept = 0.0
    recompute = dict.fromkeys(Recompute, 0.0)
    layer_saved: dict[str, float] = {}
    layer_weight: dict[str, int] = {}
    layer_inputs: dict[str, set[str]] = {}
    saved_by_node = saved_bytes(facts, local)  # moved inputs an op saves count as the copies they are
    for name, fact in facts.items():
        if fact.kind not in ("op", "input"):
            continue
        saved = saved_by_node[name]
        layer = fact.layer
        if layer is None:
            outside += saved * fact.weight
            continue
        layer_saved[layer] = layer_saved.get(layer, 0.0) + saved
        layer_weight[layer] = fact.weight
        inputs = layer_inputs.setdefault(layer, set())
        inputs.update(
            s.name for s in fact.slots if facts[s.name].kind in ("op", "input") and facts[s.name].layer != layer
        )
        forward_s = fact.full_time_s * local.work[name] * forward_share(fact) * fact.weight
        recompute[Recompute.FULL] += forward_s
        if kept_by_selective(fact.node.target):
            kept += saved * fact.weight
        else:
            recompute[Recompute.SELECTIVE] += forward_s
    checkpoints = {
        layer: sum(_bytes(facts[n], local.shapes[n]) for n in names) for layer, names in layer_inputs.items()
    }
    in_layers = {
        Recompute.NONE: sum(saved * layer_weight[layer] for layer, saved in layer_saved.items()),
        Recompute.SELECTIVE: kept,
        Recompute.FULL: sum(nbytes * layer_weight[layer] for layer, nbytes in checkpoints.items())
        + maximum(0.0, *layer_saved.values()),
    }
    return LayerTerms(outside, in_layers, recompute, maximum(0.0, *checkpoints.values()))


def schedule_cost(
    cost: Cost, facts: dict[str, NodeFacts], local: ShardedShapes, schedule: Schedule, hardware: HardwareProfile, link
) -> Cost:
    """``cost`` (one batch, everything saved, one stage) under ``schedule``.

    Recomputation adds the forward of what it drops. Microbatches divide what is in flight;
    a pipeline gives each device its stage modules' layers (cut by :func:`autopar.passes.search.partition.partition`:
    the busiest device sets the pace) and their state, holds :func:`in_flight` microbatches,
    idles :func:`bubble_share` of its step and sends each microbatch's boundary activation
    forward and its gradient back over ``link``.
    """
    split = partition(facts, local, schedule, link) if schedule.stages > 1 else None
    return scheduled(cost, layer_terms(facts, local), schedule, split, link)


def scheduled(cost: Cost, terms: LayerTerms, schedule: Schedule, split: StageSplit | None, link) -> Cost:
    """:func:`schedule_cost` from the configuration's :class:`LayerTerms` and, with stages, its stage split."""
    stages, micro = schedule.stages, schedule.microbatches
    time_share, param_share = (split.time_share, split.param_share) if split else (1.0, 1.0)
    memory = dict(cost.memory)
    memory["activations"] = (
        (terms.in_layers[schedule.recompute] / stages + terms.outside) / micro * min(in_flight(schedule), micro)
    )
    memory["temporary"] = cost.memory.get("temporary", 0.0) / micro
    for category in ("params", "grads", "optimizer", "grad_buckets"):
        memory[category] = cost.memory.get(category, 0.0) * param_share
    # full recomputation runs each layer's forward again, its collectives too: about half the step's
    recompute_comm = cost.comm_s / 2 if schedule.recompute == Recompute.FULL else 0.0
    recompute_s = terms.recompute_s[schedule.recompute]
    comm = cost.comm_s + recompute_comm
    work = (cost.compute_s + recompute_s + comm) * time_share
    boundary = terms.boundary / micro
    messages = 2 * (schedule.virtual * micro + stages - 2)
    transfers = messages * collective_time("send_recv", boundary, 2, link) if stages > 1 else 0.0
    return dataclasses.replace(
        cost,
        compute_s=(cost.compute_s + recompute_s) * time_share,
        comm_s=comm * time_share,
        grad_sync_s=cost.grad_sync_s * param_share,
        optimizer_s=cost.optimizer_s * param_share,
        pipeline_s=work * bubble_share(schedule) + transfers,
        model_flops=cost.model_flops * time_share,
        memory=memory,
    )


def _bytes(fact: NodeFacts, shapes) -> float:
    return sum(numel(s) for s in shapes) * fact.elem_bytes
