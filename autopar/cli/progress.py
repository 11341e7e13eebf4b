"""The search's progress line on stderr: configurations weighed / total, the best so far, elapsed.

Drawn only on a terminal (``sys.stderr.isatty()``) and never with ``--json``; redrawn in place at
most every ``interval_s``, and ended with a newline when the search ends.
"""

from __future__ import annotations

import sys
import time

from autopar.passes.search.search import SearchProgress
from autopar.report import degrees_text


class ProgressLine:
    """A callable for ``autopar.plan(..., progress=...)`` that redraws one line of ``stream``.

    >>> with ProgressLine(sys.stderr) as line:            # doctest: +SKIP
    ...     plan = autopar.plan(model, mesh, inputs, progress=line)
    """

    def __init__(self, stream=sys.stderr, interval_s: float = 0.2):
        self.stream, self.interval_s = stream, interval_s
        self.drawn = 0.0
        self.width = 0

    def __call__(self, progress: SearchProgress) -> None:
        now = time.monotonic()
        if now - self.drawn < self.interval_s and progress.done < progress.total:
            return
        self.drawn = now
        best = progress.best
        where = ""
        if best is not None:
            stages = f"pp={best.schedule.stages} x " if best.schedule.stages > 1 else ""
            zero = f", ZeRO-{best.zero}" if best.zero else ""
            where = f", best {best.cost.step_s * 1e3:.1f} ms/step ({stages}{degrees_text(best.degrees)}{zero})"
        text = (
            f"search: {progress.done}/{progress.total} configurations ({progress.pruned} pruned){where}, "
            f"{progress.elapsed_s:.1f} s"
        )
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc) -> None:
        if self.width:
            self.stream.write("\n")
            self.stream.flush()
