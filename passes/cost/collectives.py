"""Cost model: what moving tensors between devices costs, one device's seconds: collectives
(alpha-beta per link tier, NCCL's ring protocols where the tier names them, hierarchical across
nodes), bucketed gradient reductions and the redistributions between two placements."""

from __future__ import annotations

import dataclasses

from autopar.ir import LinkTier, Partial, Placement, Replicate, Shard
from autopar.ir.buckets import BUCKET_BYTES
from autopar.passes.cost.ops import minimum


def collective_time(kind: str, nbytes: float, ranks: int, link: LinkTier) -> float:
    """Ring/pairwise alpha-beta time of one collective over ``ranks`` (``nbytes`` = full tensor):
    ``alpha_s`` per step, or on a tier with NCCL's protocols (and no measurement of ``kind``) the
    fastest protocol's latency for its ring steps (:class:`autopar.ir.links.Protocol`).

    ``send_recv`` is one point-to-point message of ``nbytes`` (a pipeline boundary).
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if link.inner is not None and 1 < link.local_ranks < ranks and kind != "send_recv":
        return _hierarchical_time(kind, nbytes, ranks, link)
    alpha, bandwidth = link.alpha_beta(kind, ranks)
    steps = ranks - 1
    share = steps / ranks * nbytes / bandwidth
    if kind == "all_reduce":
        hops, moving = 2 * steps, 2 * share
    elif kind in ("all_gather", "reduce_scatter"):
        hops, moving = steps, share
    elif kind == "all_to_all":  # each rank holds nbytes/ranks and keeps 1/ranks of it
        hops, moving = steps, share / ranks
    elif kind == "send_recv":  # one message of nbytes between two ranks
        hops, moving = 1, nbytes / bandwidth
    else:
        raise ValueError(f"unknown collective {kind}")
    return _steps_and_bytes(link, kind, hops, moving, alpha, bandwidth) + link.sync_s


def _steps_and_bytes(link: LinkTier, kind: str, hops: int, moving: float, alpha: float, bandwidth: float) -> float:
    """Seconds of ``hops`` ring steps and of the bytes ``moving`` takes at ``bandwidth``: α per step,
    or NCCL's fastest protocol where the tier has them and did not measure ``kind``."""
    if link.protocols and kind in RING_COLLECTIVES and kind not in link.fitted:
        moved = moving * bandwidth  # bytes over the bus
        return minimum(*(p.base_s + hops * p.hop_s + moved / p.bandwidth(bandwidth) for p in link.protocols))
    return hops * alpha + moving


RING_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # what NCCL runs as rings (its all-to-all: sends)


def _hierarchical_time(kind: str, nbytes: float, ranks: int, link: LinkTier) -> float:
    """A collective over nodes with ``link.local_ranks`` members in each, NCCL-style: an
    all-reduce inside the node first, then across nodes on the node's share, then inside again.

    All-to-all has no such shortcut: (nodes − 1)/nodes of every rank's data crosses nodes, each
    rank's through its own adapter (the presets' inter-node bandwidth is per GPU, one adapter
    each, as on DGX nodes; a node with fewer adapters has its per-GPU share as that bandwidth) —
    the penalty of all-to-all across nodes is that share at the slower tier's rate.
    """
    local, nodes = link.local_ranks, ranks // link.local_ranks
    inner, outer = link.inner, dataclasses.replace(link, inner=None, local_ranks=1)
    if kind == "all_reduce":
        return (
            collective_time("reduce_scatter", nbytes, local, inner)
            + collective_time("all_reduce", nbytes / local, nodes, outer)
            + collective_time("all_gather", nbytes, local, inner)
        )
    if kind in ("all_gather", "reduce_scatter"):
        # NCCL runs these two as one ring over every rank (its tree serves all-reduce only): the
        # bytes cross nodes once, on the node's share, but a chunk takes ranks − 1 steps, nodes − 1
        # of them across nodes and ranks − nodes inside (NCCL's tuning.cc, ring latency), where a
        # ring inside the node and one across would take local − 1 inside: (nodes − 1)(local − 1) more.
        alpha, bandwidth = inner.alpha_beta(kind, local)
        inside = (local - 1) / local * nbytes / bandwidth
        return (
            collective_time(kind, nbytes / local, nodes, outer)
            + _steps_and_bytes(inner, kind, nodes * (local - 1), inside, alpha, bandwidth)
            + inner.sync_s
        )
    if kind == "all_to_all":
        alpha, bandwidth = outer.alpha_beta(kind, ranks)
        crossing = nbytes / ranks * (nodes - 1) / nodes  # what leaves this rank's node, through its adapter
        return (
            (ranks - 1) * alpha
            + crossing / bandwidth
            + collective_time("all_to_all", nbytes / nodes, local, inner)
            + link.sync_s
        )
    raise ValueError(f"unknown collective {kind}")


GRAD_BUCKET_BYTES = BUCKET_BYTES


def grad_sync_time(
    nbytes: float, ranks: int, link: LinkTier, bucket_bytes: float = GRAD_BUCKET_BYTES, kind: str = "all_reduce"
) -> float:
    """Share of a bucketed gradient reduction (``kind``: all-reduce, or ZeRO-2/3's reduce-scatter)
    one tensor of ``nbytes`` costs: :func:`collective_time` (hierarchical across nodes), its
    latency paid per bucket; no rendezvous (buckets go out as backward produces them)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    quiet = dataclasses.replace(link, sync_s=0.0)
    latency = collective_time(kind, 1.0, ranks, quiet)  # the α of every step, and one byte
    return collective_time(kind, nbytes, ranks, quiet) - (1.0 - min(1.0, nbytes / bucket_bytes)) * latency


def reshard_collectives(src: Placement, dst: Placement, needs_grad: bool) -> tuple[str, ...] | None:
    """The collectives one redistribution runs on its axis, forward then (when a gradient flows
    back) backward; None where none can (S → P, P(sum) ↔ P(avg): never chosen)."""
    if src == dst:
        return ()
    backward_gather = ("all_gather",) if needs_grad else ()
    if isinstance(src, Replicate):
        if isinstance(dst, Shard):  # take a chunk; backward all-gathers
            return backward_gather
        if isinstance(dst, Partial) and dst.reduce_op == "sum":
            return ()  # R → P keeps the value on one rank; backward is identity
        return None
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return ("all_gather",)  # backward takes a chunk
        if isinstance(dst, Shard):
            return ("all_to_all",) * (2 if needs_grad else 1)
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return ("all_reduce",)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return ("reduce_scatter", *backward_gather)
    return None


def reshard_time(src: Placement, dst: Placement, nbytes: float, ranks: int, link: LinkTier, needs_grad: bool) -> float:
    """Forward plus (when a gradient flows back) backward time of one redistribution.

    ``nbytes`` is the size of the tensor on this axis before sharding by it.
    """
    if ranks <= 1:
        return 0.0
    kinds = reshard_collectives(src, dst, needs_grad)
    return float("inf") if kinds is None else sum((collective_time(kind, nbytes, ranks, link) for kind in kinds), 0.0)
