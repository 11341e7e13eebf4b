"""Stage partitioning: where the pipeline cuts the layers, balanced by the cost model.

Alpa's inter-operator dynamic program over layer ranges, for a fixed number of stage modules
S: ``best[k][j]`` is the smallest possible slowest-module time when modules 0..k run layers
0..j − 1; a module's time is its layers' compute (forward + backward, on the stage's devices,
after the intra-op plan) plus sending its boundary activation and receiving the gradient.
Ops outside the layers go with the first layer (those before it: embeddings) or the last (the
head and the loss), as the stage split does at run time. Ties go to the cut whose boundary
activation is smaller. O(S·L²) for L layers, as S array operations over L² pairs.

Pre: per-node facts and the local shapes of a solved configuration. Post: a
:class:`StageSplit`: the cut points (the layer each module after the first starts with) and
the busiest device's share of the step's compute and of the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.ir import ConfigError, Schedule
from autopar.passes.cost.collectives import collective_time
from autopar.passes.cost.facts import NodeFacts, ShardedShapes
from autopar.passes.cost.ops import maximum
from autopar.passes.search.fold import layer_order
from autopar.passes.sharding.strategies import numel


@dataclass(frozen=True)
class StageSplit:
    cuts: tuple[str, ...]
    time_share: float  # of all stage modules' compute, what the busiest device runs
    param_share: float  # of all parameters, what the busiest device holds


@dataclass(frozen=True)
class LayerRow:
    name: str
    time_s: float  # compute, forward + backward, on one rank of the stage
    params: float  # parameter elements on one rank
    boundary: float  # bytes of the activations entering the layer


def layer_costs(facts: dict[str, NodeFacts], local: ShardedShapes, microbatches: int = 1) -> list[LayerRow]:
    """Per layer in execution order: compute seconds (the batch run in ``microbatches`` pieces),
    parameter elements, bytes of its inputs. A folded layer (:attr:`NodeFacts.folded_layers`)
    gives one row per layer it stands for."""
    time: dict[str, float] = {}
    params: dict[str, float] = {}
    inputs: dict[str, set[str]] = {}
    inside = False  # ops outside layers go with the first layer before it, with the last after
    for name, fact in facts.items():
        if fact.kind != "op":
            continue
        layer = fact.layer
        inside = inside or layer is not None
        key = layer or ("suffix" if inside else "prefix")
        time[key] = time.get(key, 0.0) + fact.seconds(local.work[name], local.slot_shapes[name], microbatches)
        for slot in fact.slots:
            producer = facts[slot.name]
            if producer.kind == "param":
                params[key] = params.get(key, 0.0) + numel(local.shapes[slot.name][0]) / max(1, producer.consumers)
            elif layer is not None and producer.kind in ("op", "input") and producer.layer != layer:
                inputs.setdefault(layer, set()).add(slot.name)
    boundary = {
        layer: sum(numel(s) * facts[n].elem_bytes for n in names for s in local.shapes[n])
        for layer, names in inputs.items()
    }
    rows = [
        [name, time.get(layer, 0.0), params.get(layer, 0.0), boundary.get(layer, 0.0)]
        for name, layer in layer_order(facts)
    ]
    if rows:
        for key, row in (("prefix", rows[0]), ("suffix", rows[-1])):
            row[1] += time.get(key, 0.0)
            row[2] += params.get(key, 0.0)
    return [LayerRow(*row) for row in rows]


def partition(facts: dict[str, NodeFacts], local: ShardedShapes, schedule: Schedule, link) -> StageSplit:
    """The balanced cut points for ``schedule.modules`` stage modules (see the module docstring);
    pinned cuts (``schedule.cuts``) are only measured."""
    return split_rows(layer_costs(facts, local, schedule.microbatches), schedule, link)


def split_rows(rows: list[LayerRow], schedule: Schedule, link, starts: list[int] | None = None) -> StageSplit:
    """:func:`partition` on the rows of :func:`layer_costs`; ``starts`` (each module's first
    row, from :func:`balanced_starts`) when already known."""
    modules = schedule.modules
    if len(rows) < modules:
        raise ConfigError(
            f"{modules} pipeline stage modules need at least as many layers (numbered modules such as layers.0); "
            f"the model has {len(rows)}: lower pp or the virtual stages"
        )
    names = [row.name for row in rows]
    if schedule.cuts:
        starts = [0] + [names.index(cut) for cut in schedule.cuts if cut in names]
    elif starts is None:
        starts = balanced_starts(rows, max(1, schedule.microbatches), link)(modules)
    bounds = list(zip(starts, starts[1:] + [len(rows)]))
    module_time = [sum(row.time_s for row in rows[a:b]) for a, b in bounds]
    module_params = [sum(row.params for row in rows[a:b]) for a, b in bounds]
    devices = schedule.device_modules()
    total_time, total_params = sum(module_time) or 1.0, sum(module_params) or 1.0
    return StageSplit(
        cuts=tuple(names[a] for a, _ in bounds[1:]),
        time_share=maximum(*(sum(module_time[k] for k in ks) for ks in devices)) / total_time,
        param_share=max(sum(module_params[k] for k in ks) for ks in devices) / total_params,
    )


def balanced_starts(rows: list[LayerRow], microbatches: int, link) -> BalancedStarts:
    """The dynamic program of the module docstring over ``rows``: called with a count of stage
    modules, the first row of each (``balanced_starts(rows, 8, link)(4)``)."""
    # into layer i, the boundary activation forward and its gradient back, per microbatch
    send = [2 * collective_time("send_recv", row.boundary / microbatches, 2, link) * microbatches for row in rows]
    return BalancedStarts([row.time_s for row in rows], send, [row.boundary for row in rows])


class BalancedStarts:
    """First layer of each module minimizing (slowest module, then boundary bytes); among equal
    candidates the earliest cut. One array operation per module over every (start, end) pair.

    Step k of the program gives the best k + 1 modules over every prefix of the layers, whatever
    count is asked for later: the steps run once, as far as the most modules asked for, and any
    count's cuts are read back from them (the search weighs many counts of virtual stages)."""

    def __init__(self, times: list[float], send: list[float], boundary: list[float]):
        count = self.count = len(times)
        prefix = np.concatenate([[0.0], np.cumsum(times)])
        send_in = np.array(list(send) + [0.0])  # into layer i; nothing after the last
        send_out = np.where(np.arange(count + 1) < count, send_in, 0.0)  # out of a module ending before layer j
        self._starts_at, self._ends_at = np.arange(count + 1)[:, None], np.arange(count + 1)[None, :]
        # own[i, j]: a module running layers i..j-1, with its sends at both ends
        self._own = prefix[None, :] - prefix[:, None] + send_in[:, None] + send_out[None, :]
        self._best_time = np.where(np.arange(count + 1) >= 1, prefix + send_out, np.inf)  # the first receives nothing
        self._best_bytes = np.zeros(count + 1)
        self._boundary_in = np.array(list(boundary) + [0.0])
        self._choices: list[np.ndarray] = []

    def __call__(self, modules: int) -> list[int]:
        while len(self._choices) < modules - 1:
            self._step(len(self._choices) + 1)
        starts, j = [], self.count
        for choice in reversed(self._choices[: modules - 1]):
            j = int(choice[j])
            starts.append(j)
        return [0] + starts[::-1]

    def _step(self, k: int) -> None:
        """From the best k modules over every prefix to the best k + 1."""
        best_time = self._best_time
        valid = (self._starts_at >= k) & (self._starts_at < self._ends_at) & np.isfinite(best_time)[:, None]
        time = np.where(valid, np.maximum(best_time[:, None], self._own), np.inf)
        nbytes = np.where(valid, self._best_bytes[:, None] + self._boundary_in[:, None], np.inf)
        fastest = time.min(axis=0)
        tied = (time == fastest[None, :]) & np.isfinite(time)
        leanest = np.where(tied, nbytes, np.inf).min(axis=0)
        self._choices.append(np.argmax(tied & (nbytes == leanest[None, :]), axis=0))
        self._best_time, self._best_bytes = fastest, np.where(np.isfinite(fastest), leanest, 0.0)
