"""The schedule part of the search: recomputation, microbatches, the pipeline schedule and
its cut points, for one configuration of degrees.

The per-axis ILPs run once per recomputation level, for a base schedule (the pinned kind, or
1F1B, with the pinned or the largest microbatch count: the leanest in activations). Every
runnable (kind, microbatches) variant is then priced on those strategies by ``evaluate``
with cut points from :func:`stages.partition`, and the fastest that fits the memory limit wins;
within :data:`TIE_TOLERANCE` the simpler schedule (earlier in :data:`SIMPLEST_FIRST`, fewer
microbatches) wins. Recomputation is tried only when nothing fits without it.
"""

from __future__ import annotations

import dataclasses

from autopar.ir import PIPELINES, RECOMPUTE, VIRTUAL_PIPELINES, ConfigError, Schedule

from .evaluate import evaluate
from .facts import ShardedShapes
from .stages import layer_costs, partition

TIE_TOLERANCE = 0.05
# 1F1B before GPipe: the same bubble in less memory; zero-bubble last: a backward split in two
SIMPLEST_FIRST = ("1f1b", "gpipe", "interleaved-1f1b", "interleaved-zb", "zbv")
VIRTUAL_STAGES = 2  # stage modules per device for the interleaved schedules (zbv always runs 2)


@dataclasses.dataclass(frozen=True)
class SchedulePins:
    """What the user fixed; None lets the search choose."""

    stages: int = 1
    microbatches: int | None = None
    recompute: str | None = None
    pipeline: str | None = None
    cuts: tuple[str, ...] = ()

    def __post_init__(self):
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute={self.recompute!r}: choose one of {list(RECOMPUTE)}")
        if self.pipeline is not None and self.pipeline not in PIPELINES:
            raise ConfigError(f"pipeline={self.pipeline!r}: choose one of {list(PIPELINES)}")


def base_schedules(pins: SchedulePins, local_batch: int) -> list[Schedule]:
    """One schedule per recomputation level to try, least recomputation first."""
    if pins.microbatches is not None and not 1 <= pins.microbatches <= local_batch:
        raise ConfigError(f"microbatches={pins.microbatches}: choose between 1 and the local batch size {local_batch}")
    micro = pins.microbatches or (max(1, local_batch) if pins.stages > 1 else 1)
    kind = pins.pipeline or "1f1b"
    virtual = VIRTUAL_STAGES if kind in VIRTUAL_PIPELINES else 1
    return [Schedule(pins.stages, micro, r, kind, virtual, pins.cuts) for r in ([pins.recompute] if pins.recompute else RECOMPUTE)]


def variants(base: Schedule, pins: SchedulePins, local_batch: int, layers: int) -> list[Schedule]:
    """The runnable (kind, microbatches) choices around ``base``, simplest first. Without
    stages, microbatches are gradient accumulation, which the user pins (the batch per step is
    theirs to choose): the pinned count, else one."""
    if base.stages == 1:
        return [base]
    kinds = [pins.pipeline] if pins.pipeline else list(SIMPLEST_FIRST)
    counts = [pins.microbatches] if pins.microbatches else [m for m in range(1, local_batch + 1) if local_batch % m == 0]
    out = []
    for kind in kinds:
        virtual = VIRTUAL_STAGES if kind in VIRTUAL_PIPELINES else 1
        if base.stages * virtual > layers or (pins.cuts and len(pins.cuts) != base.stages * virtual - 1):
            continue
        for micro in counts:
            # torch's 1F1B needs m >= p; the interleaved schedules m a multiple of their rounds
            if kind != "gpipe" and (micro < base.stages or micro % max(1, micro // base.stages)):
                continue
            out.append(dataclasses.replace(base, kind=kind, virtual=virtual, microbatches=micro, cuts=pins.cuts))
    if not out:
        raise ConfigError(
            f"no pipeline schedule runs {base.stages} stages on {layers} layers with microbatches "
            f"{counts}: pin fewer stages, another schedule or more microbatches"
        )
    return out


def best_schedule(facts, degrees, strategies, mesh, hardware, zero, base: Schedule, pins: SchedulePins, local_batch: int, limit):
    """(schedule, cost) of the fastest variant that fits ``limit``, else of the leanest one."""
    local = ShardedShapes.unsharded(facts)
    for axis, chosen in strategies.items():
        local = local.after(chosen, degrees[axis])
    link = hardware.link(mesh.shape, mesh.size)
    priced = []
    for schedule in variants(base, pins, local_batch, len(layer_costs(facts, local))):
        if schedule.stages > 1 and not pins.cuts:
            schedule = dataclasses.replace(schedule, cuts=partition(facts, local, schedule, link).cuts)
        priced.append((schedule, evaluate(facts, degrees, strategies, mesh, hardware, zero, schedule)))
    fitting = [(s, c) for s, c in priced if c.peak_memory <= limit]
    if not fitting:
        return min(priced, key=lambda sc: sc[1].peak_memory)
    fastest = min(c.step_s for _, c in fitting)
    return next((s, c) for s, c in fitting if c.step_s <= fastest * (1 + TIE_TOLERANCE))
