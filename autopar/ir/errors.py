"""User-facing errors. Each names the node, module, option or file at fault and says what to do."""


class AutoparError(ValueError):
    """Base class of every error a user can cause and fix."""


class TraceError(AutoparError):
    """The model could not be captured as a graph."""


class ShardingRuleError(AutoparError):
    """An op has no usable sharding rule, or a constraint asks for an impossible placement."""


class MeshError(AutoparError):
    """The mesh does not match the world, the degrees or the model."""


class MemoryLimitError(AutoparError):
    """No plan fits in the per-device memory limit."""


class StalePlanError(AutoparError):
    """A saved plan was made for another graph, mesh or version."""


class ConfigError(AutoparError):
    """An option has a value autopar cannot use (unknown hardware profile, bad degrees, ...)."""


class InvalidPlanError(AutoparError):
    """A plan no graph can run: a plan file edited into nonsense, or placements its model cannot take."""


class InputError(AutoparError):
    """Inputs of another count, dtype, rank or shape than the plan was made for."""


class CompileError(AutoparError):
    """``torch.compile`` cannot compile a per-rank program in one graph (names the node)."""


class CheckpointError(AutoparError):
    """A checkpoint cannot be loaded here: it is of another model, or incomplete."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint is missing, its write never finished, or a file of it is missing or truncated."""


class DistributedError(RuntimeError):
    """The ranks of a job can no longer work together: a peer raised, died or stalled past the
    process-group timeout. Every rank raises one; its message names the ranks and the collective."""


class CollectiveError(DistributedError):
    """A collective failed on this rank: it timed out, or a peer left it (died or raised)."""


class NonFiniteError(FloatingPointError):
    """``check_finite=True`` found a NaN or infinity in the loss or a gradient; the message names
    the parameters."""
