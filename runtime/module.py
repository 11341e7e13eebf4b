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

Under mixed precision (``plan.precision``, see :mod:`autopar.runtime.mixed_precision`) the
parameters are the fp32 masters and the program takes their 16-bit copies, cast once per call;
fp16's loss scale is ``pmodel.loss_scaler``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

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
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from autopar.ir import CASTS_IN_PROGRAM, EXTRA_INPUTS, GRAD_CHUNK, ConfigError, NonFiniteError, Plan, Replicate, Shard
from autopar.runtime.calls import CallProgram, Calls, local_chunk
from autopar.runtime.clip import clip_grad_norm_
from autopar.runtime.faults import agreed, collective, reported
from autopar.runtime.grad_sync import GradSync, weak_hook
from autopar.runtime.mixed_precision import LossScaler, MixedPrecision
from autopar.runtime.process_groups import rank_device
from autopar.runtime.zero.gather import Zero3Runtime
from autopar.runtime.zero.layout import ZeroLayout, ZeroOptimizer, add_grad, synced_alone

if TYPE_CHECKING:  # a type only: compiling imports inductor, which eager runs do not need
    from autopar.runtime.compile import Compiler


def to_dtensor_placement(placement):
    if isinstance(placement, Shard):
        return DShard(placement.dim)
    if isinstance(placement, Replicate):
        return DReplicate()
    return DPartial(placement.reduce_op)


def communicating(method):
    """Marks a ``train_step`` or ``forward``: its failure reaches the peers (``faults.reported``),
    it computes with 16-bit copies of the masters as they are now, and with ``check_finite`` a
    train step's loss and gradients are checked on every rank."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        self._precision.new_call()  # (mixed precision)
        with reported(method.__name__):
            result = method(self, *args, **kwargs)
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
        calls: Calls,
        check_finite: bool = False,
        compiler: Compiler | None = None,
    ):
        super().__init__()
        self.check_finite = check_finite
        self.program = program
        self._compiler = compiler  # compile=True: runs each program compiled (autopar.runtime.compile)
        self.plan = plan
        self.device_mesh = mesh
        self._param_order = param_order
        self._buffer_order = buffer_order
        self._params: dict[str, nn.Parameter] = {}
        self._locals: dict[str, torch.Tensor] = {}  # the leaves the program trains
        self.zero = ZeroLayout(plan, mesh, {name: state[name].shape for name in dict.fromkeys(param_order)})
        self._zero_chunks: dict[str, torch.Tensor] = {}  # ZeRO-1/2: the chunks the optimizer steps
        policy = plan.precision_policy
        device = rank_device(mesh)  # the model's state moves there, a shard at a time
        for name in dict.fromkeys(param_order):
            full = state[name]
            if policy.mixed and full.is_floating_point():
                full = full.float()  # the master is fp32 whatever the model holds
            placements = [to_dtensor_placement(p) for p in plan.params[name]]
            local = local_chunk(full.detach(), plan.params[name], mesh).to(device)
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
            _register(self, name, state[name].detach().to(device, copy=True), buffer=True)
        self._precision = MixedPrecision(policy, self._locals)
        self._finishing_later = False  # inside a step of several backward passes (AccumulatingModule)
        self._names_by_leaf = {id(local): name for name, local in self._locals.items()}
        self._grad_sync = self._gradient_sync({name: self._locals[name] for name in plan.grad_sync}, auto_finish=False)
        self._calls = calls
        self._zero3 = None  # ZeRO-3 (zero/gather.py): the runtime of the program that ran last; backward finishes it
        self._per_program: dict[int, tuple] = {}  # id(program) → (program, what is derived from it)
        self._callback_queued = False
        for local in self._locals.values():
            if local.requires_grad:
                local.register_post_accumulate_grad_hook(weak_hook(self._on_grad_accumulated))

    @communicating
    def forward(self, *args, **kwargs):
        """Called as the model is, with the GLOBAL batch (or this rank's share, built with
        ``local_batches=True``; see :mod:`autopar.runtime.calls`); returns what the model returns
        (a tensor, a tuple, a ``ModelOutput``), autograd connected: ``out.loss.backward()``
        completes every gradient and syncs it, as :meth:`train_step` does."""
        call, inputs = self._calls.prepare(args, kwargs, split=self._calls.given())
        return self._calls.result(call, self._run(call.program, inputs))

    @communicating
    def train_step(self, *local_inputs, **local_kwargs) -> torch.Tensor:
        """Forward and backward of this rank's inputs (``shard_batch``); gradients are complete
        (and synced) when this returns. Needs a model whose first output is its loss.

        Returns the global loss. Where the plan reduces the loss over one axis at the very
        end, that reduction runs asynchronously, overlapped with backward: backward starts
        from this rank's share, which is exactly what the reduction's backward would give.
        """
        call, inputs = self._calls.prepare(local_inputs, local_kwargs, split=self._calls.given(shards=True))
        program, group, reduce_op = self._peeled_loss_program(call)
        (partial,) = self._run(program, inputs)
        if group is None:
            partial.backward()
            return partial.detach()
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

    def _loss_program(self, call: CallProgram) -> fx.GraphModule:
        """The call's program computing only its loss (what ``train_step`` needs)."""
        if call.loss_program is None:
            raise ConfigError(
                f"{type(self).__name__}.train_step needs a model whose first output is its scalar loss; this one "
                "returns something else first (logits?). Call out = pmodel(...) instead, compute the loss from "
                "out, and call loss.backward(): gradients are completed and synced as backward runs"
            )
        return call.loss_program

    def _peeled_loss_program(self, call: CallProgram) -> tuple[fx.GraphModule, str | None, str | None]:
        """The loss program without its final loss reduction where there is one to overlap with
        backward, with that reduction's group and op (else None, None)."""
        program = self._loss_program(call)
        return self._derived(program, "peeled", lambda: _peel_loss_reduction(program))

    def _derived(self, program: fx.GraphModule, what: str, build):
        key = (id(program), what)
        if key not in self._per_program:
            self._per_program[key] = (program, build())  # the program is kept: its id stays its own
        return self._per_program[key][1]

    @property
    def loss_scaler(self) -> LossScaler | None:
        """fp16-mixed: the dynamic loss scale (GradScaler's rules; its attributes may be tuned). Else None."""
        return self._precision.loss_scaler

    def _run(self, program: fx.GraphModule, local_inputs) -> tuple:
        self._follow_zeroed_grads()
        leaves = self._precision.leaves(cast_by_program=program.meta.get(CASTS_IN_PROGRAM, False))
        params = [leaves[name] for name in self._param_order]
        buffers = [self.get_buffer(name) for name in self._buffer_order]
        self._zero3 = self._derived(program, "zero3", lambda: self._zero3_runtime(program))
        local_inputs = (*self._precision.inputs(local_inputs), *self._extra_inputs(program))
        program = self._compiler(program) if self._compiler is not None else program
        if self._zero3 is None:
            return self._precision.outputs(program(*params, *buffers, *local_inputs))
        with self._zero3.forward(leaves):  # gathered per layer; regathered for backward
            return self._precision.outputs(program(*params, *buffers, *local_inputs))

    def _extra_inputs(self, program: fx.GraphModule) -> tuple:
        """What a compiled program takes after the call's inputs (:data:`autopar.ir.EXTRA_INPUTS`):
        ZeRO-2's chunk leaves, its gradients' destination; the gradients the step's earlier pieces
        accumulated (zeros where there are none), whose leaves let go of them to receive the sums."""
        extras = []
        for kind, name in program.meta.get(EXTRA_INPUTS, ()):
            if kind == GRAD_CHUNK:
                extras.append(self._zero_chunks[name])
                continue
            local = self._locals[name]
            extras.append(local.grad if local.grad is not None else torch.zeros_like(local))
            local.grad = None
        return tuple(extras)

    def _zero3_runtime(self, program: fx.GraphModule, **kwargs) -> Zero3Runtime | None:
        """ZeRO-3's per-layer gathers and gradient reduce-scatters for one program, or None."""
        if self.zero.stage != 3 or not self.zero.dims or self._compiler is not None:  # compiled: the program gathers
            return None
        sum_over = {name: self.zero.sum_after_dp(axes) for name, axes in self.plan.grad_sync.items()}
        return Zero3Runtime(
            program,
            kwargs.pop("param_order", self._param_order),
            self._locals,
            sum_over,
            syncing=kwargs.pop("syncing", lambda: self._grad_sync.syncing),
            on_first_grad=kwargs.pop("on_first_grad", lambda: self._on_grad_accumulated(None)),
            reduce_dtype=self._precision.reduce_dtype,
            **kwargs,
        )

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks a per-rank loader serves (the batch splits this many ways)."""
        return self._calls.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's share of the batch for a per-rank loader, ``0 <= dp_rank < dp_size``."""
        return self._calls.dp_rank

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

    clip_grad_norm_ = clip_grad_norm_  # by the global norm, over every shard and stage (runtime/clip.py)

    def no_sync(self):
        """Accumulate gradients locally over several backward passes (like DDP's no_sync)."""
        return self._grad_sync.no_sync()

    def shard_batch(self, *global_inputs, **global_kwargs):
        """This rank's share of a global batch, as ``train_step`` takes it: a tuple for
        positional inputs, a dict for keyword ones (``train_step(**pmodel.shard_batch(**batch))``)."""
        if global_inputs and global_kwargs:
            raise ConfigError("shard_batch takes positional or keyword inputs, not both: pass them all one way")
        _, shards = self._calls.prepare(global_inputs, global_kwargs)
        if not global_kwargs:
            return tuple(shards)
        names = [name for name, value in self._calls.bind((), global_kwargs).items() if torch.is_tensor(value)]
        if len(names) != len(shards):
            raise ConfigError("shard_batch(**inputs) takes tensors only: pass nested inputs positionally")
        return dict(zip(names, shards))

    def _gradient_sync(self, leaves: dict[str, torch.Tensor], **options) -> GradSync:
        """A GradSync of ``leaves`` (name → leaf): each summed over the axes the plan syncs it
        over, unless the compiled program sums it itself."""
        in_program = self._compiler.synced_in_program if self._compiler is not None else ()
        entries = [
            self.zero.sync_entry(name, leaf, self.plan.grad_sync[name], self._add_grad_chunk)
            for name, leaf in leaves.items()
            if name in self.plan.grad_sync and name not in in_program
        ]
        listed = [entry for entry in entries if entry is not None]
        return GradSync(listed, reduce_dtype=self._precision.reduce_dtype, names=self._names_by_leaf, **options)

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
                param.grad = _as_dtensor(grad, param, placements)
        if self._grad_sync.syncing and not self._finishing_later:
            self._finish_step()

    def _finish_step(self) -> None:
        """Once a step's gradients are complete: fp16 unscales them, and where any rank found
        inf or NaN drops them all (``grad = None``), so the optimizer skips the step."""
        owners = [self._grad_owner(name) for name in self._params]
        grads = [owner.grad for owner in owners if owner.grad is not None]
        if self._precision.finish(grads, dist.group.WORLD):
            for owner, param in zip(owners, self._params.values()):
                owner.grad = param.grad = None

    @contextlib.contextmanager
    def _one_step(self):
        """Several backward passes that make one step: finished once, after the last."""
        self._finishing_later = True
        try:
            yield
        finally:
            self._finishing_later = False
        self._finish_step()

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


def _as_dtensor(local: torch.Tensor, like: DTensor, placements) -> DTensor:
    """``local`` as this rank's shard of a DTensor shaped like ``like``: ``DTensor.from_local``
    without its autograd function and checks (a few µs instead of ~30 per gradient, every step)."""
    meta = TensorMeta(like.shape, like.stride(), local.dtype)
    return DTensor(local, DTensorSpec(like.device_mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def _peel_loss_reduction(program: fx.GraphModule) -> tuple[fx.GraphModule, str | None, str | None]:
    """The loss program without its final all-reduce, with that reduction's group and op; as it
    is, with None and None, when its loss is not reduced once at the very end."""
    graph = fx.Graph()
    (reduced,) = graph.graph_copy(program.graph, {})
    if reduced.target is not torch.ops.autopar.all_reduce.default or len(reduced.users) != 0:
        return program, None, None
    partial, group, reduce_op = reduced.args
    if isinstance(partial, fx.Node) and partial.target is torch.ops.autopar.all_reduce.default:
        return program, None, None  # reduced over several axes in turn: keep it simple and synchronous
    graph.output((partial,))
    graph.erase_node(reduced)
    peeled = fx.GraphModule(program, graph)
    peeled.meta.update(program.meta)  # what it takes after the call's inputs, as the program did
    return peeled, group, reduce_op


def _register(root: nn.Module, name: str, value, buffer: bool = False) -> None:
    """Register under a dotted name, creating empty parent modules as needed."""
    *parents, leaf = name.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part) or not isinstance(getattr(module, part), nn.Module):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    (module.register_buffer if buffer else module.register_parameter)(leaf, value)


class AccumulatingModule(ParallelModule):
    """Gradient accumulation without stages: the local batch in ``microbatches`` pieces, one
    after another; the gradient sync runs with the last backward. Compiled, the pieces but the
    last run a program that sums nothing, and the last one's program takes the gradients they
    accumulated and sums them with its own (:func:`autopar.ir.zero.accumulates_in_program`)."""

    def _pieces(self, local_inputs) -> list[tuple]:
        count = self.plan.schedule.microbatches
        return list(zip(*(value.tensor_split(count) for value in local_inputs)))

    @communicating
    def train_step(self, *local_inputs, **local_kwargs) -> torch.Tensor:
        call, inputs = self._calls.prepare(local_inputs, local_kwargs, split=self._calls.given(shards=True))
        program = self._loss_program(call)  # a piece's whole loss, reduced (backward runs per piece)
        pieces = self._pieces(inputs)
        shares = self._shares(call, pieces)
        loss = 0.0
        with self._one_step():
            for index, (piece, share) in enumerate(zip(pieces, shares)):
                last = index == len(pieces) - 1
                (piece_loss,) = self._run(program if last else call.accumulating_loss_program or program, piece)
                with self._accumulating(last=last):
                    (piece_loss * share).backward()
                loss = loss + piece_loss.detach().float() * share
        return loss.to(piece_loss.dtype)

    def _shares(self, call: CallProgram, pieces: list[tuple]) -> list[float]:
        """Each piece's weight in the step's loss: a mean loss's, its share of the step's
        targets (a piece of padding counts fewer, :func:`autopar.passes.rewrite.loss.loss_count`);
        another loss's, equal."""
        if call.loss_count is None:
            return [1 / len(pieces)] * len(pieces)
        leaves = self._precision.leaves(cast_by_program=True)  # the count reads targets (and detached class weights)
        state = [*(leaves[name] for name in self._param_order), *(self.get_buffer(n) for n in self._buffer_order)]
        return call.loss_count.shares([dict(zip(call.loss_count.placeholders, (*state, *p))) for p in pieces])

    def _accumulating(self, last: bool):
        """ZeRO-2/3: each backward synced on its own (``ZeroLayout.syncs_each_microbatch``);
        otherwise accumulated locally and synced with the last."""
        if self.zero.syncs_each_microbatch:
            return synced_alone(whole_leaves(self))
        return contextlib.nullcontext() if last else self.no_sync()

    @communicating
    def forward(self, *args, **kwargs):
        """The pieces one after another (one backward through all of them: no memory saved,
        use ``train_step`` for that); scalar outputs (the loss) averaged by the pieces' shares
        (:meth:`_shares`), others concatenated."""
        call, inputs = self._calls.prepare(args, kwargs, split=self._calls.given())
        pieces = self._pieces(inputs)
        shares = torch.tensor(self._shares(call, pieces))
        runs = [self._run(call.program, piece) for piece in pieces]
        return self._calls.result(call, tuple(self._merge(values, shares) for values in zip(*runs)))

    def _merge(self, pieces: tuple[torch.Tensor, ...], shares: torch.Tensor) -> torch.Tensor:
        """One output of every piece as one: a scalar averaged by ``shares``; a batch gathered over the dp
        ranks per piece ([rank 0's piece 0, rank 1's piece 0, rank 0's piece 1, ...]) back in batch order."""
        if pieces[0].dim() == 0:
            return (torch.stack(pieces) * shares.to(pieces[0].dtype)).sum()
        ranks = self.dp_size
        if pieces[0].shape[0] % ranks:
            return torch.cat(pieces)
        return torch.stack(pieces).unflatten(1, (ranks, -1)).transpose(0, 1).flatten(0, 2)


def whole_leaves(module: ParallelModule) -> list[torch.Tensor]:
    """The trainable leaves ZeRO leaves whole (their gradients are all-reduced, not scattered)."""
    return [leaf for name, leaf in module._locals.items() if name not in module.zero.dims and leaf.requires_grad]
