"""Measure this machine for the cost model: matmul FLOP/s, memory bandwidth, compute
contention, collective times and the in-step rendezvous.

Measurement only; ``autopar.passes.cost.calibration`` fits the numbers into a
:class:`~autopar.ir.HardwareProfile`, and ``autopar calibrate`` does both. Everything runs
as training does here: ONE thread per rank (``torch.set_num_threads(1)``, as torchrun and
``run_local`` set it), so the FLOP/s and bytes/s are one rank's, and the collectives run
on real gloo process groups over loopback, spawned by :func:`~autopar.runtime.spawn.run_local`.
Ranks that share the cores compute slower than one rank alone: the same op mix timed on
one rank and on every rank of each group size at once measures by how much.

On a GPU machine (``backend="nccl"``) the same sweep runs on the GPUs: matmul FLOP/s per
dtype and memory bandwidth on one device, and the collectives over NCCL with one device
per rank, each timed between device synchronizations. Ranks do not share a device there,
so there is no contention or rendezvous to measure.

    measurements = calibrate(ranks=(2, 4))      # ~30 s on 2 cores; quick=True ~10 s
    measurements["collectives"][0]
    {'kind': 'all_reduce', 'ranks': 2, 'nbytes': 4096, 'seconds': 0.00021}
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from autopar.runtime.spawn import run_local

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SIZES_BYTES = tuple(1024 * 4**k for k in range(1, 8))  # 4 KiB, 16 KiB, ..., 16 MiB
QUICK_SIZES_BYTES = SIZES_BYTES[:-1]  # up to 4 MiB
MATMUL_SIZES = (128, 256, 512, 768, 1024, 1536, 2048)
MATMUL_TARGET_S = 0.05  # a matmul this long is past cache and call-overhead effects
_FLOAT_BYTES = 4  # collectives move float32


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def synchronize(device) -> None:
    """Wait for the device's queued work: a GPU op returns before it runs."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device="cpu") -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _best_time(fn, repeats: int, device="cpu") -> float:
    return min(timed(fn, device) for _ in range(repeats))


@contextmanager
def matmul_dtype(dtype: str):
    """``tf32`` is float32 storage with TensorFloat-32 matmuls (off by default in torch)."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        yield torch.float32 if dtype == "tf32" else getattr(torch, dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def measure_matmul(
    dtypes=("float32", "bfloat16"), sizes=MATMUL_SIZES, repeats: int = 3, device="cpu"
) -> dict[str, float]:
    """Achieved FLOP/s of square matmuls per dtype, on ONE thread (one rank's share of the CPU).

    Walks up ``sizes`` until one product takes at least 50 ms (or the sizes run out) and
    returns ``2·n³ / best time`` over ``repeats`` at that size.

    >>> measure_matmul(("float32",))      # doctest: +SKIP
    {'float32': 5.1e10}
    """
    rates = {}
    with _one_thread(), torch.no_grad():
        for name in dtypes:
            with matmul_dtype(name) as dtype:
                for n in sizes:
                    a = torch.randn(n, n, device=device).to(dtype)
                    b = torch.randn(n, n, device=device).to(dtype)
                    torch.mm(a, b)  # warm-up: first-call dispatch and allocation
                    seconds = _best_time(lambda: torch.mm(a, b), 1, device)
                    if seconds >= MATMUL_TARGET_S or n == sizes[-1]:
                        seconds = min(seconds, _best_time(lambda: torch.mm(a, b), repeats - 1, device))
                        rates[name] = 2 * n**3 / seconds
                        break
    return rates


def measure_memory_bandwidth(nbytes: int = 128 * 2**20, repeats: int = 5, device="cpu") -> float:
    """Bytes/s of one large tensor copy on ONE thread, reads plus writes counted (2·nbytes).

    >>> measure_memory_bandwidth()        # doctest: +SKIP
    9.8e9
    """
    with _one_thread():
        source = torch.ones(nbytes // _FLOAT_BYTES, device=device)
        target = torch.empty_like(source)
        target.copy_(source)  # warm-up: touches every page of the target
        return 2 * nbytes / _best_time(lambda: target.copy_(source), repeats, device)


def _numel(nbytes: int, world_size: int) -> int:
    """float32 elements of a full tensor of about ``nbytes`` that splits into world_size² equal chunks."""
    quantum = world_size * world_size
    return max(quantum, nbytes // _FLOAT_BYTES // quantum * quantum)


def _collective(kind: str, numel: int, rank: int, world_size: int, device="cpu"):
    """A closure that runs one ``kind`` on the full tensor of ``numel`` elements, and its byte count."""
    chunk = numel // world_size
    ones, empty = functools.partial(torch.ones, device=device), functools.partial(torch.empty, device=device)
    if kind == "all_reduce":
        tensor = ones(numel)
        return lambda: dist.all_reduce(tensor)
    if kind == "all_gather":
        local, full = ones(chunk), empty(numel)
        return lambda: dist.all_gather_single(full, local)
    if kind == "reduce_scatter":
        full, local = ones(numel), empty(chunk)
        return lambda: dist.reduce_scatter_single(local, full)
    if kind == "all_to_all":  # each rank holds numel/world_size and keeps 1/world_size of it
        sent, received = ones(chunk), empty(chunk)
        return lambda: dist.all_to_all_single(received, sent)
    if kind == "send_recv":  # pairs (0,1), (2,3), ...: a ping-pong, so one message is half of it
        message = ones(numel)
        peer = rank ^ 1
        if peer >= world_size:
            return lambda: None
        if rank % 2 == 0:
            return lambda: (dist.send(message, peer), dist.recv(message, peer))
        return lambda: (dist.recv(message, peer), dist.send(message, peer))
    raise ValueError(f"unknown collective {kind!r}: choose one of {KINDS}")


def measure_collectives(
    rank: int, world_size: int, sizes_bytes=SIZES_BYTES, repeats: int = 10, device="cpu"
) -> list[dict]:
    """Median seconds of every collective kind and size over this process group; run on every rank.

    Call through ``run_local(measure_collectives, world_size, sizes, repeats)``. Each repeat
    starts after a barrier and is timed on every rank; the slowest rank's time counts (the
    collective is done when the last rank is), and the median over repeats is reported.
    The repeats are interleaved (round r runs every kind and size once), so a burst of
    other load on a shared machine costs one sample of many measurements, not the median of
    one. Small messages get more repeats, large ones fewer (at least 3).
    ``nbytes`` is what ``collective_time`` takes: the full logical tensor (world_size × the
    per-rank chunk for all_gather, reduce_scatter, all_to_all), the tensor for all_reduce,
    one message for send_recv (timed as half a ping-pong). Every rank returns all records.
    On a GPU (``device``) each timing waits for the device before and after.

        run_local(measure_collectives, 2, (4096, 2**20), 5)[0][0]
        {'kind': 'all_reduce', 'ranks': 2, 'nbytes': 4096, 'seconds': 9.1e-05}
    """
    torch.set_num_threads(1)
    cases = []  # (kind, nbytes, run, repeats)
    for kind in KINDS:
        for nbytes in sizes_bytes:
            numel = _numel(nbytes, world_size)
            run = _collective(kind, numel, rank, world_size, device)
            run()  # warm-up: gloo sets up its buffers on first use
            count = 2 * repeats if nbytes <= 2**18 else repeats if nbytes <= 2**20 else max(3, repeats // 3)
            cases.append((kind, numel * _FLOAT_BYTES, run, count))
    seconds = [[] for _ in cases]
    for round_index in range(max(count for *_, count in cases)):
        for case, (kind, _, run, count) in enumerate(cases):
            if round_index < count:
                dist.barrier()
                elapsed = timed(run, device)
                seconds[case].append(elapsed / 2 if kind == "send_recv" else elapsed)
    by_rank = [None] * world_size
    dist.all_gather_object(by_rank, seconds)
    records = []
    for case, (kind, nbytes, _, _) in enumerate(cases):
        slowest = [max(times) for times in zip(*(rank_seconds[case] for rank_seconds in by_rank))]
        records.append({"kind": kind, "ranks": world_size, "nbytes": nbytes, "seconds": statistics.median(slowest)})
    return records


SYNC_BYTES = 2**18  # the all-reduce that measures the rendezvous: 256 KiB
SYNC_BURST_S = (0.001, 0.004, 0.016)  # compute before each collective, one core's time: a step's spacing
SYNC_REPEATS = 8  # bursts per timing
SYNC_ROUNDS = 9  # paired timings (alone, then with collectives) per burst


def _slowest(seconds: float) -> float:
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, seconds)
    return max(times)


def measure_sync(rank: int, world_size: int) -> list[dict]:
    """What a blocking collective costs inside a training step beyond its alpha-beta time.

    ``measure_collectives`` starts every collective after a barrier, all ranks waiting. In a
    step the ranks come from compute and arrive apart: the first wait for the last, and
    sleeping processes must be woken. Here every rank runs bursts of matmuls each followed
    by an all-reduce (no barrier), and the same bursts alone, in pairs of timings taken one
    right after the other; the median over pairs of the slowest rank's difference, per
    burst, is the collective's in-step cost (a difference of two medians taken apart would
    carry the machine's drift between them). In a job of 4 or more ranks, pairs of ranks
    run side by side too, as tensor-parallel groups inside data parallelism do. Every rank
    returns all records: ``{"job_ranks", "ranks", "nbytes", "burst_s", "in_step_s"}``.
    """
    torch.set_num_threads(1)
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    per_matmul = _best_time(lambda: a @ b, 5)
    groups = {world_size: None}
    if world_size >= 4:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world_size, 2)]
        groups[2] = pairs[rank // 2]
    tensor = torch.ones(SYNC_BYTES // _FLOAT_BYTES)
    records = []
    for size, group in groups.items():
        dist.all_reduce(tensor, group=group)
        for burst_s in SYNC_BURST_S:
            count = max(1, round(burst_s / per_matmul))

            def bursts(with_collective: bool):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(SYNC_REPEATS):
                    for _ in range(count):
                        a @ b
                    if with_collective:
                        dist.all_reduce(tensor, group=group)
                return _slowest(time.perf_counter() - start) / SYNC_REPEATS

            pairs_s = [(bursts(False), bursts(True)) for _ in range(SYNC_ROUNDS)]
            records.append(
                {
                    "job_ranks": world_size,
                    "ranks": size,
                    "nbytes": SYNC_BYTES,
                    "burst_s": statistics.median(alone for alone, _ in pairs_s),
                    "in_step_s": statistics.median(together - alone for alone, together in pairs_s),
                }
            )
    return records


# The op mix whose slowdown under sharing is the contention, half matmul and half memory-
# or overhead-bound time, as in the steps of small models here: linear layers (tokens x in @
# in x out) and elementwise passes over 256 KiB (call overhead) and 4 MiB (memory bandwidth).
MIX_MATMULS = ((512, 128, 512), (1024, 256, 1024), (512, 512, 1024))
MIX_ELEMENTWISE_NUMEL = (2**16, 2**20)
MIX_MATMUL_S, MIX_ELEMENTWISE_S = 4e-3, 2e-3  # each op repeated to take this long alone
MIX_ROUNDS = 15


def _mix_ops() -> list[tuple[str, object]]:
    """(category, closure) of every op of the mix, on fresh tensors."""
    ops = []
    for tokens, inner, outer in MIX_MATMULS:
        x, weight = torch.randn(tokens, inner), torch.randn(inner, outer)
        ops.append(("matmul", lambda x=x, weight=weight: x @ weight))
    for numel in MIX_ELEMENTWISE_NUMEL:
        a, b = torch.randn(numel), torch.randn(numel)
        ops += [
            ("elementwise", lambda a=a, b=b: a + b),
            ("elementwise", lambda a=a: torch.nn.functional.gelu(a)),
            ("elementwise", lambda a=a: torch.softmax(a.view(-1, 128), dim=-1)),
        ]
    return ops


def mix_repeats() -> list[int]:
    """How often each op of the mix runs per pass so that it takes its share alone, on ONE
    thread; every rank count runs these same repeats (a rank that chose its own would fill
    the same wall time and hide the slowdown)."""
    with _one_thread(), torch.no_grad():
        return [
            max(1, round((MIX_MATMUL_S if category == "matmul" else MIX_ELEMENTWISE_S) / _best_time(run, 5)))
            for category, run in _mix_ops()
        ]


def measure_contention(rank: int, world_size: int, repeats: list[int], rounds: int = MIX_ROUNDS) -> dict:
    """Seconds of one pass of the op mix per rank while ``world_size`` ranks run it at once.

    Every round starts after a barrier, as a training step does, and every rank times its
    pass; the slowest rank counts (ranks in a step wait for the slowest), per category and
    for the whole pass, and the median over rounds is reported. With ``world_size`` 1 it
    runs in this process, no group needed. ``passes.calibration.fit_contention`` divides
    by the one-rank pass. Every rank returns ``{"ranks", "mix_s", "matmul_s", "elementwise_s"}``.

        run_local(measure_contention, 4, mix_repeats())[0]
        {'ranks': 4, 'mix_s': 0.061, 'matmul_s': 0.031, 'elementwise_s': 0.030}
    """
    ops = _mix_ops()
    with _one_thread(), torch.no_grad():

        def one_pass() -> dict[str, float]:
            seconds = {"matmul_s": 0.0, "elementwise_s": 0.0}
            for (category, run), count in zip(ops, repeats):
                start = time.perf_counter()
                for _ in range(count):
                    run()
                seconds[f"{category}_s"] += time.perf_counter() - start
            return {**seconds, "mix_s": sum(seconds.values())}

        one_pass()  # warm-up: first-call dispatch and allocation
        passes = []
        for _ in range(rounds):
            if world_size > 1:
                dist.barrier()
            passes.append(one_pass())
    if world_size > 1:
        by_rank = [None] * world_size
        dist.all_gather_object(by_rank, passes)
        passes = [{key: max(p[key] for p in rank_passes) for key in rank_passes[0]} for rank_passes in zip(*by_rank)]
    return {"ranks": world_size, **{key: statistics.median(p[key] for p in passes) for key in passes[0]}}


def _collectives_and_sync(rank: int, world_size: int, sizes_bytes, repeats: int, mix: list[int]) -> dict:
    return {
        "contention": measure_contention(rank, world_size, mix),
        "collectives": measure_collectives(rank, world_size, sizes_bytes, repeats),
        "sync": measure_sync(rank, world_size),
    }


def calibrate(ranks=(2, 4), quick: bool = False, progress=print, backend: str = "gloo") -> dict:
    """Measure matmul, memory, contention and collectives on this machine; a dict for
    ``passes.calibration.fit_profile``.

    ``quick`` measures sizes up to 4 MiB with fewer repeats over 2 ranks only (~8 s
    instead of ~30 s on 2 cores). ``progress`` receives one line per step. The op mix
    runs alone here first, then on every rank of each group size at once (``contention``).
    ``backend="nccl"`` measures the GPUs instead (:func:`autopar.runtime.measure_gpu.calibrate_gpus`).

    >>> measurements = calibrate(quick=True, progress=lambda line: None)   # doctest: +SKIP
    >>> sorted(measurements)                                                # doctest: +SKIP
    ['backend', 'collectives', 'contention', 'cores', 'host', 'matmul', 'measured_at',
     'memory_bandwidth', 'quick', 'seconds', 'sync', 'threads_per_rank']
    """
    ranks = (2,) if quick else tuple(ranks)
    if not ranks or min(ranks) < 2:
        raise ValueError(f"ranks must be group sizes of at least 2, got {ranks}")
    if backend == "nccl":
        from autopar.runtime.measure_gpu import calibrate_gpus

        return calibrate_gpus(ranks, quick, progress)
    if backend != "gloo":
        raise ValueError(f"unknown backend {backend!r}: calibrate measures gloo (CPU) or nccl (GPU)")
    sizes, repeats = (QUICK_SIZES_BYTES, 10) if quick else (SIZES_BYTES, 30)
    started = time.perf_counter()
    measured_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    progress("matmul FLOP/s, float32 and bfloat16, one thread (~2 s)")
    matmul = measure_matmul(sizes=MATMUL_SIZES[:-2] if quick else MATMUL_SIZES)
    progress("  " + ", ".join(f"{dtype} {rate / 1e9:.1f} GFLOP/s" for dtype, rate in matmul.items()))
    progress("memory bandwidth, one large copy, one thread (~1 s)")
    memory_bandwidth = measure_memory_bandwidth()
    progress(f"  {memory_bandwidth / 1e9:.1f} GB/s")
    progress("compute contention: a mix of matmuls and elementwise ops, one rank alone (~1 s)")
    mix = mix_repeats()
    contention = [measure_contention(0, 1, mix)]

    collectives, sync = [], []
    for index, world_size in enumerate(ranks):
        eta = sum(6 + 3 * size for size in ranks[index:])  # spawn and sweep, measured on 2 cores
        progress(
            f"collectives over {world_size} gloo ranks: {len(KINDS)} kinds x {len(sizes)} sizes "
            f"({sizes[0] // 1024} KiB .. {sizes[-1] // 2**20} MiB), {repeats} repeats, after the same op mix "
            f"on every rank at once, then the in-step rendezvous (~{eta} s left)"
        )
        step_start = time.perf_counter()
        measured = run_local(_collectives_and_sync, world_size, sizes, repeats, mix, timeout_s=300)[0]
        contention.append(measured["contention"])
        collectives += measured["collectives"]
        sync += measured["sync"]
        progress(
            f"  done in {time.perf_counter() - step_start:.0f} s; the op mix took "
            f"{measured['contention']['mix_s'] / contention[0]['mix_s']:.2f}x its time alone"
        )
    return {
        "backend": "gloo",
        "matmul": matmul,
        "memory_bandwidth": memory_bandwidth,
        "contention": contention,
        "collectives": collectives,
        "sync": sync,
        "cores": os.cpu_count(),
        "measured_at": measured_at,
        "host": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__})",
        "threads_per_rank": 1,
        "quick": quick,
        "seconds": time.perf_counter() - started,
    }
