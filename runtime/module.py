"""ParallelModule: the per-rank program wrapped as an nn.Module that trains like the original.

Parameters are DTensors with the planned placements, registered under the model's own
names, so ``p.full_tensor()``, torch optimizers and torch.distributed.checkpoint work. The
forward feeds their local shards (``to_local``, which routes gradients back into DTensor
``.grad``) to the rewritten graph; gradients that are partial sums over an axis are summed
by a bucketed :class:`GradSync` while backward runs.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from autopar.ir import Plan, Replicate, Shard

from .grad_sync import GradSync
from .process_groups import group_name


def to_dtensor_placement(placement):
    if isinstance(placement, Shard):
        return DShard(placement.dim)
    if isinstance(placement, Replicate):
        return DReplicate()
    return DPartial(placement.reduce_op)


def local_chunk(full: torch.Tensor, placements, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's shard of a full tensor (outer mesh dims split first, as DTensor does)."""
    local = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            size = mesh.size(mesh_dim)
            local = local.chunk(size, dim=placement.dim)[mesh.get_local_rank(mesh_dim)]
    return local.contiguous()


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
    ):
        super().__init__()
        self.program = program
        self.plan = plan
        self.device_mesh = mesh
        self._param_order = param_order
        self._buffer_order = buffer_order
        self._params: dict[str, nn.Parameter] = {}
        for name in dict.fromkeys(param_order):
            full = state[name].detach()
            placements = plan.params[name]
            local = local_chunk(full, placements, mesh).clone()
            dtensor = DTensor.from_local(local, mesh, [to_dtensor_placement(p) for p in placements], run_check=False)
            param = nn.Parameter(dtensor, requires_grad=full.requires_grad or True)
            self._params[name] = param
            _register(self, name, param)
        for alias, name in (tied or {}).items():  # the same Parameter under the tied name too
            _register(self, alias, self._params[name])
        for name in buffer_order:
            _register(self, name, state[name].detach().clone(), buffer=True)
        self._grad_sync = GradSync(
            [(self._params[name], group_name(mesh, axes)) for name, axes in plan.grad_sync.items()]
        )

    def forward(self, *local_inputs):
        """Forward on this rank's slice of the batch; returns what the model returns (the loss)."""
        params = [self._params[name].to_local() for name in self._param_order]
        buffers = [self.get_buffer(name) for name in self._buffer_order]
        outputs = self.program(*params, *buffers, *local_inputs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def train_step(self, *local_inputs) -> torch.Tensor:
        """Forward and backward; gradients are complete (and synced) when this returns."""
        loss = self(*local_inputs)
        loss.backward()
        return loss.detach()

    def no_sync(self):
        """Accumulate gradients locally over several backward passes (like DDP's no_sync)."""
        return self._grad_sync.no_sync()

    def shard_batch(self, *global_inputs):
        """This rank's slice of a global batch, as ``forward`` expects it."""
        sliced = []
        for name, value in zip(self.plan.inputs, global_inputs):
            sliced.append(local_chunk(value, self.plan.inputs[name], self.device_mesh))
        return tuple(sliced)


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
