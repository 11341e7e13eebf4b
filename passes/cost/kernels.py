"""Communication of the parallel kernels (context-parallel attention, expert dispatch).

A kernel strategy does its op's work split over an axis of p ranks (compute is charged as
for any split op) and moves data inside the op, which the edges around it do not see. Per
layer, forward and backward, on one rank:

- Ulysses attention: all-to-all q, k, v from sequence-split to head-split and the output
  back: four all-to-alls of the local tensors in forward, four in backward (DeepSpeed-Ulysses,
  Jacobs et al. 2023: N·h/p elements per link and all-to-all).
- Ring attention: p − 1 steps, each passing the rank's K and V block to its neighbour while
  the current block is computed; backward passes K, V and their gradients. A step's transfer
  hides behind its block's compute up to the profile's overlap share; the rest is exposed.
- Experts: tokens (top-k copies of each) go to their experts' ranks and come back: dispatch
  and combine all-to-alls in forward, the same two with wider rows in backward. The busiest
  rank sets the pace: its share of the routed tokens (measured on the example inputs when
  capture could run the model, else uniform) scales its traffic, and the others wait for its
  extra expert work.
- Vocabulary: the embedding looks up its own rows and sends nothing (its partial output is
  completed on the edge, priced there); the cross-entropy all-reduces the row maxima and then
  the rows' sums in forward and sends nothing in backward (Megatron-LM's
  ``vocab_parallel_cross_entropy``), where gathering the logits would move N·V elements.
"""

from __future__ import annotations

import math

import torch

from autopar.ir import Kernel
from autopar.passes.cost.collectives import collective_time
from autopar.passes.cost.ops import minimum
from autopar.passes.sharding.strategies import OpView, numel


def ulysses_bytes(batch: int, heads: int, seq: int, head_dim: int, world: int, itemsize: int) -> float:
    """Bytes one rank sends in one Ulysses all-to-all of a (batch, heads, seq/p, head_dim) tensor.

    It keeps 1/p of its shard and sends the rest: B·H·(S/p)·D·itemsize·(p−1)/p — the N·h/p
    per link of the DeepSpeed-Ulysses paper. A layer's forward does 4 (q, k, v, out; pass the
    k/v head count for k and v under GQA) and its backward 4 more (grad of out, dq, dk, dv).
    Example: ``ulysses_bytes(1, 32, 8192, 128, 8, 2)`` is 7 MiB.
    """
    return batch * heads * (seq / world) * head_dim * itemsize * (world - 1) / world


def ring_bytes(
    batch: int, kv_heads: int, seq: int, head_dim: int, world: int, itemsize: int, *, backward: bool = False
) -> float:
    """Bytes one rank sends around the ring per attention layer, in forward or in backward.

    A K/V block is 2·B·H_kv·(S/p)·D·itemsize. Forward: p−1 blocks. Backward
    (``backward=True``): p−1 K/V blocks again plus p blocks of dK/dV, which travel in fp32.
    Example: ``ring_bytes(1, 8, 8192, 128, 8, 2)`` is 28 MiB.
    """
    elements = 2 * batch * kv_heads * (seq / world) * head_dim
    forward = (world - 1) * elements * itemsize
    if not backward or world == 1:  # a ring of one sends nothing
        return forward
    return forward + world * elements * 4


def ring_hideable_block(
    heads: int, kv_heads: int, itemsize: int, flops_per_s: float, bytes_per_s: float, *, causal: bool
) -> int:
    """Smallest local sequence length s = S/p at which a ring step's attention hides its send.

    One step computes s queries × s keys on every head: 4·B·H·s²·D FLOPs (q·kᵀ and p·v),
    half of that under the zigzag causal split; it sends 2·B·H_kv·s·D·itemsize bytes. Compute
    ≥ send when s ≥ H_kv·itemsize·F / (2·H·W), doubled when causal (B and D cancel).
    Example: ``ring_hideable_block(32, 8, 2, 400e12, 50e9, causal=True)`` is 4000.
    """
    tokens = kv_heads * itemsize * flops_per_s / (2 * heads * bytes_per_s)
    return math.ceil(tokens * (2 if causal else 1))


def dispatch_bytes(tokens: int, hidden: int, top_k: int, world: int, itemsize: int, *, backward: bool = False) -> float:
    """Bytes one rank sends in an MoE layer's all-to-alls, expected under uniform routing.

    Forward: dispatch and combine each move the rank's T·k slot rows of H elements, of which the
    share (P−1)/P leaves the rank: ``2 · T·k·H · itemsize · (P−1)/P``. Backward (``backward=True``)
    sends rows of 2H+1 (input, output gradient, weight) and returns rows of H+1 (input gradient,
    weight gradient): ``T·k·(3H+2) · itemsize · (P−1)/P``, about 1.5× the forward. The count
    exchanges (E integers each) are left out. Dropless; capacity can only lower it.
    Example: ``dispatch_bytes(4096, 4096, 2, 8, 2)`` ≈ 117 MB.
    """
    row_elements = 3 * hidden + 2 if backward else 2 * hidden
    return tokens * top_k * row_elements * itemsize * (world - 1) / world


def vocab_loss_bytes(tokens: int, world: int, smoothing: bool = False) -> float:
    """Bytes one rank sends in a vocabulary-parallel cross-entropy over ``tokens`` rows; backward sends none.

    Two ring all-reduces of fp32 values, each sending 2·(p−1)/p of its size: the N row maxima,
    then per row the sum of exponentials and the target logit (and, with label smoothing, the
    sum of logits): ``2·(p−1)/p · 4·N·(1 + 2)``, or ``(1 + 3)``. Gathering the logits instead
    sends (p−1)/p · N·V·itemsize. Example: ``vocab_loss_bytes(8192, 8)`` is 172032 (168 KiB).
    """
    values = tokens * (1 + (3 if smoothing else 2))
    return 2 * (world - 1) / world * 4 * values


def expert_load(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Fraction of the token-slots (T·top_k) each expert receives: [E], summing to 1.

    Uniform routing gives 1/E each. Example: ``expert_load(torch.randn(16, 8), 2).max() * 8``.
    """
    chosen = torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1).indices
    return chosen_load(chosen, router_logits.shape[-1])


def chosen_load(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """:func:`expert_load` from the chosen experts' ids [T, k] (a model's own routing)."""
    counts = torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
    return counts / chosen.numel()


def experts_top_k(node) -> int:
    """Experts per token of an ``autopar.moe`` node (its ``top_k``) or a ``moe_experts`` node
    (the width of the expert ids it is given)."""
    if node.target.name().endswith("::moe_experts"):
        return node.args[2].meta["val"].shape[1]
    return node.args[4]


def expert_imbalance(load: list[float] | None, world: int) -> float:
    """The busiest rank's share of the routed tokens over the even share 1/p, when rank r holds
    experts [r·E/p, (r+1)·E/p): 1.0 for balanced (or unmeasured) routing."""
    if not load or world <= 1 or len(load) % world:
        return 1.0
    per_rank = len(load) // world
    return max(sum(load[r * per_rank : (r + 1) * per_rank]) for r in range(world)) * world


def kernel_time(fact, strategy, ctx) -> float:
    """Exposed seconds of a kernel strategy's own communication on this axis (0 without one)."""
    if not strategy.kernel or ctx.size <= 1:
        return 0.0
    shapes = ctx.local.slot_shapes[fact.node.name]  # before this axis splits them
    elem, p = fact.elem_bytes, ctx.size
    if strategy.kernel == Kernel.ULYSSES:
        q, k, v = (numel(s) * elem for s in shapes[:3])
        forward = sum(
            collective_time("all_to_all", nbytes, p, ctx.link) for nbytes in (q, k, v, q)
        )  # q, k, v in; output back
        return 2 * forward  # backward: the same four, reversed
    if strategy.kernel == Kernel.RING:
        (batch, _, seq, head_dim), kv_heads = shapes[1], shapes[1][1]
        steps = p - 1
        sent = [ring_bytes(batch, kv_heads, seq, head_dim, p, elem, backward=b) / steps for b in (False, True)]
        transfer = sum(collective_time("send_recv", nbytes, 2, ctx.link) for nbytes in sent)
        compute = fact.full_time_s * ctx.local.work[fact.node.name] / p / p  # one block pair, forward + backward
        return steps * (transfer - minimum(transfer, compute) * ctx.overlap)
    if strategy.kernel == Kernel.EXPERTS:
        (tokens, hidden), top_k = shapes[0], experts_top_k(fact.node)
        imbalance = expert_imbalance(fact.node.meta.get("expert_load"), p)
        widths = (
            hidden,
            hidden,
            2 * hidden + 1,
            hidden + 1,
        )  # forward: out, back; backward: out (x, grad, weight), back
        moved = sum(collective_time("all_to_all", tokens * top_k * width * elem, p, ctx.link) for width in widths)
        waiting = fact.full_time_s * ctx.local.work[fact.node.name] / p * (imbalance - 1)
        return moved * imbalance + waiting
    if strategy.kernel == Kernel.VOCAB:
        if fact.node.target.overloadpacket is not torch.ops.aten.cross_entropy_loss:
            return 0.0  # the embedding: its partial sums are completed on the output's edge
        tokens, smoothing = shapes[0][0], bool(OpView(fact.node, (), ()).arg(5, "label_smoothing", 0.0))
        rows = (1, 3 if smoothing else 2)  # the maxima; the sums
        return sum(collective_time("all_reduce", 4 * tokens * width, p, ctx.link) for width in rows)
    raise ValueError(f"no cost for kernel {strategy.kernel!r}")


def kernel_bytes(kernel: str, local_bytes: float, p: int, top_k: int = 1, tokens: int = 0) -> float:
    """Bytes one rank sends in a kernel's forward, given its first input's local size (q for
    attention, the tokens for experts); backward sends about as much again (ring: twice).

    Ring: p − 1 K/V blocks, each as large as q (without grouped K/V heads). Ulysses: four
    all-to-alls keeping 1/p of q's size. Experts: every token top_k times out and back.
    Vocabulary: the cross-entropy's :func:`vocab_loss_bytes` for its ``tokens`` rows (the
    embedding, given none, sends nothing).
    """
    if kernel == Kernel.VOCAB:
        return vocab_loss_bytes(tokens, p) if tokens else 0.0
    if kernel == Kernel.RING:
        return 2 * (p - 1) * local_bytes
    if kernel == Kernel.ULYSSES:
        return 4 * (p - 1) / p * local_bytes
    if kernel == Kernel.EXPERTS:
        return 2 * top_k * (p - 1) / p * local_bytes
    raise ValueError(f"no traffic for kernel {kernel!r}")
