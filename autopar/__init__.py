"""autopar: find how to spread a PyTorch model over a device mesh, and run it there."""

from autopar import runtime  # noqa: F401, I001  (registers torch.ops.autopar.*, which captured and rewritten graphs call)
from autopar.api import capture, parallelize, plan
from autopar.ir import (
    AutoparError,
    CheckpointError,
    CollectiveError,
    ConfigError,
    DistributedError,
    IncompleteCheckpointError,
    MemoryLimitError,
    Mesh,
    MeshError,
    NonFiniteError,
    Partial,
    Plan,
    PlanOptions,
    Replicate,
    Shard,
    ShardingRuleError,
    StalePlanError,
    TraceError,
)

__all__ = [
    "AutoparError",
    "CheckpointError",
    "CollectiveError",
    "ConfigError",
    "DistributedError",
    "IncompleteCheckpointError",
    "MemoryLimitError",
    "Mesh",
    "MeshError",
    "NonFiniteError",
    "Partial",
    "Plan",
    "PlanOptions",
    "Replicate",
    "Shard",
    "ShardingRuleError",
    "StalePlanError",
    "TraceError",
    "capture",
    "parallelize",
    "plan",
]
