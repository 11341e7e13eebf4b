"""Sharding rules of autopar's composite ops, by name (``OWN_OPS``): the mixture of experts ops, the
chunked gated delta rule, the selective scan and the linear recurrence that capture makes of a
model's blocks (registered by autopar.runtime)."""

from __future__ import annotations

from autopar.ir import Kernel, Replicate, Shard
from autopar.passes.capture.moe import EXPERTS_OP, ROUTED_EXPERTS_OP
from autopar.passes.capture.recurrences import LINEAR_OP, RECURRENCE_OP, SCAN_OP
from autopar.passes.sharding.strategies import OpView, Strategy
from autopar.runtime.kernels.expert_parallel import first_expert_slot

R = Replicate()


def experts(view: OpView) -> list[Strategy]:
    """autopar::moe(x [T, H], router [E, H], gate_up [E, 2F, H], down [E, H, F], biases [E, ...] if
    any) -> (out, logits), or moe_experts(x, weights [T, k], ids [T, k], gate_up, down, biases) -> out:
    split the tokens (every rank runs every expert on its tokens), or the experts too, tokens sent
    to them (the expert-parallel kernel)."""
    routed = str(view.node.target).startswith(ROUTED_EXPERTS_OP)
    routing = (Shard(0), Shard(0)) if routed else (R,)  # its choices, or the router
    per_expert = len(view.in_shapes) - first_expert_slot(view.node.target)  # gate_up, down and their biases
    tokens = Strategy((Shard(0), *routing, *[R] * per_expert), Shard(0))
    return [tokens, Strategy((Shard(0), *routing, *[Shard(0)] * per_expert), Shard(0), Kernel.EXPERTS)]


def recurrence(view: OpView) -> list[Strategy]:
    """autopar::gated_delta_rule(q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv]) -> [B, T, Hv, Dv]:
    independent over the batch and over heads (value and key heads split alike keep each key
    head's group of value heads on one rank); sequential in time, so never split there."""
    return [Strategy((Shard(d),) * len(view.in_shapes), Shard(d)) for d in (0, 2)]


def scan(view: OpView) -> list[Strategy]:
    """autopar::selective_scan(u, delta [b, D, T], A [D, N], B, C [b, N, T], D, z [b, D, T], delta_bias [D])
    -> [b, D, T]: independent over the batch and over channels (each channel's N states are its
    own; B and C, read by every channel, whole on each rank); sequential in time."""
    batch = Strategy((Shard(0), Shard(0), R, Shard(0), Shard(0), R, Shard(0), R), Shard(0))
    return [batch, Strategy((Shard(1), Shard(1), Shard(0), R, R, Shard(0), Shard(1), Shard(0)), Shard(1))]


def linear_recurrence(view: OpView) -> list[Strategy]:
    """autopar::linear_recurrence(x, a [b, T, w]) -> [b, T, w]: independent over the batch and over
    channels (each channel's state its own); sequential in time."""
    return [Strategy((Shard(d), Shard(d)), Shard(d)) for d in (0, 2)]


OWN_OPS = {
    EXPERTS_OP: experts,
    ROUTED_EXPERTS_OP: experts,
    RECURRENCE_OP: recurrence,
    SCAN_OP: scan,
    LINEAR_OP: linear_recurrence,
}
