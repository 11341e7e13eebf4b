"""Run one Python function on every rank of a fresh local process group.

What tests, benchmarks and notebooks use instead of a launcher script: ``run_local(fn, 4)``
starts four processes, joins them in a gloo group on 127.0.0.1 and returns each rank's
result. A failing rank, or ranks still running after the timeout, end the whole run (every
process is killed by its pid) with the rank's traceback or the ranks' numbers; ranks end with
the caller, however it ends.

Ranks fork from multiprocessing's forkserver, a process that imported autopar (and torch)
once, on the first call: a rank starts in a fraction of a second where a spawned one spends
seconds importing torch. Each rank takes the caller's environment of the moment, as a spawned
one would (the server's is the one it started with).
"""

import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from autopar.runtime.launch import free_port

_EXIT_GRACE_S = 5.0  # a rank that reported gets this long to exit before it is killed


def run_local(fn, world_size: int, *args, timeout_s: float = 120, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; results by rank.

    ``fn`` must be a module-level function and its result picklable. Example::

        sums = run_local(all_reduce_rank, 2, timeout_s=60)
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["autopar"])
    environment = dict(os.environ)
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_run_rank,
            args=(fn, rank, world_size, args, backend, port, timeout_s, results, environment),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    finished = False
    try:
        outcomes = _collect(processes, results, timeout_s)
        finished = True
        return outcomes
    finally:
        # a rank killed while still flushing the queue would leak its semaphore
        grace_deadline = time.monotonic() + (_EXIT_GRACE_S if finished else 0.0)
        for process in processes:
            process.join(timeout=max(0.0, grace_deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
            process.join()
        results.close()
        results.join_thread()


def _run_rank(fn, rank, world_size, args, backend, port, timeout_s, results, environment) -> None:
    _exit_with_caller()
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(1)  # as torchrun does: the ranks share the cores
    # torch's pytree pickling warns once per copy of an exported graph; it says nothing here
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            # pickled here so that an unpicklable result is reported, not lost in a queue thread
            message = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        message = (rank, False, traceback.format_exc())
    results.put(message)


def _exit_with_caller() -> None:
    """End this rank as soon as the process that called :func:`run_local` is gone, however it
    ended: a caller killed by a signal cannot kill its ranks, and they would run on. (The kernel's
    parent-death signal would not come: the parent is the forkserver, which lives while ranks do.)"""
    caller = multiprocessing.parent_process().sentinel  # ready once the caller has exited

    def exit_when_ready() -> None:
        multiprocessing.connection.wait([caller])
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=exit_when_ready, name="autopar-exit-with-caller", daemon=True).start()


def _collect(processes, results, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    outcomes = {}
    while len(outcomes) < len(processes):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            running = [rank for rank in range(len(processes)) if rank not in outcomes]
            raise TimeoutError(f"ranks {running} still running after {timeout_s:.0f} s")
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.2))
        except queue.Empty:
            # a rank that reports exits with code 0; any other exit died before reporting
            for rank, process in enumerate(processes):
                if rank not in outcomes and process.exitcode not in (None, 0):
                    raise RuntimeError(f"rank {rank} died with exit code {process.exitcode}") from None
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} of {len(processes)} failed:\n{payload}")
        outcomes[rank] = pickle.loads(payload)
    return [outcomes[rank] for rank in range(len(processes))]
