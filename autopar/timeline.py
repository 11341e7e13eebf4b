"""A pipeline schedule drawn as a timeline: one row per pipeline device, time to the right.

An illustration of the schedule's order, not a measurement: a forward takes one time unit,
a backward two (zero-bubble schedules split it into an input-gradient and a weight-gradient
unit). Each device runs, whenever it is free, the most urgent action whose inputs are ready,
with the schedule's rule for urgency: GPipe runs every forward first; 1F1B and its
interleaved form keep at most their warm-up count of microbatches in flight and prefer
backwards; zero-bubble schedules run weight gradients when nothing else is ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from autopar.ir import ZERO_BUBBLE_PIPELINES, PipelineKind, Schedule

DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}
COLOR = {"F": "#8ecae6", "B": "#fb8500", "I": "#ffb703", "W": "#90be6d"}


@dataclass(frozen=True)
class Action:
    kind: str  # F forward, B backward, I input gradient, W weight gradient
    module: int
    microbatch: int
    start: int

    @property
    def end(self) -> int:
        return self.start + DURATION[self.kind]


def simulate(schedule: Schedule) -> list[list[Action]]:
    """The actions each device runs, in time order (see the module docstring)."""
    p, m, modules = schedule.stages, schedule.microbatches, schedule.modules
    split = schedule.kind in ZERO_BUBBLE_PIPELINES
    backward = ("I", "W") if split else ("B",)
    owner = {k: schedule.device_of(k) for k in range(modules)}
    pending = {(kind, k, i) for k in range(modules) for i in range(m) for kind in ("F", *backward)}
    done: dict[tuple, int] = {}
    busy_until = [0] * p
    rows: list[list[Action]] = [[] for _ in range(p)]
    time = 0
    while pending:
        for device in range(p):
            if busy_until[device] > time:
                continue
            ready = [a for a in pending if owner[a[1]] == device and _ready(a, done, time, modules)]
            if not ready:
                continue
            kind, k, i = min(ready, key=lambda a: _urgency(a, schedule, rows[device], device))
            pending.discard((kind, k, i))
            action = Action(kind, k, i, time)
            rows[device].append(action)
            done[(kind, k, i)] = action.end
            busy_until[device] = action.end
        time += 1
    return rows


def _ready(action, done, time, modules) -> bool:
    kind, k, i = action
    if kind == "F":
        needs = [("F", k - 1, i)] if k > 0 else []
    elif kind == "W":
        needs = [("I", k, i)]
    else:
        later = [("B", k + 1, i), ("I", k + 1, i)] if k < modules - 1 else []
        needs = [("F", k, i)] + ([next((a for a in later if a in done), later[0])] if later else [])
    return all(need in done and done[need] <= time for need in needs)


def _urgency(action, schedule: Schedule, history: list[Action], device: int) -> tuple:
    kind, k, i = action
    p, v = schedule.stages, schedule.virtual
    group = i // p  # interleaved schedules run microbatches in groups of p through each module
    if kind == "W":
        return (3, i, k)
    if schedule.kind == PipelineKind.GPIPE:
        return (0 if kind == "F" else 1, i, k if kind == "F" else -k)
    in_flight = sum(1 for a in history if a.kind == "F") - sum(1 for a in history if a.kind in ("B", "I"))
    warmup = p - device if v == 1 else (p - device - 1) * 2 + (v - 1) * p + 1
    if kind == "F":
        return (0 if in_flight < warmup else 2, group, k, i)
    return (1, group, -k, i)


def timeline_text(schedule: Schedule, max_width: int | None = None) -> str:
    """Rows of 3-character cells: ``F3`` forward of microbatch 3 (lower case: the device's
    second stage module), ``B``/``I``/``W`` backward, input and weight gradient, ``.`` idle.
    Rows wider than ``max_width`` characters are left out (the SVG draws any length)."""
    rows = simulate(schedule)
    length = max((a.end for row in rows for a in row), default=0)
    busy = sum(DURATION[a.kind] for row in rows for a in row)
    idle = 1 - busy / (length * len(rows)) if length else 0.0
    summary = f"({length} time units; forward 1, backward 2; idle {idle:.0%} of device time)"
    if max_width is not None and 3 * length + 10 > max_width:
        return f"timeline: too wide to draw here ({summary[1:-1]}); --timeline FILE.svg draws it"
    lines = []
    for device, row in enumerate(rows):
        cells = [" . "] * length
        first_module = schedule.device_modules()[device][0]
        for action in row:
            label = action.kind if action.module == first_module else action.kind.lower()
            for t in range(action.start, action.end):
                cells[t] = f"{label}{action.microbatch:<2d}"[:3]
        lines.append(f"stage {device} |" + "".join(cells) + "|")
    return "\n".join(lines) + "\n" + summary


def timeline_svg(schedule: Schedule, unit: int = 24, row_height: int = 28) -> str:
    """The same timeline as a standalone SVG document (one rectangle per action)."""
    rows = simulate(schedule)
    length = max((a.end for row in rows for a in row), default=0)
    left = 70
    width, height = left + length * unit + 10, len(rows) * row_height + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
        'font-size="11">',
        f'<text x="4" y="{height - 8}">{escape(str(schedule))}: forward 1 unit, backward 2</text>',
    ]
    for device, row in enumerate(rows):
        y = 10 + device * row_height
        parts.append(f'<text x="4" y="{y + row_height * 0.6:.0f}">stage {device}</text>')
        for action in row:
            x, w = left + action.start * unit, DURATION[action.kind] * unit
            parts.append(
                f'<rect x="{x}" y="{y}" width="{w - 1}" height="{row_height - 4}" fill="{COLOR[action.kind]}" '
                f'opacity="{1.0 if action.module < schedule.stages else 0.65}"><title>{action.kind} module '
                f"{action.module} "
                f"microbatch {action.microbatch}</title></rect>"
            )
            parts.append(f'<text x="{x + 3}" y="{y + row_height * 0.6:.0f}">{action.kind}{action.microbatch}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
