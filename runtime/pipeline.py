"""Pipeline stages and microbatches at run time, on ``torch.distributed.pipelining``.

:class:`PipelineModule` holds this rank's stage modules (the per-stage programs of
``passes.rewrite.stages``) and drives a torch pipelining schedule with them: GPipe, 1F1B,
Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble (``Schedule.kind``). Stages split the
outermost mesh dimension "pp"; inside a stage the plan's data and tensor parallelism run as
without a pipeline, on the stage's sub-mesh, whose DTensors hold this stage's parameters only.

One ``train_step`` is one schedule step over ``microbatches`` pieces of the local batch. The
loss is the mean of the microbatch losses and gradients are accumulated and divided by the
microbatch count (the schedule's ``scale_grads``), so both equal one step on the whole batch.
Gradients are summed over dp once, after the last microbatch: the schedule runs under
``no_sync`` because zero-bubble schedules set weight gradients outside autograd's hooks.

ZeRO runs over the dp axis of the stage's sub-mesh, on the stage's parameters. ZeRO-2/3 sum
each microbatch's gradients as soon as a backward made them (as DeepSpeed does, see
``ZeroLayout.syncs_each_microbatch``): :class:`_Stage` syncs after every backward that makes
weight gradients, a full one or a zero-bubble weight pass. Under ZeRO-3 each stage module
gathers its weights per layer for each microbatch's forward and again for its backward
(``zero.gather.Zero3Runtime``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _ComputationType

from autopar.ir import ZERO_BUBBLE_PIPELINES, Axis, ConfigError, PipelineKind, Plan
from autopar.runtime.module import ParallelModule, communicating, whole_leaves
from autopar.runtime.zero.gather import Zero3Runtime
from autopar.runtime.zero.layout import synced_alone

SCHEDULES = {
    PipelineKind.GPIPE: ScheduleGPipe,
    PipelineKind.ONE_F_ONE_B: Schedule1F1B,
    PipelineKind.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    PipelineKind.INTERLEAVED_ZB: ScheduleInterleavedZeroBubble,
    PipelineKind.ZBV: ScheduleZBVZeroBubble,
}


class _StageModule(nn.Module):
    """One stage program as ``PipelineStage`` calls it: ``forward(*received, **user_inputs)`` (see :func:`_keyword`).

    Its parameters are the ParallelModule's own leaves (plain tensors sharing storage with the
    DTensors), put into ``_parameters`` as they are: the schedule's ``scale_grads`` and the
    zero-bubble weight pass walk ``parameters()``, and a ``nn.Parameter`` would be a new leaf.
    """

    def __init__(
        self,
        stage,
        leaves: list[torch.Tensor],
        buffers: list[torch.Tensor],
        first: bool,
        last: bool,
        zero3: Zero3Runtime | None = None,
        shards: dict[str, torch.Tensor] | None = None,
    ):
        super().__init__()
        self.program = stage.graph_module
        for index, leaf in enumerate(leaves):
            self._parameters[f"param_{index}"] = leaf
        self._leaves, self._buffer_values = leaves, buffers
        self._input_names, self._first, self._last = stage.inputs, first, last
        self._zero3, self._shards = zero3, shards

    def forward(self, *received, **user_inputs):
        received = () if self._first else received  # the first stage reads the inputs by name
        inputs = [user_inputs[_keyword(name)] for name in self._input_names]
        with self._zero3.forward(self._shards) if self._zero3 is not None else contextlib.nullcontext():
            outputs = self.program(*self._leaves, *self._buffer_values, *inputs, *received)
        # zero-bubble schedules detach outputs in place, which views do not allow: copy those
        outputs = [out.clone() if out._is_view() else out for out in outputs]
        if self._last:  # the loss, as a 1-element tensor so the schedule can merge microbatches
            return outputs[0].reshape(1).clone()
        return tuple(outputs) if len(outputs) > 1 else outputs[0]


class _Stage(PipelineStage):
    """A PipelineStage that runs each backward making weight gradients (a full backward, or a
    zero-bubble weight pass) inside ``sync_now()`` when given: torch's hook for data parallelism."""

    def __init__(self, *args, sync_now=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._sync_now = sync_now

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if self._sync_now is None or backward_type == "input":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with self._sync_now():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def _keyword(input_name: str) -> str:
    """The keyword a user input travels under through the schedule, whose own ``step`` takes
    ``target`` and ``losses`` (an input named ``target`` would collide)."""
    return f"input_{input_name}"


def _loss_of(output: torch.Tensor, _target) -> torch.Tensor:
    return output.sum()  # the 1-element loss as a scalar that is not a view


class PipelineModule(ParallelModule):
    """This rank's pipeline stages as a trainable module. Built by ``autopar.parallelize``."""

    def __init__(
        self,
        stage_programs: list,
        plan: Plan,
        mesh: DeviceMesh,
        *,
        param_names: dict[str, str],
        buffer_names: dict[str, str],
        input_names: tuple[str, ...],
        state: dict[str, torch.Tensor],
        tied: dict[str, str] | None = None,
        check_finite: bool = False,
    ):
        schedule = plan.schedule
        pp_rank = mesh.get_local_rank(Axis.PP)
        mine = [stage_programs[i] for i in schedule.device_modules()[pp_rank]]
        _check_parameters_stay_in_one_stage(stage_programs, param_names)
        names = [param_names[p] for stage in mine for p in stage.params]
        buffers = list(dict.fromkeys(buffer_names[b] for stage in mine for b in stage.buffers))
        local_plan = dataclasses.replace(plan, grad_sync={n: a for n, a in plan.grad_sync.items() if n in names})
        super().__init__(
            mine[0].graph_module,
            local_plan,
            mesh[tuple(plan.degrees)],
            param_order=names,
            buffer_order=buffers,
            state=state,
            tied={alias: name for alias, name in (tied or {}).items() if name in names},
            check_finite=check_finite,
        )
        self.plan = plan
        self.pipeline_mesh = mesh
        self._input_names = input_names
        device = (
            torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
        )
        group = mesh.get_group(Axis.PP)
        self._whole_leaves = whole_leaves(self)
        zero3 = {}
        if self._zero3 is not None:  # one runtime per stage module, in place of the one for mine[0]
            self._zero3 = None
            zero3 = {
                stage.index: self._stage_zero3(stage, param_names, schedule.kind in ZERO_BUBBLE_PIPELINES)
                for stage in mine
            }
        self._stages = [
            _Stage(
                _StageModule(
                    stage,
                    [self._locals[param_names[p]] for p in stage.params],
                    [self.get_buffer(buffer_names[b]) for b in stage.buffers],
                    first=stage.index == 0,
                    last=stage.index == schedule.modules - 1,
                    zero3=zero3.get(stage.index),
                    shards=self._locals,
                ),
                stage.index,
                schedule.modules,
                device,
                group=group,
                sync_now=self._synced_microbatch if self.zero.syncs_each_microbatch else None,
            )
            for stage in mine
        ]
        kind = SCHEDULES[schedule.kind]
        single = schedule.kind in (PipelineKind.GPIPE, PipelineKind.ONE_F_ONE_B)
        self._schedule = kind(
            self._stages[0] if single else self._stages, schedule.microbatches, loss_fn=_loss_of, scale_grads=True
        )
        self._no_target = torch.zeros(
            schedule.microbatches
        )  # the loss is the model's own: the schedule's target is unused
        self._holds_first = any(stage.is_first for stage in self._stages)
        self._holds_last = any(stage.is_last for stage in self._stages)
        last_pp_rank = schedule.device_of(schedule.modules - 1)
        self._last_rank = dist.get_global_rank(group, last_pp_rank)  # the loss is known there

    @communicating
    def train_step(self, *local_inputs) -> torch.Tensor:
        """Forward and backward of the local batch through the pipeline; gradients complete
        (summed over dp, averaged over microbatches) on every rank's own parameters.
        Returns the global loss on every rank."""
        self._follow_zeroed_grads()
        losses: list[torch.Tensor] = []
        args = local_inputs if self._holds_first else ()
        with self._grad_sync.no_sync():
            self._schedule.step(
                *args, target=self._no_target, losses=losses, return_outputs=False, **self._keywords(local_inputs)
            )
        if self.zero.syncs_each_microbatch:  # summed as they came (_synced_microbatch)
            self._scale_zero_chunks()
        else:
            self._grad_sync.sync_accumulated()
        self._after_backward()
        loss = torch.stack([loss.detach() for loss in losses]).mean() if self._holds_last else torch.zeros(())
        return self._from_last_stage(loss)

    @communicating
    def forward(self, *local_inputs):
        """The loss of the local batch, forward only (every rank gets it)."""
        args = local_inputs if self._holds_first else ()
        with _forward_actions_only(self._schedule):
            merged = self._schedule.eval(*args, target=self._no_target, **self._keywords(local_inputs))
        loss = merged.detach().mean() if self._holds_last else torch.zeros(())
        return self._from_last_stage(loss)

    @contextlib.contextmanager
    def _synced_microbatch(self):
        """ZeRO-2/3 around one backward: sum its gradients over dp now, reduce-scattering those
        ZeRO splits into their chunks (ZeRO-3's in the backward itself)."""
        with synced_alone(self._whole_leaves):
            yield
            self._grad_sync.sync_accumulated()

    def _scale_zero_chunks(self) -> None:
        """ZeRO-2's accumulated gradient chunks, divided by the microbatch count as the schedule
        divided its stage modules' own gradients (``scale_grads``)."""
        for name, chunk in self._zero_chunks.items():
            if self._grad_is_zero_chunk(name) and chunk.grad is not None:
                chunk.grad.div_(self.plan.schedule.microbatches)

    def _stage_zero3(self, stage, param_names: dict[str, str], per_parameter: bool) -> Zero3Runtime:
        """ZeRO-3 for one stage module: its layers' gathers, and each microbatch's gradients
        reduce-scattered in its backward (per parameter under zero-bubble schedules)."""
        sum_over = {name: self.zero.sum_after_dp(axes) for name, axes in self.plan.grad_sync.items()}
        runtime = Zero3Runtime(
            stage.graph_module,
            [param_names[p] for p in stage.params],
            self._locals,
            sum_over,
            syncing=lambda: True,
            on_first_grad=lambda: torch.autograd.Variable._execution_engine.queue_callback(runtime.finish_backward),
            per_parameter=per_parameter,
        )
        return runtime

    def _keywords(self, local_inputs) -> dict[str, torch.Tensor]:
        return {_keyword(name): value for name, value in zip(self._input_names, local_inputs)}

    def _from_last_stage(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.contiguous()
        dist.broadcast(loss, src=self._last_rank, group=self.pipeline_mesh.get_group(Axis.PP))
        return loss


def _check_parameters_stay_in_one_stage(stage_programs, param_names: dict[str, str]) -> None:
    where: dict[str, int] = {}
    for stage in stage_programs:
        for placeholder in stage.params:
            if where.setdefault(placeholder, stage.index) != stage.index:
                raise ConfigError(
                    f"parameter {param_names[placeholder]!r} is used by stage modules {where[placeholder]} and "
                    f"{stage.index}: "
                    "a weight shared across pipeline stages (e.g. tied embeddings) is not supported; pin cut points "
                    "that keep "
                    "its uses in one stage, or untie it"
                )


@contextlib.contextmanager
def _forward_actions_only(schedule):
    """torch's ``eval`` runs a multi-stage schedule's own action list with backward switched
    off, which zero-bubble V schedules cannot do ("can't steal_bwd_input"): keep only the
    forward computations and their sends and receives (the per-time-step order of the
    looped schedules keeps a hole where an action goes: ranks pair their messages by step)."""
    kept = (
        _ComputationType.FORWARD,
        _ComputationType.SEND_F,
        _ComputationType.RECV_F,
        _ComputationType.UNSHARD,
        _ComputationType.RESHARD,
    )
    saved = {name: getattr(schedule, name, None) for name in ("pipeline_order", "pipeline_order_with_comms")}

    def keep(action) -> bool:
        return action is not None and action.computation_type in kept

    for name, order in saved.items():
        if order is not None:
            filtered = {rank: [a if keep(a) else None for a in actions] for rank, actions in order.items()}
            if name == "pipeline_order_with_comms":  # executed in sequence: drop the holes
                filtered = {rank: [a for a in actions if a is not None] for rank, actions in filtered.items()}
            setattr(schedule, name, filtered)
    try:
        yield
    finally:
        for name, order in saved.items():
            if order is not None:
                setattr(schedule, name, order)
