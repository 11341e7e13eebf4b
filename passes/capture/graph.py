"""Capture: model + example inputs → an aten-level fx graph with shapes and module paths.

Pre: ``model`` is an ``nn.Module`` whose forward takes ``example_inputs`` (real, fake or meta
tensors) and returns a tensor (the loss) or a tuple of tensors. With ``param_dtype`` (mixed
precision) it is captured as it computes with 16-bit copies of its floating parameters and
floating inputs (FSDP2's ``param_dtype`` and ``cast_forward_inputs``), buffers as they are: the
graph keeps the model's own upcasts (norms, softmax), which no cast inserted later could recover.
Post: a :class:`CapturedGraph` whose graph is functional (no in-place ops), whose placeholders are
the parameters, buffers and user inputs in that order, whose every node carries
``meta["val"]`` (a fake tensor or a tuple of them) and whose nodes name their module path
through :func:`module_path`.
"""

from __future__ import annotations

import hashlib
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind

from autopar.ir import TraceError, layer_of
from autopar.passes.capture.attention_pattern import buffer_values, fuse_eager_attention
from autopar.passes.capture.moe import EXPERTS_OP, composite_moe, record_expert_load


@dataclass(frozen=True)
class CapturedGraph:
    graph_module: fx.GraphModule  # placeholders: parameters, buffers, user inputs
    params: dict[str, str]  # placeholder name → parameter name in the model
    buffers: dict[str, str]  # placeholder name → buffer name in the model
    user_inputs: tuple[str, ...]  # placeholder names of the forward's arguments
    outputs: tuple[str, ...]  # "user" or "buffer:NAME" per graph output
    fingerprint: str
    tied: dict[str, str] = field(default_factory=dict)  # parameter name → the name it shares storage with

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The one dtype its floating parameters were captured in (None if none, or several)."""
        values = [n.meta["val"] for n in self.graph.find_nodes(op="placeholder") if n.name in self.params]
        dtypes = {value.dtype for value in values if value.is_floating_point()}
        return dtypes.pop() if len(dtypes) == 1 else None


def capture(model: torch.nn.Module, example_inputs: tuple, param_dtype: torch.dtype | None = None) -> CapturedGraph:
    """Export ``model`` on ``example_inputs`` (non-strict) and lift its state into placeholders;
    with ``param_dtype``, as it computes in that dtype (the model itself is left as it is).

    >>> captured = capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),), param_dtype=torch.bfloat16)
    >>> list(captured.params.values()), captured.graph_module.graph.find_nodes(op="placeholder")[0].meta["val"].dtype
    (['weight', 'bias'], torch.bfloat16)
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    if param_dtype is None:
        return _capture(model, example_inputs)
    with computing_in(model, param_dtype):
        return _capture(model, tuple(cast_floating(value, param_dtype) for value in example_inputs))


def cast_floating(value, dtype: torch.dtype):
    """A floating tensor in ``dtype``; anything else (token ids, masks) as it is."""
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


@contextmanager
def computing_in(model: torch.nn.Module, dtype: torch.dtype):
    """Within: ``model``'s floating parameters are ``dtype`` copies (tied ones stay tied). Example::

    with computing_in(model, torch.bfloat16):
        loss = model(tokens, labels)   # as under FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16)
    """
    copies, swapped = {}, []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in copies:
                copies[id(param)] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            module._parameters[name] = copies[id(param)]
            swapped.append((module, name, param))
    try:
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def _capture(model: torch.nn.Module, example_inputs: tuple) -> CapturedGraph:
    try:
        # An empty decomposition table keeps ops like linear and sdpa whole but functionalizes
        # in-place ops, whose aliasing would not survive a redistribution placed between them.
        with warnings.catch_warnings():  # torch.export's own deprecation chatter, not the user's
            warnings.simplefilter("ignore", FutureWarning)
            with composite_moe(model):  # each mixture-of-experts block becomes one autopar.moe node
                exported = torch.export.export(model, example_inputs, strict=False).run_decompositions({})
    except Exception as error:  # export raises many types; all mean the same to the user
        raise TraceError(
            f"torch.export could not trace {type(model).__name__}: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}\n"
            "autopar needs a forward without data-dependent Python control flow; see the torch.export "
            "docs (torch.cond, static shapes) or pass a model whose forward traces."
        ) from error
    fuse_eager_attention(exported.graph_module, buffer_values(exported))  # one sdpa node, causal masks as is_causal
    signature = exported.graph_signature
    params, buffers, user_inputs = {}, {}, []
    for spec in signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            params[name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
        else:
            raise TraceError(
                f"input {name!r} of kind {spec.kind.name} (e.g. a tensor constant captured from a closure) "
                "is not supported: register it as a buffer on the module instead"
            )
    outputs = tuple(
        "user" if spec.kind == OutputKind.USER_OUTPUT else f"buffer:{spec.target}" for spec in signature.output_specs
    )
    graph_module = fx.GraphModule(exported.graph_module, exported.graph_module.graph)
    tied = _merge_tied_parameters(graph_module.graph, params, model)
    graph_module.recompile()
    _measure_experts(graph_module, params, buffers, model, example_inputs)
    return CapturedGraph(
        graph_module=graph_module,
        params=params,
        buffers=buffers,
        user_inputs=tuple(user_inputs),
        outputs=outputs,
        fingerprint=fingerprint(graph_module.graph),
        tied=tied,
    )


def _measure_experts(graph_module: fx.GraphModule, params, buffers, model, example_inputs) -> None:
    """Routing depends on the data: with real weights and inputs, run the graph once and note
    how the example's tokens spread over the experts (for the cost model's load imbalance)."""
    if not any(str(node.target) == f"{EXPERTS_OP}.default" for node in graph_module.graph.nodes):
        return
    state = {
        **{p: model.get_parameter(n) for p, n in params.items()},
        **{b: model.get_buffer(n) for b, n in buffers.items()},
    }
    inputs = iter(example_inputs)
    args = [
        state[node.name] if node.name in state else next(inputs)
        for node in graph_module.graph.nodes
        if node.op == "placeholder"
    ]
    if not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
        record_expert_load(graph_module, args)


def _merge_tied_parameters(graph: fx.Graph, params: dict[str, str], model: torch.nn.Module) -> dict[str, str]:
    """Tied weights (one tensor under two names) become one placeholder, so their gradients add up."""
    first_by_tensor: dict[int, str] = {}
    tied = {}
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    for placeholder, name in list(params.items()):
        key = id(model.get_parameter(name))
        if key not in first_by_tensor:
            first_by_tensor[key] = placeholder
            continue
        canonical = first_by_tensor[key]
        placeholders[placeholder].replace_all_uses_with(placeholders[canonical])
        graph.erase_node(placeholders[placeholder])
        tied[name] = params.pop(placeholder)
        tied[name] = params[canonical]
    return tied


def module_path(node: fx.Node) -> str:
    """The innermost module a node was traced in (``layers.0.attn.wq``), or "" at top level."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def node_layer(node: fx.Node) -> str | None:
    """The numbered module (``layers.3``) a node was traced in (:func:`autopar.ir.layer_of`), or None."""
    return layer_of(module_path(node))


def fingerprint(graph: fx.Graph) -> str:
    """A hash of the graph's ops, wiring and shapes: a plan made for another graph has another."""
    digest = hashlib.sha256()
    for node in graph.nodes:
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        digest.update(f"{node.op}|{node.target}|{node.args}|{node.kwargs}|{shape}\n".encode())
    return digest.hexdigest()[:16]
