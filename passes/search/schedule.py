"""The schedule part of the search: recomputation, microbatches, the pipeline schedule and
its cut points, for one configuration of degrees.

The per-axis ILPs run once per recomputation level, for a base schedule (the pinned kind, or
1F1B, with the pinned or the largest microbatch count: the leanest in activations). Every
runnable (kind, microbatches) variant is then priced on those strategies by ``evaluate``
with cut points from :func:`autopar.passes.search.partition.partition`, and the fastest that fits the memory limit wins;
within :data:`TIE_TOLERANCE` the simpler schedule (earlier in :data:`SIMPLEST_FIRST`, fewer
microbatches) wins. Recomputation is tried only when nothing fits without it.
"""

from __future__ import annotations

import dataclasses

from autopar.ir import RECOMPUTE, VIRTUAL_PIPELINES, ConfigError, PipelineKind, PlanOptions, Schedule
from autopar.passes.cost.evaluate import evaluate
from autopar.passes.cost.facts import ShardedShapes
from autopar.passes.search.partition import layer_costs, partition

TIE_TOLERANCE = 0.05  # configurations (and schedules) this close in predicted time count as equally fast
# 1F1B before GPipe: the same bubble in less memory; zero-bubble last: a backward split in two
SIMPLEST_FIRST = (
    PipelineKind.ONE_F_ONE_B,
    PipelineKind.GPIPE,
    PipelineKind.INTERLEAVED_1F1B,
    PipelineKind.INTERLEAVED_ZB,
    PipelineKind.ZBV,
)
VIRTUAL_STAGES = 2  # stage modules per device for the interleaved schedules (zbv always runs 2)


def base_schedules(options: PlanOptions, stages: int, local_batch: int) -> list[Schedule]:
    """One schedule per recomputation level to try, least recomputation first."""
    if options.microbatches is not None and not 1 <= options.microbatches <= local_batch:
        raise ConfigError(
            f"microbatches={options.microbatches}: choose between 1 and the local batch size {local_batch}"
        )
    micro = options.microbatches or (max(1, local_batch) if stages > 1 else 1)
    kind = options.pipeline or PipelineKind.ONE_F_ONE_B
    virtual = VIRTUAL_STAGES if kind in VIRTUAL_PIPELINES else 1
    levels = [options.recompute] if options.recompute else RECOMPUTE
    return [Schedule(stages, micro, level, kind, virtual, options.stage_cuts, options.compile) for level in levels]


def variants(base: Schedule, options: PlanOptions, local_batch: int, layers: int) -> list[Schedule]:
    """The runnable (kind, microbatches) choices around ``base``, simplest first. Without
    stages, microbatches are gradient accumulation, which the user pins (the batch per step is
    theirs to choose): the pinned count, else one."""
    if base.stages == 1:
        return [base]
    cuts = options.stage_cuts
    kinds = [options.pipeline] if options.pipeline else list(SIMPLEST_FIRST)
    counts = (
        [options.microbatches]
        if options.microbatches
        else [m for m in range(1, local_batch + 1) if local_batch % m == 0]
    )
    out = []
    for kind in kinds:
        virtual = VIRTUAL_STAGES if kind in VIRTUAL_PIPELINES else 1
        if base.stages * virtual > layers or (cuts and len(cuts) != base.stages * virtual - 1):
            continue
        for micro in counts:
            # torch's 1F1B needs m >= p; the interleaved schedules m a multiple of their rounds
            if kind != PipelineKind.GPIPE and (micro < base.stages or micro % max(1, micro // base.stages)):
                continue
            out.append(dataclasses.replace(base, kind=kind, virtual=virtual, microbatches=micro, cuts=cuts))
    if not out:
        raise ConfigError(
            f"no pipeline schedule runs {base.stages} stages on {layers} layers with microbatches "
            f"{counts}: pin fewer stages, another schedule or more microbatches"
        )
    return out


def best_schedule(search, degrees, strategies, zero: int, base: Schedule, local_batch: int):
    """(schedule, cost) of the fastest variant that fits the memory budget, else of the leanest
    one. ``search`` is the :class:`~autopar.passes.search.search.SearchContext`."""
    facts, mesh, hardware = search.facts, search.mesh, search.hardware
    local = ShardedShapes.unsharded(facts)
    for axis, chosen in strategies.items():
        local = local.after(chosen, degrees[axis])
    link = hardware.link(mesh.shape, mesh.size)
    priced = []
    for schedule in variants(base, search.options, local_batch, len(layer_costs(facts, local))):
        if schedule.stages > 1 and not search.options.stage_cuts:
            schedule = dataclasses.replace(schedule, cuts=partition(facts, local, schedule, link).cuts)
        priced.append((schedule, evaluate(facts, degrees, strategies, mesh, hardware, zero, schedule)))
    fitting = [(s, c) for s, c in priced if c.peak_memory <= search.limit]
    if not fitting:
        return min(priced, key=lambda sc: sc[1].peak_memory)
    fastest = min(c.step_s for _, c in fitting)
    return next((s, c) for s, c in fitting if c.step_s <= fastest * (1 + TIE_TOLERANCE))
