"""autopar's intermediate representation: mesh, placements, hardware, plan, errors.

This package imports nothing else of autopar; everything else imports it.
"""

from .errors import (
    AutoparError,
    ConfigError,
    MemoryLimitError,
    MeshError,
    ShardingRuleError,
    StalePlanError,
    TraceError,
)
from .hardware import PROFILES, HardwareProfile, LinkTier, get_profile
from .mesh import BATCH_DIMS, CONTEXT_PARALLEL, PARALLEL_DIMS, Mesh, batch_split, check_degrees, degree_choices
from .placement import Partial, Placement, Replicate, Shard, format_placements, parse_placement
from .plan import KERNEL_DIMS, PIPELINES, RECOMPUTE, VIRTUAL_PIPELINES, Cost, NodeDecision, Plan, Schedule
