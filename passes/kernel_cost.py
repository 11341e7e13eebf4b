"""Communication of the parallel kernels (context-parallel attention, expert dispatch).

A kernel strategy does its op's work split over an axis of p ranks (compute is charged as
for any split op) and moves data inside the op, which the edges around it do not see. Per
step, forward and backward, on one rank:

- Ulysses attention: all-to-all q, k, v from sequence-split to head-split and the output
  back: four all-to-alls of the local tensors in forward, four in backward (DeepSpeed-Ulysses,
  Jacobs et al. 2023: 4·N·h/p elements per layer and direction).
- Ring attention: p − 1 steps, each passing the rank's K and V block to its neighbour while
  the current block is computed; backward passes K, V and their gradients. A step's transfer
  hides behind its block's compute up to the profile's overlap share; the rest is exposed.
- Experts: tokens (top-k copies of each) go to their experts' ranks and come back: dispatch
  and combine all-to-alls in forward, the same two in backward.
"""

from __future__ import annotations

from .cost import collective_time
from .strategies import numel


def kernel_time(fact, strategy, ctx) -> float:
    """Exposed seconds of a kernel strategy's own communication on this axis (0 without one)."""
    if not strategy.kernel or ctx.size <= 1:
        return 0.0
    shapes = ctx.local.slot_shapes[fact.node.name]  # before this axis splits them
    elem = fact.elem_bytes
    if strategy.kernel == "ulysses":
        q, k, v = (numel(s) * elem for s in shapes[:3])
        forward = sum(collective_time("all_to_all", nbytes, ctx.size, ctx.link) for nbytes in (q, k, v, q))  # q, k, v in; output back
        return 2 * forward  # backward: the same four, reversed
    if strategy.kernel == "ring":
        return ring_exposed_s(fact, shapes, ctx)
    if strategy.kernel == "experts":
        return 4 * collective_time("all_to_all", dispatch_bytes(fact, shapes), ctx.size, ctx.link)
    raise ValueError(f"no cost for kernel {strategy.kernel!r}")


def kernel_bytes(kernel: str, local_bytes: float, p: int, top_k: int = 1) -> float:
    """Bytes one rank sends in a kernel's forward, given its first input's local size (q for
    attention, the tokens for experts); backward sends about as much again (ring: twice).

    Ring: p − 1 K/V blocks, each as large as q (without grouped K/V heads). Ulysses: four
    all-to-alls keeping 1/p of q's size. Experts: every token top_k times out and back.
    """
    if kernel == "ring":
        return 2 * (p - 1) * local_bytes
    if kernel == "ulysses":
        return 4 * (p - 1) / p * local_bytes
    if kernel == "experts":
        return 2 * top_k * (p - 1) / p * local_bytes
    raise ValueError(f"no traffic for kernel {kernel!r}")


def ring_exposed_s(fact, shapes, ctx) -> float:
    """(p − 1) ring steps; each sends one K/V block forward and K, V, dK, dV backward."""
    p = ctx.size
    block = sum(numel(s) for s in shapes[1:3]) * fact.elem_bytes / p  # this rank's K and V
    transfer = collective_time("send_recv", block, 2, ctx.link) + collective_time("send_recv", 2 * block, 2, ctx.link)
    compute = fact.full_time_s * ctx.local.work[fact.node.name] / p / p  # one block pair, forward + backward
    hidden = min(transfer, compute) * ctx.overlap
    return (p - 1) * (transfer - hidden)


def ring_hideable_seq(flops_per_s: float, bytes_per_s: float, elem_bytes: int = 4) -> float:
    """Smallest local sequence block whose attention hides its K/V transfer.

    Per head and batch row, one block pair costs 4·s²·d FLOPs forward (QKᵀ and PV) and sends
    2·s·d elements (K and V): compute ≥ transfer when s ≥ elem·flops_per_s / (2·bytes_per_s).
    """
    return elem_bytes * flops_per_s / (2 * bytes_per_s)


def dispatch_bytes(fact, shapes) -> float:
    """Bytes of one dispatch (or combine) all-to-all: every token's hidden vector, top-k times."""
    tokens, hidden = shapes[0]
    top_k = fact.node.args[4]
    return tokens * hidden * top_k * fact.elem_bytes
