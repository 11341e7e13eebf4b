"""c10d process groups from a logical device mesh.

The mesh is row-major over all ranks: for {"dp": 2, "tp": 2}, ranks 0,1 share a dp
coordinate and differ in tp. A group over several axes is the flattened sub-mesh of those
axes; its c10d group ranks then run in mesh order, which the collectives rely on
("chunk k belongs to group rank k").
"""

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from autopar.ir.errors import MeshError

# Meshes built in this process, by (layout, device type), with the world they were built in.
# Every ``parallelize`` asks for one; c10d groups are never freed until the world is, so building
# anew each time grew a process that parallelizes many models by three gloo threads per group.
_MESHES: dict[tuple, tuple[dist.ProcessGroup, DeviceMesh]] = {}


def build_device_mesh(layout: dict[str, int], device_type: str) -> DeviceMesh:
    """A mesh over all ranks with one named dim per layout entry, in order (sizes of 1 allowed).

    The same layout in the same world returns the same mesh, so its groups (and the flattened
    ones ``group_name`` adds) are created once per process, however many modules use them.

    Needs the default process group (``launch.init_from_env``). Example:
    ``mesh = build_device_mesh({"dp": 2, "tp": 2}, "cpu")`` on 4 ranks.
    """
    if not layout or any(size < 1 for size in layout.values()):
        raise MeshError(f"mesh layout {layout} needs at least one axis, each of size >= 1")
    mesh_size = math.prod(layout.values())
    world_size = dist.get_world_size()
    if mesh_size != world_size:
        raise MeshError(
            f"mesh layout {layout} spans {mesh_size} ranks but the world has {world_size}; "
            f"launch {mesh_size} processes or choose degrees whose product is {world_size}"
        )
    key = (tuple((str(axis), size) for axis, size in layout.items()), device_type)
    world, mesh = _MESHES.get(key, (None, None))
    if world is not dist.group.WORLD:  # first asked, or the world was destroyed and made anew since
        mesh = init_device_mesh(device_type, tuple(layout.values()), mesh_dim_names=tuple(name for name, _ in key[0]))
        for axis in layout:
            _inherit_timeout(mesh.get_group(str(axis)))
        _MESHES[key] = (dist.group.WORLD, mesh)
    return mesh


def rank_device(mesh) -> torch.device:
    """Where this rank computes on ``mesh``: its current GPU on a CUDA mesh, else the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def world_timeout() -> timedelta:
    """The default group's timeout (``init_process_group(timeout=...)``, see ``launch.init_from_env``)."""
    world = dist.group.WORLD
    device = torch.device("cuda") if torch.device("cuda") in world._device_types else torch.device("cpu")
    return world._get_backend(device).options._timeout


def _inherit_timeout(group: dist.ProcessGroup) -> None:
    """torch gives the groups DeviceMesh creates the backend's default timeout (30 minutes for
    gloo), not the world's: set the world's, so that no collective waits longer than the user asked."""
    _set_pg_timeout(world_timeout(), group)


def group_name(mesh: DeviceMesh, axes: tuple[str, ...]) -> str:
    """The c10d group name of ``axes`` of ``mesh`` together, for the ``autopar::`` collectives.

    Several axes are flattened into one group (DeviceMesh caches it in the root mesh, so
    asking again creates no new group). Axes must be in mesh order, so that the group's
    rank order is the flattened coordinate. Example: ``group_name(mesh, ("dp", "tp"))``.
    """
    names = mesh.mesh_dim_names or ()
    unknown = [axis for axis in axes if axis not in names]
    if not axes or unknown:
        raise MeshError(f"axes {axes} must be a non-empty subset of the mesh axes {names}")
    if list(axes) != sorted(axes, key=names.index) or len(set(axes)) != len(axes):
        raise MeshError(f"axes {axes} must be distinct and in mesh order {names}")
    axes = tuple(str(axis) for axis in axes)
    if len(axes) == 1:
        return mesh.get_group(axes[0]).group_name
    group = mesh[axes]._flatten().get_group()
    _inherit_timeout(group)
    return group.group_name
