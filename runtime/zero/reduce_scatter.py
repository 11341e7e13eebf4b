"""ZeRO-3 gradients, FSDP2-style: one asynchronous reduce-scatter per layer group.

The backward of each ``zero_gather`` that the runtime served hands the parameter's whole
gradient to :class:`GroupReduceScatter` instead of reduce-scattering it alone. A group's
gradients are laid out (ranks, columns) in one buffer, row k holding chunk k of each, then
one "used" flag per parameter (as ``grad_sync._ScatterBucket``); once backward has produced
all of them, one reduce-scatter leaves each rank its chunks, while backward goes on. The end
of backward waits for them and accumulates each chunk into its shard's ``.grad``.

Buckets launch strictly in one order on every rank, the reverse of the groups' first use in
forward (the order backward completes them), because collectives on one process group must
be issued in the same order everywhere. Inside ``no_sync`` the whole gradients accumulate
locally (FSDP2's ``set_requires_gradient_sync(False)``) and join the next synced reduce-scatter.

Zero-bubble pipeline schedules take weight gradients from ``torch.autograd.grad``, which sees
only what a backward returns: for them :class:`EachReduceScatter` reduce-scatters each gradient
in its gather's own backward and returns the chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime.collectives import _chunks_to_front, _resized
from autopar.runtime.faults import collective, listing
from autopar.runtime.zero.layout import add_grad


class _GradBucket:
    """One group's gradients: ``slots`` (name, dim) of the trainable ``shards`` it reduces, summed in
    ``dtype``; ``layer`` names the group in errors."""

    def __init__(self, group_name: str, slots: list, shards: list[Tensor], sum_over: list[str | None], dtype, layer):
        self.group_name, self.slots, self.shards, self.sum_over = group_name, slots, shards, sum_over
        self.where = f"in the ZeRO-3 gradient sync of {layer_phrase(layer)} ({listing([s.name for s in slots])})"
        self.dtype = dtype or shards[0].dtype
        self.parts = _resolve_process_group(group_name).size()
        self.offsets = [0]
        for shard in shards:
            self.offsets.append(self.offsets[-1] + shard.numel())
        self.arrived = [False] * len(slots)
        self.sent: Tensor | None = None
        self.received: Tensor | None = None
        self.work: dist.Work | None = None

    @property
    def is_full(self) -> bool:
        return all(self.arrived)

    def _columns(self, index: int) -> Tensor:
        return self.sent[:, self.offsets[index] : self.offsets[index + 1]]

    def _allocate(self) -> None:
        if self.sent is None:
            first = self.shards[0]
            self.sent = torch.zeros(
                self.parts, self.offsets[-1] + len(self.slots), dtype=self.dtype, device=first.device
            )

    def add(self, index: int, grad: Tensor) -> None:
        assert self.work is None, (
            f"gradient of {self.slots[index].name} arrived after its group's reduce-scatter started"
        )
        self._allocate()
        self._columns(index).add_(_chunks_to_front(grad, self.slots[index].dim, self.parts).view(self.parts, -1))
        self.arrived[index] = True

    def launch(self, unsynced: dict[str, Tensor]) -> None:
        """Start the reduce-scatter; a parameter with no gradient contributes zeros, flag 0."""
        for index, slot in enumerate(self.slots):
            if not self.arrived[index] and slot.name in unsynced:  # accumulated under no_sync, unused now
                self.add(index, unsynced.pop(slot.name))
        self._allocate()  # no gradient on this rank still takes part: others may have some
        self.sent[:, self.offsets[-1] :] = torch.tensor(self.arrived, dtype=self.sent.dtype)
        self.received = self.sent.new_empty(self.sent.shape[1])
        group = _resolve_process_group(self.group_name)
        self.work = dist.reduce_scatter_single(self.received, self.sent.view(-1), group=group, async_op=True)

    def release_if_done(self) -> None:
        """Free the send buffer of a completed reduce-scatter (issues no collective)."""
        if self.work is not None and self.sent is not None and self.work.is_completed():
            self.work.wait()
            self.sent = None

    def finish(self) -> None:
        """Wait, then accumulate each received chunk into its shard's gradient."""
        with collective("gradient reduce-scatter", self.group_name, self.where):
            self.work.wait()
        self.work = self.sent = None
        for index, (shard, sum_over) in enumerate(zip(self.shards, self.sum_over)):
            if self.received[self.offsets[-1] + index].item() == 0:
                continue  # no rank had a gradient: stays None, as in a single process
            chunk = self.received[self.offsets[index] : self.offsets[index + 1]].view(shard.shape)
            if sum_over is not None:  # the parameter's other gradient axes: summing chunks sums the whole
                with collective("gradient all-reduce", sum_over, self.where):
                    dist.all_reduce(chunk, group=_resolve_process_group(sum_over))
            add_grad(shard, chunk.to(shard.dtype))
        self.received = None
        self.arrived = [False] * len(self.slots)


def layer_phrase(layer: str) -> str:
    """A gather group's layer in words: ``layer layers.1``, or ``the root module`` for ""."""
    return f"layer {layer}" if layer else "the root module"


class GroupReduceScatter:
    """Reduce-scatter ZeRO-3 gradients per group, overlapped with backward. Example::

    grads = GroupReduceScatter(groups, shards, sum_over, syncing=lambda: True, on_first_grad=queue_finish)
    grads.add(slot, whole_grad)   # from zero_gather's backward
    grads.finish()                # at the end of backward: shards' .grad hold their chunks
    """

    def __init__(
        self,
        groups: list,
        shards: dict[str, Tensor],
        sum_over: dict[str, str | None],
        *,
        syncing: Callable[[], bool],
        on_first_grad: Callable[[], None],
        reduce_dtype: torch.dtype | None = None,
    ):
        """``groups``: GatherGroups in order of first use; ``sum_over``: name → group the chunk
        is then all-reduced over (None: none); ``reduce_dtype``: the dtype gradients are summed
        in (default: the shards')."""
        self._buckets: list[_GradBucket] = []
        self._where: dict[str, tuple[_GradBucket, int]] = {}
        for group in reversed(groups):
            slots = [slot for slot in group.slots if slot.reduce_grad and shards[slot.name].requires_grad]
            if not slots:
                continue
            bucket = _GradBucket(
                group.group_name,
                slots,
                [shards[s.name] for s in slots],
                [sum_over.get(s.name) for s in slots],
                reduce_dtype,
                group.layer,
            )
            self._buckets.append(bucket)
            self._where.update({slot.name: (bucket, index) for index, slot in enumerate(slots)})
        self._syncing, self._on_first_grad = syncing, on_first_grad
        self._unsynced: dict[str, Tensor] = {}  # whole gradients accumulated under no_sync
        self._next_to_launch = 0
        self._started = False

    def handles(self, name: str) -> bool:
        return name in self._where

    def add(self, name: str, grad: Tensor) -> None:
        """``name``'s whole gradient from this backward (its chunk reaches the shard's ``.grad``
        in :meth:`finish`: nothing for the gather's backward to return)."""
        if not self._syncing():
            held = self._unsynced.get(name)
            self._unsynced[name] = grad.detach().clone() if held is None else held.add_(grad)
            return None
        if not self._started:
            self._started = True
            self._on_first_grad()
        bucket, index = self._where[name]
        bucket.add(index, grad)
        if name in self._unsynced:
            bucket.add(index, self._unsynced.pop(name))
        buckets = self._buckets
        while self._next_to_launch < len(buckets) and buckets[self._next_to_launch].is_full:
            buckets[self._next_to_launch].launch(self._unsynced)
            self._next_to_launch += 1
        for launched in buckets[: self._next_to_launch]:
            launched.release_if_done()

    def finish(self) -> None:
        """Launch what is left, wait for every group, write the shards' gradients."""
        if not self._started:
            return
        for bucket in self._buckets[self._next_to_launch :]:
            bucket.launch(self._unsynced)
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.finish()
        self._next_to_launch = 0
        self._started = False


class EachReduceScatter:
    """Reduce-scatter ZeRO-3 gradients one at a time, in the backward of the gather, which
    returns the chunk as the shard's gradient (then summed over the parameter's other gradient
    axes). Synchronous and unbucketed: for zero-bubble pipelines, whose weight pass accumulates
    what ``torch.autograd.grad`` returns. Example::

        grads = EachReduceScatter(groups, shards, sum_over)
        chunk = grads.add(name, whole_grad)   # from zero_gather's backward: this rank's chunk of the sum
    """

    def __init__(self, groups: list, shards: dict[str, Tensor], sum_over: dict[str, str | None], reduce_dtype=None):
        self._reduce_dtype = reduce_dtype
        self._targets = {
            slot.name: (group.group_name, slot.dim, sum_over.get(slot.name))
            for group in groups
            for slot in group.slots
            if slot.reduce_grad and shards[slot.name].requires_grad
        }

    def handles(self, name: str) -> bool:
        return name in self._targets

    def add(self, name: str, grad: Tensor) -> Tensor:
        """This rank's chunk of ``name``'s gradient summed over dp (and its other axes)."""
        group_name, dim, sum_over = self._targets[name]
        group = _resolve_process_group(group_name)
        grad = grad.to(self._reduce_dtype or grad.dtype)
        chunk = grad.new_empty(_resized(grad, dim, grad.shape[dim] // group.size()))
        where = f"in the ZeRO-3 gradient sync of {name}"
        with collective("gradient reduce-scatter", group_name, where):
            dist.reduce_scatter_single(chunk.view(-1), _chunks_to_front(grad, dim, group.size()).view(-1), group=group)
        if sum_over is not None:
            with collective("gradient all-reduce", sum_over, where):
                dist.all_reduce(chunk, group=_resolve_process_group(sum_over))
        return chunk

    def finish(self) -> None:
        """Nothing waits: every chunk was returned in its backward."""
