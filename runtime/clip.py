"""Gradient clipping by the global norm: ``torch.nn.utils.clip_grad_norm_`` as the unparallelized
model would compute it, on every rank alike.

A gradient's norm is taken over all its shards (DTensor gradients: tensor parallelism, ZeRO);
in a pipeline each rank holds its stages' gradients only, so the stages' norms are combined over
the pipeline's ranks (as torchtitan's ``clip_grad_norm_`` does with its pp mesh), and a weight
two stages share (tied embeddings), whose summed gradient both hold, counts once: on the first
device holding it. Then every gradient is scaled by ``max_norm / norm`` when that is below 1.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.ir import Axis
from autopar.runtime.grad_sync import local_tensor


def clip_grad_norm_(module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale ``module``'s gradients so their global ``norm_type``-norm is at most ``max_norm``;
    returns the norm before clipping (a plain tensor, the same on every rank). Example::

        loss = pmodel.train_step(*batch)
        pmodel.clip_grad_norm_(1.0)
        optimizer.step()
    """
    pipeline = getattr(module, "pipeline_mesh", None)  # a PipelineModule: this device's stages only
    elsewhere = module._ties.counted_elsewhere if pipeline is not None else set()
    grads = [p.grad for name, p in module.named_parameters() if p.grad is not None and name not in elsewhere]
    norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
    norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).float()
    if pipeline is not None:
        group = pipeline.get_group(Axis.PP)
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        else:
            norm = norm.pow(norm_type)
            dist.all_reduce(norm, group=group)
            norm = norm.pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is not finite: {norm.item()}")
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    scaled = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
    if scaled:
        torch._foreach_mul_(scaled, coefficient.to(scaled[0].device))
    return norm
