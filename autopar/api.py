"""The face of autopar: plan a model on a mesh, and parallelize it in a process group.

This is, with the CLI, the only place that imports both ``passes`` and ``runtime``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.ir import (
    ConfigError,
    Mesh,
    MeshError,
    Plan,
    PlanOptions,
    Precision,
    PrecisionPolicy,
    StalePlanError,
    batch_split,
)
from autopar.ir.zero import accumulates_in_program, scatters_in_program, syncs_whole_in_program, zero_dims
from autopar.passes.capture.calls import bind_call, example_call
from autopar.passes.capture.graph import CapturedGraph
from autopar.passes.capture.graph import capture as capture_graph
from autopar.passes.program import alike_in_microbatches, build_programs
from autopar.passes.rewrite.async_tp import pipeline_tp_matmuls
from autopar.passes.rewrite.compiled import sync_in_program
from autopar.passes.rewrite.loss import loss_count
from autopar.passes.rewrite.overlap import schedule_communication
from autopar.passes.runner import PassLog, verify_graph
from autopar.passes.search.search import SearchProgress, search


def capture(
    model: nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None, precision: str | None = None
) -> CapturedGraph:
    """Capture ``model`` on ``example_inputs``/``example_kwargs`` (the GLOBAL batch; real, fake
    or meta tensors) as an aten-level graph: the first stage of :func:`plan`, for planning one
    model several ways. ``precision`` ("bf16-mixed", "fp16-mixed"; default: as the model is)
    captures the graph the model computes with 16-bit copies of its parameters; plan it with
    the same precision.

    >>> captured = capture(model, model.example_inputs(8, device="meta"))   # doctest: +SKIP
    >>> plan(captured, "2x2", zero=1)                                        # doctest: +SKIP
    """
    policy = PrecisionPolicy.of(precision or Precision.FP32)
    return _capture(model, (), policy, None, bind_call(model, tuple(example_inputs), dict(example_kwargs or {})))


def plan(
    model: nn.Module | CapturedGraph,
    mesh,
    example_inputs: tuple | None = None,
    options: PlanOptions | None = None,
    *,
    example_kwargs: dict | None = None,
    progress: Callable[[SearchProgress], None] | None = None,
    **pins,
) -> Plan:
    """Find how to run ``model`` on ``mesh``; needs no process group and works on meta models.

    ``model`` is a module called on ``example_inputs``/``example_kwargs`` (the GLOBAL batch;
    when neither is given, what :func:`parallelize` would plan with), or a graph from
    :func:`capture`. What the search may not choose is :class:`PlanOptions` — ``options``, or
    its fields as keywords: ``degrees`` (``{"dp": 2, "tp": 2}``, ``"pp"`` for pipeline stages),
    ``constraints`` (placements by parameter or module name pattern: ``{"layers.*.attn_norm":
    "S(1)"}``), ``hardware``, ``memory_limit``, ``zero`` (0-3), ``recompute`` ("none",
    "selective", "selective-op", "full"), ``microbatches``, ``pipeline`` (the schedule), ``virtual`` (its
    stage modules per device), ``stage_cuts``,
    ``precision`` ("fp32", "bf16-mixed", "fp16-mixed") and ``reduce_dtype``.
    ``progress`` is called after each configuration the search weighs (a
    :class:`~autopar.passes.search.search.SearchProgress`; ``autopar plan`` draws it on a terminal).

    >>> p = plan(model, "2x2", model.example_inputs(8), zero=1)   # doctest: +SKIP
    >>> print(p)                                                  # doctest: +SKIP
    """
    mesh = Mesh.of(mesh)
    options = PlanOptions.of(options, **pins)
    if not isinstance(model, CapturedGraph):
        example = _example_call(model, mesh, example_inputs, example_kwargs)
        model = _capture(model, (), options.precision_policy, None, example)
    return _search(model, mesh, options, progress=progress)


def _capture(
    model: nn.Module, example_inputs, policy: PrecisionPolicy, log: PassLog | None = None, example_kwargs=None
) -> CapturedGraph:
    """The graph ``model`` runs under ``policy``: in its param_dtype when mixed, else as it is."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected an nn.Module, got {type(model).__name__}")
    return (log or PassLog()).run(
        "capture",
        capture_graph,
        model,
        tuple(example_inputs),
        example_kwargs,
        param_dtype=getattr(torch, policy.param_dtype) if policy.mixed else None,
        verify=lambda c: verify_graph(c.graph_module),
    )


def _search(
    captured: CapturedGraph, mesh: Mesh, options: PlanOptions, log: PassLog | None = None, progress=None
) -> Plan:
    return (log or PassLog()).run("search", search, captured, mesh, options, progress=progress)


def parallelize(
    model: nn.Module,
    mesh,
    example_inputs: tuple | None = None,
    *,
    example_kwargs: dict | None = None,
    plan: Plan | str | None = None,
    options: PlanOptions | None = None,
    local_batches: bool = False,
    check_finite: bool = False,
    **pins,
):
    """Plan (or load ``plan``) and build this rank's trainable module. Call on every rank.

    The default process group must be initialized with ``mesh.size`` ranks (torchrun or
    ``autopar run``). The returned module is called like ``model`` and returns what it returns
    (a Hugging Face ``ModelOutput``, a tuple, a tensor), autograd connected; its parameters are
    the planned DTensors from the start, so an optimizer over ``pmodel.parameters()`` is built
    as usual. Every rank passes the same GLOBAL batch and gets the one-process result; with
    ``local_batches=True`` each passes its share (``pmodel.dp_rank`` of ``pmodel.dp_size``).

    The plan is made for one call: ``example_inputs``/``example_kwargs`` (the global batch), else
    ``model.example_inputs(batch)``, else, for a Hugging Face causal LM, ``input_ids`` and
    ``labels`` from its config. Calls of other sizes run the same plan when it divides them
    (their graph is captured once per new signature, see :mod:`autopar.passes.program`); a call
    whose graph would need the parameters placed otherwise raises :class:`ConfigError`.
    ``pins`` and ``options`` are :func:`plan`'s (``degrees={"pp": p, ...}`` for pipeline stages).
    ``precision="bf16-mixed"`` (or "fp16-mixed", with dynamic loss scaling; default: the
    hardware's natural one: fp32 on CPU; on GPU ranks, with no ``hardware`` given, the GPU's preset
    and its bf16-mixed) trains fp32 master parameters with 16-bit compute
    copies, reducing gradients in ``reduce_dtype`` (default "float32"); see
    :mod:`autopar.runtime.mixed_precision`. ``check_finite=True`` makes every ``train_step``
    raise :class:`NonFiniteError` on every rank when the loss or a gradient holds a NaN or
    infinity, naming the parameters (one small all-reduce per step).

    Post: an error on any rank, before the ranks first communicate, is raised on every rank
    (see :mod:`autopar.runtime.faults`); a failure inside a step reaches the peers.

    >>> pmodel = parallelize(AutoModelForCausalLM.from_config(config), "2x2")   # doctest: +SKIP
    >>> optimizer = torch.optim.AdamW(pmodel.parameters())                     # doctest: +SKIP
    >>> pmodel(input_ids=ids, labels=ids).loss.backward(); optimizer.step()    # doctest: +SKIP
    """
    from autopar.runtime.faults import reported

    mesh = Mesh.of(mesh)
    _check_world(mesh)
    options = _on_this_hardware(PlanOptions.of(options, **pins))
    with reported("parallelize"):
        call = (example_inputs, example_kwargs)
        return _parallelize(model, mesh, call, plan, options, local_batches, check_finite)


def _parallelize(model, mesh: Mesh, call: tuple, plan, options: PlanOptions, local_batches: bool, check_finite: bool):
    """``parallelize`` once the world is known to match: every decision that can fail on some
    ranks is shared (``faults.agree``) before the ranks next communicate."""
    from autopar.runtime.calls import CallProgram, Calls
    from autopar.runtime.faults import agree, from_rank_zero
    from autopar.runtime.process_groups import build_device_mesh, group_name

    log = PassLog()
    example, captured, plan = agree(
        lambda: _captured_with_plan(model, mesh, call, plan, options, log), "capturing the model"
    )
    if plan is None:
        # one search, shared: ops timed while planning differ from rank to rank, and ranks
        # running different plans would wait on each other forever
        search = lambda: _runnable_search(model, example, captured, mesh, options, log)  # noqa: E731
        plan = from_rank_zero(search, "searching for a plan")
    if options.compile and not plan.schedule.compiled or options.async_tp and not plan.schedule.async_tp:
        # a given plan runs compiled (with async TP) when asked
        compiled = dict(compiled=True, async_tp=options.async_tp or plan.schedule.async_tp)
        plan = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, **compiled))
    _check_runnable(plan)
    device_type = _device_type()
    stages = plan.schedule.stages
    device_mesh = build_device_mesh(plan.full_degrees, device_type)
    groups = {axis: group_name(device_mesh, (axis,)) for axis in plan.degrees}
    synced_in_program: set[str] = set()  # compile=True: the gradients the programs sum themselves

    def compile_call(bound: dict, known: CapturedGraph | None = None) -> CallProgram:
        """This rank's programs for a call signature (no communication, but for a search again)."""
        built = build_programs(
            model,
            bound,
            captured,
            plan,
            groups=groups,
            device=device_type,
            replan=lambda graph, pinned: from_rank_zero(lambda: _search(graph, mesh, pinned, log), "planning a call"),
            log=log,
            captured=known,
        )
        program = built.stages if built.stages is not None else built.program
        loss_program, accumulating = built.loss_program, None
        counted = None  # over microbatches: what weighs each one's loss, its count of targets
        if loss_program is not None and built.plan.schedule.microbatches > 1:
            counted = loss_count(loss_program)
        if plan.schedule.compiled:  # the programs sum their gradients; the runtime leaves those alone
            group_of = lambda axes: group_name(device_mesh, tuple(axes))  # noqa: E731
            sync = functools.partial(
                _synced_in_program, plan=built.plan, captured=built.captured, group_of=group_of, log=log
            )
            program, synced = sync(program)
            if loss_program is not None and accumulates_in_program(built.plan.zero, built.plan.schedule):
                accumulating, _ = sync(copy.deepcopy(loss_program), whole=False)
                loss_program, more = sync(loss_program, accumulated=True)
                synced |= more
            elif loss_program is not None:
                loss_program, more = sync(loss_program)
                synced |= more
            synced_in_program.update(synced)
        return CallProgram(
            program=program,
            loss_program=loss_program,
            accumulating_loss_program=accumulating,
            loss_count=counted,
            inputs={name: built.plan.inputs[name] for name in built.captured.user_inputs},
            out_spec=built.captured.out_spec,
            signature=Calls.signature(bound),
        )

    first = agree(lambda: compile_call(example, captured), "rewriting the graph into this rank's program")
    stage_mesh = device_mesh[tuple(plan.degrees)] if stages > 1 else device_mesh
    calls = Calls(
        lambda args, kwargs: bind_call(model, args, kwargs), compile_call, stage_mesh, plan.inputs, local_batches
    )
    calls.add(first)
    compiler = _compiler(synced_in_program, plan.schedule.async_tp) if plan.schedule.compiled else None
    return agree(
        lambda: _rank_module(model, captured, plan, device_mesh, calls, first, check_finite, compiler),
        "building this rank's module",
    )


def _device_type() -> str:
    """Where the ranks compute: NCCL ranks on their GPU, gloo ranks on the CPU."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _on_this_hardware(options: PlanOptions) -> PlanOptions:
    """``options``, planning for the GPU the ranks run on when they name no hardware: its preset
    (and so its natural precision, bf16-mixed on an A100/H100/H200), not this host's CPU."""
    if options.hardware is not None or _device_type() != "cuda":
        return options
    from autopar.passes.cost.calibration import gpu_preset

    return dataclasses.replace(options, hardware=gpu_preset(torch.cuda.get_device_name()))


def _runnable_search(model, example: dict, captured: CapturedGraph, mesh: Mesh, options: PlanOptions, log) -> Plan:
    """The search's plan, in fewer microbatches where one of its microbatches captures another graph
    than the whole call (the runtime could not run it): the most that capture alike, pinned."""
    plan = _search(captured, mesh, options, log)
    count = plan.schedule.microbatches
    alike = lambda c: alike_in_microbatches(model, example, c, captured, plan, log)  # noqa: E731
    if options.microbatches is not None or alike(count):
        return plan
    fewer = next(c for c in range(count - 1, 0, -1) if count % c == 0 and alike(c))  # 1 always is
    return _search(captured, mesh, dataclasses.replace(options, microbatches=fewer), log)


def _captured_with_plan(model, mesh: Mesh, call: tuple, plan: Plan | str | None, options: PlanOptions, log: PassLog):
    """The planning call, its graph (in the precision it trains in) and the plan given, checked."""
    example = _example_call(model, mesh, *call)
    if isinstance(plan, str):
        plan = Plan.load(plan)
    policy = plan.precision_policy if plan is not None else options.precision_policy
    captured = _capture(model, (), policy, log, example)
    if plan is not None and {options.precision, options.reduce_dtype} - {None, plan.precision, plan.reduce_dtype}:
        raise ConfigError(
            f"the plan trains in precision={plan.precision!r}, reduce_dtype={plan.reduce_dtype!r}: pass "
            "dataclasses.replace(plan, precision=..., reduce_dtype=...) or plan again with those options"
        )
    if plan is not None and plan.fingerprint != captured.fingerprint:
        raise StalePlanError(
            f"the plan was made for graph {plan.fingerprint}, but this model captures as {captured.fingerprint}: "
            "re-run autopar.plan for this model and these input shapes (or pass the example inputs it was made with)"
        )
    return example, captured, plan


def _synced_in_program(
    program,
    *,
    plan: Plan,
    captured: CapturedGraph,
    group_of,
    log: PassLog,
    whole: bool | None = None,
    accumulated=False,
):
    """A compiled call's program (or stage programs) summing their own gradients where the plan
    lets them (:func:`syncs_whole_in_program`, :func:`scatters_in_program`; ``whole``: False where
    it must not), and the names of the parameters they sum; ``accumulated``: as the last
    microbatch's program (:func:`autopar.passes.rewrite.compiled.sync_in_program`)."""
    whole = syncs_whole_in_program(plan.zero, plan.schedule) if whole is None else whole
    params, scattered, synced = captured.params, None, set()
    if scatters_in_program(plan.zero, plan.schedule):
        shapes = {
            params[node.name]: node.meta["val"].shape
            for node in captured.graph.find_nodes(op="placeholder")
            if node.name in params
        }
        scattered = zero_dims(plan, shapes)

    def one(graph):
        graph, names = log.run(
            "sync in program",
            sync_in_program,
            graph,
            plan,
            params,
            group_of,
            whole=whole,
            accumulated=accumulated,
            scattered=scattered,
            verify=lambda result: verify_graph(result[0]),
        )
        synced.update(names)
        return graph

    if isinstance(program, list):  # pipeline stages
        return [dataclasses.replace(stage, graph_module=one(stage.graph_module)) for stage in program], synced
    return one(program), synced


def _compiler(synced_in_program: set[str], async_tp: bool):
    """What runs each program through ``torch.compile`` with its communication scheduled (and
    its tensor-parallel matmuls in pieces: ``async_tp``)."""
    from autopar.runtime.compile import Compiler

    return Compiler(
        schedule=schedule_communication,
        prepare=pipeline_tp_matmuls if async_tp else None,
        synced_in_program=frozenset(synced_in_program),
    )


def _rank_module(
    model, captured: CapturedGraph, plan: Plan, device_mesh, calls, first, check_finite: bool, compiler=None
):
    from autopar.runtime.module import AccumulatingModule, ParallelModule
    from autopar.runtime.pipeline import PipelineModule

    state = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
        **captured.constants,
    }
    common = dict(state=state, tied=captured.tied, calls=calls, check_finite=check_finite, compiler=compiler)
    if plan.schedule.stages > 1:
        return PipelineModule(
            first.program,
            plan,
            device_mesh,
            param_names=captured.params,
            buffer_names=captured.buffers,
            **common,
        )
    module_class = AccumulatingModule if plan.schedule.microbatches > 1 else ParallelModule
    return module_class(
        first.program,
        plan,
        device_mesh,
        param_order=[captured.params[n] for n in captured.params],
        buffer_order=[captured.buffers[n] for n in captured.buffers],
        **common,
    )


def _check_world(mesh: Mesh) -> None:
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


# The call autopar plans with when given none: a global batch every degree divides and, for
# Hugging Face models, this many tokens per sequence (or the model's maximum if shorter).
EXAMPLE_BATCH_PER_DEVICE, EXAMPLE_MIN_BATCH, EXAMPLE_SEQ = 2, 8, 256


def _example_call(model: nn.Module, mesh: Mesh, example_inputs, example_kwargs) -> dict:
    """The planning call, its arguments by name (see :func:`parallelize`)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected an nn.Module, got {type(model).__name__}")
    if example_inputs is not None or example_kwargs is not None:
        args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        return bind_call(model, tuple(args) if example_inputs is not None else (), dict(example_kwargs or {}))
    batch = max(EXAMPLE_MIN_BATCH, EXAMPLE_BATCH_PER_DEVICE * mesh.size)
    return example_call(model, batch, EXAMPLE_SEQ)


def _check_runnable(plan: Plan) -> None:
    schedule = plan.schedule
    local_batch = plan.batch_size // batch_split(plan.degrees)
    if local_batch % schedule.microbatches:
        raise ConfigError(
            f"{schedule.microbatches} microbatches must divide the local batch of {local_batch}: pick a divisor"
        )
