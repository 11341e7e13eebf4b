"""Bucketed, overlapped gradient all-reduce over the data-parallel axes (DDP's reducer, small).

Each parameter's gradient is summed (no division: the loss scaling is the plan's business)
over the group it is listed with, in the parameter's dtype or in ``reduce_dtype`` (mixed
precision: the buckets are that dtype, the sums land in the gradients' own). Parameters of one
group, dtype and device share flat buckets of about ``bucket_size_bytes``, filled in reverse
registration order (the order backward produces gradients). A post-accumulate-grad hook
copies each gradient into its bucket; a full bucket is all-reduced asynchronously while
backward goes on. A callback
queued on the autograd engine waits for every bucket at the end of backward and copies
the sums back, so the gradients are synced when ``loss.backward()`` returns.

Buckets are launched strictly in list order on every rank, as in DDP: collectives on one
group must be issued in the same order everywhere, even when ranks produce gradients in
different orders or leave different parameters unused.

ZeRO-2 lists a parameter with a :class:`Scatter`: its bucket is reduce-scattered instead, each
rank receiving only its chunk of the summed gradient (handed to ``Scatter.sink``); the full
gradient is dropped as soon as it is copied into the bucket, and the bucket's buffer lives
only while its reduction is in flight.
"""

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor

from autopar.ir.buckets import BUCKET_BYTES as DEFAULT_BUCKET_SIZE_BYTES
from autopar.ir.buckets import FIRST_BUCKET_BYTES as DEFAULT_FIRST_BUCKET_BYTES
from autopar.runtime.collectives import _chunks_to_front
from autopar.runtime.faults import collective, listing


def local_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's local part (sharing its storage), or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def weak_hook(method: Callable, *args) -> Callable[[Tensor], None]:
    """A tensor hook calling ``method`` (bound) with ``args`` and the tensor while its object lives.

    A hook holds its owner strongly otherwise, and a parameter's hooks are not seen by Python's
    cycle collector while autograd also holds the parameter: a dropped model's memory (a GPU's) would
    never be freed.
    """
    owner = weakref.WeakMethod(method)

    def hook(tensor: Tensor) -> None:
        bound = owner()
        if bound is not None:
            bound(*args, tensor)

    return hook


@dataclass
class _Bucket:
    """Gradients of ``params`` laid end to end in ``buffer``, then one "used" flag per param.

    The flags are summed with the gradients: a parameter unused on this rank but used on
    another one still receives the summed gradient, while one unused everywhere keeps
    ``grad = None``, as it would in a single process.
    """

    group_name: str
    params: list[Tensor]
    buffer: Tensor
    offsets: list[int]
    ready: list[bool] = field(init=False)
    num_ready: int = 0
    work: dist.Work | None = None
    where: str = ""  # how a failed reduction names this bucket: "in the gradient sync of bucket 2 (...)"

    def __post_init__(self):
        self.ready = [False] * len(self.params)

    @property
    def is_full(self) -> bool:
        return self.num_ready == len(self.params)

    def _slot(self, index: int) -> Tensor:
        local = local_tensor(self.params[index])
        start = self.offsets[index]
        return self.buffer[start : start + local.numel()].view(local.shape)

    def _flag(self, index: int) -> Tensor:
        return self.buffer[self.offsets[-1] + index]

    def copy_in(self, index: int) -> None:
        self._slot(index).copy_(local_tensor(self.params[index].grad))
        self.ready[index] = True
        self.num_ready += 1

    def launch(self) -> None:
        """Start the all-reduce; a parameter with no gradient yet contributes zeros."""
        self._flags().fill_(1)
        for index, param in enumerate(self.params):
            if self.ready[index]:
                continue
            if param.grad is None:
                self._slot(index).zero_()
                self._flag(index).zero_()
            else:  # accumulated under no_sync, unused in this last backward
                self.copy_in(index)
        self.work = self._reduce()

    def _flags(self) -> Tensor:
        return self.buffer[self.offsets[-1] :]

    def _reduce(self) -> dist.Work:
        return dist.all_reduce(self.buffer, group=_resolve_process_group(self.group_name), async_op=True)

    def finish(self) -> None:
        """Wait for the all-reduce and write the sums into the gradients."""
        with collective("gradient all-reduce", self.group_name, self.where):
            self.work.wait()
        for index, param in enumerate(self.params):
            if param.grad is not None:
                local_tensor(param.grad).copy_(self._slot(index))
            elif self._flag(index).item() > 0:
                param.grad = self._materialized_grad(param, self._slot(index).to(param.dtype, copy=True))
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.work = None

    @staticmethod
    def _materialized_grad(param: Tensor, local: Tensor) -> Tensor:
        if not isinstance(param, DTensor):
            return local
        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )


@dataclass(frozen=True)
class Scatter:
    """Reduce-scatter a parameter's gradient over its group along ``dim`` (ZeRO-2).

    ``sink(param, chunk)`` receives this rank's chunk of the sum (None where no rank had a
    gradient); ``then_sum_over`` names a group the chunk is then all-reduced over (the
    parameter's other gradient axes: summing chunks is summing the whole).
    """

    dim: int
    sink: Callable[[Tensor, Tensor | None], None]
    then_sum_over: str | None = None


class _ScatterBucket(_Bucket):
    """A bucket laid out (ranks, columns): row k holds chunk k of every gradient, then one
    "used" flag per parameter, so one reduce-scatter leaves each rank its chunks and flags."""

    def __init__(
        self,
        group_name: str,
        params: list[Tensor],
        scatters: list[Scatter],
        parts: int,
        offsets: list[int],
        dtype,
        device,
    ):
        super().__init__(group_name, params, None, offsets)
        self.scatters, self.parts, self.dtype, self.device = scatters, parts, dtype, device
        self.received: Tensor | None = None

    def _slot(self, index: int) -> Tensor:
        return self.buffer[:, self.offsets[index] : self.offsets[index + 1]]

    def _flag(self, index: int) -> Tensor:
        return self.buffer[:, self.offsets[-1] + index]

    def _flags(self) -> Tensor:
        return self.buffer[:, self.offsets[-1] :]

    def copy_in(self, index: int) -> None:
        if self.buffer is None:
            self.buffer = torch.empty(
                self.parts, self.offsets[-1] + len(self.params), dtype=self.dtype, device=self.device
            )
        param = self.params[index]
        self._slot(index).copy_(_chunks_to_front(param.grad, self.scatters[index].dim, self.parts).view(self.parts, -1))
        param.grad = None  # ZeRO-2: only the chunk of the sum is kept
        self.ready[index] = True
        self.num_ready += 1

    def launch(self) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(
                self.parts, self.offsets[-1] + len(self.params), dtype=self.dtype, device=self.device
            )
        super().launch()

    def _reduce(self) -> dist.Work:
        group = _resolve_process_group(self.group_name)
        self.received = self.buffer.new_empty(self.buffer.shape[1])
        return dist.reduce_scatter_single(self.received, self.buffer.view(-1), group=group, async_op=True)

    def finish(self) -> None:
        with collective("gradient reduce-scatter", self.group_name, self.where):
            self.work.wait()
        self.buffer = None
        for index, (param, scatter) in enumerate(zip(self.params, self.scatters)):
            shape = list(param.shape)
            shape[scatter.dim] //= self.parts
            used = self.received[self.offsets[-1] + index].item() > 0
            chunk = self.received[self.offsets[index] : self.offsets[index + 1]].view(shape) if used else None
            if chunk is not None and scatter.then_sum_over is not None:
                with collective("gradient all-reduce", scatter.then_sum_over, self.where):
                    dist.all_reduce(chunk, group=_resolve_process_group(scatter.then_sum_over))
            scatter.sink(param, None if chunk is None else chunk.to(param.dtype))
        self.received = None
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.work = None


def _make_buckets(
    entries: Sequence[tuple], bucket_size_bytes: int, first_bucket_bytes: int, reduce_dtype: torch.dtype | None
) -> list[_Bucket]:
    """Fill buckets in backward order; order them by when their last gradient should arrive.

    ``entries`` are (param, group) or (param, group, Scatter)."""
    members: list[tuple[int, str, list[tuple]]] = []  # (last arrival, group, entries)
    open_members: dict[tuple, tuple[str, list[tuple]]] = {}
    open_bytes: dict[tuple, int] = {}
    for arrival, entry in enumerate(reversed(entries)):
        param, group, scatter = (*entry, None)[:3]
        local = local_tensor(param)
        key = (group, local.dtype, local.device, scatter is not None and scatter.then_sum_over)
        open_members.setdefault(key, (group, []))[1].append((param, scatter))
        open_bytes[key] = open_bytes.get(key, 0) + local.numel() * local.element_size()
        if open_bytes[key] >= (bucket_size_bytes if members else min(first_bucket_bytes, bucket_size_bytes)):
            members.append((arrival, *open_members.pop(key)))
            del open_bytes[key]
    last_arrival = len(entries)
    members += [(last_arrival, group, bucket) for group, bucket in open_members.values()]
    members.sort(key=lambda member: member[0])
    return [_allocate_bucket(group, bucket, reduce_dtype) for _, group, bucket in members]


def _allocate_bucket(group_name: str, entries: list[tuple], reduce_dtype: torch.dtype | None) -> _Bucket:
    params = [param for param, _ in entries]
    first = local_tensor(params[0])
    dtype = reduce_dtype or first.dtype
    scatters = [scatter for _, scatter in entries]
    if scatters[0] is not None:
        parts = _resolve_process_group(group_name).size()
        offsets = [0]
        for param in params:
            offsets.append(offsets[-1] + param.numel() // parts)
        return _ScatterBucket(group_name, params, scatters, parts, offsets, dtype, first.device)
    offsets = [0]
    for param in params:
        offsets.append(offsets[-1] + local_tensor(param).numel())
    buffer = torch.empty(offsets[-1] + len(params), dtype=dtype, device=first.device)
    return _Bucket(group_name, params, buffer, offsets)


class GradSync:
    """Sum gradients over process groups during backward, bucketed and overlapped, like DDP.

    ``params_and_groups`` lists (parameter, c10d group name), or (parameter, group, Scatter)
    to reduce-scatter the gradient (ZeRO-2, plain tensors only); parameters that need no sync
    are left out, frozen ones are skipped. Parameters may be DTensors (their local gradient
    is reduced in place). Every rank of a group must list the same parameters of that group
    in the same order, and every synced backward must produce at least one of their
    gradients on every rank (else that rank issues no all-reduce and the others wait).
    ``names`` (``id(param)`` → its name) lets a failed reduction name its bucket's parameters.
    Example::

        sync = GradSync([(p, dp_group) for p in model.parameters()])
        loss.backward()                       # grads are summed over dp here
        with sync.no_sync():                  # gradient accumulation: skip the sync ...
            model(x1).sum().backward()
        model(x2).sum().backward()            # ... and sum the accumulated grads here
    """

    def __init__(
        self,
        params_and_groups: Sequence[tuple[Tensor, str]],
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        auto_finish: bool = True,
        reduce_dtype: torch.dtype | None = None,
        names: Mapping[int, str] | None = None,
        syncing: bool = True,
    ):
        """``auto_finish=False``: the owner calls :meth:`finish` at the end of each backward
        (from its own engine callback), e.g. to run more work after the sums are in place.
        ``reduce_dtype``: the dtype gradients are summed in (default: each parameter's own).
        ``syncing=False``: backward passes sync only inside :meth:`summing_now` or :meth:`syncing_now`."""
        trainable = [entry for entry in params_and_groups if entry[0].requires_grad]
        if len({id(entry[0]) for entry in trainable}) != len(trainable):
            raise ValueError("GradSync: a parameter is listed twice; list each one once")
        self._buckets = _make_buckets(trainable, bucket_size_bytes, first_bucket_bytes, reduce_dtype)
        for index, bucket in enumerate(self._buckets):
            listed = [(names or {}).get(id(param), f"a {tuple(param.shape)} parameter") for param in bucket.params]
            bucket.where = f"in the gradient sync of bucket {index} ({listing(listed)})"
        self._auto_finish = auto_finish
        self._sync_enabled = syncing
        self._next_to_launch = 0
        self._finish_queued = False
        self._finished = 0  # syncs done, so summing_now sees whether its backward's hooks synced
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready, bucket, index))
            for bucket in self._buckets
            for index, param in enumerate(bucket.params)
        ]

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def syncing(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self._sync_enabled

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally; the next one outside syncs
        the accumulated sum."""
        return self._syncing(False)

    def syncing_now(self) -> AbstractContextManager[None]:
        """Inside :meth:`no_sync`: the backward inside syncs the accumulated sums as it makes
        them (the last backward of an accumulation, its buckets reduced behind it)."""
        return self._syncing(True)

    @contextmanager
    def summing_now(self) -> Iterator[None]:
        """As :meth:`syncing_now`, and gradients set where no hook of autograd's sees them (a
        zero-bubble weight pass assigns them) are summed when the pass inside returns."""
        finished = self._finished
        with self._syncing(True):
            yield
        if self._finished == finished:
            self.sync_accumulated()

    @contextmanager
    def _syncing(self, enabled: bool) -> Iterator[None]:
        previous, self._sync_enabled = self._sync_enabled, enabled
        try:
            yield
        finally:
            self._sync_enabled = previous

    def remove(self) -> None:
        """Detach the hooks; gradients are no longer synced."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def _on_grad_ready(self, bucket: _Bucket, index: int, param: Tensor) -> None:
        if not self._sync_enabled:
            return
        if not self._finish_queued:
            if self._auto_finish:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._finish_queued = True
        assert bucket.work is None, "a gradient arrived for a bucket already being reduced"
        bucket.copy_in(index)
        buckets = self._buckets
        while self._next_to_launch < len(buckets) and buckets[self._next_to_launch].is_full:
            buckets[self._next_to_launch].launch()
            self._next_to_launch += 1

    def finish(self) -> None:
        """Wait for this backward's sums (launching what is left); no-op if none started."""
        if not self._finish_queued:
            return
        for bucket in self._buckets[self._next_to_launch :]:
            bucket.launch()
        for bucket in self._buckets:
            bucket.finish()
        self._next_to_launch = 0
        self._finish_queued = False
        self._finished += 1

    def sync_accumulated(self) -> None:
        """Sum the gradients accumulated so far now (after backward passes run under
        :meth:`no_sync`, or gradients set outside autograd's hooks, as a zero-bubble
        pipeline's weight pass does)."""
        self._finish_queued = True
        self.finish()
