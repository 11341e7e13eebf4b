"""Calls of a parallelized model made as the model's own: ``pmodel(*args, **kwargs)``.

Input convention (single-program semantics): every rank passes the same GLOBAL batch, as a
one-process script would, and gets the one-process result (the loss of the whole batch,
the whole batch's logits); autopar keeps each rank's share of every input, as the plan places
it. With ``local_batches=True`` each rank passes its own data-parallel share instead, which a
per-rank loader draws as ``DistributedSampler(num_replicas=pmodel.dp_size, rank=pmodel.dp_rank)``
would (torchtitan's dp_degree/dp_rank): autopar then only splits what the batch axes do not
(the sequence over cp). ``train_step`` takes this rank's shards on every axis, as
``shard_batch`` gives them. Outputs are the whole batch's in every case.

A call is bound by name (the API's ``bind``) and keyed by its signature: the arguments'
structure, each tensor's shape (of the whole batch it is a share of) and dtype, each
constant. The first call with a new signature asks the API's ``compile`` for its
:class:`CallProgram` (capture at these shapes, check that the plan still holds, rewrite) and
keeps it; later calls reuse it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from autopar.ir import BATCH_DIMS, Axis, InputError, Shard, format_placements
from autopar.runtime.kernels.zigzag import zigzag_order
from autopar.runtime.process_groups import rank_device


@dataclass(frozen=True)
class CallProgram:
    """What calls of one signature run, built by ``autopar.parallelize`` for the first of them."""

    program: Any  # a rewritten GraphModule, or a pipeline's stage programs
    loss_program: Any  # the GraphModule returning only the loss (None: the first output is no scalar)
    inputs: dict[str, tuple]  # placeholder name → placements, one per tensor leaf of the call, in order
    out_spec: TreeSpec | None  # rebuilds the model's result from the program's outputs
    signature: tuple  # what :meth:`Calls.signature` gives the calls it runs
    # compiled gradient accumulation: the loss program of the microbatches before the last, which
    # sums nothing (``loss_program`` then runs the last, summing what these accumulated); else None
    accumulating_loss_program: Any = None
    # over microbatches, a mean loss's count of targets (autopar.passes.rewrite.loss.LossCount): the
    # runtime weighs each microbatch's loss by its share of the step's targets; else None (equal shares)
    loss_count: Any = None


def local_chunk(full: torch.Tensor, placements, mesh: DeviceMesh, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """This rank's shard of a full tensor (outer mesh dims split first, as DTensor does; on
    the context-parallel dim a head and a tail chunk, see :mod:`autopar.runtime.kernels.zigzag`);
    mesh dims named in ``skip`` are taken as already split."""
    local = full
    names = mesh.mesh_dim_names or ()
    for mesh_dim, placement in enumerate(placements):
        name = names[mesh_dim] if mesh_dim < len(names) else None
        if isinstance(placement, Shard) and name not in skip:
            size = mesh.size(mesh_dim)
            if name == Axis.CP:
                local = local.index_select(
                    placement.dim, zigzag_order(local.shape[placement.dim], size).to(local.device)
                )
            local = local.chunk(size, dim=placement.dim)[mesh.get_local_rank(mesh_dim)]
    return local.contiguous()


class Calls:
    """Binds a call, finds (or has built) its :class:`CallProgram`, splits its inputs, rebuilds
    the result. ``bind(args, kwargs)`` names the arguments; ``compile(bound)`` builds the
    CallProgram for arguments of their GLOBAL size; ``planned`` are the planned inputs'
    placements (by placeholder name), which say how a rank's share scales to the whole."""

    def __init__(
        self, bind: Callable, compile: Callable, mesh: DeviceMesh, planned: dict[str, tuple], local_batches: bool
    ):  # fmt: skip
        self._bind, self._compile, self._planned = bind, compile, planned
        self.mesh, self.local_batches = mesh, local_batches
        self._programs: dict[tuple, CallProgram] = {}
        self._first: CallProgram | None = None  # the planning call's: what inputs are checked against

    def add(self, program: CallProgram) -> None:
        self._programs[program.signature] = program
        self._first = self._first or program

    def bind(self, args: tuple, kwargs: dict) -> dict:
        return self._bind(args, kwargs)

    def prepare(self, args: tuple, kwargs: dict, *, split: tuple[str, ...] = ()) -> tuple[CallProgram, list]:
        """The call's program and this rank's shards of its tensor inputs, in placeholder order.
        ``split``: the mesh axes the inputs are already split along (:attr:`batch_axes` for a
        per-rank loader's share, :attr:`axes` for ``shard_batch``'s output): the program is the
        one for the whole batch they are a share of."""
        bound = self._bind(args, kwargs)
        scale = self._scale(bound, split)
        signature = self.signature(bound, scale)
        program = self._programs.get(signature)
        if program is None:
            self.check(bound, split)
            program = self._compile({name: _repeated(value, scale.get(name, {})) for name, value in bound.items()})
            self._programs[signature] = program
        tensors = [leaf for leaf in tree_flatten(bound)[0] if isinstance(leaf, torch.Tensor)]
        device = rank_device(self.mesh)
        return program, [  # each share where this rank computes, as FSDP2's root forward moves inputs
            local_chunk(value, placements, self.mesh, split).to(device)
            for value, placements in zip(tensors, program.inputs.values(), strict=True)
        ]

    def check(self, bound: dict, split: tuple[str, ...]) -> None:
        """Raise :class:`InputError` naming the first tensor input that the planning call also
        had but of another dtype or rank, or, where shares are expected (``split``), as large as
        the planning call's whole batch where the plan splits it (the global batch passed where a
        share belongs). Other sizes are calls of their own (:mod:`autopar.passes.program`)."""
        if self._first is None:
            return
        planned: dict[str, list] = {}
        tensors = [entry for entry in self._first.signature if not isinstance(entry[2], str)]
        for (name, _, whole, dtype), placements in zip(tensors, self._first.inputs.values(), strict=True):
            planned.setdefault(name, []).append((whole, dtype, placements))
        unsplit = tuple(axis for axis in self.axes if axis not in split)
        seen: dict[str, int] = {}
        leaves = [(name, leaf) for name, value in bound.items() for leaf in tree_flatten(value)[0]]
        for index, (name, value) in enumerate([(n, v) for n, v in leaves if isinstance(v, torch.Tensor)], 1):
            position = seen[name] = seen.get(name, -1) + 1
            if position >= len(planned.get(name, ())):
                continue
            whole, dtype, placements = planned[name][position]
            share = tuple(
                local_chunk(torch.empty(whole, dtype=dtype, device="meta"), placements, self.mesh, unsplit).shape
            )
            stray = split and tuple(value.shape) == whole != share
            if value.dtype == dtype and value.dim() == len(whole) and not stray:
                continue
            where = "on this rank" if split == self.axes else ("as this rank's batch share" if split else "whole")
            give = "pmodel.shard_batch(*global_batch)" if split == self.axes else "inputs"
            raise InputError(
                f"input {name!r} (argument {index}) is {_described(value.dtype, value.shape)}, but the plan takes "
                f"{_described(dtype, share)} {where} (the global {list(whole)} split {format_placements(placements)}): "
                f"pass {give} of that dtype, or plan again for inputs like these"
            )

    def given(self, *, shards: bool = False) -> tuple[str, ...]:
        """The axes a call's inputs come split along: none (the global batch), the batch axes
        (``local_batches``), or every axis (``shards``: what ``shard_batch`` gives)."""
        if shards:
            return self.axes
        return self.batch_axes if self.local_batches else ()

    def _scale(self, bound: dict, split: tuple[str, ...]) -> dict[str, dict[int, int]]:
        """How many times each top-level input of a rank's share repeats along each dim in the
        whole batch: the sizes of the ``split`` axes where the plan splits it (an input the plan
        does not know: the batch axes along dim 0, when it is as long as the others)."""
        if not split:
            return {}
        names = self.axes
        tensors = [value for value in bound.values() if isinstance(value, torch.Tensor) and value.dim()]
        batch = tensors[0].shape[0] if tensors else None
        scale = {}
        for name, value in bound.items():
            if not isinstance(value, torch.Tensor):
                continue
            placements = self._planned.get(name)
            if placements is None and value.dim() and value.shape[0] == batch:
                placements = tuple(Shard(0) if axis in BATCH_DIMS else None for axis in names)
            factors: dict[int, int] = {}
            for axis, placement in zip(names, placements or ()):
                if axis in split and isinstance(placement, Shard):
                    factors[placement.dim] = factors.get(placement.dim, 1) * self.mesh.size(names.index(axis))
            scale[name] = factors
        return scale

    @staticmethod
    def signature(bound: dict, scale: dict[str, dict[int, int]] | None = None) -> tuple:
        """What decides the program: the structure, every tensor's (whole-batch) shape and dtype,
        every constant (not where a tensor is: inputs move to the rank's device)."""
        scale = scale or {}
        described = []
        for name, value in bound.items():
            leaves, spec = tree_flatten(value)
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    shape = [size * scale.get(name, {}).get(dim, 1) for dim, size in enumerate(leaf.shape)]
                    described.append((name, str(spec), tuple(shape), leaf.dtype))
                else:
                    described.append((name, str(spec), "constant", leaf))
        return tuple(described)

    @staticmethod
    def result(program: CallProgram, outputs: tuple):
        """What the model returns (a tensor, a tuple, a ``ModelOutput``...), from the program's outputs."""
        if program.out_spec is None:
            return outputs[0] if len(outputs) == 1 else tuple(outputs)
        return tree_unflatten(list(outputs), program.out_spec)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.mesh_dim_names or ())

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(axis for axis in self.axes if axis in BATCH_DIMS)

    @property
    def dp_size(self) -> int:
        """How many distinct shares the batch splits into (the data-parallel ranks a loader serves)."""
        size = 1
        for axis in self.batch_axes:
            size *= self.mesh.size(self.mesh.mesh_dim_names.index(axis))
        return size

    @property
    def dp_rank(self) -> int:
        """Which share of the batch this rank holds, ``0 <= dp_rank < dp_size`` (outer axes first,
        as :func:`local_chunk` splits the batch)."""
        rank = 0
        for axis in self.batch_axes:
            dim = self.mesh.mesh_dim_names.index(axis)
            rank = rank * self.mesh.size(dim) + self.mesh.get_local_rank(dim)
        return rank


def _described(dtype: torch.dtype, shape) -> str:
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"


def _repeated(value, factors: dict[int, int]):
    """A rank's share made as long as the whole batch (its rows repeated), to capture the whole
    batch's graph: values matter only where capture runs the model (expert routing statistics)."""
    for dim, factor in factors.items():
        value = torch.cat([value] * factor, dim)
    return value
