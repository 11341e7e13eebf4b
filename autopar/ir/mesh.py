"""The physical device mesh a user gives, and the logical layout a plan maps onto it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.ir.errors import ConfigError, MeshError
from autopar.ir.names import Axis

# Parallel dimensions inside a pipeline stage, outermost first. The innermost (tensor parallel)
# lands on neighbouring ranks, which share a node on real clusters. dp and tp are always present;
# ep (experts, which also splits the batch) and cp (the sequence) only where a plan uses them.
PARALLEL_DIMS = (Axis.DP, Axis.EP, Axis.CP, Axis.TP)
ALWAYS_PRESENT = (Axis.DP, Axis.TP)
BATCH_DIMS = (Axis.DP, Axis.EP)  # the dimensions that split the batch


@dataclass(frozen=True)
class Mesh:
    """A grid of devices, outermost axis first: ``Mesh((2, 4))`` is 2 nodes of 4 devices.

    >>> Mesh.parse("2x4").size
    8
    """

    shape: tuple[int, ...]
    device_type: str = "cpu"

    def __post_init__(self):
        if not self.shape or any(not isinstance(n, int) or n < 1 for n in self.shape):
            raise MeshError(f"mesh shape {self.shape!r} must be positive integers, e.g. (2, 4)")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def devices_per_node(self) -> int:
        """Devices sharing the fastest link tier: the innermost axis."""
        return self.shape[-1]

    def __str__(self) -> str:
        return "x".join(map(str, self.shape))

    @classmethod
    def parse(cls, text: str, device_type: str = "cpu") -> Mesh:
        try:
            shape = tuple(int(part) for part in str(text).lower().split("x"))
        except ValueError:
            raise MeshError(f"cannot read mesh {text!r}: write sizes joined by 'x', e.g. 2x4") from None
        return cls(shape, device_type)

    @classmethod
    def of(cls, mesh: Mesh | str | int | tuple[int, ...]) -> Mesh:
        """Accept a Mesh, ``"2x2"``, ``4``, ``(2, 2)`` or a torch DeviceMesh."""
        if isinstance(mesh, Mesh):
            return mesh
        if isinstance(mesh, str):
            return cls.parse(mesh)
        if isinstance(mesh, int):
            return cls((mesh,))
        if isinstance(mesh, tuple):
            return cls(mesh)
        if hasattr(mesh, "device_type") and hasattr(mesh, "shape"):  # torch DeviceMesh
            return cls(tuple(mesh.shape), mesh.device_type)
        raise MeshError(f"cannot use {mesh!r} as a mesh: pass autopar.Mesh, '2x2', an int or a DeviceMesh")


def check_degrees(degrees: dict[str, int], world: int) -> dict[str, int]:
    """Complete and validate a degrees dict for ``world`` devices, in PARALLEL_DIMS order."""
    unknown = set(degrees) - set(PARALLEL_DIMS)
    if unknown:
        raise ConfigError(
            f"unknown parallel dimension(s) {sorted(unknown)} in degrees; this version supports {list(PARALLEL_DIMS)}"
        )
    fixed = math.prod(degrees.values())
    missing = [dim for dim in ALWAYS_PRESENT if dim not in degrees]
    full = dict(degrees)
    if world % fixed:
        raise ConfigError(f"degrees {degrees} multiply to {fixed}, which does not divide the {world} devices")
    if len(missing) == 1:
        full[missing[0]] = world // fixed
    elif missing:
        full.update({dim: 1 for dim in missing})
        full[Axis.DP] = full[Axis.DP] * (world // math.prod(full.values()))
    if math.prod(full.values()) != world:
        raise ConfigError(f"degrees {full} multiply to {math.prod(full.values())}, but the mesh has {world} devices")
    return {str(dim): full[dim] for dim in PARALLEL_DIMS if dim in ALWAYS_PRESENT or full.get(dim, 1) > 1}


def degree_choices(world: int, optional: tuple[str, ...] = ()) -> list[dict[str, int]]:
    """Every way to split ``world`` devices into dp, tp and the ``optional`` dimensions
    (each of those present only with a degree above 1)."""
    dims = [dim for dim in PARALLEL_DIMS if dim in ALWAYS_PRESENT or dim in optional]
    choices = [{}]
    for dim in dims:
        choices = [{**c, dim: d} for c in choices for d in _divisors(world // math.prod(c.values()))]
    full = [c for c in choices if math.prod(c.values()) == world]
    return [{str(dim): n for dim, n in c.items() if dim in ALWAYS_PRESENT or n > 1} for c in full]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def batch_split(degrees: dict[str, int]) -> int:
    """How many ways the global batch is split: data and expert parallelism both split it."""
    return math.prod(degrees.get(dim, 1) for dim in BATCH_DIMS)
