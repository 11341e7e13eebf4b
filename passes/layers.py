"""Whole-layer techniques and what they do to a plan's cost: activation recomputation,
microbatches (gradient accumulation) and pipeline stages.

A layer is the ops under one numbered module (``layers.3``: an entry of a ModuleList), the
unit Megatron and torchtitan checkpoint and split into stages. Everything outside layers
(embedding, final norm, head, loss) stays as it is.

Pre: the cost of a configuration run as one batch, without recomputation, and the local
shapes it was computed from. Post: the same configuration's cost under a :class:`Schedule`.
"""

from __future__ import annotations

import dataclasses

from autopar.ir import Cost, HardwareProfile, Schedule

from .cost import collective_time
from .facts import NodeFacts, ShardedShapes, activation_bytes
from .strategies import numel

_KEPT_BY_SELECTIVE = ("mm", "linear", "matmul", "attention", "embedding", "convolution")  # saves worth their memory


def kept_share(fact: NodeFacts, schedule: Schedule) -> float:
    """The share of what autograd saves for this node that one device holds at the peak:
    the stage's microbatches in flight (1F1B: up to p on the first stage), nothing inside a
    layer under full recomputation (only layer inputs, counted in :func:`schedule_cost`),
    only what matmuls and attention save under selective recomputation."""
    in_flight = min(schedule.stages, schedule.microbatches) / schedule.microbatches
    if fact.layer is None:
        return in_flight
    if schedule.recompute == "full" or (schedule.recompute == "selective" and not _kept_by_selective(fact)):
        return 0.0
    return in_flight / schedule.stages


def _forward_share(fact: NodeFacts) -> float:
    flops = fact.profile.forward_flops + fact.profile.backward_flops
    return fact.profile.forward_flops / flops if flops else 0.5  # memory-bound: as many bytes each way


def schedule_cost(cost: Cost, facts: dict[str, NodeFacts], local: ShardedShapes, schedule: Schedule, hardware: HardwareProfile, link) -> Cost:
    """``cost`` (one batch, everything saved, one stage) under ``schedule``.

    Recomputation adds the forward of what it drops. Microbatches divide what is in flight;
    a pipeline of p stages gives each device 1/p of the layers and their state, keeps up to
    p microbatches in flight on the first stage (1F1B), idles (p − 1)/m of a stage's step
    (the bubble) and sends each microbatch's boundary activation forward and its gradient
    back over ``link``.
    """
    stages, micro = schedule.stages, schedule.microbatches
    kept = outside = recompute_s = 0.0
    layer_saved: dict[str, float] = {}
    layer_inputs: dict[str, set[str]] = {}
    for name, fact in facts.items():
        if fact.kind not in ("op", "input"):
            continue
        saved = activation_bytes(fact, local.shapes[name], local.work[name])
        layer = fact.layer
        if layer is None:
            outside += saved
            continue
        layer_saved[layer] = layer_saved.get(layer, 0.0) + saved
        inputs = layer_inputs.setdefault(layer, set())
        inputs.update(s.name for s in fact.slots if facts[s.name].kind in ("op", "input") and facts[s.name].layer != layer)
        forward_s = fact.full_time_s * local.work[name] * _forward_share(fact)
        if schedule.recompute == "full" or (schedule.recompute == "selective" and not _kept_by_selective(fact)):
            recompute_s += forward_s
        if schedule.recompute == "selective" and _kept_by_selective(fact):
            kept += saved
    checkpoints = {layer: sum(_bytes(facts[n], local.shapes[n]) for n in names) for layer, names in layer_inputs.items()}
    if schedule.recompute == "full":
        in_layers = sum(checkpoints.values()) + max(layer_saved.values(), default=0.0)
    elif schedule.recompute == "selective":
        in_layers = kept
    else:
        in_layers = sum(layer_saved.values())
    in_flight = min(stages, micro)  # 1F1B: the first stage holds up to p microbatches
    memory = dict(cost.memory)
    memory["activations"] = (in_layers / stages + outside) / micro * in_flight
    memory["temporary"] = cost.memory.get("temporary", 0.0) / micro
    for category in ("params", "grads", "optimizer", "grad_buckets"):
        memory[category] = cost.memory.get(category, 0.0) / stages
    # full recomputation runs each layer's forward again, its collectives too: about half the step's
    recompute_comm = cost.comm_s / 2 if schedule.recompute == "full" else 0.0
    comm = cost.comm_s + recompute_comm
    work = (cost.compute_s + recompute_s + comm) / stages
    boundary = max(checkpoints.values(), default=0.0) / micro
    transfers = 2 * (micro + stages - 2) * collective_time("send_recv", boundary, 2, link) if stages > 1 else 0.0
    return dataclasses.replace(
        cost,
        compute_s=(cost.compute_s + recompute_s) / stages,
        comm_s=comm / stages,
        grad_sync_s=cost.grad_sync_s / stages,
        optimizer_s=cost.optimizer_s / stages,
        pipeline_s=work * (stages - 1) / micro + transfers,
        model_flops=cost.model_flops / stages,
        memory=memory,
    )


def _kept_by_selective(fact: NodeFacts) -> bool:
    return any(word in str(fact.node.target) for word in _KEPT_BY_SELECTIVE)


def _bytes(fact: NodeFacts, shapes) -> float:
    return sum(numel(s) for s in shapes) * fact.elem_bytes
