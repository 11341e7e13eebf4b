"""autopar: find how to spread a PyTorch model over a device mesh, and run it there."""

from .ir import (
    AutoparError,
    ConfigError,
    MemoryLimitError,
    MeshError,
    Mesh,
    Partial,
    Plan,
    Replicate,
    Shard,
    ShardingRuleError,
    StalePlanError,
    TraceError,
)
from . import runtime  # noqa: F401  (registers torch.ops.autopar.*, which captured and rewritten graphs call)
from .api import parallelize, plan
