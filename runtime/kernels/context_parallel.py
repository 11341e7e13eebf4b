"""Context-parallel attention: q, k, v sharded along the sequence over a "cp" mesh axis.

Layout, ZIGZAG: over a cp group of p ranks the sequence is cut into 2p equal chunks
c0 … c(2p−1) and group rank r holds [c_r, c_(2p−1−r)], in that order. Under a causal mask
early tokens attend to little and late ones to much, so pairing them gives every rank the
same attention work (:mod:`zigzag` describes the layout).

Two kernels take this rank's shard of q, k, v, ``(batch, heads, local seq, head_dim)``, and
return the attention output of the same local tokens, equal up to fp32 rounding to
``F.scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale)`` on the full sequence:

- ``torch.ops.autopar.ulysses_attention(q, k, v, group_name, causal, scale)``, DeepSpeed-Ulysses
  (Jacobs et al. 2023): all-to-all sequence-sharded/all heads → head-sharded/full sequence,
  torch's SDPA on heads/p heads, all-to-all back. Needs heads % p == 0.
- ``torch.ops.autopar.ring_attention(q, k, v, group_name, causal, scale)``, ring attention
  (Liu et al. 2023) with the zigzag causal split of ring-flash-attention: K/V blocks travel
  the ring while the held block is computed, partial results merge by log-sum-exp. On CPU each
  block pair runs torch's fused flash-attention kernels, forward and backward; elsewhere an
  explicit fp32 version of the same math (``_block_kernels`` picks by device).

Both are composite ops over a private custom op, as ``aten::scaled_dot_product_attention`` is
over ``aten::_scaled_dot_product_flash_attention``: the public op returns the output alone and
is one node in a captured or rewritten graph; the private op (``autopar::_ulysses_attention``,
``autopar::_ring_attention``) also returns what its backward needs (head-sharded q, k, v; the
log-sum-exp) rather than recompute them with communication. Grouped-query attention (k, v
with fewer heads, dividing q's) is supported; dropout and attn_mask are not.

The planner's cost of both (bytes sent, the ring block that hides its transfer) is in
``autopar.passes.cost.kernels``.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.ir.errors import ShardingRuleError
from autopar.runtime.collectives import all_to_all
from autopar.runtime.kernels.zigzag import inverse_order, zigzag_order

_KV_TAG, _GRAD_TAG = 0, 1  # backward sends K/V and their gradients to the same peer at once


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, op: str) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or (q.shape[0], *q.shape[2:]) != (k.shape[0], *k.shape[2:]):
        raise ShardingRuleError(
            f"{op} takes q, k, v of shape (batch, heads, local seq, head_dim) with the same batch, "
            f"seq and head_dim, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ShardingRuleError(
            f"{op}: q's {q.shape[1]} heads are not a multiple of k and v's {k.shape[1]} heads; "
            "grouped-query attention needs each k/v head to serve the same number of q heads"
        )
    if q.shape[2] % 2:
        raise ShardingRuleError(
            f"{op}: a zigzag shard holds two equal chunks, but its local seq is {q.shape[2]}; "
            "shard a sequence divisible by 2 x the cp degree"
        )


# --- Ulysses ---------------------------------------------------------------------------------


def _kv_repeats_before_all_to_all(q: Tensor, k: Tensor, group_size: int) -> int:
    """k/v heads that do not split over the group are repeated to q's heads before sending."""
    if q.shape[1] % group_size:
        raise ShardingRuleError(
            f"ulysses_attention splits the {q.shape[1]} heads over {group_size} cp ranks; use a cp "
            f"degree that divides the head count, or ring_attention, which has no such limit"
        )
    return 1 if k.shape[1] % group_size == 0 else q.shape[1] // k.shape[1]


def _to_heads(x: Tensor, group_name: str, world: int) -> Tensor:
    """(b, h, s/p, d) zigzag shard → (b, h/p, s, d) in sequence order."""
    gathered = all_to_all(x, group_name, 1, 2)
    return gathered.index_select(2, inverse_order(gathered.shape[2], world).to(x.device))


def _to_sequence(x: Tensor, group_name: str, world: int) -> Tensor:
    """(b, h/p, s, d) in sequence order → (b, h, s/p, d) zigzag shard: :func:`_to_heads` inverted."""
    ranked = x.index_select(2, zigzag_order(x.shape[2], world).to(x.device))
    return all_to_all(ranked, group_name, 2, 1)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


@torch.library.custom_op("autopar::_ulysses_attention", mutates_args=())
def _ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Ulysses attention; returns (out, q, k, v), the latter head-sharded for backward."""
    world = _resolve_process_group(group_name).size()
    _check_inputs(q, k, v, "ulysses_attention")
    repeats = _kv_repeats_before_all_to_all(q, k, world)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
    q_heads, k_heads, v_heads = (_to_heads(x, group_name, world) for x in (q, k, v))
    out = _to_sequence(_sdpa(q_heads, k_heads, v_heads, causal, scale), group_name, world)
    return out, q_heads, k_heads, v_heads


@_ulysses_attention.register_fake
def _(q, k, v, group_name, causal, scale):
    world = _resolve_process_group(group_name).size()
    _check_inputs(q, k, v, "ulysses_attention")
    repeats = _kv_repeats_before_all_to_all(q, k, world)
    batch, heads, local_seq, head_dim = q.shape
    kv_heads = k.shape[1] * repeats // world
    return (
        q.new_empty(q.shape),  # contiguous, as the real output (q may be a transposed view)
        q.new_empty(batch, heads // world, local_seq * world, head_dim),
        *(k.new_empty(batch, kv_heads, local_seq * world, head_dim) for _ in range(2)),
    )


def _ulysses_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[1:])
    ctx.kv_heads = inputs[1].shape[1]
    ctx.group_name, ctx.causal, ctx.scale = inputs[3:]


def _ulysses_backward(ctx, grad_out, *_):
    """The dual all-to-alls around torch's SDPA backward (its forward recomputed from the saved
    head-sharded q, k, v: compute only, no communication)."""
    world = _resolve_process_group(ctx.group_name).size()
    grad_heads = _to_heads(grad_out, ctx.group_name, world)
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        out_heads = _sdpa(*leaves, ctx.causal, ctx.scale)
    grads = torch.autograd.grad(out_heads, leaves, grad_heads)
    grad_q, grad_k, grad_v = (_to_sequence(g, ctx.group_name, world) for g in grads)
    if grad_k.shape[1] != ctx.kv_heads:  # k, v were repeated before the all-to-all
        grad_k, grad_v = (g.unflatten(1, (ctx.kv_heads, -1)).sum(2) for g in (grad_k, grad_v))
    return grad_q, grad_k, grad_v, None, None, None


_ulysses_attention.register_autograd(_ulysses_backward, setup_context=_ulysses_setup)


# --- ring: per-block math ----------------------------------------------------------------------
# One block pair: a query chunk (batch, heads, c, head_dim) on a key/value chunk (batch, kv_heads,
# c, head_dim), all fp32 so that partial results merge without rounding. Forward gives the pair's
# normalized out and log-sum-exp per query (batch, heads, c). Backward, given the query chunk's
# FINAL out and lse (merged over all its key chunks), gives the pair's share of dq, dk, dv:
# FlashAttention-2's backward uses probs = exp(scores − lse) and delta = rowsum(grad_out · out),
# which are then the whole softmax's, so the shares sum to the full gradient (ring-flash-attention).
# A diagonal pair (query chunk == key chunk) is top-left causal.


def _fused_forward(q, k, v, scale: float, diagonal: bool) -> tuple[Tensor, Tensor]:
    """torch's fused CPU flash attention; it serves grouped-query k/v heads itself."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, diagonal, scale=scale)


def _fused_backward(grad_out, q, k, v, out, lse, scale: float, diagonal: bool):
    """torch's fused CPU flash-attention backward; dk, dv come summed over each k/v head's group."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, diagonal, scale=scale
    )


# The explicit fallback materializes each [c × c] score matrix. It groups q's heads under the
# k/v head they share, (batch, kv_heads, group, c, head_dim), and gives k, v a group dim of 1, so
# broadcasting serves every q head and summing over the group dim reduces k/v gradients.


def _block_scores(q: Tensor, k: Tensor, scale: float, diagonal: bool) -> Tensor:
    scores = (q @ k.mT) * scale
    if diagonal:  # query i of the chunk sees keys 0..i of the same chunk
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return scores


def _explicit_forward(q, k, v, scale: float, diagonal: bool) -> tuple[Tensor, Tensor]:
    scores = _block_scores(q.unflatten(1, (k.shape[1], -1)), k.unsqueeze(2), scale, diagonal)
    lse = scores.logsumexp(-1)
    out = (scores - lse.unsqueeze(-1)).exp() @ v.unsqueeze(2)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _explicit_backward(grad_out, q, k, v, out, lse, scale: float, diagonal: bool):
    """d scores = probs · (grad_out @ vᵀ − delta), the FlashAttention-2 backward written out."""
    grad_out, q, out, lse = (x.unflatten(1, (k.shape[1], -1)) for x in (grad_out, q, out, lse))
    k, v = k.unsqueeze(2), v.unsqueeze(2)
    delta = (grad_out * out).sum(-1)
    probs = (_block_scores(q, k, scale, diagonal) - lse.unsqueeze(-1)).exp()
    grad_scores = probs * (grad_out @ v.mT - delta.unsqueeze(-1)) * scale
    return (grad_scores @ k).flatten(1, 2), (grad_scores.mT @ q).sum(2), (probs.mT @ grad_out).sum(2)


def _block_kernels(device: torch.device):
    """(forward, backward) block math for tensors on ``device``: torch's fused kernels where they
    are tested here (CPU), the explicit math elsewhere."""
    if device.type == "cpu":
        return _fused_forward, _fused_backward
    return _explicit_forward, _explicit_backward


def _merge(out, lse, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online softmax: two partial results over disjoint keys → the result over their union."""
    if out is None:
        return block_out, block_lse
    merged_lse = torch.logaddexp(lse, block_lse)
    return (
        (lse - merged_lse).exp().unsqueeze(-1) * out + (block_lse - merged_lse).exp().unsqueeze(-1) * block_out
    ), merged_lse


def _block_pairs(rank: int, owner: int, world: int, causal: bool):
    """(local query chunk i, chunk j of ``owner``'s block, diagonal?) for every pair to compute:
    under a causal mask a key chunk later than the query chunk is skipped — what balances the
    zigzag — and the same chunk is masked on its diagonal."""

    def chunks(r):
        return r, 2 * world - 1 - r

    for i, query_chunk in enumerate(chunks(rank)):
        for j, key_chunk in enumerate(chunks(owner)):
            if not causal or key_chunk <= query_chunk:
                yield i, j, causal and key_chunk == query_chunk


# --- ring: communication -----------------------------------------------------------------------


def _pass_on(tensor: Tensor, group, tag: int):
    """Send ``tensor`` to the next rank and receive the previous rank's (asynchronously).

    Returns the receive buffer and the requests to wait for before reading it.
    """
    world, rank = group.size(), group.rank()
    if world == 1:
        return tensor, []
    received = torch.empty_like(tensor)
    requests = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, tensor, group=group, group_peer=(rank + 1) % world, tag=tag),
            dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % world, tag=tag),
        ]
    )
    return received, requests


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _chunks(x: Tensor) -> tuple[Tensor, Tensor]:
    """(b, h, 2c, d) → its two chunks (b, h, c, d) as fp32; views where ``x`` is fp32 already."""
    return x.float().chunk(2, dim=-2)


def _ring_blocks(kv: Tensor, group, causal: bool):
    """Each step's K/V block as ((k0, k1), (v0, v1)) fp32 chunks, with the block pairs to compute
    on it; the next block travels while the caller computes on this one."""
    world, rank = group.size(), group.rank()
    for step in range(world):
        if step < world - 1:
            next_kv, requests = _pass_on(kv, group, _KV_TAG)
        yield tuple(_chunks(x) for x in kv), _block_pairs(rank, (rank - step) % world, world, causal)
        if step < world - 1:
            _wait(requests)
            kv = next_kv


@torch.library.custom_op("autopar::_ring_attention", mutates_args=())
def _ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    """Ring attention; returns (out, fp32 log-sum-exp of shape (b, h, local seq)) for backward."""
    _check_inputs(q, k, v, "ring_attention")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale  # SDPA's default
    block_forward, _ = _block_kernels(q.device)
    queries = _chunks(q)
    outs, lses = [None, None], [None, None]
    group = _resolve_process_group(group_name)
    for (keys, values), pairs in _ring_blocks(torch.stack([k, v]), group, causal):
        for i, j, diagonal in pairs:
            block = block_forward(queries[i], keys[j], values[j], scale, diagonal)
            outs[i], lses[i] = _merge(outs[i], lses[i], *block)
    return torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)


@_ring_attention.register_fake
def _(q, k, v, group_name, causal, scale):
    _check_inputs(q, k, v, "ring_attention")
    # contiguous, as the real outputs (q may be a transposed view): compiled code checks strides
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _ring_setup(ctx, inputs, output):
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(*inputs[:3], out, lse)
    ctx.group_name, ctx.causal, ctx.scale = inputs[3:]


@torch.library.custom_op("autopar::_ring_attention_backward", mutates_args=())
def _ring_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group_name: str,
    causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The ring backward, (dq, dk, dv): K/V travel the ring again, and with each block travels
    the fp32 gradient of its K/V, which every rank adds to and which is back at its owner
    after p steps. Each block's scores are recomputed from q, k and the forward's final lse."""
    _, block_backward = _block_kernels(q.device)
    group = _resolve_process_group(group_name)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    queries, grad_outs, outs = _chunks(q), _chunks(grad_out), _chunks(out)
    lses = lse.chunk(2, dim=-1)
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grad_queries = grad_q.chunk(2, dim=-2)  # views: adding to a chunk adds to grad_q
    received_grad_kv, grad_requests = 0.0, []  # what the ranks before added to the held block's grad
    for (keys, values), pairs in _ring_blocks(torch.stack([k, v]), group, causal):
        grad_kv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        grad_keys, grad_values = (x.chunk(2, dim=-2) for x in grad_kv)
        for i, j, diagonal in pairs:
            grad_query, grad_key, grad_value = block_backward(
                grad_outs[i], queries[i], keys[j], values[j], outs[i], lses[i], scale, diagonal
            )
            grad_queries[i].add_(grad_query)
            grad_keys[j].add_(grad_key)
            grad_values[j].add_(grad_value)
        _wait(grad_requests)
        grad_kv += received_grad_kv
        received_grad_kv, grad_requests = _pass_on(grad_kv, group, _GRAD_TAG)
    _wait(grad_requests)
    # copies: the two halves of one buffer must not come out as aliases of each other
    grad_k, grad_v = (x.to(k.dtype, copy=True) for x in received_grad_kv)
    return grad_q.to(q.dtype), grad_k, grad_v


@_ring_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, group_name, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real ones


def _ring_backward(ctx, grad_out, _):
    grads = _ring_attention_backward(grad_out, *ctx.saved_tensors, ctx.group_name, ctx.causal, ctx.scale)
    return *grads, None, None, None


_ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup)


# --- public ops ------------------------------------------------------------------------------

_library = torch.library.Library("autopar", "FRAGMENT")
_SIGNATURE = "(Tensor q, Tensor k, Tensor v, str group_name, bool causal, float? scale) -> Tensor"
_library.define("ulysses_attention" + _SIGNATURE)
_library.define("ring_attention" + _SIGNATURE)


@torch.library.impl(_library, "ulysses_attention", "CompositeImplicitAutograd")
def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool, scale: float | None) -> Tensor:
    """SDPA over the cp group's whole sequence by DeepSpeed-Ulysses; q, k, v are zigzag shards.

    Forward: 4 all-to-alls (q, k, v in, out back); backward: 4 (grad in, dq, dk, dv back).
    Example: ``out = torch.ops.autopar.ulysses_attention(q, k, v, cp_group, True, None)``.
    """
    return torch.ops.autopar._ulysses_attention(q, k, v, group_name, causal, scale)[0]


@torch.library.impl(_library, "ring_attention", "CompositeImplicitAutograd")
def ring_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool, scale: float | None) -> Tensor:
    """SDPA over the cp group's whole sequence by ring attention; q, k, v are zigzag shards.

    Forward passes K/V p−1 times around the ring; backward K/V p−1 times and dK/dV p times.
    Example: ``out = torch.ops.autopar.ring_attention(q, k, v, cp_group, True, None)``.
    """
    return torch.ops.autopar._ring_attention(q, k, v, group_name, causal, scale)[0]
