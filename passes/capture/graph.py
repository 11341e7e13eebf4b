"""Capture: model + example inputs → an aten-level fx graph with shapes and module paths.

Pre: ``model`` is an ``nn.Module`` whose forward takes ``example_inputs`` and ``example_kwargs``
(real, fake or meta tensors, and constants) and returns a tensor, or a pytree of them (a tuple,
a dict, a Hugging Face ``ModelOutput``).
With ``param_dtype`` (mixed precision) it is captured as it computes with 16-bit copies of its
floating parameters and floating inputs (FSDP2's ``param_dtype`` and ``cast_forward_inputs``),
buffers as they are: the graph keeps the model's own upcasts (norms, softmax), which no cast
inserted later could recover.
Post: a :class:`CapturedGraph` whose graph is functional (no in-place ops but the buffer updates)
and differentiable op by op (no ``aten.copy``, which has no derivative), whose placeholders are
the parameters, buffers and the tensor inputs in that order (constant inputs are baked in),
whose every node carries ``meta["val"]`` (a fake tensor or a tuple of them) and whose nodes
name their module path through :func:`module_path`; ``in_spec``/``out_spec`` say how a call's
arguments flatten into the tensor inputs and how the outputs rebuild the model's result.

Buffers the forward updates (BatchNorm's running statistics and its count of batches) are not
outputs: export returns their new values, and each becomes an in-place ``copy_`` into its buffer's
placeholder just before the output (:func:`_update_buffers_in_place`), so every program derived
from the graph (the loss alone, compiled, each rank's) updates the buffers it holds as the model
does, and the outputs are the model's own.
"""

from __future__ import annotations

import hashlib
import itertools
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map

import autopar.ir
from autopar.ir import ConfigError, TraceError, layer_of
from autopar.passes.capture.attention_pattern import buffer_values, fuse_eager_attention
from autopar.passes.capture.batch_norm import BATCH_NORM_DECOMPOSITIONS
from autopar.passes.capture.calls import capture_settings, config_positions
from autopar.passes.capture.causal_mask import constant_value, node_value
from autopar.passes.capture.data_sizes import record_data_sizes
from autopar.passes.capture.dropout import draw_dropout_masks_whole
from autopar.passes.capture.moe import EXPERTS_OP, composite_moe, record_expert_load
from autopar.passes.capture.recurrences import composite_recurrences


@dataclass(frozen=True)
class CapturedGraph:
    graph_module: fx.GraphModule  # placeholders: parameters, buffers, user inputs
    params: dict[str, str]  # placeholder name → parameter name in the model
    buffers: dict[str, str]  # placeholder name → buffer name in the model
    user_inputs: tuple[str, ...]  # placeholder names of the forward's tensor arguments, in call order
    buffer_updates: tuple[str, ...]  # the buffers the forward updates in place (copy_ before the output)
    fingerprint: str
    tied: dict[str, str] = field(default_factory=dict)  # parameter name → the name it shares storage with
    in_spec: TreeSpec | None = None  # of (args, kwargs): its tensor leaves are ``user_inputs``
    out_spec: TreeSpec | None = None  # of the forward's result: rebuilds it from the user outputs
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # buffer name → tensor the forward made

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The one dtype its floating parameters were captured in (None if none, or several)."""
        values = [n.meta["val"] for n in self.graph.find_nodes(op="placeholder") if n.name in self.params]
        dtypes = {value.dtype for value in values if value.is_floating_point()}
        return dtypes.pop() if len(dtypes) == 1 else None


def capture(
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    param_dtype: torch.dtype | None = None,
) -> CapturedGraph:
    """Export ``model`` on ``example_inputs``/``example_kwargs`` (non-strict) and lift its state
    into placeholders; Hugging Face models without their KV cache (:func:`capture_settings`).
    With ``param_dtype``, as it computes in that dtype (the model itself is left as it is).

    >>> captured = capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),), param_dtype=torch.bfloat16)
    >>> list(captured.params.values()), captured.graph_module.graph.find_nodes(op="placeholder")[0].meta["val"].dtype
    (['weight', 'bias'], torch.bfloat16)
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    example_inputs, example_kwargs = _distinct(example_inputs, dict(example_kwargs or {}))
    example_inputs, example_kwargs = on_model_device(model, (example_inputs, example_kwargs))
    if param_dtype is None:
        return _capture(model, example_inputs, example_kwargs)
    inputs, kwargs = tree_map(lambda leaf: cast_floating(leaf, param_dtype), (example_inputs, example_kwargs))
    with computing_in(model, param_dtype):
        return _capture(model, inputs, kwargs)


def on_model_device(model: torch.nn.Module, example):
    """``example``'s tensors where ``model``'s state is: an example gives shapes and dtypes, and a
    model on the CPU (or meta) traces as it is whatever device the batches it will train on are."""
    state = next(itertools.chain(model.parameters(), model.buffers()), None)
    if state is None:
        return example
    return tree_map(lambda leaf: leaf.to(state.device) if isinstance(leaf, torch.Tensor) else leaf, example)


def cast_floating(value, dtype: torch.dtype):
    """A floating tensor in ``dtype``; anything else (token ids, masks) as it is."""
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


@contextmanager
def computing_in(model: torch.nn.Module, dtype: torch.dtype):
    """Within: ``model``'s floating parameters are ``dtype`` copies (tied ones stay tied). Example::

    with computing_in(model, torch.bfloat16):
        loss = model(tokens, labels)   # as under FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16)
    """

    def copy(param):
        if not param.is_floating_point() or param.dtype == dtype:
            return None
        return torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)

    with _swapped(model, copy, ("_parameters",)):
        yield


@contextmanager
def traced_as_on_cpu(model: torch.nn.Module, example: tuple):
    """Within: a model on the meta device holds fake CPU tensors, and the ``example`` (args, kwargs)
    it yields is the given one as such; any other model and example are left as they are.

    Composite ops pick their kernel by device, and the output's strides follow: on meta, attention
    takes its math path (heads outermost), on the CPU its fused kernel (heads inside), so a reshape
    after it copies on meta and not on the CPU. Traced as on the CPU, a model without weights
    captures the graph its CPU twin runs (the same fingerprint): a plan made on it runs, and is
    priced, as the ranks run it. Fake tensors hold no data: nothing is allocated."""
    state = next(itertools.chain(model.parameters(), model.buffers()), None)
    # export takes its fake mode from the inputs' tensors (:func:`capture` put them on the model's device)
    inputs = any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(example)[0])
    if state is None or not state.is_meta or not inputs:
        yield example
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    cpu = torch.device("cpu")

    def fake(tensor):
        value = FakeTensor(mode, tensor.detach(), cpu)
        return torch.nn.Parameter(value, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else value

    with _swapped(model, fake, ("_parameters", "_buffers")):
        yield tree_map(lambda leaf: fake(leaf) if isinstance(leaf, torch.Tensor) else leaf, example)


def _as_meta(value):
    """A fake tensor (from :func:`traced_as_on_cpu`) as the meta tensor it stands for; anything else as it is."""
    if isinstance(value, FakeTensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


@contextmanager
def _swapped(model: torch.nn.Module, new, slots: tuple[str, ...]):
    """Within: each tensor ``t`` in ``slots`` ("_parameters", "_buffers") of ``model``'s modules for
    which ``new(t)`` is not None is that (one call per tensor: tied ones stay tied)."""
    copies, swapped = {}, []
    for module in model.modules():
        for slot in slots:
            table = getattr(module, slot)
            for name, value in list(table.items()):
                if value is None:
                    continue
                if id(value) not in copies:
                    copies[id(value)] = new(value)
                if copies[id(value)] is not None:
                    table[name] = copies[id(value)]
                    swapped.append((table, name, value))
    try:
        yield
    finally:
        for table, name, value in swapped:
            table[name] = value


def detach_no_grad_regions(graph_module: fx.GraphModule) -> None:
    """What the forward computes under ``torch.no_grad()`` reads its inputs detached.

    torch.export keeps such a region as one ``wrap_with_set_grad_enabled(False, ...)`` node,
    which ``run_decompositions`` inlines, and with it the region's ops would pass gradients
    (Hugging Face's HRM runs its early reasoning cycles without gradients: they flowed through
    all of them). Detaching every tensor the region reads gives the gradients the model's own
    backward gives, and autograd records nothing of the region, as under no_grad.
    """
    graph = graph_module.graph
    for node in graph.find_nodes(op="call_function", target=torch.ops.higher_order.wrap_with_set_grad_enabled):
        if node.args[0] is not False:
            continue
        inputs = list(node.args[2:])
        for index, value in enumerate(inputs):
            if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
                with graph.inserting_before(node):
                    inputs[index] = graph.call_function(torch.ops.aten.detach.default, (value,))
                inputs[index].meta["val"] = value.meta["val"].detach()
        node.args = (*node.args[:2], *inputs)
    graph_module.recompile()


def _capture(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict) -> CapturedGraph:
    try:
        # A table that decomposes copy alone keeps ops like linear and sdpa whole but functionalizes
        # in-place ops, whose aliasing would not survive a redistribution placed between them.
        with warnings.catch_warnings():  # torch.export's own deprecation chatter, not the user's
            warnings.simplefilter("ignore", FutureWarning)
            # each mixture-of-experts block becomes one autopar.moe node (or its experts one moe_experts),
            # each chunked gated delta rule one autopar.gated_delta_rule node
            with (
                capture_settings(model),
                composite_moe(model),
                composite_recurrences(model),
                traced_as_on_cpu(model, (example_inputs, example_kwargs)) as (args, kwargs),
            ):
                exported = torch.export.export(model, args, kwargs, strict=False)
                detach_no_grad_regions(exported.graph_module)
                exported = exported.run_decompositions({**DIFFERENTIABLE_COPY, **BATCH_NORM_DECOMPOSITIONS})
    except Exception as error:  # export raises many types; all mean the same to the user
        raise TraceError(
            f"torch.export could not trace {type(model).__name__}{_user_line(error)}: {type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}\n"
            f"{_positions_hint(model, example_inputs, example_kwargs, error)}{_advice(error)}"
        ) from error
    known = buffer_values(exported)  # the buffers' values, where they hold data
    _check_lookups(exported.graph_module, known)
    fuse_eager_attention(exported.graph_module, known)  # one sdpa node, causal masks as is_causal
    draw_dropout_masks_whole(exported.graph_module)  # the mask drawn whole, x * mask split like any product
    signature = exported.graph_signature
    params, buffers, user_inputs, constants = {}, {}, [], {}
    placeholders = {node.name: node for node in exported.graph_module.graph.nodes if node.op == "placeholder"}
    for spec in signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            params[name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, ConstantArgument):
            if name in placeholders and not placeholders[name].users:  # baked in: the call's key holds it
                exported.graph_module.graph.erase_node(placeholders[name])
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
        elif spec.kind == InputKind.CONSTANT_TENSOR:  # a tensor the forward makes itself: a buffer of its own
            buffers[name] = spec.target
            constants[spec.target] = _as_meta(exported.constants[spec.target])
        else:
            raise TraceError(
                f"input {name!r} of kind {spec.kind.name} (e.g. a tensor constant captured from a closure) "
                "is not supported: register it as a buffer on the module instead"
            )
    updates = _update_buffers_in_place(exported.graph_module.graph, signature)
    graph_module = fx.GraphModule(exported.graph_module, exported.graph_module.graph)
    tied = _merge_tied_parameters(graph_module.graph, params, model)
    graph_module.recompile()
    leaves, in_spec = tree_flatten((example_inputs, example_kwargs))
    state = {**{p: model.get_parameter(n) for p, n in params.items()}, **_buffer_values(model, buffers, constants)}
    key = fingerprint(graph_module.graph)  # before the data's sizes are recorded: the same for every call
    state.update({placeholder: state[placeholder].clone() for placeholder in updates})  # the model's stay as they are
    _run_once(graph_module, state, [x for x in leaves if isinstance(x, torch.Tensor)])
    return CapturedGraph(
        graph_module=graph_module,
        params=params,
        buffers=buffers,
        user_inputs=tuple(user_inputs),
        buffer_updates=tuple(buffers[placeholder] for placeholder in updates),
        fingerprint=key,
        tied=tied,
        in_spec=in_spec,
        out_spec=exported.call_spec.out_spec,
        constants=constants,
    )


def _update_buffers_in_place(graph: fx.Graph, signature) -> list[str]:
    """Each buffer-mutation output of an exported graph becomes ``copy_(buffer, detach(new value))``
    before the output node, and leaves the outputs; the placeholders of the buffers updated. The
    graph reads such a buffer through a clone taken first: an op's backward may save what it read
    (BatchNorm's running statistics), which the copy would change under it."""
    output = graph.output_node()
    first_op = next(node for node in graph.nodes if node.op != "placeholder")
    values = list(output.args[0])
    placeholders = {spec.target: spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.BUFFER}
    nodes = {node.name: node for node in graph.find_nodes(op="placeholder")}
    updated, kept = [], []
    for spec, value in zip(signature.output_specs, values):
        if spec.kind != OutputKind.BUFFER_MUTATION:
            kept.append(value)
            continue
        buffer = nodes[placeholders[spec.target]]
        with graph.inserting_before(first_op):
            read = graph.call_function(torch.ops.aten.clone.default, (buffer,))
            read.meta = dict(buffer.meta)
        buffer.replace_all_uses_with(read, delete_user_cb=lambda user: user is not read)
        with graph.inserting_before(output):
            new = graph.call_function(torch.ops.aten.detach.default, (value,))
            new.meta = {**value.meta, "val": value.meta["val"].detach()}
            copy = graph.call_function(torch.ops.aten.copy_.default, (buffer, new))
            copy.meta = {**value.meta, "val": buffer.meta["val"]}
        updated.append(buffer.name)
    output.args = (tuple(kept),)
    return updated


def _check_lookups(graph_module: fx.GraphModule, buffers: dict[str, torch.Tensor]) -> None:
    """A table looked up at indices the graph makes itself (positions: an ``arange`` over the sequence)
    holds them: GPT-2's 1024 learned positions looked up for 4096 tokens export and plan without
    complaint (on the meta device nothing reads the table), and fail only when the run indexes it."""
    for node in graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default):
        rows = node_value(node.args[0]).shape[0]
        indices = constant_value(node.args[1], buffers)
        if indices is not None and indices.numel() and not 0 <= int(indices.min()) <= int(indices.max()) < rows:
            row = int(indices.max()) if int(indices.max()) >= rows else int(indices.min())
            raise ConfigError(
                f"{module_path(node) or 'an embedding'} looks up row {row} of its {rows}-row table at "
                f"positions the model makes from the input's shape: the model holds {rows} positions; call it on "
                f"sequences of at most {rows} tokens, or build it with more positions"
            )


def _copy(destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """What functional ``aten.copy`` returns (``source`` broadcast and cast to ``destination``),
    in ops autograd can differentiate: ``aten.copy`` has no derivative."""
    return source.to(dtype=destination.dtype, device=destination.device).expand(destination.shape).clone()


# ``x[..., :k].copy_(y)`` functionalizes to ``slice_scatter(x, copy(x[..., :k], y))`` (DeepSeek-V3's
# attention builds its keys so); the runtime differentiates the graph, so copy is decomposed.
DIFFERENTIABLE_COPY = {torch.ops.aten.copy.default: _copy}


def _user_line(error: BaseException | None, innermost: bool = False) -> str:
    """ " at FILE:LINE (code)" of the innermost frame of the model's own code (outside torch,
    autopar and the standard library) that the error, or what caused it, passed through;
    ``innermost``: the frame that raised it, whoever's."""
    ours = (Path(__file__).parents[1], Path(autopar.ir.__file__).parents[1])  # passes/, autopar/
    skipped = tuple(str(path) for path in (Path(torch.__file__).parent, Path(traceback.__file__).parent, *ours))
    while error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        frames = frames[-1:] if innermost else [f for f in frames if not f.filename.startswith(skipped)]
        if frames:
            return f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})"
        error = error.__cause__ or error.__context__
    return ""


# Errors Python raises for a mistake in the code that runs (an argument of the wrong type, a key
# missing): where the model's own line raised one, the forward fails as it is, traced or not
_PLAIN_MISTAKES = (TypeError, ValueError, AttributeError, KeyError, IndexError, AssertionError, ZeroDivisionError)
# What torch's ops say when two shapes disagree (export's fake tensors say the first; an eager run the
# others): capture runs the model's code on the call's own static shapes, so the forward run as it
# is fails there alike (a configuration whose head and rotary sizes disagree)
_SHAPE_MISMATCHES = (
    "attempting to broadcast a dimension", "must match the size of tensor", "shapes cannot be multiplied",
    "is invalid for input of size", "to match target batch_size",
)  # fmt: skip


def _shapes_disagree(error: BaseException) -> bool:
    return any(sign in str(error).lower() for sign in _SHAPE_MISMATCHES)


def _advice(error: BaseException) -> str:
    """What to do about ``error``: a model whose own code raised a plain Python error, or whose
    tensors' shapes disagree, fails with these inputs or this configuration whether traced or not
    (Hugging Face's DeepSeek-V2 default configuration leaves ``num_experts_per_tok`` unset, and its
    router calls topk with k=None); anything else is most often control flow on a tensor's values,
    which export cannot follow."""
    raised_in_model = isinstance(error, _PLAIN_MISTAKES) and _user_line(error) == _user_line(error, innermost=True)
    shapes_disagree = _shapes_disagree(error)
    if raised_in_model or shapes_disagree:
        what = (
            "The shapes at the model's line above disagree" if shapes_disagree else "The model's own code raised this"
        )
        return (
            f"{what}, not torch.export: the forward fails with these inputs or this "
            "configuration even run as it is. Run the model once on the same inputs, fix what it reports (a "
            "configuration value left unset or sizes that disagree, an input of the wrong type or shape), then plan it."
        )
    return (
        "autopar needs a forward without data-dependent Python control flow (a branch or loop on a "
        "tensor's values); see the torch.export docs (torch.cond, static shapes) or pass a model whose "
        "forward traces."
    )


def _positions_hint(model: torch.nn.Module, args: tuple, kwargs: dict, error: BaseException) -> str:
    """A line naming the likely cause when the call is longer than the positions the model's config
    holds: buffers sized for them (GPT-Neo's causal mask) then fail to broadcast inside export. A
    call of exactly that many tokens whose shapes disagree is named too: a model that starts its
    positions past a padding index (ProphetNet) holds fewer than its config says."""
    config = getattr(model, "config", None)
    field, limit = (config_positions(config) if config is not None else None) or ("", None)
    leaves = tree_flatten((args, kwargs))[0]  # token ids: integer [batch, tokens] (not images, not audio)
    tokens = [t.shape[1] for t in leaves if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point()]
    if limit is None or not tokens or max(tokens) < limit:
        return ""
    if max(tokens) == limit:
        return (
            f"The call has {limit} tokens, every position the model's config holds ({field}); a model that "
            "offsets its positions (past a padding index) holds fewer: call it on fewer tokens (--seq).\n"
            if _shapes_disagree(error)
            else ""
        )
    return (
        f"The call has {max(tokens)} tokens and the model's config holds {limit} positions "
        f"({field}): call it on at most {limit}, or build it with more positions.\n"
    )


def _distinct(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs with every tensor passed twice (``input_ids=t, labels=t``) copied: export gives
    one tensor one placeholder, and the graph would read the other input from it whatever is
    passed later."""
    seen: set[int] = set()

    def once(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) in seen:
            return leaf.clone()
        seen.add(id(leaf))
        return leaf

    return tree_map(once, (args, kwargs))


def _buffer_values(model: torch.nn.Module, buffers: dict[str, str], constants: dict) -> dict[str, torch.Tensor]:
    return {b: constants[n] if n in constants else model.get_buffer(n) for b, n in buffers.items()}


def _run_once(graph_module: fx.GraphModule, state: dict, example_inputs) -> None:
    """What only the data decides, from the example call run on real weights and inputs: the sizes
    torch.export could not know (:mod:`autopar.passes.capture.data_sizes`), and how the tokens
    spread over the experts (for the cost model's load imbalance)."""
    inputs = iter(example_inputs)
    args = [
        state[node.name] if node.name in state else next(inputs)
        for node in graph_module.graph.nodes
        if node.op == "placeholder"
    ]
    record_data_sizes(graph_module, args, module_path)
    experts = any(str(node.target).startswith(EXPERTS_OP) for node in graph_module.graph.nodes)  # moe, moe_experts
    if experts and not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
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
