"""Pipeline stages and microbatches at run time, on ``torch.distributed.pipelining``.

:class:`PipelineModule` holds this rank's stage modules (the per-stage programs of
``passes.rewrite.stages``) and drives a torch pipelining schedule with them: GPipe, 1F1B,
Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble (``Schedule.kind``). Stages split the
outermost mesh dimension "pp"; inside a stage the plan's data and tensor parallelism run as
without a pipeline, on the stage's sub-mesh, whose DTensors hold this stage's parameters only.

One ``train_step`` is one schedule step over ``microbatches`` pieces of the local batch. The
loss is the mean of the microbatch losses and gradients are accumulated and divided by the
microbatch count (the schedule's ``scale_grads``), so both equal one step on the whole batch.
Gradients are summed over dp once, for the last microbatch: the schedule runs under ``no_sync``
and each stage module's last backward syncs its sums in buckets as it makes them, behind it (as
DDP does, and Megatron-Core per model chunk); on a device of several modules (interleaved,
zero-bubble) each has buckets of its own (``GradSync.summing_now``: a zero-bubble weight pass
sets gradients outside autograd's hooks, so those are summed as it returns).
A weight several stages use (tied embeddings) has a copy in each, their gradients summed
over the stages holding it (:mod:`autopar.runtime.tied`, Megatron's embedding group).

ZeRO runs over the dp axis of the stage's sub-mesh, on the stage's parameters. ZeRO-2/3 sum
each microbatch's gradients as soon as a backward made them (as DeepSpeed does, see
``ZeroLayout.syncs_each_microbatch``): each :class:`autopar.runtime.pipeline_stage.Stage` syncs after
every backward that makes weight gradients, a full one or a zero-bubble weight pass. Under ZeRO-3 each stage module
gathers its weights per layer for each microbatch's forward and again for its backward
(``zero.gather.Zero3Runtime``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _ComputationType

from autopar.ir import CASTS_IN_PROGRAM, ZERO_BUBBLE_PIPELINES, Axis, ConfigError, PipelineKind, Plan
from autopar.runtime.calls import Calls
from autopar.runtime.faults import collective
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.mixed_precision import MixedPrecision
from autopar.runtime.module import ParallelModule, communicating, whole_leaves
from autopar.runtime.pipeline_stage import Stage, Transfers
from autopar.runtime.process_groups import rank_device
from autopar.runtime.tied import TiedWeights, shared_weights
from autopar.runtime.weight_pass import adding_weight_gradients
from autopar.runtime.zero.gather import Zero3Runtime
from autopar.runtime.zero.layout import synced_alone

if TYPE_CHECKING:  # types only: compiling imports inductor, which eager runs do not need
    from autopar.runtime.compile import Compiler

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
    DTensors; the fp32 masters under mixed precision), put into ``_parameters`` as they are: the
    schedule's ``scale_grads`` and the zero-bubble weight pass walk ``parameters()``, and a
    ``nn.Parameter`` would be a new leaf. A weight shared with another stage module of this
    device is a leaf of its own sharing the storage (``runtime/tied.py``). The program takes
    what ``precision.leaves(...)`` gives for them (the leaves, or their 16-bit copies cast once
    per step, whose gradients reach these leaves).
    """

    def __init__(
        self,
        stage,
        names: list[str],
        leaves: list[torch.Tensor],
        precision: MixedPrecision,
        buffers: list[torch.Tensor],
        first: bool,
        last: bool,
        zero3: Zero3Runtime | None = None,
        compiler: Compiler | None = None,
        weight_pass: bool = False,
    ):
        super().__init__()
        self.program = stage.graph_module
        # the placeholders the leaves are passed as (first, in order) → the parameters' names
        placeholders = [node.name for node in stage.graph_module.graph.find_nodes(op="placeholder")]
        self._weight_of = dict(zip(placeholders, names))
        weights = tuple(placeholders[: len(names)]) if weight_pass else ()  # compiled, a zero-bubble schedule's
        self._run = compiler(stage.graph_module, weights) if compiler is not None else stage.graph_module
        for index, leaf in enumerate(leaves):
            self._parameters[f"param_{index}"] = leaf
        self._names, self._precision, self._buffer_values = names, precision, buffers
        self._own = {name: leaf for name, leaf in zip(names, leaves) if leaf is not precision.masters[name]}
        self._input_names, self._first, self._last = stage.inputs, first, last
        self._zero3 = zero3
        self._casts_itself = stage.graph_module.meta.get(CASTS_IN_PROGRAM, False)  # compiled, summing in program

    def forward(self, *received, **user_inputs):
        # the first stage reads the inputs by name; the others send their inputs' gradients back
        received = () if self._first else tuple(_ContiguousGradient.apply(value) for value in received)
        inputs = self._precision.inputs(user_inputs[_keyword(name)] for name in self._input_names)
        leaves = self._precision.leaves(self._own, cast_by_program=self._casts_itself)
        params = [leaves[name] for name in self._names]
        with self._zero3.forward(leaves) if self._zero3 is not None else contextlib.nullcontext():
            outputs = self._run(*params, *self._buffer_values, *inputs, *received)
        # zero-bubble schedules detach outputs in place, which views do not allow, and p2p sends
        # contiguous tensors only: copy those
        copy = lambda out: out.clone(memory_format=torch.contiguous_format)  # noqa: E731
        outputs = [copy(out) if out._is_view() or not out.is_contiguous() else out for out in outputs]
        if self._last:  # the loss, as a 1-element tensor so the schedule can merge microbatches
            (loss,) = self._precision.outputs(outputs[:1])
            return loss.reshape(1).clone()
        return tuple(outputs) if len(outputs) > 1 else outputs[0]

    def weight_pass(self) -> Callable[[], None]:
        """The zero-bubble W action of this compiled stage's last backward (:mod:`autopar.runtime.weight_pass`)."""
        leaves = functools.partial(self._precision.leaves, self._own, cast_by_program=self._casts_itself)
        return adding_weight_gradients(self._run.weight_passes, leaves, self._weight_of)


class _ContiguousGradient(torch.autograd.Function):
    """Identity forward; backward hands the gradient on contiguous. A stage sends its received
    values' gradients to the stage before, which sizes its buffers after their strides, and p2p
    moves contiguous tensors only (gloo: "input tensor has to be contiguous"; Zamba2's Mamba
    layers give a transposed gradient)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _keyword(input_name: str) -> str:
    """The keyword a user input travels under through the schedule, whose own ``step`` takes
    ``target`` and ``losses`` (an input named ``target`` would collide)."""
    return f"input_{input_name}"


def _loss_of(output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The microbatch's 1-element loss as a scalar (not a view), times its weight: the
    microbatch count times its share of the step's loss (1 for equal shares), which
    ``scale_grads`` then divides by the count."""
    return output.sum() * weight.sum()


class PipelineModule(ParallelModule):
    """This rank's pipeline stages as a trainable module. Built by ``autopar.parallelize``.

    ``pmodel(...)`` with gradients enabled runs the whole schedule step at once (forward and
    backward of every microbatch, as a pipeline must) and returns the loss; its
    ``.backward()`` then publishes those gradients (scaled by the loss's gradient, added to
    any already there), so ``out.loss.backward(); optimizer.step()`` trains as without stages.
    Only the loss comes back: the other outputs stay on the last stage.
    """

    def __init__(
        self,
        stage_programs: list,
        plan: Plan,
        mesh: DeviceMesh,
        *,
        param_names: dict[str, str],
        buffer_names: dict[str, str],
        state: dict[str, torch.Tensor],
        tied: dict[str, str] | None = None,
        calls: Calls,
        check_finite: bool = False,
        compiler: Compiler | None = None,
    ):
        schedule = plan.schedule
        mine = schedule.device_modules()[mesh.get_local_rank(Axis.PP)]
        shared = shared_weights(stage_programs, param_names, schedule, plan.zero)  # decided before communicating
        names = list(dict.fromkeys(param_names[p] for i in mine for p in stage_programs[i].params))
        buffers = list(dict.fromkeys(buffer_names[b] for i in mine for b in stage_programs[i].buffers))
        local_plan = dataclasses.replace(plan, grad_sync={n: a for n, a in plan.grad_sync.items() if n in names})
        super().__init__(
            stage_programs[mine[0]].graph_module,
            local_plan,
            mesh[tuple(plan.degrees)],
            param_order=names,
            buffer_order=buffers,
            state=state,
            tied={alias: name for alias, name in (tied or {}).items() if name in names},
            calls=calls,
            check_finite=check_finite,
            compiler=compiler,
        )
        self.plan = plan
        self.pipeline_mesh = mesh
        self._param_names, self._buffer_names, self._mine = param_names, buffer_names, mine
        self._ties = TiedWeights(shared, schedule, mesh, mine)
        if len(mine) > 1 and not self.zero.syncs_each_microbatch:  # each module syncs its own (_build)
            self._grad_sync.remove()
            self._grad_sync = GradSync([], auto_finish=False)
        self._whole_leaves = whole_leaves(self)
        self._last_rank = dist.get_global_rank(mesh.get_group(Axis.PP), schedule.device_of(schedule.modules - 1))
        self._anchor = torch.zeros((), requires_grad=True)  # what a deferred backward hangs from (see forward)
        self._pending: dict[str, torch.Tensor | None] | None = None
        self._transfers = Transfers()
        self._sums = True  # whether this step sums gradients over dp (see _summed_behind)
        self._use(stage_programs)

    def _use(self, stage_programs: list) -> None:
        """Run the stage programs of one call signature (built once per signature)."""
        self._stages, self._schedule = self._derived(stage_programs, "schedule", lambda: self._build(stage_programs))
        self._holds_first = any(stage.is_first for stage in self._stages)
        self._holds_last = any(stage.is_last for stage in self._stages)

    def _build(self, stage_programs: list) -> tuple[list[Stage], object]:
        schedule = self.plan.schedule
        device = rank_device(self.pipeline_mesh)
        stages = []
        split = self._compiler is not None and schedule.kind in ZERO_BUBBLE_PIPELINES  # runtime.weight_pass
        for index in self._mine:
            stage = stage_programs[index]
            names = [self._param_names[p] for p in stage.params]
            made: list[Zero3Runtime] = []  # ZeRO-3 per stage module, finished at the end of each backward
            zero3 = self._zero3_runtime(
                stage.graph_module,
                param_order=names,
                syncing=lambda: True,
                on_first_grad=lambda made=made: _queue(made[0].finish_backward),
                per_parameter=schedule.kind in ZERO_BUBBLE_PIPELINES,
            )
            made.append(zero3)
            leaves = [self._ties.leaf(name, index, self._locals[name]) for name in names]
            module = _StageModule(
                stage,
                names,
                leaves,
                self._precision,
                [self.get_buffer(self._buffer_names[b]) for b in stage.buffers],
                first=index == 0,
                last=index == schedule.modules - 1,
                zero3=zero3,
                compiler=self._compiler,
                weight_pass=split,
            )
            if self.zero.syncs_each_microbatch:
                sync_now = self._synced_microbatch
            elif len(self._mine) == 1:  # behind its last backward, in the device's buckets
                sync_now = functools.partial(self._summed_behind, self._grad_sync.syncing_now)
            else:  # behind each module's last backward, in buckets of its own
                own = self._gradient_sync(dict(zip(names, leaves)), syncing=False)
                sync_now = functools.partial(self._summed_behind, own.summing_now)
            group = self.pipeline_mesh.get_group(Axis.PP)
            stages.append(
                Stage(
                    module,
                    index,
                    schedule.modules,
                    device,
                    group=group,
                    program=stage,
                    transfers=self._transfers,
                    sync_now=sync_now,
                    last_only=not self.zero.syncs_each_microbatch,
                    weight_pass=module.weight_pass if split else None,
                )
            )
        single = schedule.kind in (PipelineKind.GPIPE, PipelineKind.ONE_F_ONE_B)
        runner = SCHEDULES[schedule.kind](
            stages[0] if single else stages, schedule.microbatches, loss_fn=_loss_of, scale_grads=True
        )
        return stages, runner

    @communicating
    def train_step(self, *local_inputs, **local_kwargs) -> torch.Tensor:
        """Forward and backward of the local batch through the pipeline; gradients complete
        (summed over dp and over the stages sharing a weight, averaged over microbatches) on
        every rank's own parameters. Returns the global loss on every rank."""
        self._drop_pending()
        call, inputs = self._calls.prepare(local_inputs, local_kwargs, split=self._calls.given(shards=True))
        loss = self._step(call, inputs)
        self._after_backward()
        return loss

    @communicating
    def forward(self, *args, **kwargs):
        """The model's result with its loss only (every rank gets it). With gradients enabled,
        the schedule's forward and backward run now; ``loss.backward()`` publishes the gradients."""
        self._drop_pending()
        call, inputs = self._calls.prepare(args, kwargs, split=self._calls.given())
        if torch.is_grad_enabled() and any(leaf.requires_grad for leaf in self._locals.values()):
            loss = self._deferred(call, inputs)
        else:
            self._use(call.program)
            loss = self._forward_only(call, inputs)
        count = call.out_spec.num_leaves if call.out_spec is not None else 1
        return self._calls.result(call, (loss, *[None] * (count - 1)))

    def _step(self, call, inputs) -> torch.Tensor:
        self._use(call.program)
        self._follow_zeroed_grads()
        losses: list[torch.Tensor] = []
        self._sums = self._grad_sync.syncing  # (not under the user's no_sync)
        with self._grad_sync.no_sync(), self._transfers_named(), self._finished_after():
            self._schedule.step(
                *(inputs if self._holds_first else ()),
                target=self._weights(call, inputs),
                losses=losses,
                return_outputs=False,
                **self._keywords(call, inputs),
            )
        self._ties.fold(self._owners())
        if self.zero.syncs_each_microbatch:  # summed as they came (_synced_microbatch)
            self._scale_zero_chunks()
        self._ties.all_reduce(self._owners())
        loss = torch.stack([loss.detach() for loss in losses]).mean() if self._holds_last else torch.zeros(())
        return self._from_last_stage(loss)

    def _forward_only(self, call, inputs) -> torch.Tensor:
        weights = self._weights(call, inputs)
        with _forward_actions_only(self._schedule), self._transfers_named():
            merged = self._schedule.eval(
                *(inputs if self._holds_first else ()), target=weights, **self._keywords(call, inputs)
            )
        loss = (merged.detach().float().reshape(-1) * weights).mean() if self._holds_last else torch.zeros(())
        return self._from_last_stage(loss)

    def _weights(self, call, inputs) -> torch.Tensor:
        """Each microbatch's weight in the step's loss (the schedule's ``target``, see :func:`_loss_of`):
        a mean loss's, the count times its share of the step's targets (a microbatch of padding
        counts fewer), where the last stage counts them from the inputs alone; else ones."""
        micro, count = self.plan.schedule.microbatches, call.loss_count
        values = dict(zip(call.inputs, inputs))
        if not self._holds_last or count is None or not set(count.reads) <= values.keys():
            return torch.ones(micro)
        chunks = {name: values[name].tensor_split(micro) for name in count.reads}  # as the schedule splits
        shares = count.shares([{name: parts[index] for name, parts in chunks.items()} for index in range(micro)])
        return torch.tensor(shares) * micro

    def _transfers_named(self):
        """Around a schedule run: a send or receive that fails names what this rank last posted."""
        pp = self.pipeline_mesh.get_group(Axis.PP).group_name
        return collective("a transfer", pp, where=self._transfers.describe, waited_in="pipelining/schedules.py")

    def _deferred(self, call, inputs) -> torch.Tensor:
        """The step now, its gradients set aside until the returned loss's backward (a later call
        without that backward drops them, putting back what was there)."""
        owners = self._owners()
        self._follow_zeroed_grads()
        self._pending = {name: owner.grad for name, owner in owners.items()}
        for owner in owners.values():
            owner.grad = None
        loss = self._step(call, inputs)
        return _AfterStep.apply(self._anchor, loss, self._publish)

    def _publish(self, scale: torch.Tensor) -> None:
        """The deferred backward: this step's gradients times ``scale``, plus the earlier ones."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise ConfigError("this loss's step was dropped by a later call of the model: call backward before it")
        for name, owner in self._owners().items():
            if owner.grad is not None and float(scale) != 1.0:
                owner.grad.mul_(scale)
            if pending[name] is not None:
                owner.grad = pending[name] if owner.grad is None else owner.grad.add_(pending[name])
        self._anchor.grad = None
        self._after_backward()

    def _drop_pending(self) -> None:
        if self._pending is not None:
            for name, owner in self._owners().items():
                owner.grad = self._pending[name]
            self._pending = None

    def _owners(self) -> dict[str, torch.Tensor]:
        return {name: self._grad_owner(name) for name in self._params}

    @contextlib.contextmanager
    def _synced_microbatch(self):
        """ZeRO-2/3 around one backward: sum its gradients over dp now, reduce-scattering those
        ZeRO splits into their chunks (ZeRO-3's in the backward itself)."""
        with synced_alone(self._whole_leaves):
            yield
            self._ties.fold({name: self._locals[name] for name in self._params})
            self._grad_sync.sync_accumulated()

    def _summed_behind(self, summing_now):
        """Around a stage module's last backward (below ZeRO-2): its gradients summed over dp in
        buckets as it makes them, unless the step only accumulates (the user's ``no_sync``)."""
        return summing_now() if self._sums else contextlib.nullcontext()

    @contextlib.contextmanager
    def _finished_after(self):
        """Around the schedule: a step's gradients are finished (fp16 unscaled, checked) after it,
        on every rank at once, not where a last backward synced them."""
        previous, self._finishing_later = self._finishing_later, True
        try:
            yield
        finally:
            self._finishing_later = previous

    def _scale_zero_chunks(self) -> None:
        """ZeRO-2's accumulated gradient chunks, divided by the microbatch count as the schedule
        divided its stage modules' own gradients (``scale_grads``)."""
        for name, chunk in self._zero_chunks.items():
            if self._grad_is_zero_chunk(name) and chunk.grad is not None:
                chunk.grad.div_(self.plan.schedule.microbatches)

    def _keywords(self, call, local_inputs) -> dict[str, torch.Tensor]:
        return {_keyword(name): value for name, value in zip(call.inputs, local_inputs)}

    def _from_last_stage(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.float().contiguous()  # one dtype on every rank (the last stage's may be 16-bit)
        dist.broadcast(loss, src=self._last_rank, group=self.pipeline_mesh.get_group(Axis.PP))
        return loss


class _AfterStep(torch.autograd.Function):
    """The loss of a step already run: its backward calls ``publish(grad)`` (see PipelineModule)."""

    @staticmethod
    def forward(ctx, anchor, loss, publish):
        ctx.publish = publish
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.publish(grad)
        return None, None, None


def _queue(callback) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


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
