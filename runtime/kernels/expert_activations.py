"""The experts' gated activations: what ``autopar::moe`` and ``moe_experts`` compute between an
expert's two matmuls, ``hidden = glu(h)`` with ``h = gate_up[e] @ x (+ bias)``, named by the string
the ops take (``activation``), so the graph, the plan and every rank agree. ``gate, up =
h.chunk(2)`` (the gate rows of ``gate_up`` first), or with ``:interleaved`` after the name the
even and odd columns of h (GPT-OSS's layout); then

- ``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"relu"``: ``act(gate) · up`` (SwiGLU: Mixtral's,
  Qwen3-MoE's, DeepSeek-V3's experts; GeGLU; ReGLU);
- ``"softcapped_silu:G:U"``: ``cap_G(gate) · σ(gate) · cap_U(up)`` in fp32, ``cap_c(v) = c·tanh(v / c)``
  (Inkling-2's softcapped SwiGLU);
- ``"clamped_silu:L"``: ``silu(min(gate, L)) · clamp(up, −L, L)`` (Hunyuan-V4's);
- ``"clamped_swiglu:A:L"``: ``g · σ(A·g) · (clamp(up, −L, L) + 1)`` with ``g = min(gate, L)`` (GPT-OSS's
  gate, MiniMax-M3's).

The ops' backward differentiates the same function (``torch.func.vjp``), so an entry is its forward
only; SwiGLU, the common one, has its derivative written out (:func:`gated_activation_vjp`).
Example: ``"clamped_swiglu:1.702:7:interleaved"`` is GPT-OSS's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}
SOFTCAPPED, CLAMPED_SILU, CLAMPED_SWIGLU = "softcapped_silu", "clamped_silu", "clamped_swiglu"
INTERLEAVED = "interleaved"


def gated_activation(spec: str) -> Callable[[Tensor], Tensor]:
    """``glu(h)`` for an activation named as the module docstring says.

    >>> gated_activation("softcapped_silu:4.0:25.0")(torch.tensor([0.0, 1.0]))
    tensor([0.])
    """
    glu = _gate_up_activation(spec.removesuffix(f":{INTERLEAVED}"), spec)
    if spec.endswith(f":{INTERLEAVED}"):
        return lambda h: glu(h[..., ::2], h[..., 1::2])
    return lambda h: glu(*h.chunk(2, dim=-1))


def gated_activation_vjp(spec: str) -> Callable[[Tensor], tuple[Tensor, Callable[[Tensor], Tensor]]]:
    """``h ↦ (glu(h), d_hidden ↦ d_h)``: by hand for ``"silu"`` (half the time of ``torch.func.vjp``
    on the CPU), else through ``torch.func.vjp`` of :func:`gated_activation`."""
    if spec == "silu":
        return _swiglu_vjp
    glu = gated_activation(spec)

    def vjp(h: Tensor):
        hidden, pullback = torch.func.vjp(glu, h)
        return hidden, lambda d_hidden: pullback(d_hidden)[0]

    return vjp


def _swiglu_vjp(h: Tensor):
    gate, up = h.chunk(2, dim=-1)
    sigmoid = torch.sigmoid(gate)
    activated = gate * sigmoid  # silu'(g) = σ(g)(1 + g(1 − σ(g)))
    return activated * up, lambda d: torch.cat([d * up * sigmoid * (1 + gate * (1 - sigmoid)), d * activated], dim=-1)


def _gate_up_activation(name_and_numbers: str, spec: str) -> Callable[[Tensor, Tensor], Tensor]:
    name, *numbers = name_and_numbers.split(":")
    if name in UNARY and not numbers:
        act = UNARY[name]
        return lambda gate, up: act(gate) * up
    parametrized = {
        SOFTCAPPED: (_softcapped_silu, 2),
        CLAMPED_SILU: (_clamped_silu, 1),
        CLAMPED_SWIGLU: (_clamped_swiglu, 2),
    }
    function, count = parametrized.get(name, (None, -1))
    try:
        if len(numbers) == count:
            return partial(function, *map(float, numbers))
    except ValueError:  # not numbers
        pass
    raise ValueError(
        f"unknown expert activation {spec!r}: use one of {', '.join(UNARY)}, {SOFTCAPPED}:GATE_CAP:UP_CAP, "
        f"{CLAMPED_SILU}:LIMIT or {CLAMPED_SWIGLU}:ALPHA:LIMIT, each optionally followed by :{INTERLEAVED}"
    )


def _softcapped_silu(gate_cap: float, up_cap: float, gate: Tensor, up: Tensor) -> Tensor:
    g, u = gate.float(), up.float()
    capped = torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)
    return capped.to(gate.dtype)


def _clamped_silu(limit: float, gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _clamped_swiglu(alpha: float, limit: float, gate: Tensor, up: Tensor) -> Tensor:
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1.0) * (gate * torch.sigmoid(gate * alpha))


def spec(name: str, *numbers: float) -> str:
    """An activation's name with its numbers: ``spec("clamped_silu", 7.0) == "clamped_silu:7"``."""
    return ":".join([name, *(f"{number:.6g}" for number in numbers)])
