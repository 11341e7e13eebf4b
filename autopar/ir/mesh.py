"""The physical device mesh a user gives, and the logical layout a plan maps onto it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError, MeshError

# Parallel dimensions, outermost first. The innermost (tensor parallel) lands on
# neighbouring ranks, which share a node on real clusters.
PARALLEL_DIMS = ("dp", "tp")


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
    def parse(cls, text: str, device_type: str = "cpu") -> "Mesh":
        try:
            shape = tuple(int(part) for part in str(text).lower().split("x"))
        except ValueError:
            raise MeshError(f"cannot read mesh {text!r}: write sizes joined by 'x', e.g. 2x4") from None
        return cls(shape, device_type)

    @classmethod
    def of(cls, mesh: "Mesh | str | int | tuple[int, ...]") -> "Mesh":
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
            f"unknown parallel dimension(s) {sorted(unknown)} in degrees; "
            f"this version supports {list(PARALLEL_DIMS)}"
        )
    fixed = math.prod(degrees.values())
    missing = [dim for dim in PARALLEL_DIMS if dim not in degrees]
    full = dict(degrees)
    if world % fixed:
        raise ConfigError(f"degrees {degrees} multiply to {fixed}, which does not divide the {world} devices")
    if len(missing) == 1:
        full[missing[0]] = world // fixed
    elif missing:
        full.update({dim: 1 for dim in missing})
        full["dp"] = full["dp"] * (world // math.prod(full.values()))
    if math.prod(full.values()) != world:
        raise ConfigError(f"degrees {full} multiply to {math.prod(full.values())}, but the mesh has {world} devices")
    return {dim: full[dim] for dim in PARALLEL_DIMS}


def degree_choices(world: int) -> list[dict[str, int]]:
    """Every way to split ``world`` devices into the parallel dimensions."""
    return [{"dp": world // tp, "tp": tp} for tp in range(1, world + 1) if world % tp == 0]
