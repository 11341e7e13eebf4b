"""Proving a mask causal: evaluate what it is built from and compare with the lower triangle.

A mask counts as causal only if it depends on nothing but factory ops (``arange``, ``full``,
``triu``, ...) and buffers with known values — never on an input or a parameter — and, evaluated
on the CPU, shows key j to query i exactly when j <= i. Used by :mod:`attention_pattern`.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_map

MAX_MASK_ELEMENTS = 1 << 26  # an 8192 x 8192 mask; a larger one is not evaluated, so not proved causal


@dataclass(frozen=True)
class Mask:
    kind: str  # "add": ``mask`` is a float addend; "hide": True where hidden (masked_fill); "keep": True where seen
    mask: fx.Node
    dtype: torch.dtype  # of the masked scores


def node_value(node):
    """The fake value export recorded for ``node`` (None for a non-node)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def proved_causal(
    mask: Mask, queries: int, keys: int, buffers: Mapping[str, torch.Tensor], verdicts: dict[tuple, bool]
) -> bool:
    """True if the mask, evaluated, hides exactly the keys after each query (sdpa's is_causal)."""
    key = (mask.kind, mask.dtype, _structure(mask.mask), queries, keys)
    if key not in verdicts:
        value = constant_value(mask.mask, buffers)
        verdicts[key] = value is not None and _is_causal(mask, value, queries, keys)
    return verdicts[key]


def _is_causal(mask: Mask, value: torch.Tensor, queries: int, keys: int) -> bool:
    if value.ndim < 2:
        value = value.reshape((1,) * (2 - value.ndim) + tuple(value.shape))
    value = value.expand(*value.shape[:-2], queries, keys)
    if mask.kind == "add":
        visible = value == 0
        if value.dtype == torch.bool or not bool((visible | (value <= torch.finfo(mask.dtype).min)).all()):
            return False
    elif value.dtype == torch.bool:
        visible = value if mask.kind == "keep" else ~value
    else:
        return False
    causal = torch.ones(queries, keys, dtype=torch.bool).tril()
    return torch.equal(visible, causal.expand_as(visible))


def _structure(node: fx.Node) -> tuple:
    """What ``node`` computes, independent of node names: equal for the same mask built per layer."""
    memo: dict[fx.Node, tuple] = {}
    for each in _ancestors(node):
        if each.op != "call_function":
            memo[each] = (each.op, each.name)
        else:
            memo[each] = (str(each.target),) + fx.map_arg((each.args, each.kwargs), memo.__getitem__)
    return memo[node]


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and everything it depends on, in graph order."""
    seen, stack = {node}, [node]
    while stack:
        for source in stack.pop().all_input_nodes:
            if source not in seen:
                seen.add(source)
                stack.append(source)
    order = {each: index for index, each in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def constant_value(node: fx.Node, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """``node``'s real value if it depends only on factory ops and ``buffers``, else None.

    Evaluated on the CPU (factory ops on "meta" included), under no fake mode and no grad.
    """
    nodes = _ancestors(node)
    for each in nodes:
        if each.op == "placeholder" and each.name not in buffers:
            return None
        if each.op not in ("placeholder", "call_function") or not _evaluable(each):
            return None
    values: dict[fx.Node, object] = {}
    with unset_fake_temporarily(), torch.no_grad():
        for each in nodes:
            if each.op == "placeholder":
                values[each] = buffers[each.name]
                continue
            args, kwargs = tree_map(_on_cpu, fx.map_arg((each.args, each.kwargs), values.__getitem__))
            try:
                values[each] = each.target(*args, **kwargs)
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                return None  # an op that will not run on these values: nothing proved, the graph stays
    value = values[node]
    return value if isinstance(value, torch.Tensor) else None


def _on_cpu(arg):
    return torch.device("cpu") if isinstance(arg, torch.device) else arg


def _evaluable(node: fx.Node) -> bool:
    """Deterministic, with a value small enough to compute while compiling."""
    if node.op == "placeholder":
        return True
    target = node.target
    if target is not operator.getitem:
        if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
            return False
        if "empty" in target._opname:  # uninitialized memory
            return False
    val = node_value(node)
    vals = val if isinstance(val, (tuple, list)) else (val,)
    if not all(isinstance(each, torch.Tensor) or each is None for each in vals):
        return isinstance(val, (int, float, bool))
    return sum(each.numel() for each in vals if each is not None) <= MAX_MASK_ELEMENTS
