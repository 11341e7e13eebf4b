"""The tie rule: of the plans the cost model cannot tell apart, the simplest.

Plans within :data:`TIE_TOLERANCE` of the fastest predicted step count as equally fast, and of
those the simplest wins (:func:`simplicity`): fewest pipeline stages, then the most data
parallelism, the lowest ZeRO stage, the least recomputation, the simplest pipeline schedule
(:data:`SIMPLEST_FIRST`), the fewest stage modules per device, the fewest microbatches. The one
place the search breaks ties, between configurations and between the schedules of one alike, so
no two tolerances compound.

>>> choose([fast, simple], key=lambda c: c.cost.step_s)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from autopar.ir import RECOMPUTE, Axis, Cost, PipelineKind, Schedule

# The largest predicted loss the search takes for a simpler plan: below the cost model's
# resolution, and small enough that a free plan never falls below 0.98 of any plan in its space.
TIE_TOLERANCE = 0.02
# 1F1B before GPipe: the same bubble in less memory; zero-bubble last: a backward split in two
SIMPLEST_FIRST = (
    PipelineKind.ONE_F_ONE_B,
    PipelineKind.GPIPE,
    PipelineKind.INTERLEAVED_1F1B,
    PipelineKind.INTERLEAVED_ZB,
    PipelineKind.ZBV,
)


@dataclass(frozen=True)
class Candidate:
    """One fitting plan the search could choose: a configuration, one schedule, its cost."""

    degrees: dict[str, int]
    zero: int
    schedule: Schedule
    cost: Cost
    layout: Any = None  # the solved strategies it was priced on

    def simplicity(self) -> tuple:
        """Smaller is simpler (see the module docstring)."""
        return (
            self.schedule.stages,
            -self.degrees.get(Axis.DP, 1),
            self.zero,
            RECOMPUTE.index(self.schedule.recompute),
            SIMPLEST_FIRST.index(self.schedule.kind),
            self.schedule.virtual,
            self.schedule.microbatches,
        )


def within_reach(step_s: float, fastest: float) -> bool:
    """Whether a plan of ``step_s`` (or at least that: a lower bound) counts as fast as ``fastest``."""
    return step_s <= fastest * (1 + TIE_TOLERANCE)


def near(candidates: Iterable[Candidate], fastest: float) -> list[Candidate]:
    """The candidates the tie rule counts as fast as ``fastest``."""
    return [c for c in candidates if within_reach(c.cost.step_s, fastest)]


def choose(candidates: list[Candidate], key: Callable[[Candidate], tuple] = Candidate.simplicity) -> Candidate:
    """The simplest of the candidates within :data:`TIE_TOLERANCE` of the fastest."""
    fastest = min(c.cost.step_s for c in candidates)
    return min(near(candidates, fastest), key=lambda c: (key(c), c.cost.step_s))
