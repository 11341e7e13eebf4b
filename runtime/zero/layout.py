"""ZeRO stages 1-3 over the data-parallel axis "dp", per parameter (as FSDP2 does).

Each parameter the plan replicates over dp is split into dp equal chunks along one dim of
its tensor-parallel-local shard (``autopar.ir.zero.zero_shard_dim``); dp rank k owns chunk k.
Per-parameter dim chunks rather than DeepSpeed's flat buffers, because a chunk along a dim is
what a DTensor placement describes: a ZeRO-3 parameter is the DTensor ``(Shard(d), <tp>)``
and a ZeRO-2 gradient likewise, so ``p.full_tensor()`` and ``p.grad.full_tensor()`` stay
right, and an elementwise optimizer on chunks is exactly the optimizer on the whole.

- ZeRO-1: gradients are all-reduced whole as without ZeRO; the optimizer (:class:`ZeroOptimizer`)
  holds state for this rank's chunks only, steps them, then all-gathers the updated chunks
  into every rank's whole parameter.
- ZeRO-2: as ZeRO-1, but the bucketed gradient sync reduce-scatters (``grad_sync.Scatter``):
  a rank keeps only its chunk of each gradient.
- ZeRO-3: the parameter itself is stored as its chunk; the rewritten program gathers it before
  its first use, one collective per layer, prefetched (:mod:`zero3`). Gradients are
  reduce-scattered per layer (:mod:`autopar.runtime.zero.reduce_scatter`), the optimizer is a plain one on the chunks.

With microbatches (gradient accumulation, pipeline stages) ZeRO does what DeepSpeed does
(:attr:`ZeroLayout.syncs_each_microbatch`): ZeRO-1 accumulates whole gradients and all-reduces
them once, with the last microbatch; ZeRO-2/3 sync each microbatch's gradients as soon as its
backward made them, reduce-scattered into the accumulated chunk (:func:`synced_alone`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import Shard as DShard

from autopar.ir import Axis, Plan
from autopar.ir.zero import zero_dims
from autopar.runtime.collectives import _chunks_from_front
from autopar.runtime.grad_sync import DEFAULT_BUCKET_SIZE_BYTES, Scatter
from autopar.runtime.process_groups import group_name


class ZeroLayout:
    """Which parameters ZeRO splits (``dims``: name → dim), and this rank's chunk of each."""

    def __init__(self, plan: Plan, mesh: DeviceMesh, shapes: dict[str, torch.Size]):
        self.stage = plan.zero
        self.dims = zero_dims(plan, shapes)
        self.dp_axis = plan.axes.index(Axis.DP) if Axis.DP in plan.axes else None
        self.parts = plan.degrees.get(Axis.DP, 1)
        self.rank = mesh.get_local_rank(Axis.DP) if self.dims else 0
        self.dp_group = group_name(mesh, (Axis.DP,)) if self.dims else None
        self.mesh = mesh

    def chunk(self, name: str, local: Tensor) -> Tensor:
        """A copy of this rank's chunk (a view would keep the whole alive)."""
        return local.chunk(self.parts, self.dims[name])[self.rank].clone(memory_format=torch.contiguous_format)

    def placements(self, name: str, placements: list) -> list:
        """The DTensor placements of ``name``'s chunk: Shard(dim) on dp instead of Replicate."""
        return [DShard(self.dims[name]) if i == self.dp_axis else p for i, p in enumerate(placements)]

    def stores_chunk(self, name: str) -> bool:
        return self.stage == 3 and name in self.dims

    def grad_is_chunk(self, name: str) -> bool:
        return self.stage >= 2 and name in self.dims

    def sync_entry(self, name: str, local: Tensor, axes: tuple[str, ...], sink: Callable) -> tuple | None:
        """What GradSync does with ``name``'s gradient, summed over ``axes`` (None: nothing)."""
        if name not in self.dims or Axis.DP not in axes or self.stage == 1:
            return local, group_name(self.mesh, axes)
        if self.stage == 3:  # reduce-scattered per layer, then summed over the others (zero/reduce_scatter.py)
            return None
        return local, self.dp_group, Scatter(self.dims[name], sink, self.sum_after_dp(axes))

    @property
    def syncs_each_microbatch(self) -> bool:
        """Whether each microbatch's gradients are synced on their own, not accumulated whole.

        ZeRO-2/3 reduce-scatter every microbatch's gradients and accumulate the chunks, as
        DeepSpeed does ("ZeRO stage >= 2 communicates during non gradient accumulation
        boundaries as well"; its ``no_sync`` refuses gradient partitioning): no rank holds a
        whole gradient longer than one microbatch's backward. ZeRO-1's gradients are whole
        anyway: they accumulate locally and are all-reduced once, as DeepSpeed's stage 1 does.
        """
        return self.stage >= 2 and bool(self.dims)

    def sum_after_dp(self, axes: tuple[str, ...]) -> str | None:
        """The group a dp-reduce-scattered gradient chunk is then all-reduced over: the other
        gradient axes (summing chunks is summing the whole), or None."""
        others = tuple(axis for axis in axes if axis != Axis.DP)
        return group_name(self.mesh, others) if others else None


def add_grad(leaf: Tensor, grad: Tensor) -> None:
    """Accumulate ``grad`` into ``leaf.grad`` as autograd would."""
    if leaf.grad is None:
        leaf.grad = grad
    else:
        leaf.grad += grad


@contextmanager
def synced_alone(leaves: list[Tensor]):
    """Run a backward (and its sync) with the gradients accumulated on ``leaves`` so far set
    aside, then add them back: a sum synced per microbatch must not hold earlier microbatches,
    which were summed already (every rank would add them again). Example::

        with synced_alone(whole_leaves):   # ZeRO-2/3: gradients ZeRO leaves whole
            (loss / microbatches).backward()   # all-reduced alone; the chunks reduce-scattered
    """
    held = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    try:
        yield
    finally:
        for leaf, grad in zip(leaves, held):
            if grad is not None:
                add_grad(leaf, grad)


def gather_chunks(
    items: list[tuple[Tensor, Tensor, int]], group: str, bucket_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
) -> None:
    """For each (chunk, whole, dim): all-gather every rank's chunk into ``whole`` (in place),
    one all-gather per bucket of about ``bucket_bytes``. Every rank passes the same list."""
    process_group = _resolve_process_group(group)
    parts = process_group.size()
    bucket, size = [], 0
    for item in items:
        same_dtype = not bucket or bucket[0][0].dtype == item[0].dtype
        if bucket and (size >= bucket_bytes or not same_dtype):
            _gather_bucket(bucket, process_group, parts)
            bucket, size = [], 0
        bucket.append(item)
        size += item[1].numel() * item[1].element_size()
    if bucket:
        _gather_bucket(bucket, process_group, parts)


@torch.no_grad()
def _gather_bucket(items, process_group, parts: int) -> None:
    sent = torch.cat([chunk.reshape(-1) for chunk, _, _ in items])
    received = sent.new_empty(parts, sent.numel())
    dist.all_gather_single(received.view(-1), sent, group=process_group)
    offset = 0
    for chunk, whole, dim in items:
        rows = received[:, offset : offset + chunk.numel()].reshape(parts, *chunk.shape)
        whole.copy_(_chunks_from_front(rows, dim))
        offset += chunk.numel()


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2: an optimizer over this rank's chunks, whose ``step()`` leaves every rank with
    the whole updated parameters. Built by ``ParallelModule.optimizer``; wraps the torch
    optimizer it builds (``.inner``), whose state it shares. Example::

        optimizer = pmodel.optimizer(torch.optim.AdamW, lr=3e-4)   # ZeroOptimizer if plan.zero in (1, 2)
        pmodel.train_step(*batch); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        chunked: list[tuple[Tensor, Tensor, int]],
        whole: list[Tensor],
        stage: int,
        layout: ZeroLayout,
    ):
        """``chunked``: (chunk leaf the optimizer steps, whole local parameter, dim);
        ``whole``: parameters ZeRO leaves whole (stepped as they are)."""
        super().__init__([p for group in inner.param_groups for p in group["params"]], inner.defaults)
        self.inner, self.param_groups, self.state = inner, inner.param_groups, inner.state
        self._chunked, self._whole, self._stage, self._layout = chunked, whole, stage, layout

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._stage == 1:  # gradients are whole: step this rank's chunk of each
            layout = self._layout
            for chunk, whole, dim in self._chunked:
                chunk.grad = (
                    None if whole.grad is None else whole.grad.chunk(layout.parts, dim)[layout.rank].contiguous()
                )
        self.inner.step()
        gather_chunks(
            [(chunk.detach(), whole.detach(), dim) for chunk, whole, dim in self._chunked], self._layout.dp_group
        )
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)
        for _, whole, _ in self._chunked:  # ZeRO-1's whole gradients; ZeRO-2's accumulated under no_sync
            if set_to_none:
                whole.grad = None
            elif whole.grad is not None:
                whole.grad.zero_()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
