"""The experts' gated activations: what ``autopar::moe`` and ``moe_experts`` compute between an
expert's two matmuls, ``hidden = glu(gate, up)`` with ``gate, up = (gate_up[e] @ x).chunk(2)``,
named by the string the ops take (``activation``), so the graph, the plan and every rank agree:

- ``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"relu"``: ``act(gate) · up`` (SwiGLU: Mixtral's,
  Qwen3-MoE's, DeepSeek-V3's experts; GeGLU; ReGLU);
- ``"softcapped_silu:G:U"``: ``cap_G(gate) · σ(gate) · cap_U(up)`` in fp32, ``cap_c(v) = c·tanh(v / c)``
  (Inkling-2's softcapped SwiGLU).

The ops' backward differentiates the same function (``torch.func.vjp``), so an entry is its forward only.
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
SOFTCAPPED = "softcapped_silu"


def gated_activation(spec: str) -> Callable[[Tensor, Tensor], Tensor]:
    """``glu(gate, up)`` for an activation named as the module docstring says.

    >>> gated_activation("softcapped_silu:4.0:25.0")(torch.zeros(1), torch.ones(1))
    tensor([0.])
    """
    name, *caps = spec.split(":")
    if name in UNARY and not caps:
        act = UNARY[name]
        return lambda gate, up: act(gate) * up
    if name == SOFTCAPPED and len(caps) == 2:
        try:
            return partial(_softcapped_silu, *map(float, caps))
        except ValueError:
            pass
    raise ValueError(
        f"unknown expert activation {spec!r}: use one of {', '.join(UNARY)} or {SOFTCAPPED}:GATE_CAP:UP_CAP"
    )


def _softcapped_silu(gate_cap: float, up_cap: float, gate: Tensor, up: Tensor) -> Tensor:
    g, u = gate.float(), up.float()
    capped = torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)
    return capped.to(gate.dtype)


def softcapped_spec(gate_cap: float, up_cap: float) -> str:
    return f"{SOFTCAPPED}:{gate_cap:.6g}:{up_cap:.6g}"
