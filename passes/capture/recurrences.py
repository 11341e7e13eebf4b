"""Recurrences as one graph node each, while a model is captured: its chunked gated delta rule
becomes ``autopar::gated_delta_rule``, its Mamba selective scan ``autopar::selective_scan``
(:mod:`autopar.runtime.kernels.recurrences`).

Pre: a model whose modules' Python modules define transformers' torch path of either function,
with its arguments: :data:`DELTA_RULE` (query, key, value, g, beta, chunk_size, initial_state,
output_final_state, use_qk_l2norm_in_kernel: Qwen3-Next, Qwen3.5, OLMo-Hybrid, ...) or
:data:`SELECTIVE_SCAN` (hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus,
return_last_state, use_mambapy: Mamba, Falcon-Mamba, Jamba, Zamba).
Post: inside :func:`composite_recurrences`, each such function is a stand-in calling the op
where a training forward calls it (from a zero state, no final state asked for, no packed
sequences; a scan with its D, gate and delta bias; other keyword arguments the function ignores);
any other call runs the function itself. On exit the functions are back.

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
from autopar.runtime.kernels.recurrences import DELTA_RULE, ORIGINAL, SELECTIVE_SCAN

RECURRENCE_OP = f"{OP_NAMESPACE}.gated_delta_rule"
SCAN_OP = f"{OP_NAMESPACE}.selective_scan"
L2NORM = "use_qk_l2norm_in_kernel"
PACKED = ("cu_seqlens", "seq_idx")  # where packed sequences start


def recurrence_op(target) -> bool:
    """Whether ``target`` (an op, its overload or a graph node's target) is the gated delta rule."""
    return _name(target) == RECURRENCE_OP


def scan_op(target) -> bool:
    """Whether ``target`` is Mamba's selective scan."""
    return _name(target) == SCAN_OP


def _name(target) -> str:
    return str(getattr(target, "overloadpacket", target))


def _delta_rule(source: str, function):
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

    return rule


def _selective_scan(source: str, function):
    @functools.wraps(function)
    def scan(u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False, **kwargs):
        if return_last_state or D is None or z is None or delta_bias is None:
            return function(u, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, **kwargs)
        mambapy = bool(kwargs.get("use_mambapy", False))
        return torch.ops.autopar.selective_scan(u, dt, A, B, C, D, z, delta_bias, bool(delta_softplus), mambapy, source)

    return scan


# function name → (its leading arguments, other arguments it must take, the stand-in's maker)
STAND_INS = {
    DELTA_RULE: (
        ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state"),
        (L2NORM,),
        _delta_rule,
    ),
    SELECTIVE_SCAN: (
        ("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state"),
        (),
        _selective_scan,
    ),
}


@contextmanager
def composite_recurrences(model: nn.Module):
    """While active, the gated delta rules and selective scans of ``model``'s modules are one op per call."""
    replaced = []
    try:
        for source in sorted({type(module).__module__ for module in model.modules()}):
            python_module = sys.modules.get(source)
            for name, (leading, others, stand_in) in STAND_INS.items():
                function = getattr(python_module, name, None)
                if callable(function) and not hasattr(function, ORIGINAL) and _takes(function, leading, others):
                    setattr(python_module, name, _marked(stand_in(source, function), function))
                    replaced.append((python_module, name, function))
        yield model
    finally:
        for python_module, name, function in reversed(replaced):
            setattr(python_module, name, function)


def _takes(function, leading: tuple[str, ...], others: tuple[str, ...]) -> bool:
    parameters = list(inspect.signature(function).parameters)
    return parameters[: len(leading)] == list(leading) and all(name in parameters for name in others)


def _marked(stand_in, function):
    setattr(stand_in, ORIGINAL, function)
    return stand_in
