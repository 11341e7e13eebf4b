"""Starting ranks: join the default process group from torchrun's environment, or start a
local group of processes the way torchrun would (same variables, same restart semantics, so a
script runs under either).

Restarts follow torchrun's elastic agent: when one rank fails, every rank is stopped and, while
restarts remain, all are started again (``TORCHELASTIC_RESTART_COUNT`` tells them which attempt
this is); the script resumes from its last checkpoint (``runtime.checkpointer``). As torchrun's
agent does, the launcher hosts the job's c10d store, so the store outlives any rank and a rank's
failure report (``runtime.faults``) reaches its peers even when rank 0 is the one that died.
"""

import ctypes
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
from autopar.runtime.faults import collective, reported

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_EXIT_CODE = 124  # what coreutils' `timeout` returns
COLLECTIVE_TIMEOUT_VARIABLE = "AUTOPAR_COLLECTIVE_TIMEOUT"  # seconds; set by `autopar run --collective-timeout`
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0  # torch's default for gloo
_TERMINATE_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def init_from_env(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialize the default process group from torchrun's variables; no-op if already done.

    ``backend`` defaults to nccl when CUDA is available (each rank on cuda:LOCAL_RANK),
    gloo otherwise. ``timeout_s`` bounds every collective (the process-group timeout, which the
    mesh's groups inherit): a rank waiting longer for a stalled or dead peer fails with a
    CollectiveError. It defaults to ``$AUTOPAR_COLLECTIVE_TIMEOUT`` (set by ``autopar run
    --collective-timeout``), else 30 minutes. Example, in a script run by ``torchrun`` or
    ``autopar run``::

        init_from_env()
        mesh = build_device_mesh({"dp": 2}, "cpu")
    """
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError(
            f"environment variables {missing} are not set; start this script with torchrun "
            "or `autopar run`, which set them for every rank"
        )
    if timeout_s is None:
        text = os.environ.get(COLLECTIVE_TIMEOUT_VARIABLE, str(DEFAULT_COLLECTIVE_TIMEOUT_S))
        try:
            timeout_s = float(text)
        except ValueError:
            raise ConfigError(f"{COLLECTIVE_TIMEOUT_VARIABLE}={text!r} is not a number of seconds") from None
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts: keys of an attempt (the gloo peers'
        # addresses) are prefixed by it, or a restarted rank reads a dead peer's address
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        store = dist.PrefixStore(f"autopar/attempt_{attempt}", client)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return
    dist.init_process_group(backend, init_method="env://", timeout=timeout)


def finish() -> None:
    """Leave the process group together: every rank waits for the others, then tears it down.
    A rank that closes its gloo connections while a peer is still in a collective on them can
    abort that peer's process at exit (seen as SIGABRT, "terminate called", after the last step)."""
    if dist.is_initialized():
        with reported("the end of the run"), collective("barrier", where="after this rank's last step"):
            dist.barrier()  # a peer that stalls in a step with no collective (a replicated plan) shows here
        dist.destroy_process_group()


def _dying_with(launcher: int):
    """What a rank runs between fork and exec to have the kernel end it (SIGTERM) when its
    launcher exits (Linux; elsewhere None). A launcher killed by a signal it cannot act on
    (SIGKILL, or SIGTERM's default) leaves no one to stop its ranks, which would run on holding
    cores and ports, or wait in a collective until its timeout. (prctl is looked up here: the
    child, forked from a process with threads, only calls it.)"""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def die_with_launcher() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # it died before the line above
            os._exit(128 + signal.SIGTERM)

    return die_with_launcher


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(
    script: str,
    args: list[str],
    nproc: int,
    timeout_s: float | None,
    *,
    max_restarts: int = 0,
    collective_timeout_s: float | None = None,
) -> int:
    """Run ``python script *args`` as ``nproc`` local ranks; return 0 if all succeed.

    Each rank gets torchrun's variables (MASTER_ADDR=127.0.0.1, MASTER_PORT of the store this
    launcher hosts, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT,
    TORCHELASTIC_MAX_RESTARTS) and its output is streamed prefixed with ``[rank N]``. When a
    rank fails, the others are terminated; with restarts left, all ``nproc`` start again,
    else the failed rank's exit code is returned. After ``timeout_s`` for the whole job
    (restarts included) all are terminated and 124 returned. ``collective_timeout_s`` reaches
    the ranks as ``$AUTOPAR_COLLECTIVE_TIMEOUT`` (see :func:`init_from_env`). Example:
    ``sys.exit(launch_local("train.py", ["--steps", "10"], nproc=2, timeout_s=None, max_restarts=3))``.
    """
    if nproc < 1:
        raise ConfigError(f"nproc must be at least 1, got {nproc}")
    if max_restarts < 0:
        raise ConfigError(f"max_restarts must be at least 0, got {max_restarts}")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    variables = {"TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
    if collective_timeout_s is not None:
        variables[COLLECTIVE_TIMEOUT_VARIABLE] = str(collective_timeout_s)
    for attempt in range(max_restarts + 1):
        code = _run_attempt(script, args, nproc, {**variables, "TORCHELASTIC_RESTART_COUNT": str(attempt)}, deadline)
        if code == 0 or code == TIMEOUT_EXIT_CODE or attempt == max_restarts:
            return code
        _say(f"restart {attempt + 1} of {max_restarts}: starting all {nproc} ranks again")
    raise AssertionError("unreachable: the last attempt returns")


def _run_attempt(script: str, args: list[str], nproc: int, variables: dict, deadline: float | None) -> int:
    """One start of all ranks, with a fresh store (as torchrun's agent makes one per attempt)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = _start_ranks(script, args, nproc, {**variables, "MASTER_PORT": str(store.port)})
    print_lock = threading.Lock()  # whole lines, never two ranks' output interleaved in one
    printers = [
        threading.Thread(target=_print_prefixed, args=(rank, process.stdout, print_lock), daemon=True)
        for rank, process in enumerate(ranks)
    ]
    for printer in printers:
        printer.start()
    try:
        return _wait_for_ranks(ranks, deadline)
    finally:
        _terminate([process for process in ranks if process.poll() is None])
        for printer in printers:
            printer.join(timeout=_TERMINATE_GRACE_S)
        del store  # the server thread stops with its last reference


def _start_ranks(script: str, args: list[str], nproc: int, variables: dict) -> list[subprocess.Popen]:
    common = {
        **os.environ,
        **variables,
        "MASTER_ADDR": "127.0.0.1",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # env:// joins our store instead of rank 0 hosting one
        "PYTHONUNBUFFERED": "1",  # stream lines as they are printed
    }
    if nproc > 1:
        common.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: ranks share the cores
    die_with_launcher = _dying_with(os.getpid())
    return [
        subprocess.Popen(
            [sys.executable, script, *args],
            env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: terminating it reaches its workers too
            preexec_fn=die_with_launcher,
        )
        for rank in range(nproc)
    ]


def _say(text: str) -> None:
    print(f"[launch] {text}", file=sys.stderr, flush=True)


def _print_prefixed(rank: int, stream, lock: threading.Lock) -> None:
    for line in stream:
        text = line.decode(errors="replace").rstrip("\n")
        with lock:
            print(f"[rank {rank}] {text}", file=sys.stdout, flush=True)


def _wait_for_ranks(ranks: list[subprocess.Popen], deadline: float | None) -> int:
    while True:
        codes = [process.poll() for process in ranks]
        for rank, code in enumerate(codes):
            if code:
                running = [r for r, c in enumerate(codes) if c is None]
                _say(f"rank {rank} exited with code {code}; terminating ranks {running}")
                return code if code > 0 else 128 - code  # killed by signal N -> 128 + N
        if all(code == 0 for code in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            _say(f"the job timed out; terminating ranks {running}")
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
