"""Recurrences as one graph node each, while a model is captured: its chunked gated delta rule
becomes ``autopar::gated_delta_rule``, its Mamba selective scan ``autopar::selective_scan``, its
Griffin linear recurrence ``autopar::linear_recurrence`` (:mod:`autopar.runtime.kernels.recurrences`).

Pre: a model whose modules' Python modules define transformers' torch path of either function,
with its arguments: :data:`DELTA_RULE` (query, key, value, g, beta, chunk_size, initial_state,
output_final_state, use_qk_l2norm_in_kernel: Qwen3-Next, Qwen3.5, OLMo-Hybrid, ...) or
:data:`SELECTIVE_SCAN` (hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus,
return_last_state, use_mambapy: Mamba, Falcon-Mamba, Jamba, Zamba), or whose modules' classes define
the method :data:`RNN_SCAN` (self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype:
Recurrent Gemma's RG-LRU).
Post: inside :func:`composite_recurrences`, each such function is a stand-in calling the op
where a training forward calls it (from a zero state, no final state asked for, no packed
sequences; a scan with its D, gate and delta bias; other keyword arguments the function ignores; a
linear recurrence over more than one step, in float32); any other call runs the function itself. On
exit the functions are back.

A model calls the function by its module-level name, so the stand-in replaces that name in the
model's module for the duration of the capture, as the mixture-of-experts blocks' forwards are
replaced (:func:`autopar.passes.capture.moe.composite_moe`); a method, on its class. The name may
hold the ``kernels`` package's module standing in for the function; the stand-in replaces it alike.
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
LINEAR_OP = f"{OP_NAMESPACE}.linear_recurrence"
RNN_SCAN = "_rnn_scan"  # Recurrent Gemma's RG-LRU method (a loop over every token)
RNN_SCAN_ARGS = ("self", "hidden_states", "recurrent_gate", "reset", "recurrent_states", "acc_dtype")
L2NORM = "use_qk_l2norm_in_kernel"
PACKED = ("cu_seqlens", "seq_idx")  # where packed sequences start


def recurrence_op(target) -> bool:
    """Whether ``target`` (an op, its overload or a graph node's target) is the gated delta rule."""
    return _name(target) == RECURRENCE_OP


def scan_op(target) -> bool:
    """Whether ``target`` is Mamba's selective scan."""
    return _name(target) == SCAN_OP


def linear_recurrence_op(target) -> bool:
    """Whether ``target`` is Griffin's linear recurrence."""
    return _name(target) == LINEAR_OP


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


def _rnn_scan(method):
    @functools.wraps(method)
    def scan(self, hidden_states, recurrent_gate, reset, recurrent_states=None, acc_dtype=torch.float32):
        if recurrent_states is not None or hidden_states.shape[1] == 1 or acc_dtype != torch.float32:
            return method(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
        out = torch.ops.autopar.linear_recurrence(hidden_states, recurrent_gate * ~reset)
        return out, out[:, -1].to(acc_dtype)  # the last state, which only decoding reads

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
    """While active, the gated delta rules, selective scans and linear recurrences of ``model``'s
    modules are one op per call."""
    replaced = []
    try:
        for source in sorted({type(module).__module__ for module in model.modules()}):
            python_module = sys.modules.get(source)
            for name, (leading, others, stand_in) in STAND_INS.items():
                function = getattr(python_module, name, None)
                if callable(function) and not hasattr(function, ORIGINAL) and _takes(function, leading, others):
                    setattr(python_module, name, _marked(stand_in(source, function), function))
                    replaced.append((python_module, name, function))
        for cls in {type(module) for module in model.modules()}:
            method = cls.__dict__.get(RNN_SCAN)
            if callable(method) and not hasattr(method, ORIGINAL) and _takes(method, RNN_SCAN_ARGS, ()):
                setattr(cls, RNN_SCAN, _marked(_rnn_scan(method), method))
                replaced.append((cls, RNN_SCAN, method))
        yield model
    finally:
        for python_module, name, function in reversed(replaced):
            setattr(python_module, name, function)


def _takes(function, leading: tuple[str, ...], others: tuple[str, ...]) -> bool:
    # With the ``kernels`` package installed (transformers 5.25 requires it), transformers' kernel
    # functions are modules whose forward takes the function's arguments; called, they run it.
    signature = inspect.signature(function.forward if isinstance(function, nn.Module) else function)
    parameters = list(signature.parameters)
    return parameters[: len(leading)] == list(leading) and all(name in parameters for name in others)


def _marked(stand_in, function):
    setattr(stand_in, ORIGINAL, function)
    return stand_in
