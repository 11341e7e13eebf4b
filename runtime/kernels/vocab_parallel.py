"""Vocabulary parallelism: the embedding and the cross-entropy with the vocabulary split over a group.

Megatron-LM's ``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy`` (Shoeybi et al.
2019, section 3), torchtitan's ``loss_parallel``. Over a group of p ranks and a vocabulary of
V = p·v entries, group rank r holds entries [r·v, (r+1)·v): the embedding's rows, the output
projection's columns, so the class dim of the logits. No rank ever holds the full table or the
full logits.

- ``torch.ops.autopar.vocab_embedding(weight [v, H], ids [...], group_name, padding_idx)``: each
  rank looks up the ids in its range and writes zeros for the others. Every id lies in exactly
  one range, so the sum over ranks is the lookup in the whole table: the output is a partial
  sum, completed by the all-reduce (or the reduce-scatter into sequence parallelism) the
  rewrite puts on its edge. Backward: the output's gradient reaches every rank whole (the dual
  of that all-reduce is the identity); each rank adds it into the rows of its own ids only.
- ``torch.ops.autopar.vocab_cross_entropy(logits [N, v], target [N], None, reduction,
  ignore_index, label_smoothing, group_name)``: ``F.cross_entropy`` over the whole vocabulary
  (reduction 0 none, 1 mean, 2 sum, as ``aten.cross_entropy_loss``). Per row i, with x the
  logits and ε the label smoothing:

      m_i = max_c x_ic                       all-reduce (max) of the local maxima
      Z_i = Σ_c exp(x_ic − m_i)              ┐
      t_i = x_i,target − m_i                 │ one all-reduce (sum): t_i is nonzero on the
      S_i = Σ_c (x_ic − m_i)  (only if ε>0)  ┘ rank holding the target only
      loss_i = log Z_i − (1−ε)·t_i − (ε/V)·S_i      (= (1−ε)·NLL + ε·mean_c(−log p_ic))

  and 0 where target == ignore_index; the mean divides by the rows not ignored, as torch does.
  Backward sends nothing: ∂loss_i/∂x_ic = p_ic − (1−ε)·[c = target_i] − ε/V on the local
  classes, from the local softmax p saved in forward (as large as the local logits).
  Class weights are not supported (the planner offers this kernel only without them).

The planner's cost of both (the loss's two all-reduces of N and 2N or 3N fp32 values) is in
``autopar.passes.cost.kernels``.
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.ir.errors import ShardingRuleError

_REDUCTIONS = (0, 1, 2)  # none, mean, sum: at::Reduction, as aten.cross_entropy_loss takes it


def _local_ids(ids: Tensor, rows: int, rank: int) -> tuple[Tensor, Tensor]:
    """(whether each id is among this rank's ``rows`` entries, its local index there or 0)."""
    first = rank * rows
    owned = (ids >= first) & (ids < first + rows)
    return owned, torch.where(owned, ids - first, 0)


def _local_padding(padding_idx: int, rows: int, rank: int) -> int:
    first = rank * rows
    return padding_idx - first if padding_idx >= 0 and first <= padding_idx < first + rows else -1


# --- embedding -----------------------------------------------------------------------------------


@torch.library.custom_op("autopar::vocab_embedding", mutates_args=())
def vocab_embedding(weight: Tensor, indices: Tensor, group_name: str, padding_idx: int) -> Tensor:
    """``F.embedding`` of ``indices`` in the table whose rows this rank holds one group-rank
    share of: rows of its own ids, zeros elsewhere (a partial sum over the group).

    ``padding_idx`` is the global row that gets no gradient (-1: none), as in ``nn.Embedding``.
    Example: ``h = torch.ops.autopar.vocab_embedding(weight_shard, ids, tp_group, -1)``, then
    ``torch.ops.autopar.all_reduce(h, tp_group, "sum")``.
    """
    _check_table(weight)
    rank = _resolve_process_group(group_name).rank()
    owned, local = _local_ids(indices, weight.shape[0], rank)
    return torch.embedding(weight, local).masked_fill(~owned.unsqueeze(-1), 0)


@vocab_embedding.register_fake
def _(weight, indices, group_name, padding_idx):
    _check_table(weight)
    return weight.new_empty((*indices.shape, weight.shape[1]))


def _check_table(weight: Tensor) -> None:
    if weight.dim() != 2:
        raise ShardingRuleError(f"vocab_embedding takes a table of shape (rows, hidden), got {tuple(weight.shape)}")


def _embedding_setup(ctx, inputs, output):
    weight, indices, group_name, padding_idx = inputs
    ctx.save_for_backward(indices)
    ctx.rows, ctx.group_name, ctx.padding_idx = weight.shape[0], group_name, padding_idx


def _embedding_backward(ctx, grad):
    """Each rank's rows take the (whole) output gradient of its own ids: embedding's backward
    on the masked gradient; no communication."""
    (indices,) = ctx.saved_tensors
    rank = _resolve_process_group(ctx.group_name).rank()
    owned, local = _local_ids(indices, ctx.rows, rank)
    grad = grad.masked_fill(~owned.unsqueeze(-1), 0)
    padding = _local_padding(ctx.padding_idx, ctx.rows, rank)
    return torch.ops.aten.embedding_dense_backward(grad, local, ctx.rows, padding, False), None, None, None


vocab_embedding.register_autograd(_embedding_backward, setup_context=_embedding_setup)


# --- cross-entropy -------------------------------------------------------------------------------


@torch.library.custom_op("autopar::_vocab_cross_entropy", mutates_args=())
def _vocab_cross_entropy(
    logits: Tensor, target: Tensor, group_name: str, ignore_index: int, label_smoothing: float
) -> tuple[Tensor, Tensor]:
    """Per-row losses (fp32, 0 where ignored) and this rank's softmax (the logits' dtype) for backward."""
    group = _resolve_process_group(group_name)
    x = logits.float()
    classes = x.shape[-1] * group.size()
    maximum = x.amax(dim=-1)
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    shifted = x - maximum.unsqueeze(-1)
    exp = shifted.exp()
    owned, local = _local_ids(target, x.shape[-1], group.rank())
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0)
    stats = [exp.sum(-1), picked] + ([shifted.sum(-1)] if label_smoothing else [])
    totals = torch.stack(stats)
    dist.all_reduce(totals, group=group)
    loss = totals[0].log() - (1 - label_smoothing) * totals[1]
    if label_smoothing:
        loss = loss - label_smoothing / classes * totals[2]
    softmax = (exp / totals[0].unsqueeze(-1)).to(logits.dtype)
    return loss.masked_fill(target == ignore_index, 0), softmax


@_vocab_cross_entropy.register_fake
def _(logits, target, group_name, ignore_index, label_smoothing):
    return logits.new_empty(logits.shape[:-1], dtype=torch.float32), torch.empty_like(logits)


def _cross_entropy_setup(ctx, inputs, output):
    logits, target, group_name, ignore_index, label_smoothing = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(target, output[1])
    ctx.group_name, ctx.ignore_index, ctx.label_smoothing = group_name, ignore_index, label_smoothing


def _cross_entropy_backward(ctx, grad_loss, _):
    """p − (1−ε)·onehot(target) − ε/V on the local classes, times each row's loss gradient."""
    target, softmax = ctx.saved_tensors
    group = _resolve_process_group(ctx.group_name)
    smoothing = ctx.label_smoothing
    owned, local = _local_ids(target, softmax.shape[-1], group.rank())
    grad = softmax.float()
    grad.scatter_add_(-1, local.unsqueeze(-1), (owned.float() * -(1 - smoothing)).unsqueeze(-1))
    if smoothing:
        grad -= smoothing / (softmax.shape[-1] * group.size())
    grad *= grad_loss.masked_fill(target == ctx.ignore_index, 0).unsqueeze(-1)
    return grad.to(softmax.dtype), None, None, None, None


_vocab_cross_entropy.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)


_library = torch.library.Library("autopar", "FRAGMENT")
_library.define(
    "vocab_cross_entropy(Tensor input, Tensor target, Tensor? weight, int reduction, SymInt ignore_index, "
    "float label_smoothing, str group_name) -> Tensor"
)


@torch.library.impl(_library, "vocab_cross_entropy", "CompositeImplicitAutograd")
def vocab_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None,
    reduction: int,
    ignore_index: int,
    label_smoothing: float,
    group_name: str,
) -> Tensor:
    """``aten.cross_entropy_loss(input, target, weight, reduction, ignore_index, label_smoothing)``
    with the class dim of ``input`` [N, V/p] split over ``group_name`` (see the module docstring);
    ``target`` [N] holds global class ids, whole on every rank.

    Forward: 2 all-reduces (N row maxima; N·2 or N·3 sums); backward: none.
    Example: ``torch.ops.autopar.vocab_cross_entropy(logits_shard, labels, None, 1, -100, 0.0, tp_group)``.
    """
    if weight is not None:
        raise ShardingRuleError("vocab_cross_entropy takes no class weights: keep the logits whole for a weighted loss")
    if input.dim() != 2 or target.shape != input.shape[:1]:
        raise ShardingRuleError(
            f"vocab_cross_entropy takes logits (N, classes / p) and targets (N,), got {tuple(input.shape)} "
            f"and {tuple(target.shape)}: flatten the batch and sequence dims first"
        )
    if reduction not in _REDUCTIONS:
        raise ShardingRuleError(f"reduction must be 0 (none), 1 (mean) or 2 (sum), got {reduction}")
    losses, _ = torch.ops.autopar._vocab_cross_entropy(input, target, group_name, ignore_index, label_smoothing)
    if reduction == 0:
        return losses.to(input.dtype)
    total = losses.sum()
    if reduction == 1:  # torch's mean: over the rows not ignored
        total = total / (target != ignore_index).sum()
    return total.to(input.dtype)
