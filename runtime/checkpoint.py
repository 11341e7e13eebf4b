"""Checkpoints of a parallelized model and its optimizer that hold the LOGICAL state:
every parameter and every optimizer-state tensor as a DTensor of the parameter's full shape,
under the parameter's name, saved with torch.distributed.checkpoint (DCP).

Because DCP reshards DTensors on load, a checkpoint written under one plan (say DP4 with
ZeRO-1) loads under any other of the same model (DP2×TP2 with ZeRO-3, or one process):
nothing in it depends on the degrees, the ZeRO stage or the precision (mixed precision keeps
fp32 masters: those are the parameters written; fp16's loss scale is saved beside them and
read back where both sides scale). A pipelined module's ranks each
write and read the parameters of their own stages (DTensors on the stage's sub-mesh), so a
checkpoint of PP2×DP2 with ZeRO-3 loads under PP2×DP2 with ZeRO-2 or under DP4. Each rank's
optimizer state is wrapped, not copied: the DTensors share storage with what the optimizer
steps, so a load writes straight into it.

    save_checkpoint(pmodel, optimizer, "ckpt/step-100")       # every rank
    load_checkpoint(pmodel, optimizer, "ckpt/step-100")       # every rank, any plan
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor


def logical_state(pmodel, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": name → DTensor, "optimizer": name → {key → DTensor | tensor}, "param_groups"},
    sharing storage with ``pmodel``'s shards and ``optimizer``'s state."""
    state = optimizer.state
    model, moments = {}, {}
    for name, param in pmodel._params.items():
        model[name] = param
        stepped, placements = _stepped(pmodel, name)
        entries = state.get(stepped, {})
        moments[name] = {
            key: _as_logical(value, param, placements)
            if torch.is_tensor(value) and value.shape == stepped.shape and value.dim()
            else value
            for key, value in entries.items()
        }
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    state = {"model": model, "optimizer": moments, "param_groups": groups}
    if getattr(pmodel, "loss_scaler", None) is not None:
        state["loss_scaler"] = pmodel.loss_scaler.state_dict()
    return state


def save_checkpoint(pmodel, optimizer: torch.optim.Optimizer, path) -> None:
    """Write the logical parameters and optimizer state to the folder ``path`` (every rank calls it)."""
    dcp.save(logical_state(pmodel, optimizer), checkpoint_id=str(path))


def load_checkpoint(pmodel, optimizer: torch.optim.Optimizer, path) -> None:
    """Read a checkpoint written under any plan of the same model into ``pmodel`` and
    ``optimizer`` (every rank calls it). The optimizer's state is created first if it has
    not stepped yet; its hyperparameters come from the checkpoint."""
    if not optimizer.state:
        _create_state(pmodel, optimizer)
    state = logical_state(pmodel, optimizer)
    if "loss_scaler" in state and not _holds(path, "loss_scaler"):
        del state["loss_scaler"]  # written without loss scaling: the scale starts afresh
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(path))
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        group.update(saved)
    if "loss_scaler" in state:
        pmodel.loss_scaler.load_state_dict(state["loss_scaler"])
    with torch.no_grad():  # ZeRO-1/2 step copies of their chunks: refresh them from the loaded weights
        for name, chunk in pmodel._zero_chunks.items():
            chunk.copy_(pmodel.zero.chunk(name, pmodel._locals[name]))


def _holds(path, key: str) -> bool:
    """Whether the checkpoint at ``path`` has an entry under ``key``."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(name == key or name.startswith(f"{key}.") for name in stored)


def _stepped(pmodel, name: str):
    """The tensor the optimizer steps for ``name`` (the shard, or under ZeRO-1/2 its dp chunk),
    and that tensor's DTensor placements."""
    param = pmodel._params[name]
    chunk = pmodel._zero_chunks.get(name)
    if chunk is None:
        return pmodel._locals[name], list(param.placements)
    return chunk, pmodel.zero.placements(name, list(param.placements))


def _as_logical(local: torch.Tensor, param: DTensor, placements) -> DTensor:
    return DTensor.from_local(
        local, param.device_mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _create_state(pmodel, optimizer: torch.optim.Optimizer) -> None:
    """One step with zero gradients and no learning rate: the optimizer allocates its state
    and changes nothing (weight decay is scaled by the learning rate too)."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    for name, local in pmodel._locals.items():  # ZeRO-1 steps chunks of the whole gradients
        if name in pmodel._zero_chunks:
            local.grad = torch.zeros_like(local)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
