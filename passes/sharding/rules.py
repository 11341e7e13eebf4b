"""Sharding rules as data: for each aten op family, the strategies it can run with.

``RULES`` maps an op (or its overload packet) to a function enumerating candidates from the
op's arguments and shapes; :func:`node_strategies` adds the universal all-replicated
fallback, drops candidates whose sharded dims do not divide by the axis size, and says
whether the op had a rule at all (the coverage report). The rules of the ops indexed by a
vocabulary (embedding, losses) are in :mod:`vocab`, the factories' in :mod:`factories`, autopar's
own composite ops' (``OWN_OPS``, by name) in :mod:`composite`.

Partial values flow only through ops that are linear in them (views, sums, scaling,
matmuls with a replicated partner); everything else must see them reduced first.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from autopar.ir import DATA_SIZED, Kernel, Partial, Placement, Replicate, Shard
from autopar.passes.sharding.composite import OWN_OPS, experts
from autopar.passes.sharding.factories import SIZE_ARGUMENT, like_input, replicated_only, sized_factory
from autopar.passes.sharding.spatial import convolution, pooling
from autopar.passes.sharding.strategies import OpView, Strategy, normalize_dim, output_tensors
from autopar.passes.sharding.vocab import cross_entropy, embedding, loss

aten = torch.ops.aten
R = Replicate()


# -- pointwise ------------------------------------------------------------------------
_LINEAR_POINTWISE = {
    aten.neg,
    aten.clone,
    aten._to_copy,
    aten.to,
    aten.alias,
    aten.detach,
    aten.contiguous,
    aten.lift_fresh_copy,
}
# Elementwise ops torch does not tag as pointwise.
_ALSO_POINTWISE = _LINEAR_POINTWISE | {
    aten.dropout,
    aten.type_as,
    aten.__and__,
    aten.__or__,
    aten.__xor__,
    aten.masked_fill,
}
_ADDITIVE = {aten.add, aten.sub}
_SCALING = {aten.mul, aten.div}


def pointwise(view: OpView) -> list[Strategy]:
    """Broadcasting elementwise ops: shard any output dim; inputs follow, broadcast dims stay R."""
    out_ndim = len(view.out_shape)
    strategies = []
    for d in range(out_ndim):
        placements = []
        for shape in view.in_shapes:
            in_dim = d - (out_ndim - len(shape))
            broadcast = in_dim < 0 or (shape[in_dim] == 1 and view.out_shape[d] != 1)
            placements.append(R if broadcast else Shard(in_dim))
        strategies.append(Strategy(tuple(placements), Shard(d)))
    packet = getattr(view.node.target, "overloadpacket", None)
    n_in = len(view.in_shapes)
    if not all(t.dtype.is_floating_point for t in output_tensors(view.node)):
        return strategies  # a cast to integers or booleans is not linear
    # x + c over ranks holding x_r: the sum of the x_r + c counts c p times, their mean once
    number_operand = packet in _ADDITIVE and any(not isinstance(a, fx.Node) for a in view.args[:2])
    for op in ("sum", "avg"):
        if packet in _LINEAR_POINTWISE or (packet in _ADDITIVE and not (number_operand and op == "sum")):
            strategies.append(Strategy((Partial(op),) * n_in, Partial(op)))
        elif packet in _SCALING:  # linear in one operand; the other (and the divisor) replicated
            for i in range(1 if packet is aten.div else n_in):
                strategies.append(Strategy(tuple(Partial(op) if j == i else R for j in range(n_in)), Partial(op)))
    return strategies


def repeat_interleave(view: OpView) -> list[Strategy]:
    """repeat_interleave(x, repeats: int, dim): rows repeat in place, so any other dim shards."""
    dim = view.arg(2, "dim", None)
    if dim is None or not isinstance(view.arg(1, "repeats"), int):
        return []
    return along_dim(2)(view)


# -- matrix products --------------------------------------------------------------------
def linear(view: OpView) -> list[Strategy]:
    """y = x Wᵀ + b. Batch dims of x; columns of W (Megatron column); the contraction (row → P)."""
    x_ndim = len(view.in_shapes[0])
    has_bias = len(view.in_shapes) == 3
    bias = lambda p: (p,) if has_bias else ()  # noqa: E731
    strategies = [Strategy((Shard(d), R) + bias(R), Shard(d)) for d in range(x_ndim - 1)]
    strategies.append(Strategy((R, Shard(0)) + bias(Shard(0)), Shard(x_ndim - 1)))
    for op in ("sum", "avg"):
        strategies.append(Strategy((Partial(op), R) + bias(Partial(op)), Partial(op)))
    strategies.append(Strategy((Shard(x_ndim - 1), Shard(1)) + bias(Partial()), Partial()))
    return strategies


def _einsum(lhs: str, rhs: str, out: str, partial_ok: bool = True) -> list[Strategy]:
    """Strategies of a product in einsum notation: shard a shared or free letter, or contract."""
    strategies = []
    for letter in dict.fromkeys(lhs + rhs):
        a = Shard(lhs.index(letter)) if letter in lhs else R
        b = Shard(rhs.index(letter)) if letter in rhs else R
        output = Shard(out.index(letter)) if letter in out else Partial()
        strategies.append(Strategy((a, b), output))
    if partial_ok:
        for op in ("sum", "avg"):
            strategies += [Strategy((Partial(op), R), Partial(op)), Strategy((R, Partial(op)), Partial(op))]
    return strategies


def mm(view: OpView) -> list[Strategy]:
    return _einsum("mk", "kn", "mn")


def bmm(view: OpView) -> list[Strategy]:
    return _einsum("bmk", "bkn", "bmn")


def _biased(lhs: str, rhs: str, out: str):
    """bias + a @ b (addmm, baddbmm), the bias broadcast to the product (BLOOM's ALiBi bias: [b, 1, n]):
    it follows a split output dim it holds (R where it broadcasts), R→P where the product is partial."""

    def rule(view: OpView) -> list[Strategy]:
        bias, offset = view.in_shapes[0], len(out) - len(view.in_shapes[0])

        def follow(o: Placement) -> Placement:
            if not isinstance(o, Shard):
                return Partial()
            return Shard(o.dim - offset) if o.dim >= offset and bias[o.dim - offset] != 1 else R

        return [Strategy((follow(s.output),) + s.inputs, s.output) for s in _einsum(lhs, rhs, out, partial_ok=False)]

    return rule


addmm, baddbmm = _biased("mk", "kn", "mn"), _biased("bmk", "bkn", "bmn")


def matmul(view: OpView) -> list[Strategy]:
    """torch.matmul of operands of rank >= 2: ``a [..., m, k] @ b [..., k, n]``, their batch dims
    broadcast right-aligned (``x @ w``: [B, S, H] @ [H, N]). A batch dim shards each operand holding
    it at the output's size (one broadcasting it stays whole); m shards a, n b, k both (partial)."""
    a, b = view.in_shapes
    if len(a) < 2 or len(b) < 2:
        return []
    batch = max(len(a), len(b)) - 2
    at = [[j - batch + len(shape) - 2 for j in range(batch)] for shape in (a, b)]  # each operand's dim of batch dim j
    out = [max(shape[d] if d >= 0 else 1 for shape, d in ((a, at[0][j]), (b, at[1][j]))) for j in range(batch)]
    strategies = []
    for j in range(batch):
        placements = tuple(Shard(d[j]) if d[j] >= 0 and s[d[j]] == out[j] else R for s, d in zip((a, b), at))
        if any(isinstance(placement, Shard) for placement in placements):
            strategies.append(Strategy(placements, Shard(j)))
    strategies.append(Strategy((Shard(len(a) - 2), R), Shard(batch)))
    strategies.append(Strategy((R, Shard(len(b) - 1)), Shard(batch + 1)))
    strategies.append(Strategy((Shard(len(a) - 1), Shard(len(b) - 2)), Partial()))
    for op in ("sum", "avg"):
        strategies += [Strategy((Partial(op), R), Partial(op)), Strategy((R, Partial(op)), Partial(op))]
    return strategies


# -- shapes and views -----------------------------------------------------------------
def view_map(in_shape, out_shape) -> dict[int, int]:
    """Input dim → output dim for a reshape, where sharding the input dim shards the output dim.

    Dims are grouped where their products agree; inside a group only the first non-unit
    dims correspond (a contiguous chunk of the leading dim stays contiguous).
    """
    mapping, i, j = {}, 0, 0
    while i < len(in_shape) and j < len(out_shape):
        if in_shape[i] == 1 and out_shape[j] != 1:
            i += 1
            continue
        if out_shape[j] == 1 and in_shape[i] != 1:
            j += 1
            continue
        first_in, first_out = i, j
        size_in, size_out = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while size_in != size_out:
            if size_in < size_out:
                size_in *= in_shape[i]
                i += 1
            else:
                size_out *= out_shape[j]
                j += 1
        if in_shape[first_in] != 1:
            mapping[first_in] = first_out
    return mapping


def reshape(view: OpView) -> list[Strategy]:
    """view / reshape / flatten / unflatten / squeeze / unsqueeze."""
    in_shape = view.in_shapes[0]
    strategies = [Strategy((Shard(i),), Shard(o)) for i, o in view_map(in_shape, view.out_shape).items()]
    return strategies + [Strategy((Partial(op),), Partial(op)) for op in ("sum", "avg")]


def expand(view: OpView) -> list[Strategy]:
    in_shape, out_shape = view.in_shapes[0], view.out_shape
    offset = len(out_shape) - len(in_shape)
    return [
        Strategy((Shard(d),), Shard(d + offset))
        for d in range(len(in_shape))
        if in_shape[d] == out_shape[d + offset] and in_shape[d] != 1
    ]


def permute(view: OpView) -> list[Strategy]:
    ndim = len(view.in_shapes[0])
    target = view.node.target.overloadpacket
    if target is aten.transpose:
        d0, d1 = normalize_dim(view.args[1], ndim), normalize_dim(view.args[2], ndim)
        order = list(range(ndim))
        order[d0], order[d1] = order[d1], order[d0]
    elif target is aten.t:
        order = list(reversed(range(ndim)))
    else:
        order = [normalize_dim(d, ndim) for d in view.args[1]]
    strategies = [Strategy((Shard(src),), Shard(dst)) for dst, src in enumerate(order)]
    return strategies + [Strategy((Partial(op),), Partial(op)) for op in ("sum", "avg")]


def along_dim(dim_index: int, dim_name: str = "dim", default=0, partial_ok: bool = False, removes_dim: bool = False):
    """Ops that work along one dim (softmax, cumsum, split, slice, select, ...): shard any other."""

    def rule(view: OpView) -> list[Strategy]:
        ndim = len(view.in_shapes[0])
        along = normalize_dim(view.arg(dim_index, dim_name, default), ndim)
        n_in = len(view.in_shapes)
        strategies = []
        for d in range(ndim):
            if d == along:
                continue
            out_dim = d - 1 if removes_dim and d > along else d
            strategies.append(Strategy((Shard(d),) + (R,) * (n_in - 1), Shard(out_dim)))
        if partial_ok:
            strategies += [Strategy((Partial(op),) + (R,) * (n_in - 1), Partial(op)) for op in ("sum", "avg")]
        return strategies

    return rule


def slice_scatter(view: OpView) -> list[Strategy]:
    """slice_scatter(x, src, dim, start, end, step): src written over a slice of x along dim (a
    functionalized ``x[..., a:b].copy_(src)``); both split alike on any other dim. Linear in
    (x, src) together, so partial sums pass."""
    ndim = len(view.in_shapes[0])
    along = normalize_dim(view.arg(2, "dim", 0), ndim)
    strategies = [Strategy((Shard(d), Shard(d)), Shard(d)) for d in range(ndim) if d != along]
    return strategies + [Strategy((Partial(op), Partial(op)), Partial(op)) for op in ("sum", "avg")]


def argmax(view: OpView) -> list[Strategy]:
    """argmax(x, dim, keepdim): shard another dim (shifted down where the reduced dim is dropped);
    without a dim it indexes the flattened tensor, which only the whole tensor gives."""
    if view.arg(1, "dim", None) is None:
        return []
    return along_dim(1, removes_dim=not view.arg(2, "keepdim", False))(view)


def concat(view: OpView) -> list[Strategy]:
    """cat / stack: all inputs sharded alike on a dim that is not joined."""
    ndim = len(view.in_shapes[0])
    stack = view.node.target.overloadpacket is aten.stack
    along = normalize_dim(view.arg(1, "dim", 0), ndim + 1 if stack else ndim)
    n_in = len(view.in_shapes)
    strategies = []
    for d in range(ndim):
        if not stack and d == along:
            continue
        out_dim = d + 1 if stack and d >= along else d
        strategies.append(Strategy((Shard(d),) * n_in, Shard(out_dim)))
    return strategies + [Strategy((Partial(op),) * n_in, Partial(op)) for op in ("sum", "avg")]


def getitem(view: OpView) -> list[Strategy]:
    """Taking one output of a multi-output op: it is laid out like its source."""
    strategies = [Strategy((Shard(d),), Shard(d)) for d in range(len(view.out_shape))]
    return strategies + [Strategy((Partial(op),), Partial(op)) for op in ("sum", "avg")]


# -- reductions and normalization -----------------------------------------------------
def reduction(view: OpView) -> list[Strategy]:
    """sum / mean over dims: a reduced sharded dim gives a partial result (sum or avg)."""
    ndim = len(view.in_shapes[0])
    dims = view.arg(1, "dim", None)
    keepdim = view.arg(2, "keepdim", False)
    reduced = (
        set(range(ndim))
        if dims is None or dims == []
        else {normalize_dim(d, ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    )
    mean = view.node.target.overloadpacket is aten.mean
    strategies = []
    for d in range(ndim):
        if d in reduced:
            strategies.append(Strategy((Shard(d),), Partial("avg" if mean else "sum")))
        else:
            out_dim = d if keepdim else d - sum(1 for r in reduced if r < d)
            strategies.append(Strategy((Shard(d),), Shard(out_dim)))
    return strategies + [Strategy((Partial(op),), Partial(op)) for op in ("sum", "avg")]


def layer_norm(view: OpView) -> list[Strategy]:
    """Normalizes the trailing ``normalized_shape`` dims: shard a leading one; weights replicated."""
    ndim = len(view.in_shapes[0])
    normalized = len(view.args[1])
    n_in = len(view.in_shapes)
    return [Strategy((Shard(d),) + (R,) * (n_in - 1), Shard(d)) for d in range(ndim - normalized)]


def index(view: OpView) -> list[Strategy]:
    """x[..., i, j, ...]: index tensors from dim p on, broadcast together (a mask's ``pos[b[:, None], q]``):
    shard a dim d of their broadcast (output dim p + d; an index broadcasting it stays whole), or one of x's others."""
    indexed = [position for position, tensor in enumerate(view.arg(1, "indices")) if tensor is not None]
    p, count = (indexed[0], len(indexed)) if indexed else (0, 0)
    if not indexed or indexed[-1] != p + count - 1 or len(view.in_shapes) != 1 + count:
        return []
    x_ndim, index_shapes = len(view.in_shapes[0]), view.in_shapes[1:]
    nb = len(view.out_shape) - x_ndim + count  # dims of the indices' broadcast
    strategies = []
    for d in range(nb):
        placements = tuple(R if k < 0 or s[k] == 1 else Shard(k) for s in index_shapes for k in [d - nb + len(s)])
        if any(placement != R for placement in placements):
            strategies.append(Strategy((R, *placements), Shard(p + d)))
    rest = [k for k in range(x_ndim) if not p <= k < p + count]
    strategies += [Strategy((Shard(k), *(R,) * count), Shard(k if k < p else k - count + nb)) for k in rest]
    return strategies + [Strategy((Partial(op), *(R,) * count), Partial(op)) for op in ("sum", "avg")]


def attention(view: OpView) -> list[Strategy]:
    """scaled_dot_product_attention on [batch, heads, seq, head_dim]: shard batch or heads;
    or, without a mask or dropout, the sequence of q, k and v alike, run by a context-parallel
    kernel (ring or Ulysses, see autopar.runtime.kernels.context_parallel). With a dropout, none: it
    draws its mask per shard (capture traces such a call as its math form, whose mask is drawn whole)."""
    q_shape = view.in_shapes[0]
    if view.arg(4, "dropout_p", 0.0):
        return []
    strategies = []
    for d in (0, 1) if len(q_shape) == 4 else (0,):  # [batch * heads, seq, head_dim]: dim 1 is the sequence
        placements = []
        for shape in view.in_shapes:
            in_dim = d - (len(q_shape) - len(shape))
            broadcast = in_dim < 0 or shape[in_dim] == 1
            placements.append(R if broadcast else Shard(in_dim))
        strategies.append(Strategy(tuple(placements), Shard(d)))
    if len(q_shape) == 4 and len(view.in_shapes) == 3:
        seq = Shard(len(q_shape) - 2)
        strategies += [Strategy((seq, seq, seq), seq, kernel) for kernel in (Kernel.RING, Kernel.ULYSSES)]
    return strategies


def mse(view: OpView) -> list[Strategy]:
    reduction = view.arg(2, "reduction", 1)
    out = {1: Partial("avg"), 2: Partial("sum")}.get(reduction)
    return [Strategy((Shard(d), Shard(d)), out or Shard(d)) for d in range(len(view.in_shapes[0]))]


RULES: dict[object, Callable[[OpView], list[Strategy]]] = {
    aten.linear: linear,
    aten.mm: mm,
    aten.bmm: bmm,
    aten.addmm: addmm,
    aten.baddbmm: baddbmm,
    aten.matmul: matmul,
    aten.view: reshape,
    aten.reshape: reshape,
    aten._unsafe_view: reshape,
    aten.flatten: reshape,
    aten.unflatten: reshape,
    aten.squeeze: reshape,
    aten.unsqueeze: reshape,
    aten.expand: expand,
    aten.transpose: permute,
    aten.permute: permute,
    aten.t: permute,
    aten.split: along_dim(2, partial_ok=True),
    aten.split_with_sizes: along_dim(2, partial_ok=True),
    aten.chunk: along_dim(2, partial_ok=True),
    aten.slice: along_dim(1, partial_ok=True),
    aten.narrow: along_dim(1, partial_ok=True),
    aten.select: along_dim(1, partial_ok=True, removes_dim=True),
    aten.slice_scatter: slice_scatter,
    aten.softmax: along_dim(1),
    aten._softmax: along_dim(1),
    aten.log_softmax: along_dim(1),
    aten._log_softmax: along_dim(1),
    aten.cumsum: along_dim(1),
    aten.topk: along_dim(2, default=-1),
    aten.sort: along_dim(1, default=-1),
    aten.argmax: argmax,
    aten.cat: concat,
    aten.stack: concat,
    aten.sum: reduction,
    aten.mean: reduction,
    aten.layer_norm: layer_norm,
    **dict.fromkeys([aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution], convolution),
    **{getattr(aten, f"max_pool{k}d"): pooling(k) for k in (1, 2, 3)},
    aten.max_pool2d_with_indices: pooling(2),
    **{getattr(aten, f"adaptive_max_pool{k}d"): pooling(k) for k in (1, 2, 3)},
    **{getattr(aten, f"avg_pool{k}d"): pooling(k, linear=True) for k in (1, 2, 3)},
    **{getattr(aten, f"adaptive_avg_pool{k}d"): pooling(k, linear=True) for k in (1, 2, 3)},
    aten.embedding: embedding,
    aten.index: index,
    aten.scaled_dot_product_attention: attention,
    aten.cross_entropy_loss: cross_entropy,
    aten.nll_loss: loss,
    aten.mse_loss: mse,
    **dict.fromkeys(
        [aten.broadcast_tensors, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar], pointwise
    ),
    **dict.fromkeys([aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like], like_input),
    operator.getitem: getitem,
    aten.repeat_interleave: repeat_interleave,
    **dict.fromkeys(SIZE_ARGUMENT, sized_factory),
    **dict.fromkeys([aten.arange, aten.scalar_tensor], replicated_only),
    aten.copy_: replicated_only,  # a buffer's update (capture.graph): every rank holds the whole buffer
}

KERNEL_RULES = {
    Kernel.RING: (attention,),
    Kernel.ULYSSES: (attention,),
    Kernel.EXPERTS: (experts,),
    Kernel.VOCAB: (embedding, cross_entropy),
}  # the rules offering each kernel
# the rules of ops that multiply whole rows by whole columns
MATMULS = (linear, mm, bmm, addmm, baddbmm, matmul, attention)


def rule_for(target) -> Callable[[OpView], list[Strategy]] | None:
    packet = getattr(target, "overloadpacket", None)
    rule = RULES.get(target) or RULES.get(packet) or OWN_OPS.get(str(packet))
    if rule is None and isinstance(target, torch._ops.OpOverload):
        if torch.Tag.pointwise in target.tags or packet in _ALSO_POINTWISE:
            return pointwise
    return rule


def node_strategies(view: OpView, axis_size: int) -> tuple[list[Strategy], bool]:
    """Candidates for one node on an axis of ``axis_size``; and whether its op has a rule."""
    rule = rule_for(view.node.target)
    fallback = Strategy(tuple(R for _ in view.in_shapes), R)
    candidates = [fallback]
    if axis_size > 1 and rule is not None and not view.node.meta.get(DATA_SIZED):  # each rank's sizes alike
        for strategy in rule(view):
            if (
                strategy != fallback
                and _divisible(view, strategy, axis_size)
                and _kernel_fits(view, strategy, axis_size)
                and strategy not in candidates
            ):
                candidates.append(strategy)
    return candidates, rule is not None


def _kernel_fits(view: OpView, strategy: Strategy, axis_size: int) -> bool:
    """Ulysses trades the sequence for heads: every rank takes heads / p of them."""
    return strategy.kernel != Kernel.ULYSSES or all(shape[1] % axis_size == 0 for shape in view.in_shapes)


def _divisible(view: OpView, strategy: Strategy, axis_size: int) -> bool:
    if len(strategy.inputs) != len(view.in_shapes):
        return False
    pairs = list(zip(strategy.inputs, view.in_shapes)) + [(strategy.output, shape) for shape in _out_shapes(view)]
    for placement, shape in pairs:
        if isinstance(placement, Shard):
            if placement.dim >= len(shape) or shape[placement.dim] % axis_size:
                return False
    return True


def _out_shapes(view: OpView) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in output_tensors(view.node)] or [view.out_shape]
