"""Which dim of a parameter ZeRO splits over the data-parallel axis: one rule for the rewrite
(ZeRO-3 gathers) and the runtime (sharded storage, gradients and optimizer state); and which
gradients a compiled program sums itself: one rule for the rewrite and the cost model."""

from __future__ import annotations

from autopar.ir.names import Axis
from autopar.ir.placement import Replicate, Shard
from autopar.ir.plan import Plan, Schedule


def zero_shard_dim(plan: Plan, param: str, shape) -> int | None:
    """The dim of ``param``'s tensor-parallel-local shard that ZeRO splits over "dp", or None.

    ``shape`` is the parameter's full shape. ZeRO (stage 1 and up) splits a parameter the plan
    replicates over dp along the first dim that no other axis splits, so that the two splits
    nest as DTensor placements ``(Shard(d), <tp placement>)`` describe and ``full_tensor()``
    stays right; and only where dp divides that dim (uneven shards are not supported yet).
    A parameter without such a dim (a 1-D bias split over tp) stays whole on every dp rank, and
    under ZeRO-2 one whose gradient the dp ranks do not sum (a layout that runs its ops on the
    whole batch on every dp rank): its reduce-scatter would add identical copies.

    >>> zero_shard_dim(plan, "layers.0.attn.wq.weight", (64, 64))   # doctest: +SKIP
    1
    """
    dp = plan.degrees.get(Axis.DP, 1)
    if not plan.zero or dp == 1:
        return None
    placements = plan.params[param]
    if not isinstance(placements[plan.axes.index(Axis.DP)], Replicate):
        return None
    if plan.zero == 2 and Axis.DP not in plan.grad_sync.get(param, ()):
        return None  # ZeRO-2 reduce-scatters (sums) gradients over dp: one each dp rank computes whole stays whole
    local, split = list(shape), set()
    for axis, placement in zip(plan.axes, placements):
        if isinstance(placement, Shard):
            dim = placement.dim % len(local)
            local[dim] //= plan.degrees[axis]
            split.add(dim)
    return next((dim for dim, size in enumerate(local) if dim not in split and size % dp == 0), None)


def syncs_whole_in_program(zero: int, schedule: Schedule) -> bool:
    """Whether a compiled program (``schedule.compiled``) sums the gradients of the parameters
    ZeRO does not split itself (:mod:`autopar.passes.rewrite.compiled`): in a step without stages
    (over microbatches below ZeRO-2, the last one's program sums what the others accumulated:
    :func:`accumulates_in_program`; ZeRO-2 and 3 sync every microbatch anyway), and with stages
    under ZeRO-3 alone (a pipeline's runtime sums after its last backward). ZeRO-3's split
    parameters are always summed in the program, ZeRO-2's where :func:`scatters_in_program`.

    >>> syncs_whole_in_program(2, Schedule(compiled=True)), syncs_whole_in_program(2, Schedule(stages=2))
    (True, False)
    """
    return zero == 3 or schedule.stages == 1


def scatters_in_program(zero: int, schedule: Schedule) -> bool:
    """Whether a compiled program reduce-scatters ZeRO-2's split gradients into their chunks
    itself (one collective per layer, behind backward): in a step without stages.

    >>> scatters_in_program(2, Schedule(compiled=True))
    True
    """
    return zero == 2 and schedule.stages == 1


def zero_dims(plan: Plan, shapes: dict[str, tuple]) -> dict[str, int]:
    """name → the dim ZeRO splits, for the parameters of ``shapes`` (name → full shape) it splits."""
    return {name: dim for name, shape in shapes.items() if (dim := zero_shard_dim(plan, name, shape)) is not None}


def accumulates_in_program(zero: int, schedule: Schedule) -> bool:
    """Whether a compiled step's microbatches but the last leave their gradients to accumulate
    locally, and the last one's program sums them with its own, behind its backward (DDP's
    ``no_sync`` then a synced backward): gradient accumulation without stages, below ZeRO-2.

    >>> accumulates_in_program(0, Schedule(microbatches=4, compiled=True))
    True
    """
    return zero <= 1 and schedule.stages == 1 and schedule.microbatches > 1
