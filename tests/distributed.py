"""Harness for multi-process tests: run one function on every rank of a fresh process group.

Spawning costs seconds per process here, so a test should group many checks into one
``run_distributed`` call and return what it wants to assert on.
"""

import multiprocessing
import pickle
import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from autopar.runtime.launch import free_port

__all__ = ["free_port", "run_distributed"]


def run_distributed(
    fn, world_size: int, *args, timeout_s: float = 120, backend: str = "gloo"
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be a module-level function and its result picklable. If a rank raises,
    the others are killed and the error is re-raised here with that rank's traceback; if
    ranks are still running after ``timeout_s``, they are killed and TimeoutError names them.
    Example: ``sums = run_distributed(all_reduce_rank, 2)``.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(
            target=_run_rank,
            args=(fn, rank, world_size, args, backend, port, timeout_s, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    try:
        return _collect(ranks, results, timeout_s)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()


def _run_rank(fn, rank, world_size, args, backend, port, timeout_s, results) -> None:
    torch.set_num_threads(1)  # as torchrun does: ranks share the cores
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=timeout_s),
        )
        try:
            # pickled here so that an unpicklable result is reported, not lost in a queue thread
            message = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        message = (rank, False, traceback.format_exc())
    results.put(message)


def _collect(ranks, results, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    outcomes = {}
    while len(outcomes) < len(ranks):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            running = [rank for rank in range(len(ranks)) if rank not in outcomes]
            raise TimeoutError(f"ranks {running} still running after {timeout_s} s")
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.2))
        except queue.Empty:
            # a rank that reports exits with code 0; any other exit died before reporting
            for rank, process in enumerate(ranks):
                if rank not in outcomes and process.exitcode not in (None, 0):
                    raise RuntimeError(f"rank {rank} died with exit code {process.exitcode}")
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} of {len(ranks)} failed:\n{payload}")
        outcomes[rank] = pickle.loads(payload)
    return [outcomes[rank] for rank in range(len(ranks))]
