"""The face of autopar: plan a model on a mesh, and parallelize it in a process group.

This is, with the CLI, the only place that imports both ``passes`` and ``runtime``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from autopar.ir import ConfigError, HardwareProfile, Mesh, MeshError, Plan, Schedule, StalePlanError, get_profile
from autopar.passes.capture import CapturedGraph, capture
from autopar.passes.pipeline import PassLog, verify_graph
from autopar.passes.rewrite import rewrite
from autopar.passes.search import search


def plan(
    model: nn.Module,
    mesh,
    example_inputs: tuple,
    *,
    degrees: dict[str, int] | None = None,
    constraints: dict[str, object] | None = None,
    hardware: str | HardwareProfile | None = None,
    memory_limit: float | None = None,
    zero: int | None = None,
    recompute: str | None = None,
    microbatches: int | None = None,
) -> Plan:
    """Find how to run ``model`` on ``mesh``; needs no process group and works on meta models.

    ``example_inputs`` describe the GLOBAL batch. ``degrees`` pins parallel sizes
    (``{"dp": 2, "tp": 2}``), ``constraints`` pins placements by parameter or module name
    pattern (``{"layers.*.attn_norm": "S(1)"}``, on the tensor-parallel axis), ``zero`` pins
    the ZeRO stage (0-3) over the data-parallel axis; by default the search takes the lowest
    stage that fits ``memory_limit``. ``degrees={"pp": 2, ...}`` pins pipeline stages,
    ``recompute`` ("none", "selective", "full") activation recomputation (by default the
    least that fits), ``microbatches`` the pieces the local batch runs in.

    >>> p = plan(model, "2x2", model.example_inputs(8))   # doctest: +SKIP
    >>> print(p)                                         # doctest: +SKIP
    """
    return _plan_captured(
        _capture(model, example_inputs), mesh, degrees, constraints, hardware, memory_limit,
        dict(zero=zero, recompute=recompute, microbatches=microbatches),
    )


def _capture(model: nn.Module, example_inputs, log: PassLog | None = None) -> CapturedGraph:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected an nn.Module, got {type(model).__name__}")
    return (log or PassLog()).run("capture", capture, model, tuple(example_inputs), verify=lambda c: verify_graph(c.graph_module))


def _plan_captured(captured, mesh, degrees, constraints, hardware, memory_limit, pins=None, log: PassLog | None = None) -> Plan:
    return (log or PassLog()).run(
        "search",
        search,
        captured,
        Mesh.of(mesh),
        get_profile(hardware),
        degrees=degrees,
        memory_limit=memory_limit,
        constraints=constraints,
        **(pins or {}),
    )


def parallelize(
    model: nn.Module,
    mesh,
    example_inputs: tuple,
    *,
    plan: Plan | str | None = None,
    degrees: dict[str, int] | None = None,
    constraints: dict[str, object] | None = None,
    hardware: str | HardwareProfile | None = None,
    memory_limit: float | None = None,
    zero: int | None = None,
):
    """Plan (or load ``plan``) and build this rank's trainable module. Call on every rank.

    The default process group must be initialized with ``mesh.size`` ranks (torchrun or
    ``autopar run``). The returned module's ``train_step(*local_inputs)`` runs forward and
    backward; ``shard_batch(*global_inputs)`` gives this rank's slice.

    >>> pmodel = parallelize(model, "2x2", model.example_inputs(8))   # doctest: +SKIP
    >>> loss = pmodel.train_step(*pmodel.shard_batch(*batch))         # doctest: +SKIP
    """
    from autopar.runtime import collectives  # noqa: F401  (registers torch.ops.autopar.*)
    from autopar.runtime.module import ParallelModule
    from autopar.runtime.process_groups import build_device_mesh, group_name

    mesh = Mesh.of(mesh)
    if not dist.is_initialized():
        raise MeshError(
            f"parallelize needs a process group of {mesh.size} ranks: launch with torchrun or "
            "`autopar run SCRIPT --nproc N`, or use autopar.plan to plan without one"
        )
    if dist.get_world_size() != mesh.size:
        raise MeshError(
            f"mesh {mesh} has {mesh.size} devices but the world has {dist.get_world_size()} ranks: "
            f"launch {mesh.size} processes or pass a mesh of {dist.get_world_size()} devices"
        )
    log = PassLog()
    captured = _capture(model, example_inputs, log)
    if isinstance(plan, str):
        plan = Plan.load(plan)
    if plan is None:
        plan = _plan_on_rank_zero(lambda: _plan_captured(
            captured, mesh, degrees, constraints, hardware, memory_limit, dict(zero=zero, recompute="none"), log
        ))
    elif plan.fingerprint != captured.fingerprint:
        raise StalePlanError(
            f"the plan was made for graph {plan.fingerprint}, but this model captures as {captured.fingerprint}: "
            "re-run autopar.plan for this model and these input shapes"
        )
    if plan.schedule != Schedule():
        raise ConfigError(
            f"the plan's schedule {plan.schedule} is for predictions only: this version runs plans without pipeline "
            "stages, microbatches or recomputation. Plan with degrees without pp and recompute='none' to run it"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device_mesh = build_device_mesh(plan.degrees, device_type)
    groups = {axis: group_name(device_mesh, (axis,)) for axis in plan.degrees}
    program = log.run("rewrite", rewrite, captured, plan, groups=groups, device=device_type, verify=verify_graph)
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    return ParallelModule(
        program,
        plan,
        device_mesh,
        param_order=[captured.params[n] for n in captured.params],
        buffer_order=[captured.buffers[n] for n in captured.buffers],
        state=state,
        tied=captured.tied,
    )


def _plan_on_rank_zero(search):
    """One search, on rank 0, shared with every rank: ops timed while planning differ from
    rank to rank, and ranks running different plans would wait on each other forever.
    An error on rank 0 is raised on every rank."""
    outcome = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = search()
        except Exception as error:  # noqa: BLE001  (re-raised below, on every rank)
            outcome[1] = error
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]
