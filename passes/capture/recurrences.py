"""Recurrences as one graph node: a model's chunked gated delta rule becomes
``autopar::gated_delta_rule`` while it is captured.

Pre: a model whose modules' Python modules define transformers' torch path of the rule,
:data:`autopar.runtime.kernels.linear_attention.FUNCTION` (Qwen3-Next, Qwen3.5, OLMo-Hybrid, ...),
with its arguments (query, key, value, g, beta, chunk_size, initial_state, output_final_state,
use_qk_l2norm_in_kernel).
Post: inside :func:`composite_recurrences`, each such function is a stand-in calling the op
where a training forward calls it (no initial state, no final state asked for, no packed
sequences; other keyword arguments the function ignores); any other call runs the function
itself. On exit the functions are back.

A model calls the function by its module-level name, so the stand-in replaces that name in the
model's module for the duration of the capture, as the mixture-of-experts blocks' forwards are
replaced (:func:`autopar.passes.capture.moe.composite_moe`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from contextlib import contextmanager

import torch
from torch import nn

from autopar.ir import OP_NAMESPACE
from autopar.runtime.kernels.linear_attention import FUNCTION, ORIGINAL

RECURRENCE_OP = f"{OP_NAMESPACE}.gated_delta_rule"
ARGUMENTS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state")
L2NORM = "use_qk_l2norm_in_kernel"
PACKED = ("cu_seqlens", "seq_idx")  # where packed sequences start


def recurrence_op(target) -> bool:
    """Whether ``target`` (an op, its overload or a graph node's target) is the gated delta rule."""
    return str(getattr(target, "overloadpacket", target)) == RECURRENCE_OP


@contextmanager
def composite_recurrences(model: nn.Module):
    """While active, the chunked gated delta rule of ``model``'s modules is one op per call."""
    replaced = []
    try:
        for source in sorted({type(module).__module__ for module in model.modules()}):
            python_module = sys.modules.get(source)
            function = getattr(python_module, FUNCTION, None)
            if callable(function) and not hasattr(function, ORIGINAL) and _takes_the_rule(function):
                setattr(python_module, FUNCTION, _stand_in(source, function))
                replaced.append((python_module, function))
        yield model
    finally:
        for python_module, function in reversed(replaced):
            setattr(python_module, FUNCTION, function)


def _takes_the_rule(function) -> bool:
    parameters = list(inspect.signature(function).parameters)
    return parameters[: len(ARGUMENTS)] == list(ARGUMENTS) and L2NORM in parameters


def _stand_in(source: str, function):
    @functools.wraps(function)
    def rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False, **kwargs):
        l2norm = kwargs.pop(L2NORM, False)
        packed = any(kwargs.get(name) is not None for name in PACKED)  # the rule restarts at each sequence
        if initial_state is not None or output_final_state or packed:
            return function(
                query, key, value, g, beta, chunk_size, initial_state, output_final_state, **{L2NORM: l2norm}, **kwargs
            )
        out = torch.ops.autopar.gated_delta_rule(query, key, value, g, beta, chunk_size, bool(l2norm), source)
        return out, None

    setattr(rule, ORIGINAL, function)
    return rule
