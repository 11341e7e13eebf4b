"""Random calls of every op in the sharding rule table, for the rule validation (rule_check.py).

``SAMPLES`` maps an op's rule-table name (``aten.linear``, ``getitem``, ``autopar.moe``) to a
function ``(draw, p) -> Sample`` that draws one call with hypothesis: random shapes (most dims a
multiple of the axis size ``p``, some not, so the divisibility filter is exercised too), random
arguments and random fp64 values. A rule added to passes/sharding/rules.py needs a sample here:
tests/passes/sharding/test_rule_validation.py fails naming the op until it has one.
"""

from __future__ import annotations

import operator

import torch
from hypothesis import strategies as st
from rule_check import Group, Sample
from rule_draws import F64, dim_of, indices, shape, size, tensor, values
from rule_samples_composite import COMPOSITE_SAMPLES
from rule_samples_spatial import SPATIAL_SAMPLES

aten = torch.ops.aten


# -- matrix products ------------------------------------------------------------------------
def linear(draw, p):
    x = tensor(draw, p, 2, 4)
    weight = values(draw, (size(draw, p), x.shape[-1]))
    bias = (values(draw, (weight.shape[0],)),) if draw(st.booleans()) else ()
    return Sample(aten.linear.default, (x, weight, *bias))


def mm(draw, p, batched: bool = False):
    b, m, k, n = (size(draw, p) for _ in range(4))
    lead = (b,) if batched else ()
    target = aten.bmm.default if batched else aten.mm.default
    return Sample(target, (values(draw, (*lead, m, k)), values(draw, (*lead, k, n))))


def addmm(draw, p, batched: bool = False):
    """bias + a @ b with the bias broadcast to the product: [n], [m, n], [1, n] and, batched
    (baddbmm), [b, m, n] and [b, 1, n] (BLOOM's ALiBi bias), with BLOOM's alpha."""
    a, b = mm(draw, p, batched).args
    *lead, m, n = (*a.shape[:-1], b.shape[-1])
    shapes = [(n,), (m, n), (1, n)] + ([(*lead, m, n), (*lead, 1, n)] if batched else [])
    bias = values(draw, draw(st.sampled_from(shapes)))
    if not batched:
        return Sample(aten.addmm.default, (bias, a, b))
    return Sample(aten.baddbmm.default, (bias, a, b), {"alpha": draw(st.sampled_from([1.0, 0.125]))})


def matmul(draw, p):
    """Batch dims on both operands, on one only (``x @ w``: [B, S, H] @ [H, N]), or broadcast from 1."""
    batch = shape(draw, p, 0, 2)
    m, k, n = (size(draw, p) for _ in range(3))
    kind = draw(st.sampled_from(["both", "left", "right", "broadcast"]))
    a_batch = () if kind == "right" else batch
    b_batch = {"both": batch, "broadcast": (1,) * len(batch)}.get(kind, ())
    if kind == "broadcast" and draw(st.booleans()):
        a_batch, b_batch = b_batch, a_batch
    return Sample(aten.matmul.default, (values(draw, (*a_batch, m, k)), values(draw, (*b_batch, k, n))))


# -- shapes and views -------------------------------------------------------------------------
def regrouped(draw, shape: tuple[int, ...]) -> list[int]:
    """A shape with the same elements: a run of dims merged, a dim split in two, a unit dim added."""
    out = list(shape)
    action = draw(st.sampled_from(["merge", "split", "unit", "merge"]))
    if action == "merge" and len(out) >= 2:
        start = draw(st.integers(0, len(out) - 2))
        stop = draw(st.integers(start + 2, len(out)))
        out[start:stop] = [torch.Size(out[start:stop]).numel()]
    elif action == "split":
        splittable = [(i, f) for i, s in enumerate(out) for f in range(2, s) if s % f == 0]
        if splittable:
            i, f = draw(st.sampled_from(splittable))
            out[i : i + 1] = [f, out[i] // f]
    else:
        out.insert(draw(st.integers(0, len(out))), 1)
    return out


def view(op):
    def draw_sample(draw, p):
        x = tensor(draw, p, 1, 4)
        return Sample(op, (x, regrouped(draw, tuple(x.shape))))

    return draw_sample


def flatten(draw, p):
    x = tensor(draw, p, 2, 4)
    start = draw(st.integers(0, x.dim() - 2))
    return Sample(aten.flatten.using_ints, (x, start, draw(st.integers(start + 1, x.dim() - 1))))


def unflatten(draw, p):
    x = tensor(draw, p, 1, 3)
    dim = draw(st.integers(0, x.dim() - 1))
    factors = [f for f in range(1, x.shape[dim] + 1) if x.shape[dim] % f == 0]
    f = draw(st.sampled_from(factors))
    written = dim - x.dim() if draw(st.booleans()) else dim
    return Sample(aten.unflatten.int, (x, written, [f, x.shape[dim] // f]))


def squeeze(draw, p):
    x = values(draw, tuple(regrouped(draw, shape(draw, p, 1, 3))))
    units = [d for d, s in enumerate(x.shape) if s == 1] or [0]
    return Sample(aten.squeeze.dim, (x, draw(st.sampled_from(units))))


def unsqueeze(draw, p):
    x = tensor(draw, p, 1, 3)
    return Sample(aten.unsqueeze.default, (x, draw(st.integers(0, x.dim()))))


def expand(draw, p):
    small = [draw(st.sampled_from([1, s])) for s in shape(draw, p, 1, 3)]
    big = [size(draw, p) if s == 1 else s for s in small]
    lead = shape(draw, p, 0, 1)
    sizes = [*lead, *[-1 if draw(st.booleans()) and s != 1 else b for s, b in zip(small, big)]]
    return Sample(aten.expand.default, (values(draw, tuple(small)), sizes))


def transpose(draw, p):
    x = tensor(draw, p, 2, 4)
    return Sample(aten.transpose.int, (x, dim_of(draw, x.dim()), dim_of(draw, x.dim())))


def permute(draw, p):
    x = tensor(draw, p, 1, 4)
    return Sample(aten.permute.default, (x, draw(st.permutations(range(x.dim())))))


def split(draw, p):
    x = tensor(draw, p, 1, 3)
    dim = dim_of(draw, x.dim())
    return Sample(aten.split.Tensor, (x, draw(st.integers(1, x.shape[dim])), dim))


def split_with_sizes(draw, p):
    x = tensor(draw, p, 1, 3)
    dim = dim_of(draw, x.dim())
    first = draw(st.integers(0, x.shape[dim]))
    return Sample(aten.split_with_sizes.default, (x, [first, x.shape[dim] - first], dim))


def chunk(draw, p):
    x = tensor(draw, p, 1, 3)
    return Sample(aten.chunk.default, (x, draw(st.integers(1, 3)), dim_of(draw, x.dim())))


def slice_(draw, p):
    x = tensor(draw, p, 1, 3)
    dim = dim_of(draw, x.dim())
    start = draw(st.integers(0, x.shape[dim] - 1))
    return Sample(aten.slice.Tensor, (x, dim, start, draw(st.integers(start, x.shape[dim])), draw(st.integers(1, 2))))


def slice_scatter(draw, p):
    x = tensor(draw, p, 1, 3)
    dim = dim_of(draw, x.dim()) % x.dim()
    # often a slice of p rows, so that splitting the written dim too (a wrong strategy) would be tried
    start = draw(st.sampled_from([0, x.shape[dim] - min(p, x.shape[dim]), draw(st.integers(0, x.shape[dim] - 1))]))
    end, step = draw(st.sampled_from([x.shape[dim], min(start + p, x.shape[dim]), start + 1])), draw(st.integers(1, 2))
    src = values(draw, x.shape[:dim] + (len(range(start, end, step)),) + x.shape[dim + 1 :])
    return Sample(aten.slice_scatter.default, (x, src, dim - x.dim() * draw(st.booleans()), start, end, step))


def narrow(draw, p):
    x = tensor(draw, p, 1, 3)
    dim = dim_of(draw, x.dim())
    start = draw(st.integers(0, x.shape[dim] - 1))
    return Sample(aten.narrow.default, (x, dim, start, draw(st.integers(0, x.shape[dim] - start))))


def select(draw, p):
    x = tensor(draw, p, 1, 4)
    dim = dim_of(draw, x.dim())
    return Sample(aten.select.int, (x, dim, draw(st.integers(-x.shape[dim], x.shape[dim] - 1))))


def concat(op):
    def draw_sample(draw, p):
        first = tensor(draw, p, 1, 3)
        dim = dim_of(draw, first.dim() + (op is aten.stack.default))
        tensors = [first]
        for _ in range(draw(st.integers(1, 2))):
            other = list(first.shape)
            if op is aten.cat.default:
                other[dim] = size(draw, p)
            tensors.append(values(draw, tuple(other)))
        return Sample(op, (tensors, dim))

    return draw_sample


def getitem(draw, p):
    """One output of a multi-output op (split, topk, moe): outputs of one shape, laid out alike."""
    like = shape(draw, p, 1, 3)
    pieces = Group(tuple(values(draw, like) for _ in range(draw(st.integers(1, 3)))))
    return Sample(operator.getitem, (pieces, draw(st.integers(0, len(pieces.tensors) - 1))))


def repeat_interleave(draw, p):
    x = tensor(draw, p, 1, 3)
    return Sample(aten.repeat_interleave.self_int, (x, draw(st.integers(1, 3)), dim_of(draw, x.dim())))


# -- along one dim ------------------------------------------------------------------------------
def along(op, extra=lambda draw, x, dim: ()):
    def draw_sample(draw, p):
        x = tensor(draw, p, 1, 4)
        dim = dim_of(draw, x.dim())
        return Sample(op, (x, dim, *extra(draw, x, dim)))

    return draw_sample


def topk(draw, p):
    x = tensor(draw, p, 1, 3)
    dim = dim_of(draw, x.dim())
    return Sample(aten.topk.default, (x, draw(st.integers(1, x.shape[dim])), dim))


def argmax(draw, p):
    x = tensor(draw, p, 1, 4)
    return Sample(aten.argmax.default, (x, dim_of(draw, x.dim()), draw(st.booleans())))


# -- reductions and normalization -----------------------------------------------------------
def reduce(op_dims, op_all):
    def draw_sample(draw, p):
        x = tensor(draw, p, 1, 4)
        if draw(st.integers(0, 4)) == 0:
            return Sample(op_all, (x,))
        dims = draw(st.lists(st.integers(0, x.dim() - 1), min_size=1, max_size=x.dim(), unique=True))
        written = [d - x.dim() if draw(st.booleans()) else d for d in dims]
        return Sample(op_dims, (x, written, draw(st.booleans())))

    return draw_sample


def layer_norm(draw, p):
    x = tensor(draw, p, 2, 4)
    normalized = list(x.shape[-draw(st.integers(1, x.dim() - 1)) :])
    affine = (values(draw, tuple(normalized)), values(draw, tuple(normalized))) if draw(st.booleans()) else ()
    return Sample(aten.layer_norm.default, (x, normalized, *affine))


def embedding(draw, p):
    weight = values(draw, (size(draw, p), size(draw, p)))
    return Sample(aten.embedding.default, (weight, indices(draw, shape(draw, p, 1, 3), weight.shape[0])))


def index(draw, p):
    """Adjacent index tensors after Nones (``x[:, i, j]``), dims broadcast at random (``pos[b[:, None], q]``)."""
    x, common = tensor(draw, p, 1, 3), shape(draw, p, 1, 2)
    at = draw(st.integers(0, x.dim() - 1))
    sizes = [[n if draw(st.booleans()) else 1 for n in common] for _ in range(draw(st.integers(1, x.dim() - at)))]
    return Sample(aten.index.Tensor, (x, [None] * at + [indices(draw, n, top) for n, top in zip(sizes, x.shape[at:])]))


def attention(draw, p):
    batch, heads, seq, head_dim = (size(draw, p) for _ in range(4))
    kv_heads = draw(st.sampled_from([h for h in (heads, 1, p) if heads % h == 0]))
    q = values(draw, (batch, heads, seq, head_dim))
    k, v = (values(draw, (batch, kv_heads, seq, head_dim)) for _ in range(2))
    kwargs = {"enable_gqa": True} if kv_heads != heads else {}
    mask = draw(st.sampled_from(["none", "causal", "mask"]))
    if mask == "mask":
        mask_shape = (draw(st.sampled_from([1, batch])), draw(st.sampled_from([1, heads])), seq, seq)
        return Sample(aten.scaled_dot_product_attention.default, (q, k, v, values(draw, mask_shape)), kwargs)
    return Sample(aten.scaled_dot_product_attention.default, (q, k, v), {**kwargs, "is_causal": mask == "causal"})


def cross_entropy(op):
    """cross_entropy on logits / nll_loss on log-probabilities, [N, C] or [N, C, d...]; no
    ignored targets (averaging over shards is exact only with as many counted targets per shard)."""

    def draw_sample(draw, p):
        n, classes = size(draw, p), size(draw, p)
        trailing = shape(draw, p, 0, 2)
        scores = values(draw, (n, classes, *trailing))
        if op is aten.nll_loss.default:
            scores = scores.log_softmax(1)
        weight = values(draw, (classes,)).abs() + 0.5 if draw(st.booleans()) else None
        target = indices(draw, (n, *trailing), classes)
        if op is aten.nll_loss.default and trailing:  # nll_loss takes [N, C] only; nll_loss2d the rest
            scores, target = scores.movedim(1, -1).flatten(0, -2), target.flatten()
        return Sample(op, (scores, target, weight, draw(st.sampled_from([0, 1, 2]))), constant_inputs=(2,))

    return draw_sample


def mse(draw, p):
    x = tensor(draw, p, 1, 3)
    return Sample(aten.mse_loss.default, (x, values(draw, tuple(x.shape)), draw(st.sampled_from([0, 1, 2]))))


# -- factories and like-input ops -----------------------------------------------------------------
def like(op, *extra, values_defined=True):
    return lambda draw, p: Sample(op, (tensor(draw, p, 1, 3), *extra), values_defined=values_defined)


def new_tensor(op, *extra, values_defined=True):
    return lambda draw, p: Sample(
        op, (tensor(draw, p, 1, 2), list(shape(draw, p, 1, 3)), *extra), values_defined=values_defined
    )


def factory(op, *extra, values_defined=True):
    return lambda draw, p: Sample(op, (list(shape(draw, p, 1, 3)), *extra), values_defined=values_defined)


# -- pointwise ----------------------------------------------------------------------------------------
def broadcasting(op, dtype=F64, scalar_ok=True):
    """A binary op on broadcasting shapes, or on a tensor and a Python number."""

    def draw_sample(draw, p):
        x = tensor(draw, p, 1, 3, dtype)
        if scalar_ok and draw(st.integers(0, 2)) == 0:
            return Sample(op, (x, draw(st.sampled_from([2, 0.5, -3.0]))))
        tail = list(x.shape[draw(st.integers(0, x.dim())) :])
        other = [draw(st.sampled_from([1, s])) for s in tail]
        pair = (x, values(draw, tuple(other), dtype))
        return Sample(op, pair if draw(st.booleans()) else pair[::-1])

    return draw_sample


def unary(op, *extra, dtype=F64):
    return lambda draw, p: Sample(op, (tensor(draw, p, 1, 3, dtype), *extra))


def to_copy(draw, p):
    dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.bool, F64]))
    return Sample(aten._to_copy.default, (tensor(draw, p, 1, 3),), {"dtype": dtype})


def masked_fill(draw, p):
    x = tensor(draw, p, 1, 3)
    mask = values(draw, tuple(x.shape[draw(st.integers(0, x.dim())) :]), torch.bool)
    return Sample(aten.masked_fill.Scalar, (x, mask, -1.5))


def where(draw, p):
    """where(c, x, y) with tensors, or with a 0-dim x and a number y (``ScalarOther``: a mask's fill)."""
    x = tensor(draw, p, 1, 3)
    condition = values(draw, tuple(x.shape), torch.bool)
    if draw(st.booleans()):
        return Sample(aten.where.ScalarOther, (condition, values(draw, ()), -2.5))
    return Sample(aten.where.self, (condition, x, values(draw, tuple(x.shape[1:]))))


def broadcast_tensors(draw, p):
    x = tensor(draw, p, 1, 3)
    return Sample(aten.broadcast_tensors.default, ([x, values(draw, (1,) * x.dim())],))


SAMPLES = {
    "aten.linear": linear,
    "aten.mm": mm,
    "aten.bmm": lambda draw, p: mm(draw, p, batched=True),
    "aten.addmm": addmm,
    "aten.baddbmm": lambda draw, p: addmm(draw, p, batched=True),
    "aten.matmul": matmul,
    "aten.view": view(aten.view.default),
    "aten.reshape": view(aten.reshape.default),
    "aten._unsafe_view": view(aten._unsafe_view.default),
    "aten.flatten": flatten,
    "aten.unflatten": unflatten,
    "aten.squeeze": squeeze,
    "aten.unsqueeze": unsqueeze,
    "aten.expand": expand,
    "aten.transpose": transpose,
    "aten.permute": permute,
    "aten.t": lambda draw, p: Sample(aten.t.default, (tensor(draw, p, 2, 2),)),
    "aten.split": split,
    "aten.split_with_sizes": split_with_sizes,
    "aten.chunk": chunk,
    "aten.slice": slice_,
    "aten.slice_scatter": slice_scatter,
    "aten.narrow": narrow,
    "aten.select": select,
    "aten.softmax": along(aten.softmax.int),
    "aten._softmax": along(aten._softmax.default, lambda draw, x, dim: (False,)),
    "aten.log_softmax": along(aten.log_softmax.int),
    "aten._log_softmax": along(aten._log_softmax.default, lambda draw, x, dim: (False,)),
    "aten.cumsum": along(aten.cumsum.default),
    "aten.topk": topk,
    "aten.sort": along(aten.sort.default, lambda draw, x, dim: (draw(st.booleans()),)),
    "aten.argmax": argmax,
    "aten.cat": concat(aten.cat.default),
    "aten.stack": concat(aten.stack.default),
    "aten.sum": reduce(aten.sum.dim_IntList, aten.sum.default),
    "aten.mean": reduce(aten.mean.dim, aten.mean.default),
    "aten.layer_norm": layer_norm,
    **SPATIAL_SAMPLES,
    **COMPOSITE_SAMPLES,
    "aten.embedding": embedding,
    "aten.index": index,
    "aten.scaled_dot_product_attention": attention,
    "aten.cross_entropy_loss": cross_entropy(aten.cross_entropy_loss.default),
    "aten.nll_loss": cross_entropy(aten.nll_loss.default),
    "aten.mse_loss": mse,
    "aten.broadcast_tensors": broadcast_tensors,
    "aten.zeros_like": like(aten.zeros_like.default),
    "aten.ones_like": like(aten.ones_like.default),
    "aten.full_like": like(aten.full_like.default, 2.5),
    "aten.empty_like": like(aten.empty_like.default, values_defined=False),
    "getitem": getitem,
    "aten.repeat_interleave": repeat_interleave,
    "aten.new_ones": new_tensor(aten.new_ones.default),
    "aten.new_zeros": new_tensor(aten.new_zeros.default),
    "aten.new_full": new_tensor(aten.new_full.default, 1.5),
    "aten.new_empty": new_tensor(aten.new_empty.default, values_defined=False),
    "aten.arange": lambda draw, p: Sample(aten.arange.default, (size(draw, p),)),
    "aten.zeros": factory(aten.zeros.default),
    "aten.ones": factory(aten.ones.default),
    "aten.full": factory(aten.full.default, 3.0),
    "aten.empty": factory(aten.empty.memory_format, values_defined=False),
    "aten.copy_": lambda draw, p: Sample(
        aten.copy_.default, (values(draw, (size(draw, p),)), values(draw, (1,))), constant_inputs=(0, 1)
    ),
    "aten.scalar_tensor": lambda draw, p: Sample(aten.scalar_tensor.default, (draw(st.floats(-4, 4)),)),
    # pointwise: the ops the rule names, and tagged ones the example models use
    "aten.add": broadcasting(aten.add.Tensor),
    "aten.sub": broadcasting(aten.sub.Tensor),
    "aten.mul": broadcasting(aten.mul.Tensor),
    "aten.div": broadcasting(aten.div.Tensor),
    "aten.neg": unary(aten.neg.default),
    "aten.clone": unary(aten.clone.default),
    "aten._to_copy": to_copy,
    "aten.to": unary(aten.to.dtype, torch.float32),
    "aten.alias": unary(aten.alias.default),
    "aten.detach": unary(aten.detach.default),
    "aten.contiguous": unary(aten.contiguous.default),
    "aten.lift_fresh_copy": unary(aten.lift_fresh_copy.default),
    "aten.dropout": unary(aten.dropout.default, 0.5, False),
    "aten.type_as": lambda draw, p: Sample(
        aten.type_as.default, (tensor(draw, p, 1, 3), values(draw, (1,), torch.float32))
    ),
    "aten.__and__": broadcasting(aten.__and__.Tensor, torch.bool, scalar_ok=False),
    "aten.__or__": broadcasting(aten.__or__.Tensor, torch.bool, scalar_ok=False),
    "aten.__xor__": broadcasting(aten.__xor__.Tensor, torch.int64, scalar_ok=False),
    "aten.masked_fill": masked_fill,
    "aten.where": where,
    "aten.gelu": unary(aten.gelu.default),
    "aten.silu": unary(aten.silu.default),
    "aten.exp": unary(aten.exp.default),
    "aten.rsqrt": lambda draw, p: Sample(aten.rsqrt.default, (tensor(draw, p, 1, 3).abs() + 0.1,)),
    "aten.pow": unary(aten.pow.Tensor_Scalar, 2),
    "aten.tanh": unary(aten.tanh.default),
    "aten.eq": broadcasting(aten.eq.Tensor, torch.int64, scalar_ok=False),
}
