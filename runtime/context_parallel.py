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
  the ring while the held block is computed, partial results merge by log-sum-exp.

Both are composite ops over a private custom op, as ``aten::scaled_dot_product_attention`` is
over ``aten::_scaled_dot_product_flash_attention``: the public op returns the output alone and
is one node in a captured or rewritten graph; the private op (``autopar::_ulysses_attention``,
``autopar::_ring_attention``) also returns what its backward needs (head-sharded q, k, v; the
log-sum-exp) rather than recompute them with communication. Grouped-query attention (k, v
with fewer heads, dividing q's) is supported; dropout and attn_mask are not.

The planner's cost of both (bytes sent, the ring block that hides its transfer) is in
``autopar.passes.kernel_cost``.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.ir.errors import ShardingRuleError

from .collectives import all_to_all
from .zigzag import inverse_order, zigzag_order

_KV_TAG, _GRAD_TAG = 0, 1  # backward sends K/V and their gradients to the same peer at once


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, op: str) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or (
            q.shape[0], *q.shape[2:]) != (k.shape[0], *k.shape[2:]):
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
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


@torch.library.custom_op("autopar::_ulysses_attention", mutates_args=())
def _ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool,
                       scale: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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
    return (torch.empty_like(q), q.new_empty(batch, heads // world, local_seq * world, head_dim),
            *(k.new_empty(batch, kv_heads, local_seq * world, head_dim) for _ in range(2)))


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
# Blocks are (batch, kv_heads, group, seq, head_dim): q's heads grouped under the k/v head they
# share (group = 1 without GQA), k and v with group 1, so broadcasting serves every q head and
# summing over the group dim reduces k/v gradients. All block math runs in fp32.

def _block_scores(q: Tensor, k: Tensor, scale: float, diagonal: bool) -> Tensor:
    scores = (q @ k.mT) * scale
    if diagonal:  # query i of the chunk sees keys 0..i of the same chunk
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return scores


def _block_forward(q, k, v, scale: float, diagonal: bool) -> tuple[Tensor, Tensor]:
    """Attention of one query chunk on one key chunk: (normalized out, log-sum-exp per query)."""
    scores = _block_scores(q, k, scale, diagonal)
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v, lse


def _merge(out, lse, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online softmax: two partial results over disjoint keys → the result over their union."""
    if out is None:
        return block_out, block_lse
    merged_lse = torch.logaddexp(lse, block_lse)
    return ((lse - merged_lse).exp().unsqueeze(-1) * out
            + (block_lse - merged_lse).exp().unsqueeze(-1) * block_out), merged_lse


def _block_backward(grad_out, q, k, v, lse, delta, scale: float, diagonal: bool):
    """(dq, dk, dv) of one block, from the final lse and delta = rowsum(grad_out · out): with
    probs = exp(scores − lse), d scores = probs · (grad_out @ vᵀ − delta) (FlashAttention-2)."""
    probs = (_block_scores(q, k, scale, diagonal) - lse.unsqueeze(-1)).exp()
    grad_scores = probs * (grad_out @ v.mT - delta.unsqueeze(-1)) * scale
    grad_k = (grad_scores.mT @ q).sum(2, keepdim=True)
    grad_v = (probs.mT @ grad_out).sum(2, keepdim=True)
    return grad_scores @ k, grad_k, grad_v


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
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, group=group, group_peer=(rank + 1) % world, tag=tag),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % world, tag=tag),
    ])
    return received, requests


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _grouped(x: Tensor, kv_heads: int) -> tuple[Tensor, Tensor]:
    """(b, h, 2c, d) → the two local chunks as fp32 (b, kv_heads, h/kv_heads, c, d)."""
    return x.float().unflatten(1, (kv_heads, -1)).chunk(2, dim=-2)


def _ring_blocks(kv: Tensor, group, causal: bool):
    """Each step's K/V block as ((k0, k1), (v0, v1)) fp32 chunks, with the block pairs to compute
    on it; the next block travels while the caller computes on this one."""
    world, rank = group.size(), group.rank()
    for step in range(world):
        if step < world - 1:
            next_kv, requests = _pass_on(kv, group, _KV_TAG)
        chunks = tuple(x.float().unsqueeze(2).chunk(2, dim=-2) for x in kv)
        yield chunks, _block_pairs(rank, (rank - step) % world, world, causal)
        if step < world - 1:
            _wait(requests)
            kv = next_kv


@torch.library.custom_op("autopar::_ring_attention", mutates_args=())
def _ring_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool,
                    scale: float | None) -> tuple[Tensor, Tensor]:
    """Ring attention; returns (out, fp32 log-sum-exp of shape (b, h, local seq)) for backward."""
    _check_inputs(q, k, v, "ring_attention")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale  # SDPA's default
    queries = _grouped(q, k.shape[1])
    outs, lses = [None, None], [None, None]
    group = _resolve_process_group(group_name)
    for (keys, values), pairs in _ring_blocks(torch.stack([k, v]), group, causal):
        for i, j, diagonal in pairs:
            block = _block_forward(queries[i], keys[j], values[j], scale, diagonal)
            outs[i], lses[i] = _merge(outs[i], lses[i], *block)
    out = torch.cat(outs, dim=-2).flatten(1, 2).to(q.dtype)
    return out, torch.cat(lses, dim=-1).flatten(1, 2)


@_ring_attention.register_fake
def _(q, k, v, group_name, causal, scale):
    _check_inputs(q, k, v, "ring_attention")
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _ring_setup(ctx, inputs, output):
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(*inputs[:3], out, lse)
    ctx.group_name, ctx.causal, ctx.scale = inputs[3:]


@torch.library.custom_op("autopar::_ring_attention_backward", mutates_args=())
def _ring_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, group_name: str, causal: bool,
                             scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The ring backward, (dq, dk, dv): K/V travel the ring again, and with each block travels
    the fp32 gradient of its K/V, which every rank adds to and which is back at its owner
    after p steps. Block scores are recomputed from q, k and the forward's lse."""
    group = _resolve_process_group(group_name)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    kv_heads = k.shape[1]
    queries, grad_outs = _grouped(q, kv_heads), _grouped(grad_out, kv_heads)
    lses = lse.unflatten(1, (kv_heads, -1)).chunk(2, dim=-1)
    deltas = (grad_out.float() * out.float()).sum(-1).unflatten(1, (kv_heads, -1)).chunk(2, dim=-1)
    grad_queries = [torch.zeros_like(x) for x in queries]
    received_grad_kv, grad_requests = 0.0, []  # what the ranks before added to the held block's grad
    for (keys, values), pairs in _ring_blocks(torch.stack([k, v]), group, causal):
        grad_keys, grad_values = [torch.zeros_like(x) for x in keys], [torch.zeros_like(x) for x in values]
        for i, j, diagonal in pairs:
            grad_query, grad_key, grad_value = _block_backward(
                grad_outs[i], queries[i], keys[j], values[j], lses[i], deltas[i], scale, diagonal)
            grad_queries[i] += grad_query
            grad_keys[j] += grad_key
            grad_values[j] += grad_value
        grad_kv = torch.stack([torch.cat(grad_keys, dim=-2), torch.cat(grad_values, dim=-2)])
        _wait(grad_requests)
        grad_kv += received_grad_kv
        received_grad_kv, grad_requests = _pass_on(grad_kv, group, _GRAD_TAG)
    _wait(grad_requests)
    # copies: the two halves of one buffer must not come out as aliases of each other
    grad_k, grad_v = (x.squeeze(2).to(k.dtype, copy=True) for x in received_grad_kv)
    return torch.cat(grad_queries, dim=-2).flatten(1, 2).to(q.dtype), grad_k, grad_v


@_ring_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, group_name, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


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
def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool,
                      scale: float | None) -> Tensor:
    """SDPA over the cp group's whole sequence by DeepSpeed-Ulysses; q, k, v are zigzag shards.

    Forward: 4 all-to-alls (q, k, v in, out back); backward: 4 (grad in, dq, dk, dv back).
    Example: ``out = torch.ops.autopar.ulysses_attention(q, k, v, cp_group, True, None)``.
    """
    return torch.ops.autopar._ulysses_attention(q, k, v, group_name, causal, scale)[0]


@torch.library.impl(_library, "ring_attention", "CompositeImplicitAutograd")
def ring_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool,
                   scale: float | None) -> Tensor:
    """SDPA over the cp group's whole sequence by ring attention; q, k, v are zigzag shards.

    Forward passes K/V p−1 times around the ring; backward K/V p−1 times and dK/dV p times.
    Example: ``out = torch.ops.autopar.ring_attention(q, k, v, cp_group, True, None)``.
    """
    return torch.ops.autopar._ring_attention(q, k, v, group_name, causal, scale)[0]
