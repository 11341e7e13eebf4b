"""The context-parallel sequence layout: each rank holds a head and a tail chunk.

Over a cp group of p ranks the sequence is cut into 2p chunks c0 … c(2p−1) and rank r holds
[c_r, c_(2p−1−r)]. Under a causal mask early tokens attend to little and late ones to much,
so pairing them gives every rank the same attention work (Megatron-LM's and Llama 3's load
balancing). Everything else a transformer does per token is indifferent to which tokens a
rank holds, as long as every tensor split along the sequence on the cp axis uses this same
layout — which is why the rewrite wraps each chunk and gather on the cp axis in
``autopar::zigzag``: a permutation into (or, ``inverse``, out of) rank order, after which the
ordinary contiguous chunking gives rank r its head and tail chunk.
"""

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.ir.errors import ShardingRuleError


def _chunk_len(seq_len: int, world: int) -> int:
    if world < 1:
        raise ShardingRuleError(f"a cp group has at least 1 rank, got world={world}")
    if seq_len % (2 * world):
        raise ShardingRuleError(
            f"context parallelism over {world} ranks cuts the sequence into {2 * world} zigzag "
            f"chunks, but seq_len={seq_len} is not divisible by {2 * world}; pad the sequence to a "
            f"multiple of {2 * world} or use a smaller cp degree"
        )
    return seq_len // (2 * world)


def zigzag_positions(seq_len: int, world: int, rank: int) -> Tensor:
    """The sequence positions of group rank ``rank``'s tokens, in the order it holds them.

    Example: ``zigzag_positions(8, 2, 0)`` is ``tensor([0, 1, 6, 7])``.
    """
    chunk = _chunk_len(seq_len, world)
    if not 0 <= rank < world:
        raise ShardingRuleError(f"rank {rank} is not in a cp group of {world} ranks")
    tail = 2 * world - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(tail * chunk, (tail + 1) * chunk)])


def zigzag_order(seq_len: int, world: int) -> Tensor:
    """int64 index putting a full sequence in rank order: rank 0's two chunks, then rank 1's, ...

    ``full.index_select(dim, zigzag_order(S, p)).chunk(p, dim)[r]`` is rank r's shard.
    Example: ``zigzag_order(8, 2)`` is ``tensor([0, 1, 6, 7, 2, 3, 4, 5])``.
    """
    return torch.cat([zigzag_positions(seq_len, world, rank) for rank in range(world)])


def inverse_order(seq_len: int, world: int) -> Tensor:
    """int64 index putting a rank-ordered sequence back in sequence order.

    ``full.index_select(d, zigzag_order(S, p)).index_select(d, inverse_order(S, p))`` is ``full``.
    """
    return torch.argsort(zigzag_order(seq_len, world))


def _permute(x: Tensor, dim: int, world: int, inverse: bool) -> Tensor:
    order = (inverse_order if inverse else zigzag_order)(x.shape[dim], world)
    return x.index_select(dim, order.to(x.device))


@torch.library.custom_op("autopar::zigzag", mutates_args=())
def zigzag(x: Tensor, group_name: str, dim: int, inverse: bool) -> Tensor:
    """Permute a full sequence dim into cp rank order (``inverse``: back to sequence order).

    Example: ``local = chunk(zigzag(x, cp, 1, False), cp, 1)`` is this rank's head and tail.
    """
    return _permute(x, dim, _resolve_process_group(group_name).size(), inverse)


@zigzag.register_fake
def _(x, group_name, dim, inverse):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _zigzag_backward(ctx, grad):
    return torch.ops.autopar.zigzag(grad, ctx.group_name, ctx.dim, not ctx.inverse), None, None, None


def _zigzag_setup(ctx, inputs, output):
    _, ctx.group_name, ctx.dim, ctx.inverse = inputs


zigzag.register_autograd(_zigzag_backward, setup_context=_zigzag_setup)
