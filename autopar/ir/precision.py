"""Mixed precision: the policy a plan trains under, and what it keeps per parameter.

The one definition the cost model (``passes.cost``: model-state memory) and the runtime
(``runtime``: master weights, compute copies, gradient reduction, loss scaling) share.
``Precision`` names the policy (:class:`autopar.ir.names.Precision`); :class:`PrecisionPolicy`
spells it in FSDP2's terms: ``param_dtype`` for the compute copies, ``reduce_dtype`` for the
gradient reduction, fp32 master weights and optimizer state, and loss scaling for fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir.errors import ConfigError
from autopar.ir.names import Precision

_COMPUTE_DTYPE = {Precision.FP32: "float32", Precision.BF16_MIXED: "bfloat16", Precision.FP16_MIXED: "float16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PrecisionPolicy:
    """How a step computes, reduces and keeps state.

    >>> PrecisionPolicy.of("bf16-mixed").param_dtype
    'bfloat16'
    """

    precision: Precision = Precision.FP32
    param_dtype: str = "float32"  # the dtype of the copies forward and backward compute with
    reduce_dtype: str = "float32"  # the dtype gradients are reduced (all-reduced, reduce-scattered) in
    loss_scaling: bool = False  # fp16: dynamic loss scaling (torch.amp.GradScaler's rules)

    @classmethod
    def of(cls, precision: str | Precision, reduce_dtype: str | None = None) -> PrecisionPolicy:
        if precision not in tuple(Precision):
            raise ConfigError(f"precision={precision!r}: choose one of {[str(p) for p in Precision]}")
        if reduce_dtype is not None and reduce_dtype not in DTYPE_BYTES:
            raise ConfigError(f"reduce_dtype={reduce_dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
        precision = Precision(precision)
        return cls(precision, _COMPUTE_DTYPE[precision], reduce_dtype or "float32", precision == Precision.FP16_MIXED)

    @property
    def mixed(self) -> bool:
        return self.precision != Precision.FP32


# Bytes per parameter element for Adam(W): weight, gradient, optimizer state. fp32 keeps two
# moments; mixed precision (the ZeRO paper's K=12) keeps 16-bit weights and gradients, and an
# fp32 master copy and two moments in the optimizer.
_STATE_BYTES = {
    False: {"params": 4, "grads": 4, "optimizer": 8},
    True: {"params": 2, "grads": 2, "optimizer": 12},
}


def model_state_bytes(
    params: float, *, precision: str | Precision = Precision.FP32, zero_stage: int = 0, data_parallel: int = 1
) -> dict[str, float]:
    """Per-device bytes of weights, gradients and optimizer state (ZeRO paper, Rajbhandari et al.).

    Stage 1 shards the optimizer state over the data-parallel ranks, stage 2 the gradients
    too, stage 3 the weights too. Mixed precision, 7.5e9 parameters, 64 ranks:
    120 / 31.4 / 16.6 / 1.88 GB for stages 0-3.

    >>> round(sum(model_state_bytes(7.5e9, precision="bf16-mixed", zero_stage=1, data_parallel=64).values()) / 1e9, 1)
    31.4
    """
    mixed = PrecisionPolicy.of(precision).mixed
    per = dict(_STATE_BYTES[mixed])
    if not mixed and zero_stage in (1, 2) and data_parallel > 1:
        per["optimizer"] += per["params"]  # the optimizer steps a copy of its chunk (fp32 has no master copy to reuse)
    sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}[zero_stage]
    return {kind: params * nbytes / (data_parallel if kind in sharded else 1) for kind, nbytes in per.items()}
