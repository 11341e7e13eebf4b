"""autopar's intermediate representation: mesh, placements, hardware, plan, errors.

This package imports nothing else of autopar; everything else imports it.
"""

from autopar.ir.errors import (
    AutoparError,
    CheckpointError,
    CollectiveError,
    CompileError,
    ConfigError,
    DistributedError,
    IncompleteCheckpointError,
    InputError,
    InvalidPlanError,
    MemoryLimitError,
    MeshError,
    NonFiniteError,
    ShardingRuleError,
    StalePlanError,
    TraceError,
)
from autopar.ir.hardware import PROFILES, HardwareProfile, KernelFigures, LinkTier, get_profile
from autopar.ir.mesh import BATCH_DIMS, PARALLEL_DIMS, Mesh, batch_split, check_degrees, degree_choices
from autopar.ir.names import OP_NAMESPACE, Axis, Kernel, PipelineKind, Precision, Recompute, layer_of, module_label
from autopar.ir.options import PlanOptions
from autopar.ir.placement import Partial, Placement, Replicate, Shard, format_placements, parse_placement
from autopar.ir.plan import (
    KERNEL_DIMS,
    PIPELINES,
    RECOMPUTE,
    VIRTUAL_PIPELINES,
    ZERO_BUBBLE_PIPELINES,
    Cost,
    NodeDecision,
    Plan,
    Schedule,
)
from autopar.ir.precision import PrecisionPolicy, model_state_bytes

__all__ = [
    "BATCH_DIMS",
    "KERNEL_DIMS",
    "OP_NAMESPACE",
    "module_label",
    "PARALLEL_DIMS",
    "PIPELINES",
    "PROFILES",
    "RECOMPUTE",
    "VIRTUAL_PIPELINES",
    "ZERO_BUBBLE_PIPELINES",
    "AutoparError",
    "CompileError",
    "Axis",
    "CheckpointError",
    "CollectiveError",
    "ConfigError",
    "InputError",
    "InvalidPlanError",
    "Cost",
    "DistributedError",
    "IncompleteCheckpointError",
    "HardwareProfile",
    "Kernel",
    "KernelFigures",
    "LinkTier",
    "MemoryLimitError",
    "Mesh",
    "MeshError",
    "NodeDecision",
    "NonFiniteError",
    "Partial",
    "PipelineKind",
    "Placement",
    "Plan",
    "PlanOptions",
    "Precision",
    "PrecisionPolicy",
    "Recompute",
    "Replicate",
    "Schedule",
    "Shard",
    "ShardingRuleError",
    "StalePlanError",
    "TraceError",
    "batch_split",
    "check_degrees",
    "degree_choices",
    "format_placements",
    "get_profile",
    "layer_of",
    "model_state_bytes",
    "parse_placement",
]
