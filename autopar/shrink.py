"""A plan's placement pattern, and a smaller copy of a model to run it on (for ``autopar verify``).

When the model or its mesh does not fit on this machine, ``autopar verify`` checks a copy:

- **Smaller sizes.** The model's factory is called again with each keyword argument named in
  :data:`SIZES` lowered to its small value (never raised): ``layers`` 2 (at least one per pipeline
  stage module), ``hidden`` 64, ``heads`` 4, ``kv_heads`` 2 (4 when the model has as many KV heads
  as heads), ``ffn`` 128, ``vocab`` 256, ``seq`` 32, ``experts`` 4, ``top_k`` at most the experts.
  They are the examples' own small sizes, powers of two, so every split by the smaller degrees
  divides. The examples' factories and the Hugging Face ones in examples/hf.py (configs built from
  these arguments) take them; a factory that takes none of them cannot be shrunk.
- **Smaller degrees.** Every parallel degree above 1 becomes 2; while that needs more than
  ``max_ranks`` ranks, dimensions drop to 1 in the order dp, pp, ep, cp (dp last under ZeRO, which
  runs over dp); tp stays, as most of the rewrite's work is on it.
- **The same placement pattern** (:func:`pattern_options`): the plan's parameter placements on the
  tensor-parallel axis pinned by name (the copy's layers keep the first layers' names), its parallel
  kernels pinned by module, its ZeRO stage, recomputation, microbatches and pipeline schedule. The
  search places the rest (activations) on the copy.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from autopar.ir import KERNEL_DIMS, Axis, Plan, PlanOptions, batch_split, module_label

SIZES = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256, "seq": 32, "experts": 4}
SMALL_DEGREE = 2
DROP_ORDER = (Axis.DP, Axis.PP, Axis.EP, Axis.CP)  # the first dropped first; tp is kept


@dataclass(frozen=True)
class Shrunk:
    """The copy: its factory keyword arguments, its degrees (``pp`` included) and what changed."""

    kwargs: dict
    degrees: dict[str, int]
    changes: tuple[str, ...]


def shrink(factory, kwargs: dict, plan: Plan, max_ranks: int) -> Shrunk:
    """The smaller copy of ``factory(**kwargs)`` planned as ``plan`` (see the module docstring).

    >>> shrink(build, {"hidden": 4096, "layers": 32}, plan, max_ranks=4).changes   # doctest: +SKIP
    ('layers 32 -> 2', 'hidden 4096 -> 64', ..., 'dp 8 -> 2', 'tp 8 -> 2')
    """
    degrees, degree_changes = shrink_degrees(plan.full_degrees, plan.zero, max_ranks)
    layers = max(SIZES["layers"], degrees.get(Axis.PP, 1) * plan.schedule.virtual)
    new_kwargs, size_changes = shrink_sizes(factory, kwargs, layers)
    return Shrunk(new_kwargs, degrees, size_changes + degree_changes)


def shrink_degrees(degrees: dict[str, int], zero: int, max_ranks: int) -> tuple[dict[str, int], tuple[str, ...]]:
    small = {axis: min(size, SMALL_DEGREE) for axis, size in degrees.items()}
    order = [a for a in DROP_ORDER if a != Axis.DP] + [Axis.DP] if zero else list(DROP_ORDER)
    dropped = []
    for axis in order:
        if math.prod(small.values()) <= max_ranks:
            break
        if small.get(axis, 1) > 1:
            small[axis] = 1
            dropped.append(axis)
    if math.prod(small.values()) > max_ranks:
        small[Axis.TP] = 1
        dropped.append(Axis.TP)
    changes = tuple(
        f"{axis} {size} -> {small[axis]}" + (f" (more than {max_ranks} ranks)" if axis in dropped else "")
        for axis, size in degrees.items()
        if small[axis] != size
    )
    return small, changes


def shrink_sizes(factory, kwargs: dict, layers: int) -> tuple[dict, tuple[str, ...]]:
    """The factory's keyword arguments with :data:`SIZES` lowered; the defaults it declares count
    as given. Raises ValueError when the factory takes none of them."""
    parameters = inspect.signature(factory).parameters
    current = {
        name: kwargs.get(name, parameters[name].default)
        for name in (*SIZES, "top_k")
        if name in parameters and isinstance(kwargs.get(name, parameters[name].default), int)
    }
    if not set(current) & set(SIZES):
        raise ValueError(f"the factory takes none of the sizes verify lowers ({', '.join(SIZES)})")
    wanted = {**SIZES, "layers": layers}
    if "kv_heads" in current and "heads" in current and current["kv_heads"] >= current["heads"]:
        wanted["kv_heads"] = wanted["heads"]  # multi-head attention stays multi-head
    new = {name: min(value, wanted[name]) for name, value in current.items() if name in wanted}
    if "top_k" in current:
        new["top_k"] = min(current["top_k"], new.get("experts", current["top_k"]))
    changes = tuple(f"{name} {current[name]} -> {value}" for name, value in new.items() if value != current[name])
    return {**kwargs, **new}, changes


def pattern_options(plan: Plan, degrees: dict[str, int], *, params: set[str], modules: set[str]) -> PlanOptions:
    """Options that make a search on ``degrees`` (pp included) place parameters as ``plan`` does:
    its tensor-parallel placements and parallel kernels pinned for the ``params`` and ``modules``
    the model to plan has, its ZeRO stage, recomputation and schedule; on the plan's own degrees
    also its microbatches and stage cuts, on smaller ones at most two microbatches per stage.

    >>> pattern_options(plan, {"dp": 2, "tp": 2}, params=names, modules=paths)   # doctest: +SKIP
    """
    constraints = {}
    if degrees.get(Axis.TP, 1) > 1 and Axis.TP in plan.degrees:
        tp = list(plan.degrees).index(Axis.TP)
        constraints.update({name: str(p[tp]) for name, p in plan.params.items() if name in params})
    for node in plan.nodes.values():
        if node.kernel and node.module in modules and degrees.get(KERNEL_DIMS[node.kernel], 1) > 1:
            constraints[module_label(node.module)] = str(node.kernel)
    stages = degrees.get(Axis.PP, 1)
    same = degrees == plan.full_degrees
    microbatches = plan.schedule.microbatches if same else min(plan.schedule.microbatches, 2 * stages)
    return PlanOptions(
        degrees=degrees,
        constraints=constraints or None,
        zero=plan.zero if degrees.get(Axis.DP, 1) > 1 else 0,
        recompute=plan.schedule.recompute,
        microbatches=max(microbatches, stages),
        pipeline=plan.schedule.kind if stages > 1 else None,
        virtual=plan.schedule.virtual if stages > 1 else None,
        stage_cuts=plan.schedule.cuts if same else (),
        precision="fp32",
    )


def pattern_batch(options: PlanOptions, per_device: int = 2) -> int:
    """A global batch for the copy: ``per_device`` samples for each rank the batch splits over,
    times the microbatches."""
    degrees = {a: s for a, s in (options.degrees or {}).items() if a != Axis.PP}
    return per_device * batch_split(degrees) * (options.microbatches or 1)
