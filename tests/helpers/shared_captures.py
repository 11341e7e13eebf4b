"""Models built alike share their captured graphs, within one process (one spawned rank).

A model built by the same builder from the same arguments after the same seed, its parameters and
buffers still of the same shapes, dtypes and devices, and called at the same sizes, captures the
same graph; torch.export is most of a small equivalence case's time
(each ``parallelize`` captures the planning call and, with microbatches, one microbatch, and a
spawn runs many cases). A model made by :func:`build` captures once per call signature, and
every later model built alike gets that graph; any other model captures as usual. Capture
itself is tested in tests/passes/capture; every case still plans, rewrites and runs its own
program against its own reference model.

>>> model = build(gpt.build, hidden=32, layers=2)   # doctest: +SKIP
"""

import weakref

import torch

import autopar.api
import autopar.passes.program
from autopar.passes.capture.graph import capture

_BUILT = weakref.WeakKeyDictionary()  # model → how it was built
_GRAPHS: dict = {}  # (how, call signature, param dtype) → CapturedGraph
# the names autopar's planning call and its microbatch capture call capture by
_CALLERS = ((autopar.api, "capture_graph"), (autopar.passes.program, "capture"))


def build(builder, **kwargs) -> torch.nn.Module:
    """``builder(**kwargs)``, its captures shared with every model built alike."""
    model = builder(**kwargs)
    _BUILT[model] = (builder.__module__, builder.__qualname__, repr(sorted(kwargs.items())), torch.initial_seed())
    for module, name in _CALLERS:
        setattr(module, name, _shared)
    return model


def _shared(model, example_inputs=(), example_kwargs=None, param_dtype=None):
    how = _BUILT.get(model)
    if how is None:
        return capture(model, example_inputs, example_kwargs, param_dtype)
    state = tuple((name, _signature(value)) for name, value in model.state_dict(keep_vars=True).items())
    key = (how, state, model.training, _signature(example_inputs), _signature(example_kwargs or {}), param_dtype)
    if key not in _GRAPHS:
        _GRAPHS[key] = capture(model, example_inputs, example_kwargs, param_dtype)
    return _GRAPHS[key]


def _signature(value):
    """Sizes and dtypes of tensors, values of the rest: what a captured graph depends on."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type, value.requires_grad)
    if isinstance(value, dict):
        return tuple((key, _signature(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(item) for item in value))
    return value
