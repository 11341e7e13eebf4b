"""The schedule part of the search: recomputation, microbatches, the pipeline schedule and
its cut points, for one configuration of degrees.

A configuration's layout is solved once (per ZeRO class, :mod:`search`); every runnable
schedule is then priced on it by :class:`~autopar.passes.cost.evaluate.PricedConfiguration`,
with cut points from Alpa's dynamic program (:mod:`partition`). Per recomputation level, the
runnable (kind, stage modules, microbatches) variants: every kind (or the pinned one), its counts
of stage modules per device (:func:`virtual_counts`) and every microbatch count dividing the local
batch that the kind runs (:func:`variants`); without stages, the
pinned microbatch count or one, and where one does not fit, gradient accumulation over every
count dividing the local batch (:func:`accumulations`). More recomputation on the same layout
and schedule only adds time, so a level is priced only where the ones below it fit nothing
(accumulating is weighed against it, not instead of it); a level is recomputation with or
without regathering gathered inputs (:attr:`Schedule.regather`), and the levels that save
memory by different means are priced side by side (:func:`levels`). The tie rule among all of
them is :mod:`ranking`'s.
"""

from __future__ import annotations

import dataclasses

from autopar.ir import VIRTUAL_PIPELINES, ConfigError, Cost, PipelineKind, PlanOptions, Recompute, Schedule
from autopar.passes.cost.evaluate import PricedConfiguration
from autopar.passes.search.ranking import SIMPLEST_FIRST

# torch's interleaved schedules run their microbatches in rounds of one per stage
ROUNDS_PIPELINES = (PipelineKind.INTERLEAVED_1F1B, PipelineKind.INTERLEAVED_ZB)

VIRTUAL_STAGES = 2  # stage modules per device the leanest interleaved schedule runs (zbv always runs 2)


Level = tuple[Recompute, bool]  # (recomputation, regather)
NO_SAVING: Level = (Recompute.NONE, False)
# everything saved; regathered or selective (neither always faster); both, or every second matmul
# recomputed too (regathering against recomputing again); full (no gathered input saved)
LADDER: tuple[tuple[Level, ...], ...] = (
    (NO_SAVING,),
    ((Recompute.NONE, True), (Recompute.SELECTIVE, False)),
    ((Recompute.SELECTIVE, True), (Recompute.SELECTIVE_OP, False)),
    ((Recompute.FULL, False),),
)


def levels(options: PlanOptions) -> list[list[Level]]:
    """The rungs of :data:`LADDER` to try, least saving first, with the pinned recomputation and
    regather only. Async tensor parallelism pieces the gathered inputs' linears instead: no
    regather with it."""
    regathers = {options.regather} if options.regather is not None else {False, not options.async_tp}

    def allowed(level: Level) -> bool:
        return level[0] == (options.recompute or level[0]) and level[1] in regathers

    rungs = ([level for level in rung if allowed(level)] for rung in LADDER)
    return [rung for rung in rungs if rung]


def leanest(options: PlanOptions, stages: int, local_batch: int, level: Level) -> Schedule:
    """The schedule holding the fewest activations at ``level``: the pinned kind, or 1F1B, with
    the pinned or the largest microbatch count (the one the ILP's memory budget is set for)."""
    if options.microbatches is not None and not 1 <= options.microbatches <= local_batch:
        raise ConfigError(
            f"microbatches={options.microbatches}: choose between 1 and the local batch size {local_batch}"
        )
    micro = options.microbatches or (max(1, local_batch) if stages > 1 else 1)
    kind = options.pipeline or PipelineKind.ONE_F_ONE_B
    virtual = (options.virtual or VIRTUAL_STAGES) if kind in VIRTUAL_PIPELINES else 1
    recompute, regather = level
    return Schedule(
        stages, micro, recompute, kind, virtual, options.stage_cuts, options.compile, options.async_tp, regather
    )


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
        for virtual in virtual_counts(kind, base.stages, layers, options):
            for micro in counts:
                # torch's 1F1B and V schedules need m >= p; the interleaved ones also m a multiple of their rounds
                if kind != PipelineKind.GPIPE and micro < base.stages:
                    continue
                if kind in ROUNDS_PIPELINES and micro % max(1, micro // base.stages):
                    continue
                out.append(dataclasses.replace(base, kind=kind, virtual=virtual, microbatches=micro, cuts=cuts))
    if not out:
        modules = f" of {options.virtual} stage modules each" if options.virtual else ""
        fewer = "stages or stage modules" if options.virtual else "stages"
        raise ConfigError(
            f"no pipeline schedule runs {base.stages} stages{modules} on {layers} layers with microbatches "
            f"{counts}: pin fewer {fewer}, another schedule or more microbatches"
        )
    return out


def virtual_counts(kind: PipelineKind, stages: int, layers: int, options: PlanOptions) -> list[int]:
    """The stage modules per device ``kind`` may run on ``layers`` layers: one for gpipe and 1F1B,
    two for zbv (its V), and for the interleaved schedules every count giving each module a layer
    at least (Megatron's virtual pipeline stages: more modules shrink the bubble, each adds a
    boundary's sends and warm-up activations; the cost model weighs them); the pinned count or
    the one pinned cut points make, where they allow ``kind``."""
    if kind not in VIRTUAL_PIPELINES:
        counts = [1]
    elif kind == PipelineKind.ZBV:
        counts = [VIRTUAL_STAGES]
    else:
        counts = list(range(VIRTUAL_STAGES, layers // stages + 1))
    if options.stage_cuts:
        counts = [v for v in counts if stages * v == len(options.stage_cuts) + 1]
    if options.virtual is not None:
        counts = [v for v in counts if v == options.virtual]
    return [v for v in counts if stages * v <= layers]


def accumulations(base: Schedule, options: PlanOptions, local_batch: int) -> list[Schedule]:
    """Gradient accumulation without stages, for when the whole local batch does not fit: every
    microbatch count above one dividing it, unless the user pinned the count (or stages run)."""
    if base.stages > 1 or options.microbatches:
        return []
    return [dataclasses.replace(base, microbatches=m) for m in range(2, local_batch + 1) if local_batch % m == 0]


def price(configuration: PricedConfiguration, schedules: list[Schedule]) -> list[tuple[Schedule, Cost]]:
    """(schedule with its cut points, cost) of each schedule on one solved configuration."""
    out = []
    for schedule in schedules:
        split = configuration.split(schedule)
        if split is not None and not schedule.cuts:
            schedule = dataclasses.replace(schedule, cuts=split.cuts)
        out.append((schedule, configuration.under(schedule)))
    return out
