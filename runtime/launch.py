"""Starting ranks: join the default process group from torchrun's environment, or start a
local group of processes the way torchrun would (same variables, so a script runs under
either)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from autopar.ir.errors import ConfigError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_EXIT_CODE = 124  # what coreutils' `timeout` returns
_TERMINATE_GRACE_S = 5.0


def init_from_env(backend: str | None = None, timeout_s: float = 1800.0) -> None:
    """Initialize the default process group from torchrun's variables; no-op if already done.

    ``backend`` defaults to nccl when CUDA is available (each rank on cuda:LOCAL_RANK),
    gloo otherwise. Example, in a script run by ``torchrun`` or ``launch_local``::

        init_from_env()
        mesh = build_device_mesh({"dp": 2}, "cpu")
    """
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError(
            f"environment variables {missing} are not set; start this script with torchrun "
            "or `autopar launch`, which set them for every rank"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(script: str, args: list[str], nproc: int, timeout_s: float | None) -> int:
    """Run ``python script *args`` as ``nproc`` local ranks; return 0 if all succeed.

    Each rank gets torchrun's variables (MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) and its output is streamed prefixed with
    ``[rank N]``. When a rank fails, the others are terminated and its exit code returned;
    after ``timeout_s`` all are terminated and 124 returned. Example:
    ``sys.exit(launch_local("train.py", ["--steps", "10"], nproc=2, timeout_s=None))``.
    """
    if nproc < 1:
        raise ConfigError(f"nproc must be at least 1, got {nproc}")
    ranks = _start_ranks(script, args, nproc)
    print_lock = threading.Lock()  # whole lines, never two ranks' output interleaved in one
    printers = [
        threading.Thread(target=_print_prefixed, args=(rank, process.stdout, print_lock), daemon=True)
        for rank, process in enumerate(ranks)
    ]
    for printer in printers:
        printer.start()
    try:
        return _wait_for_ranks(ranks, timeout_s)
    finally:
        _terminate([process for process in ranks if process.poll() is None])
        for printer in printers:
            printer.join(timeout=_TERMINATE_GRACE_S)


def _start_ranks(script: str, args: list[str], nproc: int) -> list[subprocess.Popen]:
    common = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "PYTHONUNBUFFERED": "1",  # stream lines as they are printed
    }
    if nproc > 1:
        common.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: ranks share the cores
    return [
        subprocess.Popen(
            [sys.executable, script, *args],
            env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: terminating it reaches its workers too
        )
        for rank in range(nproc)
    ]


def _print_prefixed(rank: int, stream, lock: threading.Lock) -> None:
    for line in stream:
        text = line.decode(errors="replace").rstrip("\n")
        with lock:
            print(f"[rank {rank}] {text}", file=sys.stdout, flush=True)


def _wait_for_ranks(ranks: list[subprocess.Popen], timeout_s: float | None) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [process.poll() for process in ranks]
        for rank, code in enumerate(codes):
            if code:
                running = [r for r, c in enumerate(codes) if c is None]
                print(
                    f"[launch] rank {rank} exited with code {code}; terminating ranks {running}",
                    file=sys.stderr,
                    flush=True,
                )
                return code if code > 0 else 128 - code  # killed by signal N -> 128 + N
        if all(code == 0 for code in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            print(f"[launch] timed out after {timeout_s} s; terminating ranks {running}", file=sys.stderr, flush=True)
            return TIMEOUT_EXIT_CODE
        time.sleep(0.05)


def _terminate(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each rank's process group, SIGKILL what is left after a grace period."""
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:  # already gone
        pass
