"""Periodic checkpoints of a training job, written atomically, and resuming from the newest.

A training script that may be killed at any moment (a node lost, a restart by ``autopar run
--max-restarts`` or ``torchrun --max-restarts``) needs two calls::

    checkpointer = Checkpointer("ckpt", every=100)
    pmodel = autopar.parallelize(model, world, example, plan=checkpointer.plan(world))
    optimizer = pmodel.optimizer(torch.optim.AdamW, lr=3e-4)
    start = checkpointer.resume(pmodel, optimizer, data=loader)   # 0 on a fresh start
    for step in range(start, steps):
        ...  # train step ``step``
        checkpointer.maybe_save(step + 1, pmodel, optimizer, data=loader)

The folder holds ``step-00000100/`` (complete checkpoints, the newest ``keep``) and at most one
``.step-00000200.partial/`` being written. A checkpoint is written aside, into its partial
folder: the logical model and optimizer state (``runtime.checkpoint``, DCP), the plan, each
rank's RNG states and data position (``rank-R.pt``), then the manifest; only then does rank 0
rename it to ``step-N``, an atomic step on POSIX file systems. A crash at any point leaves either
no ``step-N`` or a complete one; resuming ignores partial folders and falls back to the previous
checkpoint if the newest fails its checks (a file lost since).

Resuming on another world size (4 ranks, then 2) works: the logical state loads into any plan
of the model, :meth:`plan` returns None so that ``parallelize`` plans for the new mesh, and each
rank continues from rank 0's RNG and data state (saved per rank, they cannot be matched up).
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

from autopar.ir import CheckpointError, ConfigError, IncompleteCheckpointError, Plan, StalePlanError
from autopar.runtime.checkpoint import MANIFEST, load_checkpoint, save_checkpoint, write_durably
from autopar.runtime.faults import agree, from_rank_zero, reported

_COMPLETE = re.compile(r"step-(\d+)")
_PARTIAL_SUFFIX = ".partial"
PLAN_FILE = "plan.json"


class Checkpointer:
    """Checkpoints of one training job in ``directory``: every ``every`` steps, the newest ``keep``
    kept. Every method is called on every rank (each is collective). Example in the module docstring."""

    def __init__(self, directory, every: int, keep: int = 2):
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"Checkpointer every={every!r}: pass a positive number of steps")
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"Checkpointer keep={keep!r}: keep at least the newest checkpoint")
        self.directory, self.every, self.keep = Path(directory), every, keep

    def checkpoints(self) -> list[Path]:
        """The ``step-N`` folders, newest first, as this rank sees them (complete, as the rename
        made them, unless damaged since: loading checks)."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _COMPLETE.fullmatch(p.name))]
        return [path for _, path in sorted(found, reverse=True)]

    def plan(self, world_size: int) -> Plan | None:
        """The plan the newest checkpoint was trained with, if it was made for ``world_size``
        ranks (reusing it keeps a restarted job's numerics bitwise those of the job before);
        None otherwise, and when there is no checkpoint: ``parallelize`` then plans anew."""

        def newest_plan():
            for path in self.checkpoints():
                if (path / PLAN_FILE).is_file():
                    try:
                        plan = Plan.load(path / PLAN_FILE)
                    except StalePlanError:  # written by another autopar version: plan anew
                        return None
                    return plan if plan.mesh.size == world_size else None
            return None

        return from_rank_zero(newest_plan, f"reading the plan of the newest checkpoint in {self.directory}")

    def resume(self, pmodel, optimizer: torch.optim.Optimizer, data=None) -> int:
        """Load the newest checkpoint that passes its checks into ``pmodel``, ``optimizer``, the
        RNGs (torch, CUDA, Python, NumPy) and ``data`` (anything with ``state_dict()`` and
        ``load_state_dict()``, e.g. a stateful data loader); return its step, or 0 with nothing
        loaded when there is none. An incomplete checkpoint is skipped with a warning; one of
        another model raises CheckpointError."""
        with reported("resuming from a checkpoint"):
            candidates = from_rank_zero(self.checkpoints, f"listing the checkpoints in {self.directory}")
            for path in candidates:
                try:
                    manifest = load_checkpoint(pmodel, optimizer, path)
                except IncompleteCheckpointError as error:  # model and optimizer untouched: try the one before
                    if dist.get_rank() == 0:
                        warnings.warn(f"skipping checkpoint {path}: {error}", stacklevel=2)
                    continue
                self._restore_rank_state(path, manifest, data)
                return manifest["step"]
            return 0

    def maybe_save(self, step: int, pmodel, optimizer: torch.optim.Optimizer, data=None) -> Path | None:
        """:meth:`save` when ``step`` is a multiple of ``every``; the checkpoint's folder, or None."""
        return self.save(step, pmodel, optimizer, data) if step % self.every == 0 else None

    def save(self, step: int, pmodel, optimizer: torch.optim.Optimizer, data=None) -> Path:
        """Write the checkpoint of ``step`` (optimizer steps taken) aside, then rename it into
        place and drop every other ``step-N`` folder but the newest ``keep`` complete ones. When
        this returns on any rank, ``step-N`` is complete on disk; a failure on any rank is raised
        on every rank."""
        final = self.directory / f"step-{step:08d}"
        partial = self.directory / f".{final.name}{_PARTIAL_SUFFIX}"
        with reported(f"saving the checkpoint of step {step}"):
            from_rank_zero(lambda: self._start(partial), f"creating {partial}")
            agree(lambda: self._write_rank_state(partial, pmodel, data), f"writing the rank states into {partial}")
            save_checkpoint(pmodel, optimizer, partial, extra={"step": step})
            from_rank_zero(lambda: self._commit(partial, final), f"renaming {partial} to {final}")
        return final

    def _start(self, partial: Path) -> None:
        """A fresh partial folder; what an interrupted save or drop left is removed first."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(".step-*"):
            shutil.rmtree(leftover)
        partial.mkdir()

    def _write_rank_state(self, partial: Path, pmodel, data) -> None:
        rank = dist.get_rank()
        state = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "python": random.getstate(),
            "numpy": numpy.random.get_state(),
            "data": data.state_dict() if data is not None else None,
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_durably(partial / f"rank-{rank}.pt", buffer.getvalue())
        if rank == 0:
            write_durably(partial / PLAN_FILE, json.dumps(pmodel.plan.to_json(), indent=1).encode())

    def _commit(self, partial: Path, final: Path) -> None:
        if final.exists():  # the same step saved again (after a restart): the new one replaces it
            self._drop(final)
        os.replace(partial, final)
        _fsync_folder(self.directory)
        complete = [path for path in self.checkpoints() if (path / MANIFEST).is_file()]
        for old in set(self.checkpoints()) - set(complete[: self.keep]):  # a broken folder never loads: it goes too
            self._drop(old)

    def _drop(self, path: Path) -> None:
        """Renamed out of the ``step-N`` namespace first, so a crash mid-delete leaves no
        half-deleted folder that looks complete."""
        doomed = path.with_name(f".{path.name}.deleting")
        os.replace(path, doomed)
        shutil.rmtree(doomed)

    def _restore_rank_state(self, path: Path, manifest: dict, data) -> None:
        rank = dist.get_rank() if manifest["world_size"] == dist.get_world_size() else 0
        state = torch.load(path / f"rank-{rank}.pt", weights_only=False)
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        random.setstate(state["python"])
        numpy.random.set_state(state["numpy"])
        if data is not None:
            if state["data"] is None:
                raise CheckpointError(f"{path} holds no data position: it was saved without data=")
            data.load_state_dict(state["data"])


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX: fsync the directory)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
