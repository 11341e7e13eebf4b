"""The planning options: what a user may pin, as one frozen object.

``autopar.plan``, ``autopar.parallelize``, the CLI and the search all take this one object
(the API also takes its fields as keywords), so an option is named, checked and documented
once, here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from autopar.ir.errors import ConfigError
from autopar.ir.hardware import HardwareProfile, get_profile
from autopar.ir.mesh import PARALLEL_DIMS
from autopar.ir.names import Axis, PipelineKind, Precision, Recompute
from autopar.ir.placement import Placement
from autopar.ir.plan import Schedule
from autopar.ir.precision import PrecisionPolicy


@dataclass(frozen=True)
class PlanOptions:
    """What the search may not choose by itself; ``None`` (or empty) lets it choose.

    - ``degrees``: parallel sizes, e.g. ``{"dp": 2, "tp": 2}``; ``"pp"`` pins pipeline stages
      over the outermost mesh dimension.
    - ``constraints``: placements on the tensor-parallel axis by parameter or module name
      pattern (``{"layers.*.attn_norm": "S(1)"}``), or a parallel kernel by module
      (``{"layers.*.attn": "ring"}``).
    - ``hardware``: a profile name (``"a100-80gb"``), a profile JSON path or a
      :class:`HardwareProfile`; ``None`` is this machine's preset.
    - ``memory_limit``: bytes per device (default: the profile's memory).
    - ``zero``: the ZeRO stage 0-3 over the data-parallel axis (default: the fastest that fits; the
      lowest of those within the tie tolerance, :mod:`autopar.passes.search.ranking`).
    - ``recompute``: activation recomputation (default: the fastest that fits; the least of those
      within the tie tolerance).
    - ``microbatches``: pieces the local batch runs in (pipeline microbatches, gradient accumulation).
    - ``pipeline``: the pipeline schedule (default: the fastest that fits).
    - ``virtual``: stage modules per device of the interleaved schedules (Megatron's virtual
      pipeline stages; zbv runs 2; default: the fastest that fits).
    - ``stage_cuts``: the layers that start each stage module after the first
      (``("layers.6",)``; default: Alpa's balanced split).
    - ``precision``: "fp32", "bf16-mixed" or "fp16-mixed" (default: the hardware profile's
      natural choice, ``HardwareProfile.precision``); see :mod:`autopar.ir.precision`.
    - ``compile``: run each program through ``torch.compile`` with its communication scheduled
      for overlap (:attr:`Schedule.compiled`); the cost model prices that schedule.
    - ``async_tp``: with ``compile``, run each tensor-parallel matmul in pieces with the
      collective before or after it, one piece's communication behind another's matmul
      (:attr:`Schedule.async_tp`; opt-in, as torchtitan's and Megatron's TP overlap are).
    - ``regather``: linears of an all-gathered activation keep its shard and gather it again in
      backward (:attr:`Schedule.regather`; Megatron-LM's sequence parallelism); default: where
      memory needs it, weighed against recomputation.
    - ``reduce_dtype``: the dtype gradients are reduced in (default "float32").

    >>> PlanOptions(degrees={"dp": 2, "tp": 2}, zero=1).zero
    1
    """

    degrees: Mapping[str, int] | None = None
    constraints: Mapping[str, str | Placement] | None = None
    hardware: str | HardwareProfile | None = None
    memory_limit: float | None = None
    zero: int | None = None
    recompute: Recompute | None = None
    microbatches: int | None = None
    pipeline: PipelineKind | None = None
    virtual: int | None = None
    stage_cuts: tuple[str, ...] = ()
    precision: Precision | None = None
    compile: bool = False
    async_tp: bool = False
    regather: bool | None = None
    reduce_dtype: str | None = None

    def __post_init__(self):
        known = (Axis.PP, *PARALLEL_DIMS)
        unknown = sorted(set(self.degrees or {}) - set(known))
        if unknown:
            raise ConfigError(
                f"degrees: unknown parallel dimension(s) {unknown}; choose from {[str(a) for a in known]}"
            )
        if any(not isinstance(size, int) or size < 1 for size in (self.degrees or {}).values()):
            raise ConfigError(f"degrees={dict(self.degrees)}: each size must be a positive integer")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero={self.zero!r}: the ZeRO stage is 0, 1, 2 or 3")
        if self.recompute is not None and self.recompute not in tuple(Recompute):
            raise ConfigError(f"recompute={self.recompute!r}: choose one of {[str(r) for r in Recompute]}")
        if self.pipeline is not None and self.pipeline not in tuple(PipelineKind):
            raise ConfigError(f"pipeline={self.pipeline!r}: choose one of {[str(p) for p in PipelineKind]}")
        if self.virtual is not None and (not isinstance(self.virtual, int) or self.virtual < 1):
            raise ConfigError(f"virtual={self.virtual!r}: pass a positive integer (stage modules per device)")
        if self.virtual is not None and self.pipeline is not None:  # the schedule's rule for its stage modules
            Schedule(2, 2, kind=self.pipeline, virtual=self.virtual)
        PrecisionPolicy.of(self.precision or Precision.FP32, self.reduce_dtype)  # a ConfigError naming a bad one
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ConfigError(f"microbatches={self.microbatches!r}: pass a positive integer")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise ConfigError(f"memory_limit={self.memory_limit!r}: pass a positive number of bytes")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile={self.compile!r}: pass True or False")
        if not isinstance(self.async_tp, bool):
            raise ConfigError(f"async_tp={self.async_tp!r}: pass True or False")
        if self.async_tp and not self.compile:
            raise ConfigError("async_tp=True runs in compiled programs only: pass compile=True with it")
        if self.regather not in (None, True, False):
            raise ConfigError(f"regather={self.regather!r}: pass True, False or None (the search decides)")
        if self.regather:  # what no schedule runs with it (Schedule's rules)
            Schedule(
                recompute=self.recompute or Recompute.NONE, compiled=self.compile, async_tp=self.async_tp, regather=True
            )
        object.__setattr__(self, "stage_cuts", tuple(self.stage_cuts or ()))

    @classmethod
    def of(cls, options: PlanOptions | None = None, **overrides) -> PlanOptions:
        """``options`` with ``overrides`` (the API's keyword arguments) applied; an unknown
        keyword is a :class:`ConfigError` naming the known ones."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ConfigError(f"unknown planning option(s) {unknown}: the options are {sorted(fields)}")
        return dataclasses.replace(options or cls(), **overrides)

    @property
    def profile(self) -> HardwareProfile:
        """The hardware profile the options name, as the program runs on it (compiled or eager)."""
        return get_profile(self.hardware).running(self.compile)

    @property
    def precision_policy(self) -> PrecisionPolicy:
        """The precision the plan trains in: ``precision``, else the hardware profile's natural
        choice (bf16-mixed on the A100/H100/H200 presets, fp32 on the CPU ones), with
        ``reduce_dtype``. The one place that default is taken.

        >>> PlanOptions(hardware="a100-80gb").precision_policy.param_dtype
        'bfloat16'
        """
        return PrecisionPolicy.of(self.precision or self.profile.precision, self.reduce_dtype)

    @property
    def stages(self) -> int | None:
        """The pinned pipeline stages, or None."""
        return (self.degrees or {}).get(Axis.PP)

    @property
    def intra_stage_degrees(self) -> dict[str, int]:
        """The pinned degrees inside a pipeline stage (all but ``pp``)."""
        return {axis: size for axis, size in (self.degrees or {}).items() if axis != Axis.PP}
