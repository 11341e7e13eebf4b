"""Mixed precision: the policy a plan trains under, and what it keeps per parameter.

The one definition the cost model (``passes.cost``: model-state memory) and the runtime
(``runtime.mixed_precision``: master weights, compute copies, gradient reduction, loss
scaling) share. ``Precision`` names the policy (:class:`autopar.ir.names.Precision`);
:class:`PrecisionPolicy` spells it in FSDP2's terms (``MixedPrecisionPolicy``): ``param_dtype``
for the compute copies, ``reduce_dtype`` for the gradient reduction, fp32 master weights and
optimizer state, and dynamic loss scaling for fp16.

What a rank holds per parameter element is data (:data:`LAYOUTS`): each tensor the runtime
keeps, its bytes, and the ZeRO stage from which it is split over the data-parallel ranks.
:func:`model_state_bytes` adds them up; a test measures the runtime against it.
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

    - ``param_dtype``: the dtype of the copies forward and backward compute with (the graph is
      captured in it); "float32" means no copies: the model trains in its own dtype.
    - ``reduce_dtype``: the dtype parameter gradients are reduced (all-reduced, reduce-scattered) in.
    - ``loss_scaling``: fp16's dynamic loss scaling (``torch.amp.GradScaler``'s rules).

    >>> PrecisionPolicy.of("bf16-mixed").param_dtype
    'bfloat16'
    >>> PrecisionPolicy.of("fp16-mixed", reduce_dtype="float16").loss_scaling
    True
    """

    precision: Precision = Precision.FP32
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    loss_scaling: bool = False

    @classmethod
    def of(cls, precision: str | Precision, reduce_dtype: str | None = None) -> PrecisionPolicy:
        """The policy a precision name means; ``reduce_dtype`` defaults to "float32"."""
        if precision not in tuple(Precision):
            raise ConfigError(f"precision={precision!r}: choose one of {[str(p) for p in Precision]}")
        if reduce_dtype is not None and reduce_dtype not in DTYPE_BYTES:
            raise ConfigError(f"reduce_dtype={reduce_dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
        precision = Precision(precision)
        return cls(precision, _COMPUTE_DTYPE[precision], reduce_dtype or "float32", precision == Precision.FP16_MIXED)

    @property
    def mixed(self) -> bool:
        return self.precision != Precision.FP32


@dataclass(frozen=True)
class Held:
    """One tensor a rank keeps for each parameter element: its memory category ("params",
    "grads" or "optimizer"), bytes per element, the ZeRO stage from which it is split over the
    data-parallel ranks (1 optimizer state, 2 gradients, 3 weights) and the stages it exists at."""

    category: str
    what: str
    nbytes: int
    split_from: int
    stages: tuple[int, ...] = (0, 1, 2, 3)


# What autopar's runtime holds (runtime/module.py, runtime/zero, runtime/mixed_precision.py),
# for Adam(W). ZeRO-1/2 step a copy of this rank's chunk of each weight and all-gather it back
# into the whole weight (runtime/zero/layout.py), so they keep that chunk besides the weight.
# Counted at the end of backward, the step's peak of model state (ZeRO-1's optimizer copies
# out its gradient chunks only in ``step()``, until ``zero_grad``).
# Mixed precision keeps FSDP2's layout: the fp32 master is the parameter (a DTensor), gradients
# land on it in fp32, and a 16-bit copy of the master (of its ZeRO-3 shard) is what the
# program computes with, cast afresh at each call of the module (once per step).
LAYOUTS: dict[bool, tuple[Held, ...]] = {
    False: (
        Held("params", "weight", 4, split_from=3),
        Held("grads", "gradient", 4, split_from=2),
        Held("optimizer", "Adam's two moments", 8, split_from=1),
        Held("optimizer", "the chunk the optimizer steps", 4, split_from=1, stages=(1, 2)),
    ),
    True: (
        Held("params", "fp32 master weight", 4, split_from=3),
        Held("params", "16-bit compute copy", 2, split_from=3),
        Held("grads", "fp32 gradient of the master", 4, split_from=2),
        Held("optimizer", "Adam's two moments", 8, split_from=1),
        Held("optimizer", "the fp32 chunk the optimizer steps", 4, split_from=1, stages=(1, 2)),
    ),
}

# DeepSpeed's mixed-precision layout as the ZeRO paper counts it (Rajbhandari et al., K=12):
# 16-bit weights and gradients, fp32 master weight and two moments in the optimizer. Not what
# autopar holds (its gradients are fp32, reduced in fp32 by default): for checking the ZeRO
# stage rule against the paper's worked example.
ZERO_PAPER_LAYOUT: tuple[Held, ...] = (
    Held("params", "16-bit weight", 2, split_from=3),
    Held("grads", "16-bit gradient", 2, split_from=2),
    Held("optimizer", "fp32 master weight and two moments", 12, split_from=1),
)


def model_state_bytes(
    params: float,
    *,
    precision: str | Precision = Precision.FP32,
    zero_stage: int = 0,
    data_parallel: int = 1,
    layout: tuple[Held, ...] | None = None,
) -> dict[str, float]:
    """Per-device bytes of weights, gradients and optimizer state of ``params`` elements.

    Stage 1 splits the optimizer state over the data-parallel ranks, stage 2 the gradients
    too, stage 3 the weights too (ZeRO); with one data-parallel rank nothing is split.
    ``layout`` defaults to what autopar's runtime holds at ``precision`` (:data:`LAYOUTS`).
    The ZeRO paper's example, 7.5e9 parameters on 64 ranks: 120 / 31.4 / 16.6 / 1.88 GB.

    >>> model_state_bytes(1000, precision="bf16-mixed")
    {'params': 6000.0, 'grads': 4000.0, 'optimizer': 8000.0}
    >>> round(sum(model_state_bytes(7.5e9, zero_stage=1, data_parallel=64, layout=ZERO_PAPER_LAYOUT).values()) / 1e9, 1)
    31.4
    """
    if layout is None:
        layout = LAYOUTS[PrecisionPolicy.of(precision).mixed]
    stage = zero_stage if data_parallel > 1 else 0  # ZeRO has nothing to split over one rank
    held = dict.fromkeys(("params", "grads", "optimizer"), 0.0)
    for tensor in layout:
        if stage in tensor.stages:
            split = data_parallel if stage >= tensor.split_from else 1
            held[tensor.category] += params * tensor.nbytes / split
    return held
