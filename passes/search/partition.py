"""Stage partitioning: where the pipeline cuts the layers, balanced by the cost model.

Alpa's inter-operator dynamic program over layer ranges, for a fixed number of stage modules
S: ``best[k][j]`` is the smallest possible slowest-module time when modules 0..k run layers
0..j − 1; a module's time is its layers' compute (forward + backward, on the stage's devices,
after the intra-op plan) plus sending its boundary activation and receiving the gradient.
Ops outside the layers go with the first layer (those before it: embeddings) or the last (the
head and the loss), as the stage split does at run time. Ties go to the cut whose boundary
activation is smaller. O(S·L²) for L layers.

Pre: per-node facts and the local shapes of a solved configuration. Post: a
:class:`StageSplit`: the cut points (the layer each module after the first starts with) and
the busiest device's share of the step's compute and of the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir import ConfigError, Schedule
from autopar.passes.cost.facts import NodeFacts, ShardedShapes
from autopar.passes.cost.ops import collective_time, maximum
from autopar.passes.sharding.strategies import numel


@dataclass(frozen=True)
class StageSplit:
    cuts: tuple[str, ...]
    time_share: float  # of all stage modules' compute, what the busiest device runs
    param_share: float  # of all parameters, what the busiest device holds


def layer_costs(facts: dict[str, NodeFacts], local: ShardedShapes, microbatches: int = 1):
    """Per layer in execution order: (name, compute seconds, parameter elements, bytes of its inputs)."""
    order: list[str] = []
    time: dict[str, float] = {}
    params: dict[str, float] = {}
    inputs: dict[str, set[str]] = {}
    position = "prefix"
    for name, fact in facts.items():
        if fact.kind != "op":
            continue
        layer = fact.layer
        if layer is not None and layer not in time:
            order.append(layer)
        key = layer or (position if not order else "suffix")
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
    rows = [[layer, time.get(layer, 0.0), params.get(layer, 0.0), boundary.get(layer, 0.0)] for layer in order]
    if rows:
        for key, row in (("prefix", rows[0]), ("suffix", rows[-1])):
            row[1] += time.get(key, 0.0)
            row[2] += params.get(key, 0.0)
    return [tuple(row) for row in rows]


def partition(facts: dict[str, NodeFacts], local: ShardedShapes, schedule: Schedule, link) -> StageSplit:
    """The balanced cut points for ``schedule.modules`` stage modules (see the module docstring);
    pinned cuts (``schedule.cuts``) are only measured."""
    rows = layer_costs(facts, local, schedule.microbatches)
    modules = schedule.modules
    if len(rows) < modules:
        raise ConfigError(
            f"{modules} pipeline stage modules need at least as many layers (numbered modules such as layers.0); "
            f"the model has {len(rows)}: lower pp or the virtual stages"
        )
    names = [row[0] for row in rows]
    micro = max(1, schedule.microbatches)
    send = [
        2 * collective_time("send_recv", row[3] / micro, 2, link) * micro for row in rows
    ]  # into layer i, both ways
    if schedule.cuts:
        starts = [0] + [names.index(cut) for cut in schedule.cuts if cut in names]
    else:
        starts = _balanced_starts([row[1] for row in rows], send, [row[3] for row in rows], modules)
    bounds = list(zip(starts, starts[1:] + [len(rows)]))
    module_time = [sum(row[1] for row in rows[a:b]) for a, b in bounds]
    module_params = [sum(row[2] for row in rows[a:b]) for a, b in bounds]
    devices = schedule.device_modules()
    total_time, total_params = sum(module_time) or 1.0, sum(module_params) or 1.0
    return StageSplit(
        cuts=tuple(names[a] for a, _ in bounds[1:]),
        time_share=maximum(*(sum(module_time[k] for k in ks) for ks in devices)) / total_time,
        param_share=max(sum(module_params[k] for k in ks) for ks in devices) / total_params,
    )


def _balanced_starts(times: list[float], send: list[float], boundary: list[float], modules: int) -> list[int]:
    """First layer of each module minimizing (slowest module, then boundary bytes)."""
    count = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = (float("inf"), float("inf"))
    # best[k][j]: (slowest module time, boundary bytes) with modules 0..k on layers 0..j-1
    best = [[inf] * (count + 1) for _ in range(modules)]
    choice = [[0] * (count + 1) for _ in range(modules)]
    for j in range(1, count + 1):
        best[0][j] = (prefix[j] + (send[j] if j < count else 0.0), 0.0)
    for k in range(1, modules):
        for j in range(k + 1, count + 1):
            for i in range(k, j):  # module k runs layers i..j-1
                if best[k - 1][i] == inf:
                    continue
                own = prefix[j] - prefix[i] + send[i] + (send[j] if j < count else 0.0)
                candidate = (max(best[k - 1][i][0], own), best[k - 1][i][1] + boundary[i])
                if candidate < best[k][j]:
                    best[k][j], choice[k][j] = candidate, i
    starts, j = [], count
    for k in range(modules - 1, 0, -1):
        j = choice[k][j]
        starts.append(j)
    return [0] + starts[::-1]
