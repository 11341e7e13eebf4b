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
steps, so a load writes straight into it. Both kinds of optimizer work: ``pmodel.optimizer(...)``
over the local shards, and a torch optimizer over ``pmodel.parameters()`` (DTensors).

A checkpoint folder ends with a manifest, ``autopar.json``, written after every other file:
the size of each file, each parameter's shape and the optimizer's state keys. A load first
checks all of it on every rank (:func:`verify_checkpoint`) and refuses, on every rank and
before touching any tensor, a folder whose write never finished, a truncated or missing file,
or a checkpoint of another model (naming what differs). Contents are not checksummed: a file
of the right size with flipped bits is not caught.

    save_checkpoint(pmodel, optimizer, "ckpt/step-100")       # every rank
    load_checkpoint(pmodel, optimizer, "ckpt/step-100")       # every rank, any plan
    model.load_state_dict(load_weights("ckpt/step-100"), strict=False)  # one process, to export
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from autopar.ir.errors import CheckpointError, IncompleteCheckpointError
from autopar.runtime.faults import agree, from_rank_zero

MANIFEST = "autopar.json"
MANIFEST_FORMAT = 1


def logical_state(pmodel, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": name → DTensor, "optimizer": name → {key → DTensor | tensor}, "param_groups"},
    sharing storage with ``pmodel``'s shards and ``optimizer``'s state."""
    state = optimizer.state
    stepped_dtensors = {id(p) for group in optimizer.param_groups for p in group["params"]}
    model, moments = {}, {}
    for name, param in pmodel._params.items():
        model[name] = param
        if id(param) in stepped_dtensors:  # a torch optimizer over the DTensors: its state is logical already
            moments[name] = dict(state.get(param, {}))
            continue
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


def save_checkpoint(pmodel, optimizer: torch.optim.Optimizer, path, extra: dict | None = None) -> None:
    """Write the logical parameters and optimizer state to the folder ``path`` (every rank calls
    it), then the manifest (rank 0), which lists every file in the folder: files written there
    before (a rank's RNG state, the plan) are covered too. ``extra`` (JSON) is kept in the
    manifest (:func:`read_manifest`). A failure on any rank is raised on every rank."""
    state = logical_state(pmodel, optimizer)
    metadata = dcp.save(state, checkpoint_id=str(path))  # gathers every rank's write results before it returns
    from_rank_zero(lambda: _write_manifest(Path(path), metadata, state, extra or {}), f"writing {path}/{MANIFEST}")


def load_checkpoint(pmodel, optimizer: torch.optim.Optimizer, path) -> dict:
    """Read a checkpoint written under any plan of the same model into ``pmodel`` and
    ``optimizer`` (every rank calls it); return its manifest. The optimizer's state is created
    first if it has not stepped yet; its hyperparameters come from the checkpoint.

    Raises :class:`CheckpointError` on every rank, with nothing loaded, when the checkpoint is
    missing, incomplete or of another model (:func:`verify_checkpoint`).
    """
    if not optimizer.state:
        _create_state(pmodel, optimizer)
    state = logical_state(pmodel, optimizer)
    manifest = agree(lambda: verify_checkpoint(path, pmodel, state), f"checking the checkpoint {path}")
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
    return manifest


def read_manifest(path) -> dict:
    """The manifest of the checkpoint folder ``path``; CheckpointError if it has none (a write
    that never finished, or not an autopar checkpoint) or it cannot be read."""
    path = Path(path)
    if not path.is_dir():
        raise IncompleteCheckpointError(f"no checkpoint at {path}: the folder does not exist")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{path} has no {MANIFEST}: its write never finished, or it is not an autopar checkpoint; "
            "resume from an earlier checkpoint"
        ) from None
    except (OSError, json.JSONDecodeError) as error:
        raise IncompleteCheckpointError(
            f"{path / MANIFEST} cannot be read ({error}): resume from an earlier checkpoint"
        ) from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(
            f"{path / MANIFEST} has format {manifest.get('format')!r}, this autopar reads {MANIFEST_FORMAT}"
        )
    return manifest


def load_weights(path) -> dict[str, torch.Tensor]:
    """The model's parameters in the checkpoint folder ``path``, whole (fp32 masters under mixed
    precision), read in one process with no process group: what the unparallelized model loads
    (``model.load_state_dict(weights, strict=False)``: buffers are not in a checkpoint) to be
    exported, e.g. by Hugging Face's ``save_pretrained``. CheckpointError if the folder is
    incomplete. Example::

        model.load_state_dict(load_weights("ckpt/step-1000"), strict=False)
    """
    path = Path(path)
    _check_files(path, read_manifest(path))
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    weights = {
        key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.items()
        if key.startswith("model.")
    }
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": the one process is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"model": weights}, checkpoint_id=str(path), no_dist=True)
    return weights


def _check_files(path: Path, manifest: dict) -> None:
    """Every file the manifest lists is in ``path`` at its size, else IncompleteCheckpointError."""
    broken = []
    for file, size in manifest["files"].items():
        actual = (path / file).stat().st_size if (path / file).is_file() else None
        if actual != size:
            broken.append(f"{file} is {'missing' if actual is None else f'{actual} bytes'} (written: {size} bytes)")
    if broken:
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: {'; '.join(broken)}. Resume from an earlier one"
        )


def verify_checkpoint(path, pmodel, state: dict) -> dict:
    """Check, without loading, that ``path`` is complete and holds this model: every file the
    manifest lists is there at its size, every parameter this rank holds is in it with its
    shape, no parameter of the model's plan is missing from it or extra in it, and the optimizer
    keeps the same state keys. Returns the manifest; raises CheckpointError naming what differs."""
    path = Path(path)
    manifest = read_manifest(path)
    _check_files(path, manifest)
    saved = manifest["params"]
    differences = [f"{name!r} is not in the checkpoint" for name in pmodel.plan.params if name not in saved]
    differences += [
        f"the checkpoint has {name!r}, which this model does not" for name in saved if name not in pmodel.plan.params
    ]
    for name, param in pmodel._params.items():
        if name in saved and list(param.shape) != saved[name]["shape"]:
            differences.append(f"{name!r} is {tuple(saved[name]['shape'])} there and {tuple(param.shape)} here")
    ours = _state_keys(state)
    if not differences and manifest["optimizer_state"] != ours:
        differences.append(
            f"its optimizer kept {manifest['optimizer_state'] or 'no state'}, this one keeps {ours or 'none'} "
            "(another optimizer class?)"
        )
    if differences:
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        raise CheckpointError(
            f"checkpoint {path} is of another model: {shown}. Load it into the model (and optimizer) that wrote it"
        )
    return manifest


def _write_manifest(path: Path, metadata, state: dict, extra: dict) -> None:
    """Every file now in the folder (all ranks wrote theirs before DCP's save returned), with its
    size, and every parameter's shape (from DCP's global metadata: a pipeline rank holds only
    its stages); fsync'd, so that a manifest on disk means a complete folder on disk."""
    files = {entry.name: entry.stat().st_size for entry in path.iterdir() if entry.is_file() and entry.name != MANIFEST}
    manifest = {
        "format": MANIFEST_FORMAT,
        "world_size": dist.get_world_size(),
        "files": files,
        "params": {
            key.removeprefix("model."): {"shape": list(entry.size)}
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith("model.")
        },
        "optimizer_state": _state_keys(state),
        **extra,
    }
    write_durably(path / MANIFEST, json.dumps(manifest, indent=1).encode())


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it: on disk when this returns."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _state_keys(state: dict) -> list[str]:
    """The optimizer's per-parameter state keys (``exp_avg``, ``step``, ...), as the manifest lists them."""
    return sorted({key for entries in state["optimizer"].values() for key in entries})


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
