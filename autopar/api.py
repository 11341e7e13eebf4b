"""The face of autopar: plan a model on a mesh, and parallelize it in a process group.

This is, with the CLI, the only place that imports both ``passes`` and ``runtime``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from autopar.ir import Axis, ConfigError, Mesh, MeshError, Plan, PlanOptions, StalePlanError, batch_split
from autopar.ir.zero import syncs_whole_in_program
from autopar.passes.capture.graph import CapturedGraph
from autopar.passes.capture.graph import capture as capture_graph
from autopar.passes.rewrite.compiled import sync_in_program
from autopar.passes.rewrite.overlap import schedule_communication
from autopar.passes.rewrite.recompute import apply_recompute
from autopar.passes.rewrite.rewrite import rewrite
from autopar.passes.rewrite.stages import split_stages
from autopar.passes.runner import PassLog, verify_graph
from autopar.passes.search.search import SearchProgress, search


def capture(model: nn.Module, example_inputs: tuple) -> CapturedGraph:
    """Capture ``model`` on ``example_inputs`` (the GLOBAL batch; real, fake or meta tensors) as
    an aten-level graph: the first stage of :func:`plan`, for planning one model several ways.

    >>> captured = capture(model, model.example_inputs(8, device="meta"))   # doctest: +SKIP
    >>> plan(captured, "2x2", zero=1)                                        # doctest: +SKIP
    """
    return _capture(model, example_inputs)


def plan(
    model: nn.Module | CapturedGraph,
    mesh,
    example_inputs: tuple | None = None,
    options: PlanOptions | None = None,
    *,
    progress: Callable[[SearchProgress], None] | None = None,
    **pins,
) -> Plan:
    """Find how to run ``model`` on ``mesh``; needs no process group and works on meta models.

    ``model`` is a module with ``example_inputs`` describing the GLOBAL batch, or a graph from
    :func:`capture`. What the search may not choose is :class:`PlanOptions` — ``options``, or
    its fields as keywords: ``degrees`` (``{"dp": 2, "tp": 2}``, ``"pp"`` for pipeline stages),
    ``constraints`` (placements by parameter or module name pattern: ``{"layers.*.attn_norm":
    "S(1)"}``), ``hardware``, ``memory_limit``, ``zero`` (0-3), ``recompute`` ("none",
    "selective", "full"), ``microbatches``, ``pipeline`` (the schedule), ``stage_cuts`` and
    ``precision`` ("fp32", "bf16-mixed", "fp16-mixed"; default: the hardware's natural choice).
    ``progress`` is called after each configuration the search weighs (a
    :class:`~autopar.passes.search.search.SearchProgress`; ``autopar plan`` draws it on a terminal).

    >>> p = plan(model, "2x2", model.example_inputs(8), zero=1)   # doctest: +SKIP
    >>> print(p)                                                  # doctest: +SKIP
    """
    if not isinstance(model, CapturedGraph):
        if example_inputs is None:
            raise ConfigError("plan needs example_inputs for a module (or a graph from autopar.capture)")
        model = _capture(model, example_inputs)
    return _search(model, Mesh.of(mesh), PlanOptions.of(options, **pins), progress=progress)


def _capture(model: nn.Module, example_inputs, log: PassLog | None = None) -> CapturedGraph:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected an nn.Module, got {type(model).__name__}")
    return (log or PassLog()).run(
        "capture", capture_graph, model, tuple(example_inputs), verify=lambda c: verify_graph(c.graph_module)
    )


def _search(
    captured: CapturedGraph, mesh: Mesh, options: PlanOptions, log: PassLog | None = None, progress=None
) -> Plan:
    return (log or PassLog()).run("search", search, captured, mesh, options, progress=progress)


def parallelize(
    model: nn.Module,
    mesh,
    example_inputs: tuple,
    *,
    plan: Plan | str | None = None,
    options: PlanOptions | None = None,
    **pins,
):
    """Plan (or load ``plan``) and build this rank's trainable module. Call on every rank.

    The default process group must be initialized with ``mesh.size`` ranks (torchrun or
    ``autopar run``). The returned module's ``train_step(*local_inputs)`` runs forward and
    backward; ``shard_batch(*global_inputs)`` gives this rank's slice. With ``degrees={"pp": p,
    ...}`` the layers run in p pipeline stages over the outermost mesh dimension (``pipeline``
    picks the schedule, ``stage_cuts`` the stage boundaries); ``recompute`` pins activation
    recomputation, as for :func:`plan`; ``microbatches`` splits the local
    batch (gradient accumulation, and the pipeline's microbatches).

    >>> pmodel = parallelize(model, "2x2", model.example_inputs(8))   # doctest: +SKIP
    >>> loss = pmodel.train_step(*pmodel.shard_batch(*batch))         # doctest: +SKIP
    """
    from autopar.runtime.module import AccumulatingModule, ParallelModule
    from autopar.runtime.pipeline import PipelineModule
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
        options = PlanOptions.of(options, **pins)
        plan = _plan_on_rank_zero(lambda: _search(captured, mesh, options, log))
    elif plan.fingerprint != captured.fingerprint:
        raise StalePlanError(
            f"the plan was made for graph {plan.fingerprint}, but this model captures as {captured.fingerprint}: "
            "re-run autopar.plan for this model and these input shapes"
        )
    if "compile" in pins:  # a given plan runs compiled or not, as asked
        plan = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, compiled=pins["compile"]))
    _check_runnable(plan)
    schedule = plan.schedule
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    layout = {Axis.PP: schedule.stages, **plan.degrees} if schedule.stages > 1 else plan.degrees
    device_mesh = build_device_mesh(layout, device_type)
    groups = {axis: group_name(device_mesh, (axis,)) for axis in plan.degrees}
    running = _microbatch_capture(model, example_inputs, captured, plan, log)
    program = log.run(
        "rewrite",
        rewrite,
        running,
        dataclasses.replace(plan, fingerprint=running.fingerprint),
        groups=groups,
        device=device_type,
        verify=verify_graph,
    )
    program = log.run("recompute", apply_recompute, program, schedule.recompute, verify=verify_graph)
    state = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    compiler, group_of = None, lambda axes: group_name(device_mesh, tuple(axes))
    if schedule.stages > 1:
        stages = log.run("split stages", split_stages, program, set(captured.params), set(captured.buffers), schedule)
        if schedule.compiled:
            programs, compiler = _compiling([s.graph_module for s in stages], plan, captured.params, group_of, log)
            stages = [dataclasses.replace(s, graph_module=p) for s, p in zip(stages, programs)]
        module = PipelineModule(
            stages,
            plan,
            device_mesh,
            param_names=captured.params,
            buffer_names=captured.buffers,
            input_names=captured.user_inputs,
            state=state,
            tied=captured.tied,
            compiler=compiler,
        )
    else:
        if schedule.compiled:
            (program,), compiler = _compiling([program], plan, captured.params, group_of, log)
        module_class = AccumulatingModule if schedule.microbatches > 1 else ParallelModule
        module = module_class(
            program,
            plan,
            device_mesh,
            param_order=[captured.params[n] for n in captured.params],
            buffer_order=[captured.buffers[n] for n in captured.buffers],
            state=state,
            tied=captured.tied,
            compiler=compiler,
        )
    module.expect_inputs(example_inputs)  # forward and train_step refuse inputs unlike these
    return module


def _compiling(programs: list, plan: Plan, params: dict[str, str], group_of, log: PassLog):
    """The programs summing their own gradients, and the compiler that schedules their communication."""
    from autopar.runtime.compile import Compiler

    whole, synced, out = syncs_whole_in_program(plan.zero, plan.schedule), frozenset(), []
    for program in programs:
        program, names = log.run(
            "sync in program",
            sync_in_program,
            program,
            plan,
            params,
            group_of,
            whole=whole,
            verify=lambda result: verify_graph(result[0]),
        )
        out.append(program)
        synced |= names
    return out, Compiler(schedule=schedule_communication, synced_in_program=synced)


def _check_runnable(plan: Plan) -> None:
    schedule = plan.schedule
    local_batch = plan.batch_size // batch_split(plan.degrees)
    if local_batch % schedule.microbatches:
        raise ConfigError(
            f"{schedule.microbatches} microbatches must divide the local batch of {local_batch}: pick a divisor"
        )


def _microbatch_capture(model, example_inputs, captured: CapturedGraph, plan: Plan, log: PassLog) -> CapturedGraph:
    """The graph one microbatch runs: the model captured at the microbatch's global size
    (views in an exported graph name their batch size), checked to be the planned graph."""
    count = plan.schedule.microbatches
    if count == 1:
        return captured
    pieces = tuple(value[: value.shape[0] // count] for value in example_inputs)
    micro = _capture(model, pieces, log)
    shape = [(n.name, n.op, str(n.target)) for n in micro.graph.nodes]
    if shape != [(n.name, n.op, str(n.target)) for n in captured.graph.nodes]:
        raise ConfigError(
            f"the model captures another graph at the microbatch size {pieces[0].shape[0]} than at the batch size "
            f"{example_inputs[0].shape[0]}: run it without microbatches"
        )
    return micro


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
