"""Eager attention → one ``aten.scaled_dot_product_attention`` node; causal masks → ``is_causal``.

Context parallelism splits attention only where it is one node without a mask (``passes/rules.py``'s
``attention``), but many models spell it out: ``softmax(q @ kᵀ * scale + causal_mask) @ v``, and
Hugging Face's sdpa attention passes SDPA a materialized [B, 1, S, S] causal mask under export.
:func:`fuse_eager_attention` replaces each such subgraph by
``scaled_dot_product_attention(q, k, v, None, 0.0, is_causal, scale=scale)``, then gives each sdpa
node whose ``attn_mask`` is proved causal (below; boolean True where seen, or additive 0/-inf) and
whose q and k have one sequence length ``attn_mask=None, is_causal=True``, keeping its other arguments.

Pre: an aten-level graph from ``torch.export`` (``passes/capture.py``) whose nodes carry
``meta["val"]``; ``buffers`` maps buffer placeholders to their values (:func:`buffer_values`).
Post: each recognized subgraph is one sdpa node carrying the softmax's ``nn_module_stack`` and a
fake ``meta["val"]``; nodes only it used are erased (so is a mask no node needs any more); values and
gradients are unchanged up to fp32 rounding. Everything else is left as it was.

Recognized, read from the scores on:

- ``q @ kᵀ`` as ``aten.matmul`` on [B, H, S, D] tensors, or ``aten.bmm`` on their [B·H, S, D]
  views (as ``matmul``'s decomposition and hand-written code spell it); ``kᵀ`` is a transpose or
  permute of k's last two dims, or any [B, H, D, S] tensor;
- optionally times a constant (``mul``/``div`` by a number or a constant one-element tensor);
- optionally a mask: ``add`` of a float mask, or ``masked_fill``/``where`` with -inf or the
  dtype's minimum. The mask must be a constant — computed from factory ops (``arange``,
  ``full``, ``triu``, ...) and buffers with known values, never from an input or parameter — that
  is exactly causal (key j visible to query i iff j <= i). It is evaluated on the CPU to prove
  that. Anything else (padding from an input, a sliding window, a bias, a buffer on the meta
  device, a mask over ``causal_mask.MAX_MASK_ELEMENTS``) leaves the subgraph alone;
- softmax over the last dim; between any of these, casts to a dtype at least as wide as q's,
  ``clone``/``alias``, no-op ``expand``, views that keep the last two dims, ``dropout`` with p=0
  or in eval; then ``probs @ v``.

Each node between the two matmuls must feed only the next (attention weights that are also
returned keep the eager form).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export.graph_signature import InputKind

from autopar.passes.capture.causal_mask import Mask, constant_value, proved_causal
from autopar.passes.capture.causal_mask import node_value as _val

aten = torch.ops.aten

_SDPA = aten.scaled_dot_product_attention.default
_MATMULS = {aten.matmul.default, aten.bmm.default}
_SOFTMAXES = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default}
_COPIES = {aten.clone.default, aten.alias.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SCALES = {aten.mul.Tensor: False, aten.mul.Scalar: False, aten.div.Tensor: True, aten.div.Scalar: True}  # op → divides
_ASSERT = aten._assert_tensor_metadata.default


@dataclass(frozen=True)
class _Match:
    q: fx.Node  # [B, H, Sq, D]
    key: fx.Node  # k [B, H, Sk, D], or kᵀ [B, H, D, Sk] if key_transposed
    key_transposed: bool
    v: fx.Node  # [B, H, Sk, Dv]
    scale: float
    mask: Mask | None
    softmax: fx.Node
    output: fx.Node  # the probs @ v node, [B, H, Sq, Dv] or [B·H, Sq, Dv]


def fuse_eager_attention(graph_module: fx.GraphModule, buffers: Mapping[str, torch.Tensor] | None = None) -> int:
    """Replace each eager attention subgraph (see the module docstring) by one sdpa node and
    each sdpa node's provably causal mask by ``is_causal=True``, in place; returns how many
    attention nodes it made or changed.

    >>> model = build(layers=2, seq=64, attention="eager")  # examples/long_context_gpt.py
    >>> exported = torch.export.export(model, model.example_inputs(2), strict=False).run_decompositions({})
    >>> fuse_eager_attention(exported.graph_module, buffer_values(exported))  # one per layer
    2
    """
    buffers = buffers or {}
    verdicts: dict[tuple, bool] = {}  # layers often build the same mask: prove it once
    erased: set[fx.Node] = set()
    fused = 0
    for scores in [node for node in graph_module.graph.nodes if node.target in _MATMULS]:
        match = None if scores in erased else _match(scores, buffers)
        if match is None:
            continue
        queries, keys = _val(match.q).shape[2], _val(match.v).shape[2]
        if match.mask is not None and not proved_causal(match.mask, queries, keys, buffers, verdicts):
            continue
        erased |= _replace(match)
        fused += 1
    sdpa_nodes = [node for node in graph_module.graph.nodes if node.target is _SDPA]
    unmasked = sum(_unmask_if_causal(node, buffers, verdicts) for node in sdpa_nodes)
    if fused or unmasked:
        graph_module.graph.lint()
        graph_module.recompile()
    return fused + unmasked


def buffer_values(exported: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Buffer placeholder name → the buffer's value, for the buffers that hold real data."""
    values = {}
    for spec in exported.graph_signature.input_specs:
        if spec.kind == InputKind.BUFFER:
            value = exported.state_dict.get(spec.target, exported.constants.get(spec.target))
            if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and not value.is_meta:
                values[spec.arg.name] = value
    return values


def _match(scores: fx.Node, buffers: Mapping[str, torch.Tensor]) -> _Match | None:
    """Follow ``scores`` = q @ kᵀ down its only-user chain to probs @ v, or None."""
    scale, mask, softmax, node = None, None, None, scores
    while True:
        user = _only_user(node)
        if user is None:
            return None
        if softmax is not None and user.target in _MATMULS and user.args[0] is node:
            break
        before_softmax = softmax is None
        if _passes_through(user, node, _val(scores).dtype):
            pass
        elif before_softmax and mask is None and scale is None and (found := _scale(user, node, buffers)) is not None:
            scale = found
        elif before_softmax and mask is None and (found := _mask(user, node, buffers)) is not None:
            mask = found
        elif before_softmax and user.target in _SOFTMAXES and user.args[0] is node and _last_dim(user):
            if not _wide(_val(user).dtype, _val(scores).dtype):
                return None
            softmax = user
        else:
            return None
        node = user
    q, v = _as_4d(scores.args[0]), _as_4d(user.args[1])
    key = _key(scores.args[1])
    if q is None or v is None or key is None:
        return None
    match = _Match(q, key[0], key[1], v, 1.0 if scale is None else scale, mask, softmax, user)
    return match if _shapes_agree(match) else None


def _only_user(node: fx.Node) -> fx.Node | None:
    users = _real_users(node)
    return users[0] if len(users) == 1 else None


def _real_users(node: fx.Node) -> list[fx.Node]:
    return [user for user in node.users if user.target is not _ASSERT]  # asserts only check metadata


def _passes_through(node: fx.Node, source: fx.Node, dtype: torch.dtype) -> bool:
    """True if ``node`` hands ``source``'s values on unchanged but for a harmless cast or view."""
    if not node.args or node.args[0] is not source:
        return False
    before, after = _val(source), _val(node)
    if not isinstance(after, torch.Tensor):
        return False
    if node.target in _CASTS:
        return _wide(after.dtype, dtype) and after.shape == before.shape and after.device == before.device
    if node.target in _COPIES or node.target is aten.expand.default:
        return after.shape == before.shape
    if node.target is aten.dropout.default:
        return node.args[1] == 0 or not node.args[2]
    if node.target in _VIEWS:  # [B·H, S, S] ↔ [B, H, S, S]: only the batch dims regroup
        return after.shape[-2:] == before.shape[-2:]
    return False


def _wide(dtype: torch.dtype, base: torch.dtype) -> bool:
    """True if scores in ``dtype`` lose nothing that sdpa on ``base`` inputs keeps."""
    return dtype == base or (dtype.is_floating_point and dtype.itemsize >= 4)


def _scale(node: fx.Node, source: fx.Node, buffers: Mapping[str, torch.Tensor]) -> float | None:
    """The factor ``node`` multiplies ``source`` by, if it is a constant."""
    divides = _SCALES.get(node.target)
    if divides is None or len(node.args) != 2 or _val(node).shape != _val(source).shape:
        return None
    if node.args[0] is source:
        factor = _scalar(node.args[1], buffers)
    elif node.args[1] is source and not divides:
        factor = _scalar(node.args[0], buffers)
    else:
        return None
    if factor is None or (divides and factor == 0):
        return None
    return 1.0 / factor if divides else factor


def _scalar(arg, buffers: Mapping[str, torch.Tensor]) -> float | None:
    """A number, or a one-element constant tensor (``torch.full([], d ** 0.5)``), as a float."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if isinstance(arg, fx.Node) and isinstance(_val(arg), torch.Tensor) and _val(arg).numel() == 1:
        value = constant_value(arg, buffers)
        return None if value is None else float(value)
    return None


def _mask(node: fx.Node, source: fx.Node, buffers: Mapping[str, torch.Tensor]) -> Mask | None:
    """How ``node`` masks ``source``, if it masks it with -inf (or the dtype's minimum)."""
    out, scores = _val(node), _val(source)
    if not isinstance(out, torch.Tensor) or out.shape != scores.shape or out.dtype != scores.dtype:
        return None
    args = node.args
    if node.target is aten.add.Tensor and len(args) == 2 and source in args and node.kwargs.get("alpha", 1) == 1:
        other = args[1] if args[0] is source else args[0]
        return Mask("add", other, scores.dtype) if isinstance(other, fx.Node) and other is not source else None
    if node.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) and args[0] is source:
        return Mask("hide", args[1], scores.dtype) if _hides(args[2], scores.dtype, buffers) else None
    if node.target in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf) and source in args[1:]:
        kind, other = ("keep", args[2]) if args[1] is source else ("hide", args[1])
        return Mask(kind, args[0], scores.dtype) if _hides(other, scores.dtype, buffers) else None
    return None


def _hides(fill, dtype: torch.dtype, buffers: Mapping[str, torch.Tensor]) -> bool:
    """A fill value that softmax turns into an exact zero next to any finite score."""
    value = _scalar(fill, buffers)
    return value is not None and value <= torch.finfo(dtype).min


def _last_dim(softmax: fx.Node) -> bool:
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    return isinstance(dim, int) and dim % _val(softmax).ndim == _val(softmax).ndim - 1


def _as_4d(node: fx.Node) -> fx.Node | None:
    """The [B, H, S, D] tensor whose values ``node`` is (itself, or a [B·H, S, D] view of it)."""
    start = node
    while _val(node).ndim == 3 and node.target in _VIEWS | _COPIES | {aten.expand.default}:
        source = node.args[0]
        if _val(source).shape[-2:] != _val(start).shape[-2:] or _val(source).numel() != _val(start).numel():
            return None
        node = source
    if _val(node).ndim != 4:
        return None
    # the no-op expand and clone of matmul's decomposition: give sdpa their source
    while node.target in _COPIES | {aten.expand.default} and _val(node.args[0]).shape == _val(node).shape:
        node = node.args[0]
    return node


def _key(key_t: fx.Node) -> tuple[fx.Node, bool] | None:
    """k for the scores' second operand kᵀ: ``(k, False)``, or ``(kᵀ as [B, H, D, S], True)``
    where no node holds k itself and a transpose must be inserted."""
    if _swaps_last_two(key_t):
        key = _as_4d(key_t.args[0])
        return None if key is None else (key, False)
    key_t = _as_4d(key_t)
    if key_t is None:
        return None
    return (key_t.args[0], False) if _swaps_last_two(key_t) else (key_t, True)


def _swaps_last_two(node: fx.Node) -> bool:
    ndim = _val(node).ndim
    if node.target is aten.transpose.int:
        return {node.args[1] % ndim, node.args[2] % ndim} == {ndim - 2, ndim - 1}
    if node.target is aten.permute.default:
        return [d % ndim for d in node.args[1]] == [*range(ndim - 2), ndim - 1, ndim - 2]
    return False


def _shapes_agree(match: _Match) -> bool:
    """q [B, H, Sq, D], k [B, H, Sk, D], v [B, H, Sk, Dv] of one floating dtype, no broadcasting."""
    q, v, key, out = _val(match.q), _val(match.v), _val(match.key), _val(match.output)
    k = (*key.shape[:2], key.shape[3], key.shape[2]) if match.key_transposed else tuple(key.shape)
    if not (q.dtype == key.dtype == v.dtype == out.dtype and q.is_floating_point()):
        return False
    expected_out = (*q.shape[:3], v.shape[3])
    return (
        tuple(q.shape[:2]) == k[:2] == tuple(v.shape[:2])
        and q.shape[3] == k[3]
        and k[2] == v.shape[2]
        and out.shape[-2:] == expected_out[-2:]
        and out.numel() == math.prod(expected_out)
    )


def _unmask_if_causal(sdpa: fx.Node, buffers: Mapping[str, torch.Tensor], verdicts: dict[tuple, bool]) -> bool:
    """Give ``sdpa`` ``attn_mask=None, is_causal=True`` if its mask is proved causal for q and k
    of one length (sdpa's is_causal is the top-left triangle, not the one a KV cache needs)."""
    names = [argument.name for argument in _SDPA._schema.arguments]
    given = {**dict(zip(names, sdpa.args)), **sdpa.kwargs}
    mask, queries, keys = given.get("attn_mask"), _val(given["query"]).shape[-2], _val(given["key"]).shape[-2]
    if not isinstance(mask, fx.Node) or given.get("is_causal", False) or queries != keys:
        return False
    kind = "keep" if _val(mask).dtype == torch.bool else "add"  # sdpa: True attends; a float mask adds
    if not proved_causal(Mask(kind, mask, _val(given["query"]).dtype), queries, keys, buffers, verdicts):
        return False
    sdpa.args = (given["query"], given["key"], given["value"], None, given.get("dropout_p", 0.0), True)
    sdpa.kwargs = {name: value for name, value in sdpa.kwargs.items() if name not in names[3:6]}  # scale, enable_gqa
    _erase_unused(mask)
    return True


def _replace(match: _Match) -> set[fx.Node]:
    """Insert the sdpa node before the output, move the users over, erase what is left unused
    (returned)."""
    graph, output = match.output.graph, match.output
    meta = {key: match.softmax.meta[key] for key in ("nn_module_stack", "stack_trace") if key in match.softmax.meta}
    with graph.inserting_before(output):
        key = match.key
        if match.key_transposed:
            key = new_node(graph, aten.transpose.int, (key, -2, -1), meta)
        causal = match.mask is not None
        fused = new_node(
            graph,
            aten.scaled_dot_product_attention.default,
            (match.q, key, match.v, None, 0.0, causal),
            meta,
            scale=match.scale,
        )
        if _val(fused).shape != _val(output).shape:  # a bmm's [B·H, Sq, Dv]: read on as 4D, or reshaped
            back = _only_user(output)
            if back is not None and back.target in _VIEWS and _val(back).shape == _val(fused).shape:
                output = back
            else:
                fused = new_node(graph, aten.reshape.default, (fused, list(_val(output).shape)), meta)
    output.replace_all_uses_with(fused)
    return _erase_unused(output)


def new_node(graph: fx.Graph, target, args: tuple, meta: dict, like: fx.Node | None = None, **kwargs) -> fx.Node:
    """A node with ``meta`` and, as ``meta["val"]``, its output on its inputs' fake values (a factory's
    in the fake mode of ``like``'s value: one graph's values share one mode)."""
    node = graph.create_node("call_function", target, args, kwargs, name=target.overloadpacket.__name__)
    fake_args = fx.map_arg(args, _val)
    tensors = [arg for arg in fake_args if isinstance(arg, torch.Tensor)] + ([_val(like)] if like is not None else [])
    fake_mode = detect_fake_mode(tuple(tensors))
    with fake_mode or FakeTensorMode(allow_non_fake_inputs=True):
        node.meta.update(meta, val=target(*fake_args, **kwargs))
    return node


def _erase_unused(node: fx.Node) -> set[fx.Node]:
    """Erase ``node`` and, transitively, the computations only it used (with their asserts)."""
    erased, stack = set(), [node]
    while stack:
        node = stack.pop()
        if node in erased or node.op != "call_function" or _real_users(node) or node.is_impure():
            continue
        inputs = node.all_input_nodes
        for check in list(node.users):
            node.graph.erase_node(check)
            erased.add(check)
        node.graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)
    return erased
