"""The configurations a search weighs, and the rules that spare it work.

A configuration is a number of pipeline stages p (over the outermost mesh dimension), the
degrees inside one stage (dp × ep × cp × tp over its devices) and a ZeRO stage; its schedules
(recomputation, microbatches, pipeline kind, stage cuts) are priced on its solved layout
(:mod:`schedule`). The space: every p dividing the outermost mesh dimension and at most the
layer count that some schedule runs, every split of a stage's devices whose batch and sequence
splits divide the inputs (cp only up to :func:`useful_cp`), every ZeRO stage with dp > 1. Pins
narrow it.

Every configuration is weighed unless a rule proves it cannot be chosen; the search log names
the rule of each one pruned:

- ``memory``: its model state alone — weights, gradients and optimizer state, split at best
  over tp (and ep for experts) and over the stages, ZeRO-sharded over dp — exceeds the memory
  limit, so no layout and no schedule of it fits.
- ``bound``: a lower bound on its step time is out of the tie rule's reach of the fastest
  fitting plan found so far (:func:`~autopar.passes.search.ranking.within_reach`), so neither it
  nor a plan the tie rule would prefer to the fastest can come from it. The bound:
  :meth:`LowerBounds.step_s` from the graph alone, else :meth:`LowerBounds.layout_s` once the
  axes before its last are solved (they are shared by many configurations), before that axis's ILP.

And within a configuration (:mod:`search`), what cannot change the choice is not computed:

- a layout costs alike under ZeRO-1 and -2 (they differ in memory and in how often gradients
  are reduced, which pricing counts), so one is solved for both; unpinned, ZeRO-0 is priced on
  that layout too and never solved under the memory budget, since on any layout it moves the
  same bytes and steps the whole optimizer, no faster than ZeRO-1 and in more memory (it stays a
  candidate for the tie rule);
- more recomputation on the same layout and schedule only adds time, so a level is priced only
  where the ones below it fit no schedule;
- a layout is solved under the memory budget only where the free one fits no schedule at that
  recomputation level, and only when the level's forward recomputed (:meth:`LowerBounds.recompute_s`)
  on top of the configuration's bound can still win.

Pre: the (folded) facts of a graph. Post: the configurations to weigh, and their bounds.
"""

from __future__ import annotations

import bisect
import itertools
import math

import numpy as np

from autopar.ir import (
    Axis,
    ConfigError,
    HardwareProfile,
    Mesh,
    PlanOptions,
    Replicate,
    Shard,
    batch_split,
    check_degrees,
    degree_choices,
)
from autopar.passes.capture.moe import EXPERTS_OP
from autopar.passes.cost.axis_terms import AxisContext, axis_contexts, partial_gradients
from autopar.passes.cost.evaluate import stage_mesh
from autopar.passes.cost.facts import NodeFacts, ShardedShapes
from autopar.passes.cost.kernels import ring_hideable_block
from autopar.passes.cost.ops import param_state_bytes, state_update_s
from autopar.passes.cost.schedule import bubble_share, dropped, forward_share
from autopar.passes.search.fold import layer_order
from autopar.passes.search.pins import chunks_per_rank, expert_params
from autopar.passes.sharding.rules import node_strategies
from autopar.passes.sharding.strategies import OpView, Strategy, numel, work_fraction

MEMORY, BOUND = "memory", "bound"  # the prune rules, as the search log names them
NO_PIPELINE = ((0.0, 1),)  # the bounds' runs (schedule_shapes) of one schedule: no bubble, one microbatch


def configurations(
    facts: dict[str, NodeFacts], mesh: Mesh, options: PlanOptions, hardware: HardwareProfile, batch: int
) -> list[tuple[int, dict[str, int]]]:
    """(pipeline stages, degrees of one stage) of every configuration to weigh (see the module docstring)."""
    layers = len({f.layer for f in facts.values() if f.layer is not None} | _folded(facts))
    pinned = options.intra_stage_degrees
    if options.stages:
        counts = [options.stages]
    else:
        counts = [p for p in range(1, min(mesh.shape[0], max(1, layers)) + 1) if mesh.shape[0] % p == 0]
    optional = optional_dims(facts)
    most_cp = useful_cp(facts, hardware) if not pinned else None
    found, refusal = [], None
    for stages in counts:
        devices = stage_mesh(mesh, stages).size
        if pinned:
            try:
                configs = [check_degrees(pinned, devices)]
            except ConfigError as error:  # the pinned degrees need another number of stages
                refusal = refusal or error
                continue
            _check_pinned_split(facts, configs[0], batch)
        else:
            configs = degree_choices(devices, optional)
        runnable = [c for c in configs if batch % batch_split(c) == 0 and _sequence_splits(facts, c.get(Axis.CP, 1))]
        configs = runnable or configs
        if not pinned:
            configs = [c for c in configs if c.get(Axis.CP, 1) <= most_cp]
        found += [(stages, c) for c in configs]
    if not found:
        raise refusal
    return found


def _check_pinned_split(facts: dict[str, NodeFacts], degrees: dict[str, int], batch: int) -> None:
    """Pinned degrees must split what they split: dp x ep the global batch, cp the sequence."""
    ranks, shown = batch_split(degrees), " x ".join(f"{k}={v}" for k, v in degrees.items())
    if batch % ranks:
        raise ConfigError(
            f"degrees {shown}: {ranks} ranks split the global batch of {batch}, which {ranks} does "
            f"not divide: pass a batch that is a multiple of {ranks}, or other degrees"
        )
    cp = degrees.get(Axis.CP, 1)
    if not _sequence_splits(facts, cp):
        lengths = sorted({f.out_shape[1] for f in facts.values() if f.kind == "input" and len(f.out_shape) > 1})
        raise ConfigError(
            f"degrees {shown}: cp={cp} splits the sequence into {chunks_per_rank(Axis.CP) * cp} chunks "
            f"(a head and a tail per rank), which the inputs' sequence length(s) {lengths} do not divide: pass a "
            f"multiple of {chunks_per_rank(Axis.CP) * cp}, or another cp"
        )


def _folded(facts) -> set[str]:
    return {layer for f in facts.values() for layer in f.folded_layers}


def optional_dims(facts: dict[str, NodeFacts]) -> tuple[str, ...]:
    """The dimensions worth searching for this graph: cp where attention can run on a split
    sequence, ep where there are experts to split."""
    targets = {str(f.node.target) for f in facts.values() if f.kind == "op"}
    dims = []
    if any("scaled_dot_product_attention" in t for t in targets) and _sequence_splits(facts, 2):
        dims.append(Axis.CP)
    if any(t.startswith(EXPERTS_OP) for t in targets):
        dims.append(Axis.EP)
    return tuple(dims)


def useful_cp(facts: dict[str, NodeFacts], hardware: HardwareProfile) -> int:
    """The largest cp degree worth searching: each rank's sequence chunk at least the block
    whose ring attention hides its K/V transfer on the innermost link (smaller chunks only add
    communication). Pinned degrees are not limited."""
    attention = [f for f in facts.values() if f.kind == "op" and "scaled_dot_product_attention" in str(f.node.target)]
    if not attention:
        return 1
    fact = attention[0]
    q, k = (tuple(slot.meta["val"].shape) for slot in fact.slots[:2])
    flops = hardware.flops_per_s("float32" if fact.elem_bytes == 4 else "bfloat16")
    causal = bool(fact.node.kwargs.get("is_causal", fact.node.args[5] if len(fact.node.args) > 5 else False))
    block = ring_hideable_block(q[1], k[1], fact.elem_bytes, flops, hardware.links[0].bandwidth, causal=causal)
    return max(1, q[2] // max(block, 1))


def _sequence_splits(facts: dict[str, NodeFacts], cp: int) -> bool:
    """Whether the user inputs' sequence dim (dim 1) splits into 2·cp chunks (a head and a
    tail chunk per rank, which balances causal attention)."""
    shapes = [f.out_shape for f in facts.values() if f.kind == "input" and f.out_shape]
    multiple = chunks_per_rank(Axis.CP) * cp
    return cp == 1 or bool(shapes) and all(len(s) >= 2 and s[1] % multiple == 0 for s in shapes)


class LowerBounds:
    """Bounds no layout of a configuration can beat, from the graph alone (no ILP).

    - compute: every op's work split over every axis whose size divides some dim of its
      shapes (its rule's strategies there), whole layers spread over the stages as evenly as
      they go (:func:`busiest_stage_s`); and the pipeline bubble of the schedules the
      configuration runs;
    - optimizer: the AdamW step over each parameter split over tp (ep for experts) where its
      shape allows, ZeRO-sharded over dp, its stage's share 1/p;
    - gradients, with dp > 1: per parameter, the cheaper of syncing its gradient over dp (the
      cost model's own :func:`partial_gradients`, over its share left by tp) and running the
      ops that use it, each counted for one parameter, unsplit over dp; under ZeRO-2/3 once per
      microbatch (they reduce-scatter, and ZeRO-3 regathers, every microbatch).

    Each is the least over the configuration's schedules, whose bubble and microbatch count
    trade against each other (a pipeline of few microbatches idles longer, of many moves more).

    :meth:`layout_s`, once the axes before the last sharded one are solved (they are shared by
    many configurations), is tighter: their exact traffic (gradient sync over the parameters'
    shards before the later axes, divided by their sizes), and what the last axis's ops cost at least:
    each its cheapest candidate (:func:`~autopar.passes.search.axes.floor_of`), then with the
    least its layout moves (:func:`~autopar.passes.search.axes.solve_axis`). :meth:`ahead_s`,
    before any axis is solved, counts the last axis's floor taken on the unsharded shapes over the
    sizes ahead (:func:`~autopar.passes.search.axes.ahead_floors`): its ops' cheapest candidates,
    then the least its layout moves; the collectives tensor parallelism cannot avoid count there,
    which the compute bound leaves out.

    >>> bounds = LowerBounds(facts, hardware, limit=80e9)        # doctest: +SKIP
    >>> bounds.step_s(mesh, 2, {"dp": 4, "tp": 8}, zero=1)         # doctest: +SKIP
    """

    def __init__(self, facts: dict[str, NodeFacts], hardware: HardwareProfile, variable=None, memo=None):
        self.facts, self.hardware, self.variable, self.memo = facts, hardware, variable, memo
        self._splits: dict[tuple[str, int], bool] = {}
        self._sync: dict[tuple, dict[str, float]] = {}
        self._works: dict[tuple, float] = {}
        self._busiest: dict[tuple, float] = {}
        self._gradients: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._rows = None  # the ops, their unsplit seconds and the layer rows they add to (_busiest_s)
        self._split_masks: dict[int, np.ndarray] = {}  # axis size -> which ops split over it
        self.unsharded = ShardedShapes.unsharded(facts)
        self.experts = expert_params(facts)
        self.params = [n for n, f in facts.items() if f.kind == "param"]
        # each op that uses parameters counts for the largest of them
        self.owner: dict[str, str] = {}
        for name, fact in facts.items():
            used = [s.name for s in fact.slots if facts[s.name].kind == "param"]
            if fact.kind == "op" and used:
                self.owner[name] = max(used, key=lambda p: numel(facts[p].out_shape))

    def splits(self, name: str, size: int) -> bool:
        """Whether some strategy of the node does 1/size of its work on an axis of ``size``
        (for a parameter: whether some dim of it divides)."""
        key = (name, size)
        if key not in self._splits:
            fact = self.facts[name]
            if size == 1:
                found = False
            elif fact.kind == "op":
                view = OpView(fact.node, tuple(fact.slot_shapes), fact.out_shape)
                found = any(work_fraction(s, size) < 1 for s in node_strategies(view, size)[0])
            else:
                found = any(d % size == 0 for d in fact.out_shape)
            self._splits[key] = found
        return self._splits[key]

    def _work(self, name: str, degrees: dict[str, int], skip: str | None = None) -> float:
        key = (name, tuple(degrees.items()), skip)
        if key not in self._works:
            self._works[key] = math.prod(1 / s for a, s in degrees.items() if a != skip and self.splits(name, s))
        return self._works[key]

    def _state_update_s(self, degrees: dict[str, int], zero: int, stage: Mesh) -> float:
        """The optimizer step and mixed precision's casts of the busiest device (all stages')."""
        dp, contention = degrees.get(Axis.DP, 1), self.hardware.contention(stage.shape)
        return sum(
            state_update_s(self._param_elements(p, degrees), self.facts[p], zero, dp, self.hardware, contention)
            for p in self.params
        )

    def _param_share(self, name: str, degrees: dict[str, int]) -> float:
        """The least share of a parameter one device holds: split over tp (ep for experts) where its shape allows."""
        split = [Axis.TP] + ([Axis.EP] if name in self.experts else [])
        return self._work(name, {a: degrees.get(a, 1) for a in split})

    def _param_elements(self, name: str, degrees: dict[str, int]) -> float:
        fact = self.facts[name]
        return numel(fact.out_shape) * fact.weight * self._param_share(name, degrees)

    def model_state_bytes(self, stages: int, degrees: dict[str, int], zero: int) -> float:
        """Weights, gradients and optimizer state of the busiest device, at least."""
        dp = degrees.get(Axis.DP, 1)
        return (
            sum(
                sum(param_state_bytes(self._param_elements(p, degrees), self.facts[p], dp, zero).values())
                for p in self.params
            )
            / stages
        )

    def step_s(self, mesh: Mesh, stages: int, degrees: dict[str, int], zero: int, runs=NO_PIPELINE) -> float:
        """Seconds of a step, at least, on ``mesh`` (the whole mesh) under any layout and any
        schedule of ``runs`` (:func:`schedule_shapes`: (pipeline bubble as a share of the busiest
        device's work, microbatches) pairs; ZeRO-2/3 sync gradients every microbatch)."""
        key = (stages, tuple(degrees.items()))
        if key not in self._busiest:
            self._busiest[key] = self._busiest_s(stages, degrees)
        return self._with_syncs(self._busiest[key], stages, degrees, zero, stage_mesh(mesh, stages), runs)

    def ahead_s(self, stages: int, degrees: dict[str, int], zero: int, floor, stage: Mesh, runs) -> float:
        """:meth:`step_s` with ``floor`` (:func:`~autopar.passes.search.axes.ahead_floors`' (work,
        gradient sync), all stages') for the busiest device's work, its sync added as :meth:`layout_s`
        adds the last axis's, the stages balanced perfectly."""
        work, sync = floor
        return self._with_syncs(work / stages, stages, degrees, zero, stage, runs, sync)

    def _with_syncs(self, busiest: float, stages: int, degrees: dict[str, int], zero: int, stage: Mesh, runs, last=0.0):
        """The least over ``runs`` of the busiest device's work stretched by the bubble, and the
        optimizer step and gradient sync (every microbatch's under ZeRO-2/3; ``last``: the last
        axis's, per microbatch there too, as :meth:`layout_s` counts it)."""
        optimizer = self._state_update_s(degrees, zero, stage)
        return min(
            busiest * (1 + bubble)
            + (optimizer + self._gradients_s(stage, degrees, zero, micro if zero >= 2 else 1)) / stages
            + last * (micro if zero >= 2 else 1) / stages
            for bubble, micro in runs
        )

    def _busiest_s(self, stages: int, degrees: dict[str, int]) -> float:
        """The work of the busiest device, at least: each op split as far as its shapes allow,
        the layers spread over the stages as evenly as whole layers can be."""
        if self._rows is None:  # per layer, which ops it runs (ops outside layers: first or last)
            rows: dict[str, int] = {}
            ops, op_index, row_index, inside = [], [], [], False
            for name, fact in self.facts.items():
                if fact.kind != "op":
                    continue
                inside = inside or fact.layer is not None
                key = fact.layer or ("suffix" if inside else "prefix")
                for layer in fact.folded_layers or (key,):
                    op_index.append(len(ops))
                    row_index.append(rows.setdefault(layer, len(rows)))
                ops.append(name)
            full = np.array([self.facts[n].full_time_s for n in ops])
            in_order = [rows[name] for name, _ in layer_order(self.facts)]  # the whole graph's layers, run in turn
            self._rows = (ops, full, np.array(op_index, dtype=int), np.array(row_index, dtype=int), rows, in_order)
        ops, full, op_index, row_index, rows, in_order = self._rows
        share = np.ones(len(ops))
        for size in degrees.values():
            if size > 1:
                if size not in self._split_masks:
                    self._split_masks[size] = np.array([self.splits(n, size) for n in ops])
                share *= np.where(self._split_masks[size], 1 / size, 1.0)
        sums = np.bincount(row_index, weights=(full * share)[op_index], minlength=len(rows))
        first, last = (float(sums[rows[k]]) if k in rows else 0.0 for k in ("prefix", "suffix"))
        layers = [float(sums[i]) for i in in_order]
        return busiest_stage_s(layers, first, last, stages)

    def recompute_s(self, stages: int, degrees: dict[str, int], level: str) -> float:
        """Seconds of forward that recomputation at ``level`` runs again, at least (the ops it
        drops, each split as far as its shapes allow, the stages balanced perfectly)."""
        total = 0.0
        for name, fact in self.facts.items():
            if fact.kind == "op" and fact.layer is not None and dropped(fact, level):
                total += fact.full_time_s * fact.weight * forward_share(fact) * self._work(name, degrees)
        return total / stages

    def layout_s(self, stages: int, degrees: dict[str, int], zero: int, solved, floor, stage: Mesh, runs):
        """Seconds of a step, at least, once the axes before the last sharded one are solved
        (``solved``: their (context, strategies)): their exact traffic, the last axis's
        ``floor`` ((work, gradient sync): :func:`~autopar.passes.search.axes.solve_axis`'s), the
        optimizer step and, of ``runs`` (as :meth:`step_s`'s), the least pipeline bubble on the work
        and gradient sync per microbatch, the stages balanced perfectly."""
        comm = sync = 0.0
        before = {ctx.name: chosen for ctx, chosen in solved}
        for ctx, _, moved in axis_contexts(self.facts, degrees, before, stage, self.hardware, zero, self.memo):
            if ctx is not None:  # shared by the configurations with these axes first: priced once
                # at most the profile's shares hide (overlap.py caps them further)
                hidden = self.hardware.hidden(self.hardware.tp_overlap) if ctx.name == Axis.TP else 0.0
                comm += moved.comm_s * (1 - hidden)
                # its parameters' shards before the later axes, which may split them: a collective of
                # 1/k of the bytes takes at least 1/k of the time
                later = math.prod(list(degrees.values())[list(degrees).index(ctx.name) + 1 :])
                sync += moved.sync_s * (1 - ctx.overlap) / later
        work, last_sync = floor
        optimizer = self._state_update_s(degrees, zero, stage)
        return min(
            ((comm + work) * (1 + bubble) + (sync + last_sync) * (micro if zero >= 2 else 1) + optimizer) / stages
            for bubble, micro in runs
        )

    def _gradients_s(self, stage: Mesh, degrees: dict[str, int], zero: int, microbatches: int = 1) -> float:
        dp = degrees.get(Axis.DP, 1)
        if dp == 1:
            return 0.0
        key = (stage.shape, tuple(degrees.items()), zero)
        if key not in self._gradients:  # per parameter: one microbatch's sync, and what it saves at most
            facts = self.facts
            sync = self._syncs(stage, dp, zero)
            unsplit: dict[str, float] = {}
            for name, param in self.owner.items():
                if self.splits(name, dp):  # else it never splits over dp and never leaves a partial gradient
                    work = facts[name].full_time_s * facts[name].weight * self._work(name, degrees, skip=Axis.DP)
                    unsplit[param] = unsplit.get(param, 0.0) + work * (1 - 1 / dp)
            self._gradients[key] = (
                np.array([seconds * facts[p].weight * self._param_share(p, degrees) for p, seconds in sync.items()]),
                np.array([unsplit.get(p, 0.0) for p in sync]),
            )
        each, most = self._gradients[key]
        # a collective over 1/k of the bytes takes at least 1/k of the time (alpha-beta)
        return float(np.minimum(each * microbatches, most).sum())

    def _syncs(self, stage: Mesh, dp: int, zero: int) -> dict[str, float]:
        """Per parameter, the seconds of its gradient's sync over dp (ZeRO-3 regathers it too)."""
        hardware = self.hardware
        link = hardware.link(stage.shape, stage.size, dp)
        key = (repr(link), dp, zero)  # each stage its own (ZeRO-0 all-reduces where ZeRO-1/2 may reduce-scatter)
        if key not in self._sync:
            facts = self.facts
            ctx = AxisContext(
                name=Axis.DP,
                size=dp,
                link=link,
                pins={},
                local=self.unsharded,
                overlap=hardware.hidden(hardware.overlap),
                data_parallel=dp,
                zero=zero,
                hardware=hardware,
            )
            sync: dict[str, float] = {}
            for name in self.owner:
                if self.splits(name, dp):
                    fact = facts[name]
                    split = Strategy(tuple(Replicate() for _ in fact.slots), Shard(0))
                    for slot, seconds, _ in partial_gradients(fact, split, ctx, facts):
                        if facts[slot].kind == "param":  # at least what overlap leaves exposed
                            sync[slot] = max(sync.get(slot, 0.0), seconds * (1 - ctx.overlap))
            self._sync[key] = sync
        return self._sync[key]


def schedule_shapes(schedules) -> tuple[tuple[float, int], ...]:
    """What the bounds need of a configuration's runnable ``schedules``: (the least pipeline
    bubble, microbatches) per microbatch count (gradient accumulation only adds microbatches)."""
    least: dict[int, float] = {}
    for schedule in schedules:
        least[schedule.microbatches] = min(least.get(schedule.microbatches, math.inf), bubble_share(schedule))
    return tuple((bubble, micro) for micro, bubble in sorted(least.items()))


def busiest_stage_s(layers: list[float], first: float, last: float, stages: int) -> float:
    """The least work of the busiest of ``stages`` devices running whole ``layers`` (seconds
    each), the first layer's device also ``first`` (the embeddings) and the last's ``last`` (the
    head): the smallest load x at which the devices can hold every layer, each at most the
    cheapest layers that fit beside its extra. The first and the last share a device in V
    schedules, not in the others: the lesser of the two. Never under an even split of the whole.

    >>> busiest_stage_s([1.0] * 8, 0.0, 0.5, 4)   # two layers each; the head's device 2.5
    2.5
    """
    total = sum(layers) + first + last
    if stages == 1 or not layers:
        return total / stages
    cheapest = list(itertools.accumulate(sorted(layers), initial=0.0))

    def fits(x: float, extras: list[float]) -> bool:
        if x < max(extras):
            return False  # a device cannot even hold its extra
        # how many layers each device holds at most (a hair of rounding allowed); the others hold no extra
        held = sum(bisect.bisect_right(cheapest, (x - extra) * (1 + 1e-12)) - 1 for extra in extras)
        held += (stages - len(extras)) * (bisect.bisect_right(cheapest, x * (1 + 1e-12)) - 1)
        return held >= len(layers)

    least = math.inf
    for extras in ([first, last], [first + last]):
        loads = sorted({extra + held for extra in extras + [0.0] for held in cheapest})  # where the fit changes
        low, high = 0, len(loads) - 1  # the largest load always fits: find the smallest that does
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if fits(loads[mid], extras) else (mid + 1, high)
        least = min(least, loads[low])
    return max(total / stages, least)
