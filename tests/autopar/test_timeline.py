"""autopar/timeline.py: the schedule's unit-time simulation and its text and SVG drawings, and
the one stage-module-to-device mapping (``Schedule.device_modules``) they share with the runtime."""

import pytest

from autopar.ir import Schedule
from autopar.timeline import simulate, timeline_svg, timeline_text


@pytest.mark.parametrize(
    "kind, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2)]
)
def test_the_timeline_runs_every_action_once_in_dependency_order(kind, virtual):
    schedule = Schedule(4, 8, kind=kind, virtual=virtual)
    rows = simulate(schedule)
    actions = [a for row in rows for a in row]
    backward = 2 if kind in ("interleaved-zb", "zbv") else 1
    assert len(actions) == schedule.modules * 8 * (1 + backward)
    end = {(a.kind, a.module, a.microbatch): a.end for a in actions}
    for a in actions:
        if a.kind == "F" and a.module > 0:
            assert end[("F", a.module - 1, a.microbatch)] <= a.start
    text = timeline_text(schedule)
    assert text.count("stage ") == 4 and "F0" in text
    assert timeline_svg(schedule).startswith("<svg") and "</svg>" in timeline_svg(schedule)


def test_stage_modules_loop_over_devices_and_zbv_runs_a_v():
    assert Schedule(2, 4, kind="interleaved-1f1b", virtual=2).device_modules() == [[0, 2], [1, 3]]
    assert Schedule(2, 4, kind="zbv", virtual=2).device_modules() == [[0, 3], [1, 2]]
    assert Schedule(4, 4).device_modules() == [[0], [1], [2], [3]]
    assert Schedule(2, 4, kind="zbv", virtual=2).device_of(3) == 0


def test_a_timeline_too_wide_for_a_terminal_is_summarized():
    wide = Schedule(8, 64)
    assert timeline_text(wide).count("stage ") == 8
    text = timeline_text(wide, max_width=240)
    assert "stage " not in text and "too wide" in text and "--timeline" in text and "idle" in text
    assert timeline_text(Schedule(2, 4), max_width=240).count("stage ") == 2
