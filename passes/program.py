"""From one call of the model to the programs a rank runs for it.

A plan places the nodes of the graph captured at one call (the planning call). A call of
another signature (another batch size or sequence length, another set of inputs) captures
its own graph; :func:`build_programs` decides whether the plan still holds for it:

- the graph has the same nodes (only shapes differ): the plan applies as it is, node by node
  (view shapes come from the new graph, so any size the mesh divides runs; no search);
- the graph differs (an ``attention_mask`` given now, not then): ``replan`` searches it
  again with everything that decides where the parameters live pinned (degrees, ZeRO, the
  schedule, each parameter's tensor-parallel placement); if the search still places every
  parameter as before, that plan runs (a gradient it completes otherwise than the runtime
  sums is completed in the graph, :func:`complete_gradients_as_synced`; a compiled program that
  sums its own gradients sums them as its plan says); if not, the call
  needs a new plan and :class:`ConfigError` says so (parameters and optimizer state cannot
  move under a model already training).

Either way every split the plan makes must divide the call's sizes: an input the mesh
cannot split is a :class:`ConfigError` naming the input, its dim and the divisor. Then the
graph is rewritten for this rank (collectives, recomputation), its loss-only form kept for
``train_step``, and, with pipeline stages, split into stage programs.

Pre: the captured graph and plan of the planning call; the model; the call's arguments by
name (``passes.capture.calls.bind_call``), at their GLOBAL size.
Post: :class:`Programs` for this call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir import Axis, ConfigError, Plan, PlanOptions, Shard
from autopar.ir.zero import syncs_whole_in_program
from autopar.passes.capture.graph import CapturedGraph, capture, module_path
from autopar.passes.rewrite.loss import loss_only
from autopar.passes.rewrite.recompute import apply_recompute
from autopar.passes.rewrite.regather import regather_gathered_inputs
from autopar.passes.rewrite.rewrite import rewrite
from autopar.passes.rewrite.stages import StageProgram, split_stages
from autopar.passes.runner import PassLog, verify_graph
from autopar.passes.search.pins import chunks_per_rank


@dataclass(frozen=True)
class Programs:
    """What one call signature runs on this rank."""

    captured: CapturedGraph  # the graph one microbatch of the call captures as
    plan: Plan  # the plan it was rewritten with (the parallelize plan, or one placing everything alike)
    program: fx.GraphModule  # this rank's program: every output
    loss_program: fx.GraphModule | None  # the loss alone (None: the first output is not a scalar)
    stages: list[StageProgram] | None  # pipeline stage programs, with stages


def build_programs(
    model: torch.nn.Module,
    bound: dict,
    planned: CapturedGraph,
    plan: Plan,
    *,
    groups: dict[str, str],
    device: str,
    replan: Callable[[CapturedGraph, PlanOptions], Plan],
    log: PassLog | None = None,
    captured: CapturedGraph | None = None,
) -> Programs:
    """The programs for the call ``model(**bound)`` (see the module docstring); ``captured``:
    its graph, when the caller has it already (the planning call without microbatches)."""
    log = log or PassLog()
    check_inputs(bound, plan)
    synced = plan.grad_sync  # what the runtime sums, whatever plan this call runs
    # but a compiled program that sums its gradients itself sums what the plan it runs needs
    # (passes/rewrite/compiled.py): nothing to complete for the runtime, which sums none of them
    program_sums = plan.schedule.compiled and syncs_whole_in_program(plan.zero, plan.schedule)
    count = plan.schedule.microbatches
    micro = captured if captured is not None and count == 1 else _capture(model, microbatch(bound, count), log, plan)
    check_constants(micro, planned)
    if _nodes(micro) != _nodes(planned):
        whole = _capture(model, bound, log, plan) if count > 1 else micro
        plan = _same_placements(plan, replan(whole, pinned_options(plan)))
        if _nodes(micro) != _nodes(whole):
            raise ConfigError(
                f"the model captures another graph for a microbatch ({count} per batch) than for the whole batch: "
                "run it without microbatches"
            )
    plan = dataclasses.replace(plan, fingerprint=micro.fingerprint)
    check_splits(micro, plan)
    program = log.run("rewrite", rewrite, micro, plan, groups=groups, device=device, verify=verify_graph)
    if not program_sums:
        complete_gradients_as_synced(program, micro, plan, synced, groups)
    if plan.schedule.regather:
        program = log.run("regather", lambda p: regather_gathered_inputs(p)[0], program, verify=verify_graph)
    program = log.run("recompute", apply_recompute, program, plan.schedule.recompute, verify=verify_graph)
    stages = None
    if plan.schedule.stages > 1:
        stages = log.run("split stages", split_stages, program, set(micro.params), set(micro.buffers), plan.schedule)
    return Programs(micro, plan, program, loss_only(program), stages)


def alike_in_microbatches(model, bound: dict, count: int, whole: CapturedGraph, plan: Plan, log: PassLog) -> bool:
    """Whether one of ``count`` microbatches of the call captures the graph the whole call does
    (what :func:`build_programs` needs: torch.export specializes a dim of size 1, and a model may
    compute otherwise for one sequence)."""
    return count == 1 or _nodes(_capture(model, microbatch(bound, count), log, plan)) == _nodes(whole)


def check_constants(captured: CapturedGraph, planned: CapturedGraph) -> None:
    """The tensors the forward makes from Python data (torch.export's constants) hold what they
    held in the planning call: the module keeps that call's, one per name, for every call."""
    for placeholder, name in captured.buffers.items():
        if name not in captured.constants or name not in planned.constants:
            continue
        value, kept = captured.constants[name], planned.constants[name]
        if value.shape != kept.shape or not torch.equal(value, kept):
            node = next(n for n in captured.graph.nodes if n.name == placeholder)
            module = next((path for user in node.users if (path := module_path(user))), "the model")
            raise ConfigError(
                f"{module} makes a tensor from Python data ({name}: torch.tensor(...) of values the call decides, "
                f"{tuple(value.shape)} here, {tuple(kept.shape)} in the planning call): autopar keeps the planning "
                "call's. Plan with inputs of the sizes you call it with (example_inputs=/example_kwargs=, and "
                "no microbatches), or make the tensor with torch ops (torch.arange) so the graph computes it"
            )


def check_inputs(bound: dict, plan: Plan) -> None:
    """Every split the plan makes of an input divides it: the mesh axes splitting it, and the
    microbatches splitting the batch."""
    batch = _batch(bound)
    for name, value in bound.items():
        if not isinstance(value, torch.Tensor):
            continue
        placements = plan.inputs.get(name, ())
        for dim in range(value.dim()):
            axes = [axis for axis, p in zip(plan.degrees, placements) if p == Shard(dim) and plan.degrees[axis] > 1]
            parts = [f"{axis}={plan.degrees[axis]}" + (" x 2 chunks" if axis == Axis.CP else "") for axis in axes]
            divisor = math.prod(plan.degrees[axis] * chunks_per_rank(axis) for axis in axes)
            if dim == 0 and value.shape[0] == batch and plan.schedule.microbatches > 1:
                divisor *= plan.schedule.microbatches
                parts.append(f"{plan.schedule.microbatches} microbatches")
            if value.shape[dim] % divisor:
                raise ConfigError(
                    f"input {name!r} has {value.shape[dim]} along dim {dim}, which the plan splits into {divisor} "
                    f"equal parts ({' x '.join(parts)}): pass a size divisible by {divisor}"
                )


def check_splits(captured: CapturedGraph, plan: Plan) -> None:
    """Every value the plan splits has a size the split divides (a new sequence length may not)."""
    for node in captured.graph.nodes:
        decision = plan.nodes.get(node.name)
        value = node.meta.get("val")
        if decision is None or decision.output is None or not isinstance(value, torch.Tensor):
            continue
        for axis, placement in zip(plan.degrees, decision.output):
            if isinstance(placement, Shard) and plan.degrees[axis] > 1:
                parts = plan.degrees[axis] * chunks_per_rank(axis)
                if value.shape[placement.dim] % parts:
                    raise ConfigError(
                        f"{node.name} in {module_path(node) or 'the model'} has {value.shape[placement.dim]} along "
                        f"dim {placement.dim}, which the plan splits {parts} ways over {axis}: pass inputs whose "
                        "sizes it divides, or plan for them (example_inputs=...)"
                    )


def microbatch(bound: dict, count: int) -> dict:
    """One microbatch of the call: the first 1/count of every input batched like the first."""
    batch = _batch(bound)
    if count == 1 or batch is None:
        return bound
    return {
        name: value[: batch // count]
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch
        else value
        for name, value in bound.items()
    }


def pinned_options(plan: Plan) -> PlanOptions:
    """Options that let a search decide only what does not move parameters: the plan's
    degrees, ZeRO stage, schedule (compiled or not included) and every parameter's
    tensor-parallel placement."""
    schedule = plan.schedule
    tp = list(plan.degrees).index(Axis.TP) if plan.degrees.get(Axis.TP, 1) > 1 else None
    return PlanOptions(
        degrees=plan.full_degrees,
        constraints={name: str(placements[tp]) for name, placements in plan.params.items()} if tp is not None else None,
        hardware=plan.hardware,
        zero=plan.zero,
        recompute=schedule.recompute,
        regather=schedule.regather,
        microbatches=schedule.microbatches,
        pipeline=schedule.kind if schedule.stages > 1 else None,
        virtual=schedule.virtual if schedule.stages > 1 else None,
        stage_cuts=schedule.cuts,
        precision=plan.precision,
        compile=schedule.compiled,
        async_tp=schedule.async_tp,
    )


def complete_gradients_as_synced(
    program: fx.GraphModule, captured: CapturedGraph, plan: Plan, synced: dict[str, tuple[str, ...]], groups: dict
) -> None:
    """Make ``program`` (rewritten with ``plan``) fit a runtime that sums each parameter's
    gradient over the axes ``synced`` names: where the plan leaves a gradient partial over an
    axis the runtime does not sum, it is summed in the graph (``grad_all_reduce``, Megatron's f);
    where the plan makes it whole on every rank of an axis the runtime sums over, each rank's
    share is divided by the axis size (``all_reduce(avg)``: the same value forward, grad / p
    backward). A call planned again (another graph) may place a head replicated where the
    planning call split it by batch, or the other way round."""
    graph = program.graph
    by_name = {node.name: node for node in graph.nodes}
    position = {node: index for index, node in enumerate(graph.nodes)}
    for placeholder, name in captured.params.items():
        wanted, given = set(plan.grad_sync.get(name, ())), set(synced.get(name, ()))
        node = by_name.get(placeholder)
        if wanted == given or node is None or not node.users:
            continue
        users = list(node.users)
        value = node
        with graph.inserting_before(min(users, key=position.__getitem__)):
            for axis in sorted(wanted - given):
                value = graph.call_function(torch.ops.autopar.grad_all_reduce.default, (value, groups[axis]))
            for axis in sorted(given - wanted):
                value = graph.call_function(torch.ops.autopar.all_reduce.default, (value, groups[axis], "avg"))
        for user in users:
            user.replace_input_with(node, value)
    graph.lint()
    program.recompile()


def _same_placements(old: Plan, new: Plan) -> Plan:
    if (new.params, new.zero, new.schedule) != (old.params, old.zero, old.schedule):
        moved = sorted(name for name in old.params if new.params.get(name) != old.params[name])
        what = ", ".join(moved[:3]) + (", ..." if len(moved) > 3 else "") if moved else "the schedule or ZeRO"
        raise ConfigError(
            "this call's graph differs from the one planned (other inputs or sizes), and planning it again places "
            f"the parameters otherwise ({what}): it needs a new plan. Call parallelize with "
            "example_inputs/example_kwargs like this call"
        )
    return new


def _batch(bound: dict) -> int | None:
    """The call's batch size: dim 0 of its first tensor input (as the search takes it)."""
    tensors = [value for value in bound.values() if isinstance(value, torch.Tensor) and value.dim()]
    return tensors[0].shape[0] if tensors else None


def _capture(model, bound: dict, log: PassLog, plan: Plan) -> CapturedGraph:
    """The call's graph as the plan computes it (under mixed precision, in its param_dtype)."""
    policy = plan.precision_policy
    dtype = getattr(torch, policy.param_dtype) if policy.mixed else None
    return log.run("capture", capture, model, (), bound, dtype, verify=lambda c: verify_graph(c.graph_module))


def _nodes(captured: CapturedGraph) -> list[tuple]:
    return [(n.name, n.op, str(n.target)) for n in captured.graph.nodes]
