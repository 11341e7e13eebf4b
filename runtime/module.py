"""ParallelModule: the per-rank program wrapped as an nn.Module that trains like the original.

Parameters are DTensors with the planned placements, registered under the model's own
names, so ``p.full_tensor()``, torch optimizers and torch.distributed.checkpoint work. Each
DTensor's local shard is also a plain leaf tensor (same storage) that the rewritten graph
takes directly, so a training step pays no DTensor dispatch. Gradients accumulate on those
leaves; partial sums over an axis are summed by a bucketed :class:`GradSync` while backward
runs; at the end of backward every local gradient is published as the DTensor's ``.grad``
(again the same storage, no copy).

With ZeRO (``plan.zero``, see :mod:`autopar.runtime.zero.layout`) the optimizer state (1), gradients (2) and
parameters (3) of data-parallel replicated parameters are split over dp: ZeRO-2 gradients
and ZeRO-3 parameters are DTensors sharded over dp, so ``full_tensor()`` still gives the whole.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from autopar.ir import Axis, NonFiniteError, Plan, Replicate, Shard
from autopar.runtime.faults import agreed, collective, reported
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.kernels.zigzag import zigzag_order
from autopar.runtime.zero.gather import Zero3Runtime
from autopar.runtime.zero.layout import ZeroLayout, ZeroOptimizer, add_grad, synced_alone


def to_dtensor_placement(placement):
    if isinstance(placement, Shard):
        return DShard(placement.dim)
    if isinstance(placement, Replicate):
        return DReplicate()
    return DPartial(placement.reduce_op)


def local_chunk(full: torch.Tensor, placements, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's shard of a full tensor (outer mesh dims split first, as DTensor does; on
    the context-parallel dim a head and a tail chunk, see :mod:`autopar.runtime.kernels.zigzag`)."""
    local = full
    names = mesh.mesh_dim_names or ()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            size = mesh.size(mesh_dim)
            if mesh_dim < len(names) and names[mesh_dim] == Axis.CP:
                local = local.index_select(
                    placement.dim, zigzag_order(local.shape[placement.dim], size).to(local.device)
                )
            local = local.chunk(size, dim=placement.dim)[mesh.get_local_rank(mesh_dim)]
    return local.contiguous()


def communicating(method):
    """Marks a ``train_step`` or ``forward``: its failure reaches the peers (``faults.reported``),
    and with ``check_finite`` a train step's loss and gradients are checked on every rank."""

    @functools.wraps(method)
    def run(self, *local_inputs):
        with reported(method.__name__):
            result = method(self, *local_inputs)
            if self.check_finite and method.__name__ == "train_step":
                self._check_finite(result)
        return result

    return run


class ParallelModule(nn.Module):
    """Runs a rewritten graph on this rank. Built by ``autopar.parallelize``."""

    def __init__(
        self,
        program: fx.GraphModule,
        plan: Plan,
        mesh: DeviceMesh,
        *,
        param_order: list[str],
        buffer_order: list[str],
        state: dict[str, torch.Tensor],
        tied: dict[str, str] | None = None,
        check_finite: bool = False,
    ):
        super().__init__()
        self.check_finite = check_finite
        self.program = program
        self.plan = plan
        self.device_mesh = mesh
        self._param_order = param_order
        self._buffer_order = buffer_order
        self._params: dict[str, nn.Parameter] = {}
        self._locals: dict[str, torch.Tensor] = {}  # the leaves the program trains
        self.zero = ZeroLayout(plan, mesh, {name: state[name].shape for name in dict.fromkeys(param_order)})
        self._zero_chunks: dict[str, torch.Tensor] = {}  # ZeRO-1/2: the chunks the optimizer steps
        for name in dict.fromkeys(param_order):
            full = state[name]
            placements = [to_dtensor_placement(p) for p in plan.params[name]]
            local = local_chunk(full.detach(), plan.params[name], mesh)
            if self.zero.stores_chunk(name):
                local, placements = self.zero.chunk(name, local), self.zero.placements(name, placements)
            local = local.clone().requires_grad_(full.requires_grad)
            if name in self.zero.dims and not self.zero.stores_chunk(name) and local.requires_grad:
                self._zero_chunks[name] = self.zero.chunk(name, local.detach()).requires_grad_()
            param = nn.Parameter(
                DTensor.from_local(
                    local.detach(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
                )
            )
            assert param._local_tensor.data_ptr() == local.data_ptr(), "the DTensor must share the leaf's storage"
            self._params[name], self._locals[name] = param, local
            _register(self, name, param)
        for alias, name in (tied or {}).items():  # the same Parameter under the tied name too
            _register(self, alias, self._params[name])
        for name in buffer_order:
            _register(self, name, state[name].detach().clone(), buffer=True)
        self._names_by_leaf = {id(local): name for name, local in self._locals.items()}
        entries = [
            self.zero.sync_entry(name, self._locals[name], axes, self._add_grad_chunk)
            for name, axes in plan.grad_sync.items()
        ]
        self._grad_sync = GradSync([entry for entry in entries if entry is not None], auto_finish=False)
        self._zero3 = None  # ZeRO-3: per-layer gathers and gradient reduce-scatters (zero/gather.py)
        if self.zero.stage == 3 and self.zero.dims:
            sum_over = {name: self.zero.sum_after_dp(axes) for name, axes in plan.grad_sync.items()}
            self._zero3 = Zero3Runtime(
                program,
                param_order,
                self._locals,
                sum_over,
                syncing=lambda: self._grad_sync.syncing,
                on_first_grad=lambda: self._on_grad_accumulated(None),
            )
        self._local_loss = _peel_loss_reduction(program)
        self._callback_queued = False
        for local in self._locals.values():
            if local.requires_grad:
                local.register_post_accumulate_grad_hook(self._on_grad_accumulated)

    @communicating
    def forward(self, *local_inputs):
        """Forward on this rank's slice of the batch; returns what the model returns (the loss)."""
        outputs = self._run(self.program, local_inputs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    @communicating
    def train_step(self, *local_inputs) -> torch.Tensor:
        """Forward and backward; gradients are complete (and synced) when this returns.

        Returns the global loss. Where the plan reduces the loss over one axis at the very
        end, that reduction runs asynchronously, overlapped with backward: backward starts
        from this rank's share, which is exactly what the reduction's backward would give.
        """
        if self._local_loss is None:
            loss = self(*local_inputs)
            loss.backward()
            return loss.detach()
        program, group, reduce_op = self._local_loss
        (partial,) = self._run(program, local_inputs)
        loss = partial.detach().clone()
        work = dist.all_reduce(
            loss,
            op=dist.ReduceOp.AVG if reduce_op == "avg" else dist.ReduceOp.SUM,
            group=_resolve_process_group(group),
            async_op=True,
        )
        share = partial / _resolve_process_group(group).size() if reduce_op == "avg" else partial
        share.backward()
        with collective("loss all-reduce", group):
            work.wait()
        return loss

    def _run(self, program: fx.GraphModule, local_inputs) -> tuple:
        self._follow_zeroed_grads()
        params = [self._locals[name] for name in self._param_order]
        buffers = [self.get_buffer(name) for name in self._buffer_order]
        if self._zero3 is None:
            return tuple(program(*params, *buffers, *local_inputs))
        with self._zero3.forward(self._locals):  # gathered per layer; regathered for backward
            return tuple(program(*params, *buffers, *local_inputs))

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        """An optimizer stepping this rank's shards as plain tensors (no DTensor dispatch).

        Exact for elementwise optimizers (SGD, Adam, AdamW, ...): each element's update needs
        only its own gradient and state. For optimizers with whole-tensor statistics, pass
        ``pmodel.parameters()`` (DTensors) to the optimizer instead. Under ZeRO-1/2 it is a
        :class:`ZeroOptimizer` over this rank's 1/dp of each parameter, whose ``step()``
        all-gathers the updated parameters; under ZeRO-3 the shards already are 1/dp.
        """
        if not self._zero_chunks:
            return optimizer_class(list(self._locals.values()), **kwargs)
        chunked = [(self._zero_chunks[name], self._locals[name], self.zero.dims[name]) for name in self._zero_chunks]
        whole = [local for name, local in self._locals.items() if name not in self._zero_chunks]
        inner = optimizer_class([chunk for chunk, _, _ in chunked] + whole, **kwargs)
        return ZeroOptimizer(inner, chunked, whole, self.zero.stage, self.zero)

    def no_sync(self):
        """Accumulate gradients locally over several backward passes (like DDP's no_sync)."""
        return self._grad_sync.no_sync()

    def shard_batch(self, *global_inputs):
        """This rank's slice of a global batch, as ``forward`` expects it."""
        return tuple(
            local_chunk(value, self.plan.inputs[name], self.device_mesh)
            for name, value in zip(self.plan.inputs, global_inputs)
        )

    def _on_grad_accumulated(self, _local: torch.Tensor) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            self._callback_queued = True

    def _after_backward(self) -> None:
        self._callback_queued = False
        self._grad_sync.finish()
        if self._zero3 is not None:
            self._zero3.finish_backward()
        for name, param in self._params.items():
            placements = param.placements
            if self._grad_is_zero_chunk(name):
                local = self._locals[name]
                if local.grad is not None and self._grad_sync.syncing:  # complete already: keep our chunk
                    add_grad(self._zero_chunks[name], self.zero.chunk(name, local.grad))
                    local.grad = None
                placements = self.zero.placements(name, list(placements))
            grad = self._grad_owner(name).grad
            if grad is not None and (param.grad is None or param.grad._local_tensor.data_ptr() != grad.data_ptr()):
                param.grad = DTensor.from_local(
                    grad, param.device_mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
                )

    def _grad_is_zero_chunk(self, name: str) -> bool:
        return name in self._zero_chunks and self.zero.grad_is_chunk(name)

    def _grad_owner(self, name: str) -> torch.Tensor:
        """The leaf whose gradient ``param.grad`` shows: ZeRO-2's chunk, else the program's leaf."""
        return self._zero_chunks[name] if self._grad_is_zero_chunk(name) else self._locals[name]

    def _add_grad_chunk(self, leaf: torch.Tensor, chunk: torch.Tensor | None) -> None:
        """ZeRO-2: the reduce-scattered chunk of ``leaf``'s gradient (a view into a bucket: copied)."""
        if chunk is not None:
            add_grad(self._zero_chunks[self._names_by_leaf[id(leaf)]], chunk.clone())

    def _check_finite(self, loss: torch.Tensor) -> None:
        """Raise NonFiniteError on every rank if the loss or any rank's gradient shard is not finite.

        Ranks hold different shards (and pipeline ranks different parameters): one MAX
        all-reduce of a flag per parameter of the plan lets every rank name the same ones."""
        names = list(self.plan.params)
        flags = torch.zeros(len(names) + 1, device=loss.device)
        flags[0] = float(not torch.isfinite(loss).all())
        for index, name in enumerate(names, start=1):
            grad = self._grad_owner(name).grad if name in self._params else None
            if grad is not None and not torch.isfinite(grad).all():
                flags[index] = 1.0
        with collective("check_finite all-reduce"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags.any():
            bad = [name for name, flag in zip(names, flags[1:].tolist()) if flag]
            loss_text = f"the loss is {loss.item()}" if flags[0] else "the loss is finite"
            raise agreed(
                NonFiniteError(
                    f"check_finite: {loss_text}; non-finite gradients in {len(bad)} parameter(s)"
                    f"{': ' + ', '.join(bad[:8]) + (' ...' if len(bad) > 8 else '') if bad else ''}. "
                    "Look for NaN or inf in the batch, lower the learning rate, or use a loss scaler"
                )
            )

    def _follow_zeroed_grads(self) -> None:
        """An optimizer over either view may have set its gradients to None: mirror that."""
        for name, param in self._params.items():
            owner = self._grad_owner(name)
            if param.grad is None:
                owner.grad = None
            elif owner.grad is None:
                param.grad = None


def _peel_loss_reduction(program: fx.GraphModule) -> tuple[fx.GraphModule, str, str] | None:
    """The program without its final loss all-reduce, with that reduction's group and op.

    Only for a single scalar output reduced once (the usual data-parallel loss); otherwise
    None and ``train_step`` runs the program as it is.
    """
    graph = fx.Graph()
    outputs = graph.graph_copy(program.graph, {})
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 1:
        return None
    reduced = outputs[0]
    if reduced.target is not torch.ops.autopar.all_reduce.default or len(reduced.users) != 0:
        return None
    partial, group, reduce_op = reduced.args
    if isinstance(partial, fx.Node) and partial.target is torch.ops.autopar.all_reduce.default:
        return None  # reduced over several axes in turn: keep it simple and synchronous
    graph.output((partial,))
    graph.erase_node(reduced)
    return fx.GraphModule(program, graph), group, reduce_op


def _register(root: nn.Module, name: str, value, buffer: bool = False) -> None:
    """Register under a dotted name, creating empty parent modules as needed."""
    *parents, leaf = name.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part) or not isinstance(getattr(module, part), nn.Module):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if buffer:
        module.register_buffer(leaf, value)
    else:
        module.register_parameter(leaf, value)


class AccumulatingModule(ParallelModule):
    """Gradient accumulation without stages: the local batch in ``microbatches`` pieces, one
    after another; the gradient sync runs with the last backward."""

    def _pieces(self, local_inputs) -> list[tuple]:
        count = self.plan.schedule.microbatches
        return list(zip(*(value.tensor_split(count) for value in local_inputs)))

    @communicating
    def train_step(self, *local_inputs) -> torch.Tensor:
        pieces = self._pieces(local_inputs)
        losses = []
        for index, piece in enumerate(pieces):
            (loss,) = self._run(self.program, piece)
            with self._accumulating(last=index == len(pieces) - 1):
                (loss / len(pieces)).backward()
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    def _accumulating(self, last: bool):
        """ZeRO-2/3: each backward synced on its own (``ZeroLayout.syncs_each_microbatch``);
        otherwise accumulated locally and synced with the last."""
        if self.zero.syncs_each_microbatch:
            return synced_alone(whole_leaves(self))
        return contextlib.nullcontext() if last else self.no_sync()

    @communicating
    def forward(self, *local_inputs):
        return torch.stack([self._run(self.program, piece)[0] for piece in self._pieces(local_inputs)]).mean()


def whole_leaves(module: ParallelModule) -> list[torch.Tensor]:
    """The trainable leaves ZeRO leaves whole (their gradients are all-reduced, not scattered)."""
    return [leaf for name, leaf in module._locals.items() if name not in module.zero.dims and leaf.requires_grad]
