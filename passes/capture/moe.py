"""Mixture-of-experts blocks as one graph node: ``torch.ops.autopar.moe`` per layer.

Pre: a model whose MoE blocks :func:`moe_modules` recognizes.
Post: inside :func:`composite_moe`, each recognized block's forward is one call of
``autopar::moe(x, router_weight, gate_up, down, top_k, normalize, capacity_factor, activation,
gate_up_bias, down_bias, "")``
(``runtime/expert_parallel.py`` holds its math), so ``passes.capture.capture`` records one
``autopar.moe`` node per layer and none of the routing's data-dependent ops; on exit the
original forwards are back.

What is recognized (duck-typing, so Hugging Face blocks of Mixtral's shape match too:
Mixtral, Qwen3-MoE, OLMoE, and Qwen2-MoE's with its gated shared expert; routers with biases,
an activation not named below or another kind of shared expert do not):

- a router at ``block.gate`` or ``block.router`` holding only a ``weight`` [E, H] (an
  ``nn.Linear`` without bias, or a Hugging Face ``*TopKRouter``), with softmax → top-k routing;
- ``block.experts`` holding only ``gate_up_proj`` [E, 2F, H] (gate rows, then up rows) and
  ``down_proj`` [E, H, F], or both transposed (Aria's, as ``grouped_mm`` takes them: transposed
  back in the graph), gated by an activation the ops know (``runtime/kernels/expert_activations.py``):
  the experts' own ``_apply_gate(gate_up)`` where they have one (Hunyuan-V4's and MiniMax-M3's
  clamped SwiGLUs), else ``act_fn(gate, up)`` (Inkling-2's softcapped SwiGLU) or ``act_fn(gate) · up``
  (SiLU, GELU, tanh-GELU, ReLU), told apart by their values on probe inputs (:func:`_activation_name`),
  gate and up the halves of the projection or its alternate columns (GPT-OSS's); with their
  biases ``gate_up_proj_bias`` [E, 2F] and ``down_proj_bias`` [E, H] where they have them;
- ``top_k`` on the block or the router; ``norm_topk_prob`` on either says whether the top-k
  weights are renormalized (without it they are, as in Mixtral);
- nothing else in the block (no other parameters or buffers), but for Qwen2-MoE's shared expert:
  ``block.shared_expert`` (any module, called on the tokens) with ``block.shared_expert_gate``
  (an ``nn.Linear`` [1, H] without bias), the output then ``routed + sigmoid(gate(x)) * shared(x)``
  (the shared expert stays ordinary ops in the graph).

Experts a block calls with routing of its own (``experts(hidden_states, top_k_index,
top_k_weights)``, transformers' experts classes: DeepSeek-V3's behind its grouped sigmoid router,
DBRX's, Inkling-2's, GPT-OSS's, ...) in a block not recognized as above become one
``autopar::moe_experts(x, weights, ids, gate_up, down, capacity_factor, activation, gate_up_bias,
down_bias, False, "")`` call each, when the experts module holds what ``block.experts`` must hold
above or DBRX's layout of the same gated experts (:func:`_expert_weights`): the router and
whatever else the block does stay ordinary ops. A block as Llama 4's (every expert run on every
token scaled by its score: :func:`weighted_input_parts`) becomes its router's logits and top-k
as ordinary ops, one ``moe_experts`` call with weighted inputs (``True``) and its shared expert.

The block's forward takes hidden states [..., H]. It returns the output alone (Hugging Face), or
``(output, router_logits [T, E])`` if the block sets ``returns_router_logits = True``
(``examples/moe_gpt.py``). A router that is not an ``nn.Linear`` is still called, with the op's
logits, through a pass-through forward returning ``(router_logits, None, None)``, so forward
hooks on it (Hugging Face's ``OutputRecorder`` for ``output_router_logits``) see the logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.ir import OP_NAMESPACE, ConfigError
from autopar.passes.cost.kernels import chosen_load, expert_load
from autopar.runtime.kernels.expert_activations import (
    CLAMPED_SILU,
    CLAMPED_SWIGLU,
    INTERLEAVED,
    SOFTCAPPED,
    UNARY,
    gated_activation,
    spec,
)

EXPERTS_OP = f"{OP_NAMESPACE}.moe"  # the composite op each mixture-of-experts block becomes
ROUTED_EXPERTS_OP = f"{OP_NAMESPACE}.moe_experts"  # experts routed by the model's own ops (names start alike)
_ROUTED_ARGS = (  # transformers' experts calls: (tokens, expert ids, their weights)
    ["hidden_states", "top_k_index", "top_k_weights"],
    ["hidden_states", "router_indices", "routing_weights"],  # GPT-OSS's
)
_ROUTER_NAMES = ("gate", "router")
_EXPERT_PARAMS = {"gate_up_proj", "down_proj"}
_EXPERT_BIASES = {"gate_up_proj_bias", "down_proj_bias"}  # GPT-OSS's experts add biases


@dataclass(frozen=True)
class MoEParts:
    """What the op needs from a recognized block."""

    router: nn.Module  # holds ``weight`` [E, H]
    weights: Callable[[], tuple]  # the experts' gate_up [E, 2F, H], down [E, H, F] and biases (or Nones)
    top_k: int
    normalize: bool
    returns_router_logits: bool
    activation: str  # the experts' gated activation, by its ops' name
    shared: nn.Module | None = None  # Qwen2-MoE's shared expert, added under a sigmoid gate
    shared_gate: nn.Module | None = None


def moe_parts(block: nn.Module) -> MoEParts | None:
    """The router, experts and options of ``block`` if it is an MoE block (see the module
    docstring), else None. Example: ``moe_parts(model.layers[0].moe).top_k``."""
    router_name = next((name for name in _ROUTER_NAMES if isinstance(getattr(block, name, None), nn.Module)), None)
    experts = getattr(block, "experts", None)
    if router_name is None or not isinstance(experts, nn.Module):
        return None
    router = getattr(block, router_name)
    children = {name for name, _ in block.named_children()}
    shared, shared_gate = _gated_shared_expert(block)
    expected = {router_name, "experts"} | ({"shared_expert", "shared_expert_gate"} if shared else set())
    if children != expected or _own_tensors(block):
        return None
    if set(_own_tensors(router)) != {"weight"} or any(True for _ in router.children()):
        return None
    weights, activation = _stacked(experts)
    if activation is None:
        return None
    top_k = getattr(block, "top_k", getattr(router, "top_k", None))
    if not isinstance(top_k, int) or _expert_shape(*weights()[:2]) != router.weight.shape:
        return None
    normalize = getattr(block, "norm_topk_prob", getattr(router, "norm_topk_prob", True))
    if not _routes_by_softmax_top_k(router, top_k, bool(normalize)):
        return None
    returns_logits = bool(getattr(block, "returns_router_logits", False))
    return MoEParts(router, weights, top_k, bool(normalize), returns_logits, activation, shared, shared_gate)


def _routes_by_softmax_top_k(router: nn.Module, top_k: int, normalize: bool) -> bool:
    """Whether ``router`` routes as the op does. A plain linear leaves the routing to its block;
    a router with a forward of its own (transformers' ``*TopKRouter``) is run once, on random
    tokens with a random weight of its shape on the CPU, and must give (logits, the top-k
    softmax weights, renormalized when ``normalize``, their experts): PhiMoE's router has the
    same weight and name but samples its experts (sparsemixer), which the op does not."""
    if type(router).forward is nn.Linear.forward:
        return True
    logits, out = _probe_router(router, 3)
    if out is None:
        return False
    top, experts = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True) if normalize else top
    _, scores, indices = out
    return indices.shape == experts.shape and bool(
        (indices == experts).all() and torch.allclose(scores.float(), top, atol=1e-5)
    )


def _probe_router(router: nn.Module, outputs: int) -> tuple[torch.Tensor, tuple | None]:
    """(the logits of random tokens through a random weight of ``router``'s shape, what ``router``
    returns for them on the CPU, or None unless a tuple of ``outputs`` tensors)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(router.weight.shape, generator=generator)
    tokens = torch.randn(16, weight.shape[1], generator=generator)
    try:
        with torch.no_grad():
            out = torch.func.functional_call(router, {"weight": weight}, (tokens,))
    except Exception:  # noqa: BLE001  (a router this call does not suit is not one the op replaces)
        out = None
    ok = isinstance(out, tuple) and len(out) == outputs and all(torch.is_tensor(t) for t in out)
    return tokens @ weight.T, out if ok else None


@dataclass(frozen=True)
class WeightedInputParts:
    """A block as Llama 4's (:func:`weighted_input_parts`)."""

    router: nn.Linear
    weights: Callable[[], tuple]  # as :attr:`MoEParts.weights`, without biases
    activation: str
    shared: nn.Module


def weighted_input_parts(block: nn.Module) -> WeightedInputParts | None:
    """The parts of a block as Llama 4's, or None: ``router`` a bias-free ``nn.Linear`` [E, H] with
    ``top_k`` whose forward gives (scores, logits), the scores σ(logit) at each token's top-k
    logits and 0 elsewhere; ``experts`` stacked as ``block.experts`` must be above, without biases,
    taking every expert's copy of the tokens at once (``forward(hidden_states)``); ``shared_expert``;
    nothing else. Such a block returns (shared(x) + Σ_e expert_e(score_e · x), logits): a token
    reaches an expert scaled by its score, and its zero copies add nothing, so the op computes it
    with weighted inputs over the top-k experts alone."""
    if {name for name, _ in block.named_children()} != {"router", "experts", "shared_expert"} or _own_tensors(block):
        return None
    router, experts = block.router, block.experts
    top_k = getattr(router, "top_k", None)
    if not isinstance(router, nn.Linear) or router.bias is not None or not isinstance(top_k, int):
        return None
    weights, activation = _stacked(experts)
    if activation is None or _parameter_names(type(experts).forward) != ["hidden_states"]:
        return None
    gate_up, down, gate_up_bias, _ = weights()
    if gate_up_bias is not None or _expert_shape(gate_up, down) != router.weight.shape:
        return None  # (biased experts would add their biases for the zero copies too)
    logits, out = _probe_router(router, 2)
    if out is None:
        return None
    top, chosen = logits.topk(top_k, dim=-1)
    scores = torch.zeros_like(logits).scatter_(1, chosen, torch.sigmoid(top))
    if out[0].shape != scores.shape or not torch.allclose(out[0].float(), scores, atol=1e-6):
        return None
    return WeightedInputParts(router, weights, activation, block.shared_expert)


def _gated_shared_expert(block: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """Qwen2-MoE's ``shared_expert`` and its ``shared_expert_gate`` (Linear H -> 1, no bias), or Nones."""
    shared, gate = getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)
    gated = isinstance(shared, nn.Module) and isinstance(gate, nn.Linear) and gate.bias is None
    return (shared, gate) if gated and gate.out_features == 1 else (None, None)


def _stacked(experts) -> tuple[Callable | None, str | None]:
    """(a function giving the weights as ``autopar::moe`` and ``moe_experts`` take them, (gate_up,
    down, gate_up bias or None, down bias or None), and the activation's name) if ``experts`` holds
    ``gate_up_proj`` and ``down_proj`` in either layout of the module docstring, and maybe their
    biases [E, 2F] and [E, H], gated as the ops know; else (None, None)."""
    if not isinstance(experts, nn.Module) or set(_own_tensors(experts)) not in (
        _EXPERT_PARAMS,
        _EXPERT_PARAMS | _EXPERT_BIASES,
    ):
        return None, None
    # Aria's and GPT-OSS's weights are [E, H, 2F] and [E, F, H]: transposed in the graph
    transposed = _expert_shape(experts.gate_up_proj, experts.down_proj) is None
    biased = hasattr(experts, "down_proj_bias")

    def weights():
        gate_up, down = experts.gate_up_proj, experts.down_proj
        gate_up, down = (gate_up.mT, down.mT) if transposed else (gate_up, down)
        return gate_up, down, *((experts.gate_up_proj_bias, experts.down_proj_bias) if biased else (None, None))

    gate_up, down, *biases = weights()
    if _expert_shape(gate_up, down) is None:
        return None, None
    if biased and [b.shape for b in biases] != [gate_up.shape[:2], down.shape[:2]]:
        return None, None  # not [E, 2F] and [E, H]
    activation = _activation_name(experts, "act_fn")
    return (weights, activation) if activation else (None, None)


def routed_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name → experts module called with the model's own routing (see the module
    docstring) outside any block :func:`moe_parts` recognizes."""
    blocks = moe_modules(model)
    return {
        name: module
        for name, module in model.named_modules()
        if _expert_weights(module)[1] is not None
        and _parameter_names(type(module).forward) in _ROUTED_ARGS
        and not any(name.startswith(f"{block}.") for block in blocks)
    }


def _expert_weights(experts: nn.Module):
    """(a function giving ``experts``' tensors as ``moe_experts`` takes them, (gate_up [E, 2F, H],
    down [E, H, F], the biases or Nones), and their activation's name) when it holds gated experts
    in a layout known here, else (None, None): stacked (:func:`_stacked`), or DBRX's (``mlp.w1``,
    ``mlp.v1``, ``mlp.w2``, each [E·F, H]: gate, up and the transposed down of expert e in rows e·F
    to (e+1)·F; viewed and joined in the graph, so their gradients reach them)."""
    weights, activation = _stacked(experts)
    if activation is not None:
        return weights, activation
    mlp, count = getattr(experts, "mlp", None), getattr(experts, "num_experts", None)
    if _own_tensors(experts) or [name for name, _ in experts.named_children()] != ["mlp"] or not isinstance(count, int):
        return None, None
    if set(_own_tensors(mlp)) != {"w1", "v1", "w2"} or (activation := _activation_name(mlp, "activation_fn")) is None:
        return None, None
    shape = mlp.w1.shape
    if len(shape) != 2 or shape[0] % count or mlp.v1.shape != shape or mlp.w2.shape != shape:
        return None, None
    split = (count, shape[0] // count, shape[1])
    return lambda: (
        torch.cat([mlp.w1.view(split), mlp.v1.view(split)], dim=1),
        mlp.w2.view(split).mT,
        None,
        None,
    ), activation


def _parameter_names(forward) -> list[str]:
    try:
        return list(inspect.signature(forward).parameters)[1:]  # after self
    except (TypeError, ValueError):
        return []


def moe_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name → MoE block, for every block :func:`moe_parts` recognizes.

    >>> sorted(moe_modules(build_mixtral(layers=2)))  # examples/hf.py
    ['model.layers.0.mlp', 'model.layers.1.mlp']
    """
    return {name: module for name, module in model.named_modules() if moe_parts(module) is not None}


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name → every module an experts op is made for: the blocks of :func:`moe_modules`
    and :func:`weighted_input_parts`, the experts of :func:`routed_experts` (the modules to pin to
    the expert-parallel kernel: ``constraints=dict.fromkeys(expert_modules(model), "experts")``)."""
    return {**moe_modules(model), **weighted_input_blocks(model), **routed_experts(model)}


def weighted_input_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name → block as Llama 4's, for every block :func:`weighted_input_parts` recognizes."""
    return {name: module for name, module in model.named_modules() if weighted_input_parts(module) is not None}


@contextmanager
def composite_moe(model: nn.Module, *, capacity_factor: float = 0.0):
    """While active, every MoE block of ``model`` runs as one ``autopar::moe`` call (group ""),
    and experts routed by the model's own ops as one ``autopar::moe_experts`` call.

    ``capacity_factor`` > 0 drops slots over capacity, which the eager blocks (dropless) do not:
    the loss then differs from the eager one (``import autopar`` registers the op). Example::

        with composite_moe(model):
            captured = capture(model, model.example_inputs(8, device="meta"))
    """
    overridden: list[tuple[nn.Module, object]] = []
    try:
        for name, block in moe_modules(model).items():
            parts = moe_parts(block)
            _override_forward(block, _composite_forward(name, block, parts, capacity_factor), overridden)
            if not isinstance(parts.router, nn.Linear):
                _override_forward(parts.router, _logits_pass_through, overridden)
        for experts in routed_experts(model).values():
            _override_forward(experts, _routed_forward(experts, capacity_factor), overridden)
        for block in weighted_input_blocks(model).values():
            parts = weighted_input_parts(block)
            _override_forward(block, _weighted_input_forward(parts, capacity_factor), overridden)
            _override_forward(parts.router, lambda logits: (None, logits), overridden)  # for its hooks
        yield model
    finally:
        for module, previous in reversed(overridden):
            if previous is None:
                del module.forward
            else:
                module.forward = previous


def _composite_forward(name: str, block: nn.Module, parts: MoEParts, capacity_factor: float):
    def forward(hidden_states: torch.Tensor):
        if block.training and getattr(block, "jitter_noise", 0) > 0:
            raise ConfigError(
                f"MoE block {name!r} multiplies its input by random jitter in training, which the composite "
                "moe op does not: build it with router_jitter_noise=0 or call model.eval()"
            )
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        gate_up, down, *biases = parts.weights()
        options = (parts.top_k, parts.normalize, float(capacity_factor), parts.activation, *biases, "")
        out, router_logits = torch.ops.autopar.moe(x, parts.router.weight, gate_up, down, *options)
        if parts.shared is not None:  # Qwen2-MoE's: routed + sigmoid(gate(x)) * shared(x)
            out = out + torch.sigmoid(parts.shared_gate(x)) * parts.shared(x)
        out = out.view(hidden_states.shape)
        if parts.returns_router_logits:
            return out, router_logits
        if not isinstance(parts.router, nn.Linear):
            parts.router(router_logits)  # for its forward hooks
        return out

    return forward


def _routed_forward(experts: nn.Module, capacity_factor: float):
    weights, activation = _expert_weights(experts)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        gate_up, down, *biases = weights()
        options = (float(capacity_factor), activation, *biases, False, "")
        out = torch.ops.autopar.moe_experts(x, top_k_weights, top_k_index, gate_up, down, *options)
        return out.view(hidden_states.shape)

    return forward


def _weighted_input_forward(parts: WeightedInputParts, capacity_factor: float):
    def forward(hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(x, parts.router.weight)
        top, chosen = logits.topk(parts.router.top_k, dim=-1)
        gate_up, down, *biases = parts.weights()
        options = (float(capacity_factor), parts.activation, *biases, True, "")
        routed = torch.ops.autopar.moe_experts(
            x, torch.sigmoid(top.float()).to(x.dtype), chosen, gate_up, down, *options
        )
        parts.router(logits)  # for its forward hooks
        return parts.shared(x) + routed, logits

    return forward


def _logits_pass_through(router_logits: torch.Tensor):
    return router_logits, None, None


def _override_forward(module: nn.Module, forward, overridden: list) -> None:
    overridden.append((module, module.__dict__.get("forward")))
    module.forward = forward


def _own_tensors(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters(recurse=False)] + [
        name for name, _ in module.named_buffers(recurse=False)
    ]


def _activation_name(module: nn.Module, act_attr: str) -> str | None:
    """The name the expert ops know ``module``'s gating by (``runtime/kernels/expert_activations.py``),
    else None: its values on probe inputs (:func:`_gated`) equal one of the ops' activations, on
    the halves of the projection or on its even and odd columns (``:interleaved``): those with a
    clamp or a scale taken from the module's ``*limit*`` and ``*alpha*`` numbers, then the
    one-argument ones, then the softcapped SwiGLU whose caps the values show at large inputs
    (σ(gate) → 1 and cap(gate) → its cap; cap(up) ≈ up while up is small)."""
    gate = torch.cat([torch.linspace(-8.0, 8.0, 33), torch.tensor([-1e3, -100.0, -30.0, 30.0, 100.0, 1e3])])
    projected = torch.cat([gate, torch.roll(gate, 7) * 1.5])  # every sign and size against every other
    numbers = {
        name: float(v) for name, v in vars(module).items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    limit = next((v for name, v in numbers.items() if "limit" in name), None)
    alpha = next((v for name, v in numbers.items() if "alpha" in name), None)

    def candidates():
        if limit is not None:
            yield spec(CLAMPED_SILU, limit)
            if alpha is not None:
                yield spec(CLAMPED_SWIGLU, alpha, limit)
        yield from UNARY
        gate_cap = _gated(module, act_attr, torch.tensor([1e4, 1e-3])).item() / 1e-3  # ≈ gate cap · up
        yield spec(SOFTCAPPED, gate_cap, _gated(module, act_attr, torch.tensor([1e4, 1e4])).item() / gate_cap)

    with torch.no_grad():
        try:
            values = _gated(module, act_attr, projected)
            for name in candidates():
                for layout in (name, f"{name}:{INTERLEAVED}"):
                    if _close(values, gated_activation(layout)(projected)):
                        return layout
        except Exception:  # noqa: BLE001  (gating that cannot take plain CPU tensors is not one the ops know)
            return None
    return None


def _gated(module: nn.Module, act_attr: str, projected: torch.Tensor) -> torch.Tensor:
    """What ``module``'s experts compute from a projection ``projected`` [..., 2F]: their own
    ``_apply_gate`` of it, else of its halves gate, up ``act_fn(gate, up)`` where it takes both,
    else ``act_fn(gate) · up``."""
    apply_gate = getattr(module, "_apply_gate", None)
    if callable(apply_gate):
        return apply_gate(projected)
    act_fn = getattr(module, act_attr)
    gate, up = projected.chunk(2, dim=-1)
    try:
        return act_fn(gate) * up
    except TypeError:  # takes (gate, up)
        return act_fn(gate, up)


def _close(actual, expected) -> bool:
    return torch.is_tensor(actual) and actual.shape == expected.shape and torch.allclose(actual, expected, 1e-5, 1e-6)


def _expert_shape(gate_up, down) -> tuple[int, int] | None:
    """(experts, hidden) of stacked expert weights gate_up [E, 2F, H] and down [E, H, F], or None."""
    if gate_up.dim() != 3 or down.dim() != 3:
        return None
    (experts, hidden, ffn), shape = down.shape, (gate_up.shape[0], gate_up.shape[2])
    return shape if tuple(gate_up.shape) == (experts, 2 * ffn, hidden) else None


def record_expert_load(graph_module: torch.fx.GraphModule, args: list) -> None:
    """Run the captured graph once on real values (parameters, buffers, example inputs, in
    placeholder order) and note on each ``autopar.moe`` or ``moe_experts`` node the share of routed tokens each
    expert got (``node.meta["expert_load"]``): the cost model's load imbalance."""

    class Recorder(torch.fx.Interpreter):
        def call_function(self, target, call_args, kwargs):
            result = super().call_function(target, call_args, kwargs)
            if str(target) == f"{EXPERTS_OP}.default":
                self.current_node.meta["expert_load"] = expert_load(result[1], call_args[4]).tolist()
            elif str(target) == f"{ROUTED_EXPERTS_OP}.default":
                self.current_node.meta["expert_load"] = chosen_load(call_args[2], call_args[3].shape[0]).tolist()
            return result

        def run_node(self, node):
            self.current_node = node
            return super().run_node(node)

    with torch.no_grad():
        Recorder(graph_module).run(*args)
