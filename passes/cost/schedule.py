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
from autopar.passes.cost.facts import NodeFacts, ShardedShapes, saved_bytes, transient_bytes
from autopar.passes.cost.ops import maximum, moves_no_data
from autopar.passes.cost.overlap import boundary_seconds, exposed_grad_sync, exposed_tp_comm, pipeline_messages
from autopar.passes.rewrite.recompute import kept_at
from autopar.passes.search.partition import StageSplit, partition
from autopar.passes.sharding.strategies import numel

RECOMPUTED = tuple(level for level in Recompute if level != Recompute.NONE)  # the levels that run a forward again
SELECTIVE_LEVELS = (Recompute.SELECTIVE, Recompute.SELECTIVE_OP)  # the levels that keep some ops' outputs
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


def in_flight_after_layers(schedule: Schedule) -> float:
    """Microbatches whose activations after the layers (head, loss) the last stage module holds
    at once: one, as its backward follows its forward, except under GPipe (all forwards first)."""
    return in_flight(schedule) if schedule.kind == PipelineKind.GPIPE else 1.0


def bubble_share(schedule: Schedule) -> float:
    """The share of a device's busy time it idles in the pipeline's fill and drain."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    return BUBBLE_FACTOR[schedule.kind] * (p - 1) / (v * m) if p > 1 else 0.0


def kept_share(fact: NodeFacts, schedule: Schedule) -> float:
    """The share of what autograd saves for this node that one device holds at the peak:
    the stage's microbatches in flight (:func:`in_flight`; after the layers, the last stage
    module's: :func:`in_flight_after_layers`), nothing inside a layer under full recomputation
    (only layer inputs, counted in :func:`schedule_cost`), only what matmuls and attention save
    under selective recomputation."""
    share = min(1.0, in_flight(schedule) / schedule.microbatches)
    if fact.layer is None:
        return min(1.0, in_flight_after_layers(schedule) / schedule.microbatches) if fact.after_layers else share
    if dropped(fact, schedule.recompute):
        return 0.0
    return share / schedule.stages


def dropped(fact: NodeFacts, level: str) -> bool:
    """Whether recomputation at ``level`` drops what autograd saves for this node and runs its
    forward again: the ops inside a layer whose outputs the level does not keep (:func:`kept_at`)."""
    return fact.layer is not None and not kept_at(level, fact.node.target, fact.matmuls_before)


def output_held(fact: NodeFacts, level: str) -> bool | None:
    """Whether a device holds this node's output at ``level`` whoever reads it, for the ILP's
    per-node memory row: under the selective levels, the output of every op of a layer the level
    keeps (the runtime keeps it for the recompute; the row leaves out a partial sum, which only
    its reduction reads); None elsewhere: as autograd saves it. :func:`selective_held` prices
    the solved layout, reader by reader."""
    return True if level in SELECTIVE_LEVELS and fact.layer is not None and not dropped(fact, level) else None


def selective_held(facts: dict[str, NodeFacts], local: ShardedShapes, level: str, regathered=frozenset()):
    """Bytes each layer holds between its forward and its backward at a selective ``level``:
    what :class:`autopar.passes.rewrite.recompute._KeptOutputs` keeps for the recompute.

    - the output of each op the level keeps that an op of its layer reads as it is (through
      views, what reads those), and what the op saves besides (attention's statistics);
    - not an output only moves read (a row-parallel linear's partial sum, read by its
      reduction): the collectives are kept, and each one's output an op of the layer reads is
      held instead, once per value, local shape and :func:`~autopar.passes.cost.facts.move_scope` (q, k and v
      read one).
    An input in ``regathered`` is read as it is (its shard, gathered again in backward).
    """
    needed: set[str] = set()  # kept or viewed outputs an op of their layer reads as they are
    moves: dict[tuple, tuple[str, float]] = {}  # one collective's output → (its layer, bytes)
    for name in reversed(facts):  # readers before what they read
        fact = facts[name]
        if fact.kind != "op" or fact.layer is None:
            continue
        view = moves_no_data(fact.node.target) and dropped(fact, level)
        for slot, value in enumerate(fact.slots):
            if (name, slot) in local.moved and (name, slot) not in regathered:
                shape = tuple(local.slot_shapes[name][slot])
                nbytes = numel(shape) * facts[value.name].elem_bytes
                moves[(value.name, shape, fact.scope)] = (fact.layer, nbytes)
            elif facts[value.name].layer == fact.layer and (not view or name in needed):
                needed.add(value.name)
    held: dict[str, float] = {}
    for name, fact in facts.items():
        if fact.kind == "op" and fact.layer is not None and not dropped(fact, level):
            output = _bytes(fact, local.shapes[name]) if name in needed or fact.profile.saves_output else 0.0
            held[fact.layer] = held.get(fact.layer, 0.0) + output + fact.profile.saved_extra_bytes * local.work[name]
    for layer, nbytes in moves.values():
        held[layer] = held.get(layer, 0.0) + nbytes
    return held


def forward_share(fact: NodeFacts) -> float:
    """The share of a node's forward + backward time its forward takes, as the op is priced
    (:func:`autopar.passes.cost.ops.compute_time`): by FLOPs where they are counted, else by the
    bytes each pass moves; all of it where no gradient flows. The one rule the step's sums, the
    search's bounds and the compiled replay share."""
    if not fact.needs_grad:
        return 1.0
    profile = fact.profile
    flops = profile.forward_flops + profile.backward_flops
    if flops:
        return profile.forward_flops / flops
    moved = profile.io_bytes + (profile.backward_io_bytes or profile.io_bytes)
    return profile.io_bytes / moved if moved else 0.5


@dataclass(frozen=True)
class StepParts:
    """What placing a step's overlaps needs (:mod:`autopar.passes.cost.overlap`) of a solved layout,
    whatever its schedule."""

    tp_comm_s: float = 0.0  # tensor-parallel collectives (part of cost.comm_s), before any overlap
    scatter: int = 1  # tensor-parallel ranks: a boundary they hold whole crosses as 1/scatter each
    scatter_link: LinkTier | None = None  # the link those pieces are all-gathered over
    replicated: frozenset[str] = frozenset()  # nodes whose output every tensor-parallel rank holds whole
    zero: int = 0  # the ZeRO stage: when data-parallel traffic flows (overlap.exposed_grad_sync)
    replayed: bool = False  # a compiled step's replay (:mod:`replay`) already placed what hides
    gather_once_s: float = 0.0  # ZeRO-1/2's parameter all-gather after the optimizer, exposed
    accumulate_s: float = 0.0  # each microbatch after the first adding its gradients (ops.accumulation_s)


@dataclass(frozen=True)
class LayerTerms:
    """What a schedule's cost needs of one solved configuration's bytes, summed once over its
    nodes (each weighed by :attr:`NodeFacts.weight`) for every schedule priced on it."""

    outside: float  # bytes autograd saves outside layers, before the last one (embeddings)
    in_layers: dict[str, float]  # recomputation level → bytes a device keeps inside layers (one stage, one batch)
    boundary: float  # the largest layer input: what a stage boundary sends per batch
    boundary_inputs: frozenset[str] = frozenset()  # the nodes whose outputs enter layers
    after: float = 0.0  # bytes autograd saves after the layers (head, loss: NodeFacts.after_layers)
    # recomputation level → the most a layer's backward holds of what it recomputes, beside one
    # op's transients (one batch): never beside the transients after the layers (their backward ran)
    recomputing: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class StepTimes:
    """A solved configuration's compute, its batch run in some number of microbatches (GEMMs and
    attention run at the efficiency of a microbatch's shapes: :meth:`NodeFacts.seconds`)."""

    compute_s: float  # forward + backward of every node, all microbatches, all stages
    backward_s: float  # of which backward
    gemm_s: float  # of which GEMMs, forward and backward
    recompute_s: dict[str, float]  # recomputation level → the forward it runs again
    recompute_gemm_s: dict[str, float]  # recomputation level → the GEMMs' share of that


def step_times(facts: dict[str, NodeFacts], local: ShardedShapes, microbatches: int = 1) -> StepTimes:
    """:class:`StepTimes` of the configuration whose local shapes are ``local``."""
    compute = backward = gemm = 0.0
    recompute = dict.fromkeys(Recompute, 0.0)
    recompute_gemm = dict.fromkeys(Recompute, 0.0)
    for name, fact in facts.items():
        if fact.kind != "op":
            continue
        seconds = fact.seconds(local.work[name], local.slot_shapes[name], microbatches) * fact.weight
        is_gemm = fact.node.target in GEMMS
        forward = seconds * forward_share(fact)
        compute += seconds
        backward += seconds - forward
        gemm += seconds if is_gemm else 0.0
        for level in RECOMPUTED:
            if dropped(fact, level):
                recompute[level] += forward
                recompute_gemm[level] += forward if is_gemm else 0.0
    return StepTimes(compute, backward, gemm, recompute, recompute_gemm)


def layer_terms(facts: dict[str, NodeFacts], local: ShardedShapes, regathered: frozenset = frozenset()) -> LayerTerms:
    """:class:`LayerTerms` of the configuration whose local shapes are ``local``; the moved inputs
    in ``regathered`` kept as their shards (:func:`saved_bytes`)."""
    outside = after = 0.0
    layer_saved: dict[str, float] = {}
    layer_weight: dict[str, int] = {}
    layer_inputs: dict[str, set[str]] = {}
    saved_by_node = saved_bytes(facts, local, regathered)  # moved inputs an op saves count as the copies they are
    # backward walks a layer's ops in reverse, freeing what each one's recompute saved: at an op,
    # what the ops before it saved is held beside its transients (its own output, saved for the
    # ops after it, is gone by then)
    recomputed = {level: {} for level in RECOMPUTED}  # by layer, so far in forward order
    recomputing = dict.fromkeys(RECOMPUTED, 0.0)
    for name, fact in facts.items():
        if fact.kind not in ("op", "input"):
            continue
        saved = saved_by_node[name]
        layer = fact.layer
        if layer is None:
            if fact.after_layers:
                after += saved * fact.weight
            else:
                outside += saved * fact.weight
            continue
        layer_saved[layer] = layer_saved.get(layer, 0.0) + saved
        layer_weight[layer] = fact.weight
        transient = transient_bytes(fact, local.shapes[name])
        for level, by_layer in recomputed.items():
            before = by_layer.get(layer, 0.0)
            by_layer[layer] = before + (saved if dropped(fact, level) else 0.0)
            recomputing[level] = maximum(recomputing[level], before + transient, by_layer[layer])
        inputs = layer_inputs.setdefault(layer, set())
        inputs.update(
            s.name for s in fact.slots if facts[s.name].kind in ("op", "input") and facts[s.name].layer != layer
        )
    checkpoints = {
        layer: sum(_bytes(facts[n], local.shapes[n]) for n in names) for layer, names in layer_inputs.items()
    }
    entering_bytes = sum(nbytes * layer_weight[layer] for layer, nbytes in checkpoints.items())
    kept = {level: selective_held(facts, local, level, regathered) for level in SELECTIVE_LEVELS}
    kept[Recompute.FULL] = {}
    in_layers = {
        Recompute.NONE: sum(saved * layer_weight[layer] for layer, saved in layer_saved.items()),
        # every layer's input and what the level keeps
        **{
            level: entering_bytes + sum(b * layer_weight[layer] for layer, b in by_layer.items())
            for level, by_layer in kept.items()
        },
    }
    entering = frozenset().union(*layer_inputs.values()) if checkpoints else frozenset()
    return LayerTerms(outside, in_layers, maximum(0.0, *checkpoints.values()), entering, after, recomputing)


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

    Recomputation adds the forward of what it drops. Microbatches divide what is in flight and
    the shapes GEMMs run at; a pipeline gives each device its stage modules' layers (cut by
    :func:`autopar.passes.search.partition.partition`: the busiest device sets the pace) and their
    state, holds :func:`in_flight` microbatches, idles :func:`bubble_share` of its step and sends
    each microbatch's boundary activation forward and its gradient back over ``link``. What
    overlaps hide of tensor-parallel collectives, gradient sync and boundary transfers is
    :mod:`autopar.passes.cost.overlap`'s.
    """
    split = partition(facts, local, schedule, link) if schedule.stages > 1 else None
    times = step_times(facts, local, schedule.microbatches)
    return scheduled(cost, layer_terms(facts, local), times, schedule, split, link, hardware, parts)


def scheduled(
    cost: Cost,
    terms: LayerTerms,
    times: StepTimes,
    schedule: Schedule,
    split: StageSplit | None,
    link,
    hardware: HardwareProfile,
    parts: StepParts = StepParts(),
) -> Cost:
    """:func:`schedule_cost` from the configuration's :class:`LayerTerms`, its :class:`StepTimes`
    at the schedule's microbatches and, with stages, its stage split."""
    stages, micro = schedule.stages, schedule.microbatches
    time_share, param_share = (split.time_share, split.param_share) if split else (1.0, 1.0)
    memory = dict(cost.memory)
    memory["activations"] = (
        (terms.in_layers[schedule.recompute] / stages + terms.outside) * min(in_flight(schedule), micro)
        + terms.after * min(in_flight_after_layers(schedule), micro)
    ) / micro
    # a layer recomputing in backward holds its activations beside its own transients only
    recomputing = terms.recomputing.get(schedule.recompute, 0.0)
    memory["temporary"] = maximum(cost.memory.get("temporary", 0.0), recomputing) / micro
    for category in ("params", "grads", "optimizer", "grad_buckets"):
        memory[category] = cost.memory.get(category, 0.0) * param_share
    recompute_s = times.recompute_s[schedule.recompute]
    # full recomputation runs each layer's forward again, its collectives too: about half the step's
    again = 1.5 if schedule.recompute == Recompute.FULL else 1.0
    tp_comm = parts.tp_comm_s * again
    comm = (cost.comm_s - parts.tp_comm_s) * again + exposed_tp_comm(
        tp_comm, times.gemm_s + times.recompute_gemm_s[schedule.recompute], hardware.hidden(hardware.tp_overlap)
    )
    work = (times.compute_s + recompute_s + comm) * time_share
    sync = cost.grad_sync_s * param_share
    if not parts.replayed:
        window = sync_window_s(times, parts.zero, time_share, micro)
        sync = exposed_grad_sync(sync, window, hardware.hidden(hardware.overlap))
    sync += stepped_gather_s(parts.gather_once_s * param_share, times, time_share, micro, hardware)
    return dataclasses.replace(
        cost,
        compute_s=(times.compute_s + recompute_s) * time_share,
        comm_s=comm * time_share,
        grad_sync_s=sync,
        optimizer_s=(cost.optimizer_s + parts.accumulate_s * (micro - 1)) * param_share,
        pipeline_s=work * bubble_share(schedule) + _boundary_transfers(terms, schedule, hardware, link, parts),
        model_flops=cost.model_flops * time_share,
        memory=memory,
    )


def sync_window_s(times: StepTimes, zero: int, time_share: float, microbatches: int) -> float:
    """The compute data-parallel traffic can hide behind, on the busiest device (``time_share``
    of the step's compute): the last microbatch's backward (buckets reduce as it produces them),
    every microbatch's backward under ZeRO-2 (reduce-scatter per microbatch), the whole step's
    compute under ZeRO-3 (parameter gathers are prefetched in forward and backward)."""
    if zero >= 3:
        return times.compute_s * time_share
    backward = times.backward_s * time_share
    return backward if zero == 2 else backward / microbatches


def stepped_gather_s(gather_s: float, times: StepTimes, time_share: float, microbatches: int, hardware) -> float:
    """What ZeRO-1/2's gather of the stepped weights leaves on the step: all of it where it runs
    after the optimizer; where the stack overlaps it (``param_gather_overlap``), what the next
    step's first forward (the busiest device's) does not hide."""
    if not hardware.param_gather_overlap:
        return gather_s
    forward = (times.compute_s - times.backward_s) * time_share / microbatches
    return exposed_grad_sync(gather_s, forward, hardware.hidden(hardware.overlap))


def _boundary_transfers(terms: LayerTerms, schedule: Schedule, hardware: HardwareProfile, link, parts) -> float:
    """Seconds of stage-boundary transfers on the critical path (:mod:`overlap`): the largest
    layer input of one microbatch, scattered over the tensor-parallel ranks when they all hold it."""
    if schedule.stages <= 1 or not terms.boundary_inputs:
        return 0.0
    whole = terms.boundary_inputs <= parts.replicated
    seconds = boundary_seconds(
        terms.boundary / schedule.microbatches, link, parts.scatter if whole else 1, parts.scatter_link
    )
    messages = pipeline_messages(schedule.stages, schedule.microbatches, schedule.virtual, hardware.p2p_overlap)
    return messages * seconds


def _bytes(fact: NodeFacts, shapes) -> float:
    return sum(numel(s) for s in shapes) * fact.elem_bytes
