"""ZeRO-3's parameter gathers, FSDP2-style: one collective per layer, prefetched, and a
regather per layer for backward.

The rewrite puts one ``torch.ops.autopar.zero_gather(shard, dp_group, dim, reduce_grad)``
before the first use of each dp-split parameter; the program drops the whole weight after
its last use (fx frees values after their last use). :class:`Zero3Forward` (one per forward)
serves these ops:

- parameters are grouped by layer (the first numbered module in their name, ``layers.3``;
  the others form the root group), groups ordered by first use (:func:`gather_groups`);
- a group's first gather all-gathers all its shards in one flat collective, after starting
  the next group's (prefetch, overlapped with this group's compute), as FSDP2 does per block;
- ops that save a weight for backward (matmul, layer norm) would keep it alive until then,
  so while the forward runs, a pack hook swaps every saved tensor that is (a view of) a
  gathered weight for a note; in backward the first note of a group regathers the group
  (kept until its last note is unpacked) and starts the gather backward needs next;
- the gather's backward hands the whole gradient to :class:`GroupReduceScatter`, one
  asynchronous reduce-scatter per group (or, for zero-bubble pipelines, to
  :class:`EachReduceScatter`, which returns it reduce-scattered). Run without a
  :class:`Zero3Forward` (a program called by hand), the op all-gathers alone and its backward
  reduce-scatters.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.ir import layer_of
from autopar.runtime.collectives import _all_gather_backward, _chunks_from_front, all_gather, register_dual
from autopar.runtime.faults import collective, listing
from autopar.runtime.zero.reduce_scatter import EachReduceScatter, GroupReduceScatter, layer_phrase

# Autograd nodes of view ops: a saved tensor reached from a gather through these shares its memory.
_VIEW_NODES = frozenset(
    {
        "AliasBackward0",
        "AsStridedBackward0",
        "ExpandBackward0",
        "PermuteBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "TBackward0",
        "TransposeBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)

# The forward running now: the program passes the op only tensors and strings.
_active: Zero3Forward | None = None


@dataclass(frozen=True)
class Slot:
    """One gathered parameter: its name, the dim of its dp chunks, whether its gradient is summed
    over dp (else every dp rank has it whole), and the index of its group."""

    name: str
    dim: int
    reduce_grad: bool
    group: int


@dataclass(frozen=True)
class GatherGroup:
    """Parameters gathered by one collective: a layer's (``"layers.3"``; ``""``: the root's)."""

    layer: str
    group_name: str
    slots: tuple[Slot, ...]


def gather_groups(program: fx.GraphModule, param_order: list[str], shards: dict[str, Tensor]) -> list[GatherGroup]:
    """The program's ``zero_gather`` ops grouped by layer, dtype and process group, in order of
    first use. ``param_order`` names the program's first placeholders; ``shards`` their tensors.

    >>> [g.layer for g in gather_groups(program, param_order, shards)]   # doctest: +SKIP
    ['', 'layers.0', 'layers.1']
    """
    placeholders = [node for node in program.graph.nodes if node.op == "placeholder"]
    names = dict(zip(placeholders, param_order))
    members: dict[tuple, list[tuple[str, int, bool]]] = {}
    seen = set()
    for node in program.graph.nodes:
        if node.target is not torch.ops.autopar.zero_gather.default or names.get(node.args[0]) in seen:
            continue  # a parameter fed twice is served once; its other gather runs alone
        shard, group_name, dim, reduce_grad = node.args
        seen.add(name := names[shard])
        members.setdefault((layer_of(name) or "", shards[name].dtype, group_name), []).append((name, dim, reduce_grad))
    return [
        GatherGroup(layer, group_name, tuple(Slot(name, dim, reduce_grad, index) for name, dim, reduce_grad in slots))
        for index, ((layer, _, group_name), slots) in enumerate(members.items())
    ]


def unflatten_gathered(received: Tensor, shapes: list[torch.Size], dims: list[int]) -> list[Tensor]:
    """Each parameter's whole weight (a fresh tensor) from a flat gather's (ranks, columns)
    buffer, in which row k holds rank k's shards end to end."""
    wholes, offset = [], 0
    for shape, dim in zip(shapes, dims):
        rows = received[:, offset : offset + shape.numel()].reshape(received.shape[0], *shape)
        wholes.append(_chunks_from_front(rows, dim))
        offset += shape.numel()
    return wholes


class _FlatGather:
    """One group's all-gather in flight."""

    def __init__(self, group: GatherGroup, shards: list[Tensor]):
        with torch.no_grad():
            self.sent = torch.cat([shard.detach().reshape(-1) for shard in shards])
        process_group = _resolve_process_group(group.group_name)
        self.received = self.sent.new_empty(process_group.size(), self.sent.numel())
        self.work = dist.all_gather_single(self.received.view(-1), self.sent, group=process_group, async_op=True)
        self.shapes, self.dims = [shard.shape for shard in shards], [slot.dim for slot in group.slots]
        self.group_name = group.group_name
        self.where = f"in the ZeRO-3 gather of {layer_phrase(group.layer)} ({listing([s.name for s in group.slots])})"

    def finish(self) -> None:
        with collective("parameter all-gather", self.group_name, self.where):
            self.work.wait()

    def wait(self) -> list[Tensor]:
        self.finish()
        return unflatten_gathered(self.received, self.shapes, self.dims)


@dataclass(frozen=True)
class _Note:
    """A saved gathered weight, by reference: its slot and the view of the whole to rebuild."""

    slot: Slot
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


class Zero3Forward:
    """Serves one forward's ``zero_gather`` ops from per-layer gathers and regathers them for
    backward. Example::

        with Zero3Forward(groups, shards, grads).recording():
            loss = program(*shards, *inputs)   # one all-gather per layer, prefetched
        loss.backward()                        # regathered per layer; gradients to ``grads``
    """

    def __init__(
        self,
        groups: list[GatherGroup],
        shards: dict[str, Tensor],
        grads: GroupReduceScatter | EachReduceScatter | None = None,
    ):
        self.groups, self.grads = groups, grads
        self._shards = [[shards[slot.name] for slot in group.slots] for group in groups]
        self._slot_by_data = {shards[slot.name].data_ptr(): slot for group in groups for slot in group.slots}
        self._in_flight: dict[int, _FlatGather] = {}
        self._untaken: dict[int, dict[str, Tensor]] = {}  # forward: group → gathered weights not yet used
        self._served: dict[int, Slot] = {}  # data_ptr of a weight handed to the program → its slot
        self._notes_left = [0] * len(groups)  # per group: notes packed and not yet unpacked
        self._last_packed = [-1] * len(groups)
        self._packed = 0
        self._regathered: dict[int, list[Tensor]] = {}
        self._backward_order: list[int] | None = None

    @contextmanager
    def recording(self):
        global _active
        previous, _active = _active, self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            _active = previous
            for gather in self._in_flight.values():  # every rank started them: finish them too
                gather.finish()
            self._in_flight.clear()
            self._untaken.clear()
            self._served.clear()

    def take(self, shard: Tensor) -> Tensor | None:
        """``shard``'s whole weight, gathered with its group's; None if this runtime does not serve it."""
        slot = self._slot_by_data.get(shard.data_ptr())
        if slot is None:
            return None
        if slot.group not in self._untaken:
            self._start(slot.group)
            self._start(slot.group + 1)  # prefetch: the next layer's gather overlaps this one's compute
            gathered = self._in_flight.pop(slot.group).wait()
            self._untaken[slot.group] = {s.name: whole for s, whole in zip(self.groups[slot.group].slots, gathered)}
        whole = self._untaken[slot.group].pop(slot.name, None)  # the program holds it from now on
        if whole is not None:
            self._served[whole.data_ptr()] = slot
        return whole

    def served(self, whole: Tensor) -> Slot | None:
        """The slot of a weight :meth:`take` returned (asked once, from the op's autograd setup)."""
        return self._served.pop(whole.data_ptr(), None)

    def _start(self, group: int) -> None:
        if group < len(self.groups) and group not in self._in_flight:
            self._in_flight[group] = _FlatGather(self.groups[group], self._shards[group])

    def _pack(self, tensor: Tensor):
        # A gathered weight, or a view of one, is found by its autograd history: view nodes
        # back to a zero_gather node (frozen shards have none: their weights stay saved whole).
        node = tensor.grad_fn
        while node is not None and node.name() in _VIEW_NODES:
            node = node.next_functions[0][0]
        slot = getattr(node, "slot", None) if node is not None and "autopar_zero_gather" in node.name() else None
        if slot is None:
            return tensor
        self._notes_left[slot.group] += 1
        self._last_packed[slot.group], self._packed = self._packed, self._packed + 1
        return _Note(slot, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())

    def _unpack(self, packed):
        if not isinstance(packed, _Note):
            return packed
        group = packed.slot.group
        wholes = self._regathered.get(group) or self._regather(group)
        self._notes_left[group] -= 1
        if self._notes_left[group] <= 0:
            self._regathered.pop(group, None)
        whole = wholes[self.groups[group].slots.index(packed.slot)]
        return whole.as_strided(packed.size, packed.stride, packed.storage_offset)

    def _regather(self, group: int) -> list[Tensor]:
        if group not in self._in_flight:
            self._start(group)
        following = self._next_in_backward(group)
        if following is not None:
            self._start(following)
        wholes = self._in_flight.pop(group).wait()
        if self._notes_left[group] > 1:  # more notes to come: keep the group until its last one
            self._regathered[group] = wholes
        return wholes

    def _next_in_backward(self, group: int) -> int | None:
        """The group whose notes backward unpacks after ``group``'s: the reverse of their last packing."""
        if self._backward_order is None:
            packed = [g for g in range(len(self.groups)) if self._last_packed[g] >= 0]
            self._backward_order = sorted(packed, key=lambda g: -self._last_packed[g])
        order = self._backward_order
        later = order[order.index(group) + 1 :] if group in order else []
        return next((g for g in later if self._notes_left[g] > 0 and g not in self._regathered), None)


@torch.library.custom_op("autopar::zero_gather", mutates_args=())
def zero_gather(shard: Tensor, group_name: str, dim: int, reduce_grad: bool) -> Tensor:
    """All-gather a parameter's ZeRO-3 shards along ``dim``; backward: reduce-scatter (sum) if
    ``reduce_grad``, else this rank's chunk. Served from its layer's gather while a
    :class:`Zero3Forward` records; otherwise the all-gather of :mod:`autopar.runtime.collectives`."""
    whole = _active.take(shard) if _active is not None else None
    return whole if whole is not None else all_gather(shard, group_name, dim, reduce_grad)


@zero_gather.register_fake
def _(shard, group_name, dim, reduce_grad):
    return torch.ops.autopar.all_gather.default(shard, group_name, dim, reduce_grad)


def _setup_zero_gather(ctx, inputs, output):
    ctx.args = inputs[1:]
    ctx.slot = _active.served(output) if _active is not None else None  # read by Zero3Forward._pack
    ctx.grads = _active.grads if ctx.slot is not None else None


def _zero_gather_backward(ctx, grad):
    _, _, reduce_grad = ctx.args
    if ctx.grads is None or not reduce_grad or not ctx.grads.handles(ctx.slot.name):
        return _all_gather_backward(ctx, grad)
    chunk = ctx.grads.add(ctx.slot.name, grad)  # None: reduce-scattered with its group, the shard's .grad set then
    return chunk, None, None, None


register_dual(zero_gather, _zero_gather_backward, _setup_zero_gather)


class Zero3Runtime:
    """A ParallelModule's ZeRO-3 state: its programs' gather groups and gradient reducer. Example::

        zero3 = Zero3Runtime(program, param_order, shards, sum_over, syncing=..., on_first_grad=...)
        with zero3.forward(shards):
            loss = program(*shards, *inputs)
        loss.backward(); zero3.finish_backward()   # from the module's end-of-backward callback

    ``per_parameter=True`` reduce-scatters each gradient in its gather's backward instead
    (:class:`EachReduceScatter`: zero-bubble pipelines; ``syncing`` and ``on_first_grad`` unused).
    ``shards`` are the masters gradients land on; ``forward`` may be given other tensors for
    them (mixed precision: their 16-bit copies, which the gathers then move);
    ``reduce_dtype`` is the dtype gradients are reduce-scattered in (default: the masters').
    """

    def __init__(
        self,
        program: fx.GraphModule,
        param_order: list[str],
        shards: dict[str, Tensor],
        sum_over: dict[str, str | None],
        *,
        syncing,
        on_first_grad,
        per_parameter: bool = False,
        reduce_dtype: torch.dtype | None = None,
    ):
        self.groups = gather_groups(program, param_order, shards)
        if per_parameter:
            self.grads = EachReduceScatter(self.groups, shards, sum_over, reduce_dtype)
        else:
            self.grads = GroupReduceScatter(
                self.groups, shards, sum_over, syncing=syncing, on_first_grad=on_first_grad, reduce_dtype=reduce_dtype
            )

    def forward(self, shards: dict[str, Tensor]):
        return Zero3Forward(self.groups, shards, self.grads).recording()

    def finish_backward(self) -> None:
        self.grads.finish()
