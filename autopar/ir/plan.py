"""The Plan: the contract between planning and running.

A plan says, for one captured graph on one mesh, how the devices split into parallel
dimensions, where every parameter and activation lives, which gradients are reduced over
which axes, and what the cost model predicts. It is plain data: ``str(plan)`` is a
readable table and ``Plan.load(plan.save(path))`` round-trips.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tabulate import tabulate

from autopar.ir.errors import AutoparError, ConfigError, InvalidPlanError, StalePlanError
from autopar.ir.mesh import Mesh
from autopar.ir.names import Axis, Kernel, PipelineKind, Recompute, fold_rows, folded_note
from autopar.ir.placement import Placement, format_placements, parse_placement
from autopar.ir.plan_schema import check_plan_json
from autopar.ir.precision import PrecisionPolicy

PLAN_FORMAT = 6  # 3: pipeline kind, virtual stages, cut points; 4: kernels (cp, ep); 5: precision; 6: compiled

# The mesh dimension each parallel kernel runs over (see :class:`Kernel`).
KERNEL_DIMS = {Kernel.RING: Axis.CP, Kernel.ULYSSES: Axis.CP, Kernel.EXPERTS: Axis.EP, Kernel.VOCAB: Axis.TP}

AxisPlacements = tuple[Placement, ...]  # one placement per parallel dimension of the plan


@dataclass(frozen=True)
class NodeDecision:
    """The chosen strategy of one graph node: where its inputs must be and where its output is."""

    op: str
    module: str
    inputs: tuple[AxisPlacements | None, ...]  # one per argument; None for non-tensors
    output: AxisPlacements | None  # None for nodes without a tensor output
    comm_bytes: float = 0.0  # bytes moved to bring inputs into place, per step (fwd + bwd)
    kernel: Kernel | str = ""  # the parallel kernel the node runs as, else ""


@dataclass(frozen=True)
class Cost:
    """Predicted per-step time (seconds) and per-device memory (bytes) of a plan."""

    compute_s: float
    comm_s: float  # exposed: collectives a rank waits for inside forward and backward
    grad_sync_s: float  # the part of gradient synchronization not hidden behind backward
    memory: dict[str, float]  # category → bytes per device
    optimizer_s: float = 0.0
    pipeline_s: float = 0.0  # pipeline bubble and the stage-boundary transfers on the critical path
    model_flops: float = 0.0  # the model's forward + backward FLOPs one device does per step (no recomputation)

    @property
    def model_flops_per_s(self) -> float:
        """Model FLOP/s per device (MFU's numerator): what the step achieves on the model's own work."""
        return self.model_flops / self.step_s if self.step_s else 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.grad_sync_s + self.optimizer_s + self.pipeline_s

    @property
    def peak_memory(self) -> float:
        """Model state and buffers stay all step; gradients are born in backward as the
        saved activations (and the temporaries at its start) die, so those two do not add."""
        m = self.memory
        transient = m.get("activations", 0.0) + m.get("temporary", 0.0)
        return self._steady_memory + max(transient, m.get("grads", 0.0))

    @property
    def state_memory(self) -> float:
        """The peak without activations and temporaries: weights, gradients, optimizer state and
        buffers, which no recomputation, accumulation or smaller batch changes."""
        return self._steady_memory + self.memory.get("grads", 0.0)

    @property
    def _steady_memory(self) -> float:
        return sum(v for k, v in self.memory.items() if k not in ("activations", "temporary", "grads"))


RECOMPUTE = tuple(Recompute)
PIPELINES = tuple(PipelineKind)
# several stage modules per device
VIRTUAL_PIPELINES = (PipelineKind.INTERLEAVED_1F1B, PipelineKind.INTERLEAVED_ZB, PipelineKind.ZBV)
# a backward split in two: input gradients, then weight gradients in a pass of their own
ZERO_BUBBLE_PIPELINES = (PipelineKind.INTERLEAVED_ZB, PipelineKind.ZBV)


@dataclass(frozen=True)
class Schedule:
    """How one step runs through the graph, beyond where tensors live.

    ``stages``: pipeline stages (devices along the outermost mesh dimension);
    ``microbatches``: the local batch runs in this many pieces, gradients accumulated;
    ``recompute``: activations autograd keeps — "none" all, "selective" only what matmuls and
    attention save (the rest is recomputed in backward), "selective-op" that but every second
    matmul's output (torchtitan's op-level policy), "full" only each layer's input;
    ``kind``: the pipeline schedule (one of :data:`PIPELINES`); ``virtual``: stage modules
    per device (2+ for the interleaved and V schedules); ``cuts``: the layer each stage module
    after the first starts with (``("layers.4",)``), empty for an even split of the layers;
    ``compiled``: each program runs through ``torch.compile`` with its communication scheduled
    for overlap (issued early, waited for late, bucketed: ``parallelize(..., compile=True)``),
    which the cost model prices (:mod:`autopar.passes.cost.replay`); ``async_tp``: compiled
    programs also run each tensor-parallel matmul in pieces with its collective
    (:mod:`autopar.passes.rewrite.async_tp`), priced piece by piece; ``regather``: linears
    of an all-gathered activation (a sequence-parallel norm's output) keep its shard and
    gather it again in backward, as Megatron-LM does (:mod:`autopar.passes.rewrite.regather`).
    """

    stages: int = 1
    microbatches: int = 1
    recompute: Recompute = Recompute.NONE
    kind: PipelineKind = PipelineKind.ONE_F_ONE_B
    virtual: int = 1
    cuts: tuple[str, ...] = ()
    compiled: bool = False
    async_tp: bool = False
    regather: bool = False

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute={self.recompute!r}: choose one of {[str(r) for r in RECOMPUTE]}")
        if self.kind not in PIPELINES:
            raise ConfigError(f"pipeline schedule {self.kind!r}: choose one of {[str(p) for p in PIPELINES]}")
        if (
            self.kind == PipelineKind.ZBV
            and self.virtual != 2
            or self.kind not in VIRTUAL_PIPELINES
            and self.virtual != 1
        ):
            raise ConfigError(
                f"schedule {self.kind!r} cannot run {self.virtual} stage modules per device (zbv runs 2, gpipe and "
                "1f1b 1)"
            )
        if self.async_tp and not self.compiled:
            raise ConfigError("async tensor parallelism runs in compiled programs only: pass compile=True with it")
        if self.regather and self.async_tp:
            raise ConfigError("regather and async_tp both rewrite the linears of a gathered input: choose one")
        if self.regather and self.recompute == Recompute.FULL:
            raise ConfigError(
                "recompute='full' keeps only each layer's input: there is no gathered input to regather; leave it off"
            )
        if self.regather and self.recompute == Recompute.SELECTIVE_OP:
            # regathered linears run as one op that is no matmul: the count of matmuls would shift
            raise ConfigError(
                "recompute='selective-op' recomputes every second matmul, and regather fuses linears with their "
                "gathers: choose one (recompute='selective' regathers)"
            )
        if self.cuts and len(self.cuts) != self.modules - 1:
            raise ConfigError(f"{self.modules} stage modules need {self.modules - 1} cut points, got {list(self.cuts)}")

    @property
    def modules(self) -> int:
        """Stage modules in the whole pipeline."""
        return self.stages * self.virtual

    def device_modules(self) -> list[list[int]]:
        """The stage modules each pipeline device runs, in order: a loop (device d: d, d + p,
        ...) or, for zbv, a V (d and 2p − 1 − d). The one mapping the cost model, the stage
        split, the timeline and the runtime use."""
        p = self.stages
        if self.kind == PipelineKind.ZBV:
            return [[d, 2 * p - 1 - d] for d in range(p)]
        return [[d + i * p for i in range(self.virtual)] for d in range(p)]

    def device_of(self, module: int) -> int:
        """The pipeline device that runs stage module ``module``."""
        return next(d for d, modules in enumerate(self.device_modules()) if module in modules)

    def __str__(self) -> str:
        parts = [f"{self.microbatches} microbatch(es)", f"recompute {self.recompute}"]
        if self.stages > 1:
            virtual = f" x {self.virtual} virtual" if self.virtual > 1 else ""
            parts.insert(0, f"{self.stages} stages{virtual}, {self.kind}")
        if self.compiled:
            parts.append("compiled, async TP" if self.async_tp else "compiled")
        if self.regather:
            parts.append("gathered inputs regathered")
        return ", ".join(parts)


@dataclass(frozen=True)
class Plan:
    mesh: Mesh
    degrees: dict[str, int]  # parallel dimension → size, outermost first
    nodes: dict[str, NodeDecision]
    params: dict[str, AxisPlacements]  # parameter name → placement per parallel dimension
    grad_sync: dict[str, tuple[str, ...]]  # parameter name → dimensions its gradient is summed over
    inputs: dict[str, AxisPlacements]  # user input name → placement
    cost: Cost
    fingerprint: str
    hardware: str
    batch_size: int
    search: tuple[dict, ...] = ()  # every configuration tried, with its predicted cost
    search_time_s: float = 0.0
    replicated_ops: tuple[str, ...] = ()  # ops without a sharding rule, run replicated
    zero: int = 0  # ZeRO stage over the data-parallel axis: 1 optimizer state, 2 + gradients, 3 + weights
    schedule: Schedule = Schedule()
    precision: str = "fp32"  # what it trains in: an autopar.ir.Precision (autopar.ir.precision)
    reduce_dtype: str = "float32"  # the dtype gradients are reduced in
    format: int = PLAN_FORMAT

    @property
    def precision_policy(self) -> PrecisionPolicy:
        """What the runtime computes, reduces and keeps in (:mod:`autopar.ir.precision`)."""
        return PrecisionPolicy.of(self.precision, self.reduce_dtype)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.degrees)

    @property
    def full_degrees(self) -> dict[str, int]:
        """Every dimension of the mesh, outermost first: the pipeline stages as ``pp`` when there
        are several (the outermost, as the runtime lays ranks out), then ``degrees``; what
        ``PlanOptions`` pins to run this plan again."""
        stages = self.schedule.stages
        return {**({Axis.PP: stages} if stages > 1 else {}), **self.degrees}

    # -- persistence -------------------------------------------------------------------
    def to_json(self) -> dict:
        data = asdict(self)
        data["mesh"] = {"shape": list(self.mesh.shape), "device_type": self.mesh.device_type}
        data["nodes"] = {
            name: {**asdict(node), "inputs": [_dump(p) for p in node.inputs], "output": _dump(node.output)}
            for name, node in self.nodes.items()
        }
        data["params"] = {name: _dump(p) for name, p in self.params.items()}
        data["inputs"] = {name: _dump(p) for name, p in self.inputs.items()}
        return data

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        """The plan ``to_json`` wrote; :class:`InvalidPlanError` naming the field that is not
        well formed (:mod:`autopar.ir.plan_schema`), :class:`StalePlanError` for another format."""
        if isinstance(data, dict) and data.get("format") != PLAN_FORMAT:
            raise StalePlanError(
                f"plan file has format {data.get('format')!r}, this autopar reads format {PLAN_FORMAT}: re-run "
                "autopar.plan"
            )
        check_plan_json(data)
        nodes = {
            name: NodeDecision(
                op=node["op"],
                module=node["module"],
                inputs=tuple(_load(p) for p in node["inputs"]),
                output=_load(node["output"]),
                comm_bytes=node["comm_bytes"],
                kernel=node["kernel"],
            )
            for name, node in data["nodes"].items()
        }
        return cls(
            mesh=Mesh(tuple(data["mesh"]["shape"]), data["mesh"]["device_type"]),
            degrees=dict(data["degrees"]),
            nodes=nodes,
            params={name: _load(p) for name, p in data["params"].items()},
            grad_sync={name: tuple(axes) for name, axes in data["grad_sync"].items()},
            inputs={name: _load(p) for name, p in data["inputs"].items()},
            cost=Cost(**data["cost"]),
            fingerprint=data["fingerprint"],
            hardware=data["hardware"],
            batch_size=data["batch_size"],
            search=tuple(data["search"]),
            search_time_s=data["search_time_s"],
            replicated_ops=tuple(data["replicated_ops"]),
            zero=data["zero"],
            schedule=_schedule(data["schedule"]),
            precision=data["precision"],
            reduce_dtype=data.get("reduce_dtype", "float32"),  # plans saved before it was recorded reduced in fp32
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file; an error names the file and what is wrong in it."""
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as error:
            raise InvalidPlanError(f"{path}: not JSON ({error}): re-save the plan with autopar plan --save") from None
        except AutoparError as error:
            raise type(error)(f"{path}: {error}") from None

    # -- display -----------------------------------------------------------------------
    def __str__(self) -> str:
        pipeline = {"pp": self.schedule.stages} if self.schedule.stages > 1 else {}
        degrees = " x ".join(f"{dim}={size}" for dim, size in (pipeline | self.degrees).items())
        rows = fold_rows(
            [
                {
                    "parameter": name,
                    "placement": format_placements(placement),
                    "grad": "+".join(self.grad_sync.get(name, ())) or "-",
                }
                for name, placement in self.params.items()
            ],
            field="parameter",
        )
        table = tabulate(
            [list(row.values()) for row in rows], headers=["parameter", "placement " + str(self.axes), "grad sum over"]
        )
        folded = folded_note([row["parameter"] for row in rows], "plan.params lists")
        table += f"\n{folded}" if folded else ""
        memory = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.cost.memory.items())
        return (
            f"Plan for mesh {self.mesh} ({degrees}{f', ZeRO-{self.zero}' if self.zero else ''}"
            f", {self.precision}) on {self.hardware}, "
            f"global batch {self.batch_size}\n"
            f"schedule: {self.schedule}\n"
            f"predicted step {self.cost.step_s * 1e3:.2f} ms (compute {self.cost.compute_s * 1e3:.2f}, "
            f"communication {self.cost.comm_s * 1e3:.2f}, gradient sync {self.cost.grad_sync_s * 1e3:.2f}, "
            f"optimizer {self.cost.optimizer_s * 1e3:.2f}, pipeline bubble {self.cost.pipeline_s * 1e3:.2f}); "
            f"memory per device: {memory}\n{table}"
        )


def _schedule(data: dict) -> Schedule:
    try:
        return Schedule(**{**data, "cuts": tuple(data["cuts"])})
    except ConfigError as error:  # the schedule's own invariants, e.g. cut points per stage module
        raise InvalidPlanError(f"field 'schedule': {error}") from None


def _dump(placements: AxisPlacements | None) -> list[str] | None:
    return None if placements is None else [str(p) for p in placements]


def _load(placements: list[str] | None) -> AxisPlacements | None:
    return None if placements is None else tuple(parse_placement(p) for p in placements)
